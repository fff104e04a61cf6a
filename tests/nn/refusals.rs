//! What CP cannot compute is an error: burn-nn's own attention under a context fails `finish()`, a
//! partly ported model is refused, unsupported calls fail at the call, and rows that do not fit
//! the context are refused.

use super::*;

/// Runs `task` on every rank of a cp-2 world under a ring context of two sequences (one per
/// row); returns each rank's result.
fn under_context<T: Send>(
    task: impl Fn(usize, burn_dcp::CpContextGuard) -> Result<T, String> + Sync,
) -> Vec<Result<T, RankFailure>> {
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    world.run(|comm| -> Result<T, String> {
        let placement =
            Placement::of_layout(&[6, 4], 2, Layout::Zigzag).map_err(|e| e.to_string())?;
        let batch = CpBatch::new(placement, vec![MaskSpec::Causal])
            .with_rows(BatchRows::one_per_row(2))
            .map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let group = CpGroup::new(comm, Strategy::Ring).map_err(|e| e.to_string())?;
        task(rank, set_context(CpContext { group, batch }))
    })
}

#[test]
fn burn_nns_attention_under_a_context_fails_finish() {
    let results = under_context(|_, guard| {
        let device = Default::default();
        let mha = burn::nn::attention::MultiHeadAttentionConfig::new(8, 2)
            .with_dropout(0.0)
            .init::<Cp>(&device);
        let x = input::<Cp>(2, 3, 8, 1);
        let _ = mha.forward(burn::nn::attention::MhaInput::self_attn(x));
        Ok(guard.finish().map_err(|e| e.to_string()))
    });
    for result in results {
        let error = result.unwrap().unwrap_err();
        for needle in [
            "no attention call was intercepted",
            "MultiHeadAttention",
            "burn_dcp::nn",
            "CP size 2",
        ] {
            assert!(error.contains(needle), "{needle:?} missing from: {error}");
        }
    }
    // The drop-in under the same context: intercepted, finish() counts the call.
    let results = under_context(|_rank, guard| {
        let device = Default::default();
        let mha = MultiHeadAttentionConfig::new(8, 2)
            .with_dropout(0.0)
            .init::<Cp>(&device);
        let width = 3;
        let out = mha.forward(MhaInput::self_attn(input::<Cp>(2, width, 8, 1)).causal());
        assert!(out.weights.is_none(), "no weights under CP");
        guard.finish().map_err(|e| e.to_string())
    });
    for result in results {
        assert_eq!(result.unwrap(), 1);
    }
}

/// A model only partly ported — a drop-in layer beside attention computed on the shard — is
/// refused by `finish()` in three shapes (burn-nn's `MultiHeadAttention`, a burn-nn
/// `TransformerEncoder`, a hand-written `[B, H, L, d]` softmax(QKᵀ)V), naming what it saw; an MLP
/// whose width equals the local length (burn-nn `Linear`, a hand-written rank-3 matmul, a weight
/// broadcast over a rank-4 input) is not.
#[test]
fn a_partly_ported_model_is_refused_and_an_mlp_of_the_local_width_is_not() {
    let width = 3; // every rank's local row width under `under_context`
    let drop_in = |x: Tensor<Cp, 3>| {
        let mha = MultiHeadAttentionConfig::new(8, 2)
            .with_dropout(0.0)
            .init::<Cp>(&Default::default());
        mha.forward(MhaInput::self_attn(x).causal()).context
    };
    let cases: Vec<(&str, RankCall, bool)> = vec![
        (
            "burn-nn MultiHeadAttention beside a drop-in",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let mha = burn::nn::attention::MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                let _ = mha.forward(burn::nn::attention::MhaInput::self_attn(x));
            }),
            true,
        ),
        (
            "a burn-nn TransformerEncoder beside a drop-in",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let encoder = burn::nn::transformer::TransformerEncoderConfig::new(8, 16, 2, 1)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                let _ = encoder.forward(burn::nn::transformer::TransformerEncoderInput::new(x));
            }),
            true,
        ),
        (
            "a hand-written attention beside a drop-in",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let heads = x.reshape([2, width, 2, 4]).swap_dims(1, 2);
                let scores = heads
                    .clone()
                    .matmul(heads.clone().transpose())
                    .div_scalar(2.0);
                let _ = burn::tensor::activation::softmax(scores, 3).matmul(heads);
            }),
            true,
        ),
        (
            "an MLP of the local width (Linear, rank-3 matmul, broadcast weight)",
            Box::new(move |_| {
                let x = drop_in(input::<Cp>(2, width, 8, 1));
                let linear = burn::nn::LinearConfig::new(8, width).init::<Cp>(&Default::default());
                let _ = linear.forward(x.clone());
                let weight = input::<Cp>(1, 8, width, 2);
                let _ = x.clone().matmul(weight.clone());
                let _ = x.unsqueeze_dim::<4>(1).matmul(weight.unsqueeze_dim::<4>(0));
            }),
            false,
        ),
    ];
    for (what, case, refused) in &cases {
        let results = under_context(|rank, guard| {
            case(rank);
            Ok(guard.finish().map_err(|e| e.to_string()))
        });
        for result in results {
            match (result.unwrap(), refused) {
                (Err(error), true) => {
                    for needle in [
                        "computed attention scores over its own shard",
                        "beside 1 intercepted attention call",
                        "burn_dcp::nn",
                        ", 3, 3]",
                    ] {
                        assert!(
                            error.contains(needle),
                            "{what}: {needle:?} missing from: {error}"
                        );
                    }
                }
                (Ok(calls), false) => assert_eq!(calls, 1, "{what}"),
                (other, _) => panic!("{what}: {other:?}"),
            }
        }
    }
}

