//! `ContextParallel<Autodiff<Flex>>`: burn's own `attention` call runs the CP strategy (bytes are
//! communicated, exactly the analytic volume) and its gradients equal the single-device ones.

use crate::common;

use burn::backend::{Autodiff, Flex};
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::Tensor;
use burn_dcp::backend::{set_context, ContextParallel, CpContext};
use burn_dcp::batch::shard::unshard_rows;
use burn_dcp::comm::{InProcessWorld, WorldConfig};
use burn_dcp::diagnostics::harness::{max_rel_err, run_single_device, PackedInputs};
use burn_dcp::diagnostics::volume::analytic_volume;
use burn_dcp::kernels::MaskSpec;
use burn_dcp::{CpBatch, CpGroup, Layout, Placement, Strategy};
use common::*;

type Cp = ContextParallel<Autodiff<Flex>>;

fn options(is_causal: bool) -> AttentionModuleOptions {
    AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal,
    }
}

/// Rows `indices` of a token-major `[T, H, D]` buffer as a `[1, H, n, D]` tensor.
fn local<B: burn::tensor::backend::Backend>(
    data: &[f32],
    heads: usize,
    dim: usize,
    indices: &[usize],
) -> Tensor<B, 4> {
    token_rows::<B>(data, heads, dim, indices)
        .swap_dims(0, 1)
        .unsqueeze_dim(0)
}

/// `[1, H, n, D]` → token-major host rows.
fn rows<B: burn::tensor::backend::Backend>(t: Tensor<B, 4>) -> Vec<f32> {
    let [_, h, n, d] = t.dims();
    t.reshape([h, n, d])
        .swap_dims(0, 1)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap()
}

struct RankGrads {
    indices: Vec<usize>,
    out: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    bytes: u64,
}

fn run_decorated(
    inputs: &PackedInputs,
    cp: usize,
    strategy: Strategy,
    layout: Layout,
    mask: &MaskSpec,
) -> Vec<RankGrads> {
    let world = InProcessWorld::new(cp, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<RankGrads, burn_dcp::CpError> {
        let x = inputs;
        let placement = Placement::of_layout(&x.seq_lens, cp, layout)?;
        let indices = placement.packed_indices(comm.rank());
        let group = CpGroup::new(comm.clone(), strategy)?;
        let _context = set_context(CpContext {
            group,
            batch: CpBatch::new(placement, vec![mask.clone()]),
        });
        let q = local::<Cp>(&x.q, x.heads, x.head_dim, &indices).require_grad();
        let k = local::<Cp>(&x.k, x.kv_heads, x.head_dim, &indices).require_grad();
        let v = local::<Cp>(&x.v, x.kv_heads, x.value_dim, &indices).require_grad();
        let dout = local::<Cp>(&x.dout, x.heads, x.value_dim, &indices);
        let before = comm.stats().total_bytes();
        let out = attention(
            q.clone(),
            k.clone(),
            v.clone(),
            None,
            None,
            options(*mask != MaskSpec::Full),
        );
        let grads = (out.clone() * dout).sum().backward();
        let grad = |t: &Tensor<Cp, 4>| rows(t.grad(&grads).expect("gradient"));
        Ok(RankGrads {
            out: rows(out),
            dq: grad(&q),
            dk: grad(&k),
            dv: grad(&v),
            bytes: comm.stats().total_bytes() - before,
            indices,
        })
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

fn unshard(
    ranks: &[RankGrads],
    field: impl Fn(&RankGrads) -> &Vec<f32>,
    width: usize,
    tokens: usize,
) -> Vec<f32> {
    let shards: Vec<_> = ranks
        .iter()
        .map(|r| (r.indices.clone(), field(r).clone()))
        .collect();
    unshard_rows(&shards, width, tokens)
}

#[test]
fn decorated_attention_gradients_equal_single_device() {
    let device = Default::default();
    let cases = [
        (Strategy::Ulysses, 4, Layout::Zigzag),
        (Strategy::Ring, 4, Layout::Zigzag),
        (Strategy::Ring, 3, Layout::Stripe),
        (Strategy::AllGather, 2, Layout::Contiguous),
        (USP_2X2, 4, Layout::Zigzag),
    ];
    for mask in [
        MaskSpec::Causal,
        MaskSpec::Full,
        "lambda:2,5".parse().unwrap(),
    ] {
        for (strategy, cp, layout) in cases {
            let inputs = random_inputs(&[17, 6, 2], 4, 4, 8, 21);
            let want =
                run_single_device::<Flex>(&device, &inputs, std::slice::from_ref(&mask), None)
                    .unwrap();
            let ranks = run_decorated(&inputs, cp, strategy, layout, &mask);
            let t = inputs.tokens();
            let what = format!("{strategy} cp {cp} {layout} {mask}");
            for (name, got, want) in [
                ("out", unshard(&ranks, |r| &r.out, 32, t), &want.out),
                ("dq", unshard(&ranks, |r| &r.dq, 32, t), &want.dq),
                ("dk", unshard(&ranks, |r| &r.dk, 32, t), &want.dk),
                ("dv", unshard(&ranks, |r| &r.dv, 32, t), &want.dv),
            ] {
                let err = max_rel_err(&got, want);
                assert!(err <= TOLERANCE, "{what}: {name} max_rel_err {err:e}");
            }
            // The strategy really ran: every rank sent exactly its analytic forward + backward volume.
            let placement = Placement::of_layout(&inputs.seq_lens, cp, layout).unwrap();
            let shape = f32_volume_shape(4, 4, 8);
            let expected = analytic_volume(strategy, &placement, &shape);
            for (rank, r) in ranks.iter().enumerate() {
                assert!(r.bytes > 0, "{what}: rank {rank} sent nothing");
                assert_eq!(
                    r.bytes,
                    expected[rank].forward + expected[rank].backward,
                    "{what}: rank {rank} bytes"
                );
            }
        }
    }
}

#[test]
fn without_a_context_attention_is_the_inner_backends() {
    let inputs = random_inputs(&[9], 2, 2, 8, 3);
    let all: Vec<usize> = (0..9).collect();
    let run = |causal| {
        let ours = attention(
            local::<Cp>(&inputs.q, 2, 8, &all),
            local::<Cp>(&inputs.k, 2, 8, &all),
            local::<Cp>(&inputs.v, 2, 8, &all),
            None,
            None,
            options(causal),
        );
        let theirs = attention(
            local::<Autodiff<Flex>>(&inputs.q, 2, 8, &all),
            local::<Autodiff<Flex>>(&inputs.k, 2, 8, &all),
            local::<Autodiff<Flex>>(&inputs.v, 2, 8, &all),
            None,
            None,
            options(causal),
        );
        (rows(ours), rows(theirs))
    };
    for causal in [false, true] {
        let (ours, theirs) = run(causal);
        assert_eq!(ours, theirs, "causal {causal}");
    }
}

fn panic_message(result: std::thread::Result<()>) -> String {
    let payload = result.expect_err("expected a panic");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn dense_masks_softcap_and_causality_conflicts_are_rejected() {
    let world = InProcessWorld::new(1, WorldConfig::default()).unwrap();
    let comm = world.communicators().remove(0);
    let inputs = random_inputs(&[6], 2, 2, 4, 3);
    let all: Vec<usize> = (0..6).collect();
    let call = |mask: MaskSpec, with_mask: bool, opts: AttentionModuleOptions| {
        let comm = comm.clone();
        let inputs = inputs.clone();
        let all = all.clone();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let placement = Placement::of_layout(&[6], 1, Layout::Contiguous).unwrap();
            let group = CpGroup::new(comm, Strategy::Ring).unwrap();
            let _context = set_context(CpContext {
                group,
                batch: CpBatch::new(placement, vec![mask]),
            });
            let q = local::<Cp>(&inputs.q, 2, 4, &all);
            let dense = with_mask.then(|| {
                Tensor::<Cp, 4, burn::tensor::Bool>::empty([1, 2, 6, 6], &Default::default())
            });
            let _ = attention(q.clone(), q.clone(), q, dense, None, opts);
        }))
    };
    let msg = panic_message(call(MaskSpec::Causal, true, options(true)));
    assert!(
        msg.contains("explicit dense mask tensor cannot be sharded"),
        "{msg}"
    );
    let msg = panic_message(call(
        MaskSpec::Causal,
        false,
        AttentionModuleOptions {
            softcap: Some(30.0),
            ..options(true)
        },
    ));
    assert!(msg.contains("softcap 30 is not supported"), "{msg}");
    let msg = panic_message(call(MaskSpec::Full, false, options(true)));
    assert!(
        msg.contains("is_causal = true but the CP context's mask of sequence 0 is full"),
        "{msg}"
    );
    let msg = panic_message(call(MaskSpec::Causal, false, options(false)));
    assert!(msg.contains("is_causal = false"), "{msg}");
}

/// Grouped-query K/V go to the op with their real heads: the strategies move `K` kv heads (the
/// analytic volume with `K`, not `H`), results equal the single-device ones; without a context the
/// decorator repeats the heads itself and equals the inner backend on repeated heads.
#[test]
fn grouped_query_heads_move_only_the_real_kv_heads() {
    let device = Default::default();
    let (heads, kv_heads) = (4, 2);
    let cases = [
        (Strategy::Ring, 4, Layout::Zigzag),
        (Strategy::Ulysses, 4, Layout::Contiguous),
        (Strategy::Ulysses, 2, Layout::Zigzag),
        (USP_2X2, 4, Layout::Zigzag),
        (Strategy::AllGather, 3, Layout::Stripe),
    ];
    let mask = MaskSpec::Causal;
    let inputs = random_inputs(&[17, 6, 9], heads, kv_heads, 8, 5);
    let want =
        run_single_device::<Flex>(&device, &inputs, std::slice::from_ref(&mask), None).unwrap();
    for (strategy, cp, layout) in cases {
        let ranks = run_decorated(&inputs, cp, strategy, layout, &mask);
        let t = inputs.tokens();
        let what = format!("GQA {heads}/{kv_heads}: {strategy} cp {cp} {layout}");
        for (name, got, want, width) in [
            ("out", unshard(&ranks, |r| &r.out, 32, t), &want.out, 32),
            ("dq", unshard(&ranks, |r| &r.dq, 32, t), &want.dq, 32),
            ("dk", unshard(&ranks, |r| &r.dk, 16, t), &want.dk, 16),
            ("dv", unshard(&ranks, |r| &r.dv, 16, t), &want.dv, 16),
        ] {
            assert_eq!(got.len(), t * width, "{what}: {name}");
            let err = max_rel_err(&got, want);
            assert!(err <= TOLERANCE, "{what}: {name} max_rel_err {err:e}");
        }
        let placement = Placement::of_layout(&inputs.seq_lens, cp, layout).unwrap();
        let shape = |kv_heads| f32_volume_shape(heads, kv_heads, 8);
        let real = analytic_volume(strategy, &placement, &shape(kv_heads));
        let repeated = analytic_volume(strategy, &placement, &shape(heads));
        let total = |v: &[burn_dcp::diagnostics::volume::RankVolume]| -> u64 {
            v.iter().map(|r| r.forward + r.backward).sum()
        };
        for (rank, r) in ranks.iter().enumerate() {
            assert_eq!(
                r.bytes,
                real[rank].forward + real[rank].backward,
                "{what}: rank {rank} bytes"
            );
        }
        let measured: u64 = ranks.iter().map(|r| r.bytes).sum();
        eprintln!(
            "{what}: {measured} bytes (with {heads} repeated kv heads: {})",
            total(&repeated)
        );
        if strategy == Strategy::Ulysses && cp >= heads {
            // One query head per rank: each rank needs one kv head either way.
            assert_eq!(measured, total(&repeated), "{what}");
        } else {
            assert!(measured < total(&repeated), "{what}");
        }
    }
    // Without a context: the inner backend's attention on repeated heads.
    let all: Vec<usize> = (0..inputs.tokens()).collect();
    let repeat = |data: &[f32]| -> Vec<f32> {
        data.chunks(8)
            .flat_map(|head| std::iter::repeat_n(head.to_vec(), heads / kv_heads).flatten())
            .collect()
    };
    let ours = attention(
        local::<Cp>(&inputs.q, heads, 8, &all),
        local::<Cp>(&inputs.k, kv_heads, 8, &all),
        local::<Cp>(&inputs.v, kv_heads, 8, &all),
        None,
        None,
        options(true),
    );
    let theirs = attention(
        local::<Autodiff<Flex>>(&inputs.q, heads, 8, &all),
        local::<Autodiff<Flex>>(&repeat(&inputs.k), heads, 8, &all),
        local::<Autodiff<Flex>>(&repeat(&inputs.v), heads, 8, &all),
        None,
        None,
        options(true),
    );
    assert_eq!(rows(ours), rows(theirs));
}