/// One rank's call of a module under the context.
type RankCall = Box<dyn Fn(usize) + Sync>;

#[test]
fn what_cp_cannot_compute_is_an_error_at_the_call() {
    let cases: Vec<(&str, RankCall)> = vec![
        (
            "dropout 0.1",
            Box::new(|_rank| {
                // burn-nn's default configuration: dropout 0.1.
                let mha = MultiHeadAttentionConfig::new(8, 2).init::<Cp>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Cp>(2, 3, 8, 1)).causal());
            }),
        ),
        (
            "quiet_softmax",
            Box::new(|_rank| {
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .with_quiet_softmax(true)
                    .init::<Cp>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Cp>(2, 3, 8, 1)).causal());
            }),
        ),
        (
            "MaskSpec",
            Box::new(|_rank| {
                let width = 3;
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                // Some key masked for the first query: neither causal nor none.
                let mut values = vec![false; 2 * width * width];
                values[0] = true;
                let odd = Tensor::<Cp, 3, Bool>::from_data(
                    TensorData::new(values, [2, width, width]),
                    &Default::default(),
                );
                mha.forward(MhaInput::self_attn(input::<Cp>(2, width, 8, 1)).mask_attn(odd));
            }),
        ),
        (
            "mask_pad differs",
            Box::new(|_rank| {
                let width = 3;
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                let wider = input::<Cp>(2, width + 1, 8, 1);
                let pad = Tensor::<Cp, 2, Bool>::from_data(
                    TensorData::new(vec![false; 2 * (width + 1)], [2, width + 1]),
                    &Default::default(),
                );
                mha.forward(MhaInput::self_attn(wider).mask_pad(pad).causal());
            }),
        ),
        (
            "causal-family but the input has no causal mask",
            Box::new(|_rank| {
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Cp>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Cp>(2, 3, 8, 1)));
            }),
        ),
        (
            "is not ContextParallel",
            Box::new(|_rank| {
                let mha = MultiHeadAttentionConfig::new(8, 2)
                    .with_dropout(0.0)
                    .init::<Plain>(&Default::default());
                mha.forward(MhaInput::self_attn(input::<Plain>(2, 3, 8, 1)).causal());
            }),
        ),
    ];
    for (needle, case) in &cases {
        let results = under_context(|rank, _guard| {
            case(rank);
            Ok(())
        });
        for result in results {
            let error = result.unwrap_err();
            assert!(error.contains(needle), "{needle:?} missing from: {error}");
        }
    }
}

#[test]
fn lengths_from_mask_pad_read_right_padding() {
    let pad = padding_mask::<Flex>(&[3, 1, 4], 4);
    assert_eq!(
        burn_dcp::nn::lengths_from_mask_pad(pad).unwrap(),
        vec![3, 1, 4]
    );
    let left = Tensor::<Flex, 2, Bool>::from_data(
        TensorData::new(vec![true, false, false], [1, 3]),
        &Default::default(),
    );
    let error = burn_dcp::nn::lengths_from_mask_pad(left)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("column 1 after padding at column 0"),
        "{error}"
    );
}

/// burn's causal attention op on zeros of `dims` (`[batch, heads, tokens, dim]`).
fn causal_self_attention(dims: [usize; 4]) {
    let x = Tensor::<Cp, 4>::zeros(dims, &Default::default());
    let options = burn::tensor::ops::AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: true,
    };
    burn::tensor::module::attention(x.clone(), x.clone(), x, None, None, options);
}

#[test]
fn rows_that_do_not_fit_the_context_are_refused() {
    let results = under_context(|_, _guard| {
        // Three rows under a context of two.
        causal_self_attention([3, 2, 3, 4]);
        Ok(())
    });
    for result in results {
        let error = result.unwrap_err();
        assert!(
            error.contains("batch has 3 rows") && error.contains("describe 2"),
            "{error}"
        );
    }
    // Without BatchRows, B > 1 names the fix.
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<(), String> {
        let placement = Placement::of_layout(&[6, 4], 2, Layout::Zigzag).unwrap();
        let group = CpGroup::new(comm, Strategy::Ring).unwrap();
        let _context = set_context(CpContext {
            group,
            batch: CpBatch::new(placement, vec![MaskSpec::Causal]),
        });
        causal_self_attention([2, 2, 3, 4]);
        Ok(())
    });
    for result in results {
        let error = result.unwrap_err();
        assert!(error.contains("BatchRows::one_per_row(2)"), "{error}");
    }
}
