//! Without a CP context the drop-ins equal burn-nn: multi-head attention (every mask, on Flex and
//! wgpu), the encoder (norm first or last) and the position modules.

use super::*;

fn mha_equals_burn_nn<B: Backend>(backend: &str) {
    let device = Default::default();
    B::seed(&device, 5);
    let config = burn::nn::attention::MultiHeadAttentionConfig::new(16, 4).with_dropout(0.0);
    let bytes = record_bytes::<B, _>(config.init::<B>(&device));
    let theirs = load(config.init::<B>(&device), &bytes);
    let ours: MultiHeadAttention<B> = load(
        MultiHeadAttentionConfig::new(16, 4)
            .with_dropout(0.0)
            .init(&device),
        &bytes,
    );
    let lens = [7, 4, 6];
    let x = input::<B>(3, 7, 16, 1);
    let pad = padding_mask::<B>(&lens, 7);
    let causal = generate_autoregressive_mask::<B>(3, 7, &device);
    let window: Vec<bool> = (0..3 * 7 * 7)
        .map(|i| {
            let (q, k) = ((i / 7) % 7, i % 7);
            k > q || q - k >= 2
        })
        .collect();
    let window = Tensor::<B, 3, Bool>::from_data(TensorData::new(window, [3, 7, 7]), &device);
    let cases = [
        ("no mask", None, None),
        ("mask_pad", Some(pad.clone()), None),
        (
            "mask_pad + causal mask_attn",
            Some(pad.clone()),
            Some(causal.clone()),
        ),
        (
            "a non-causal mask_attn (sliding window of 2)",
            Some(pad.clone()),
            Some(window),
        ),
    ];
    for (what, mask_pad, mask_attn) in cases {
        let mut want = burn::nn::attention::MhaInput::self_attn(x.clone());
        let mut got = MhaInput::self_attn(x.clone());
        if let Some(mask) = mask_pad {
            (want, got) = (want.mask_pad(mask.clone()), got.mask_pad(mask));
        }
        if let Some(mask) = mask_attn {
            (want, got) = (want.mask_attn(mask.clone()), got.mask_attn(mask));
        }
        assert_close(
            &values(ours.forward(got).context),
            &values(theirs.forward(want).context),
            &format!("{backend}: MHA {what}"),
        );
    }
    let want =
        theirs.forward(burn::nn::attention::MhaInput::self_attn(x.clone()).mask_attn(causal));
    let got = ours.forward(MhaInput::self_attn(x.clone()).causal());
    assert_close(
        &values(got.context),
        &values(want.context),
        &format!("{backend}: MHA causal() extension"),
    );
    let memory = input::<B>(3, 5, 16, 9);
    let want = theirs.forward(burn::nn::attention::MhaInput::new(
        x.clone(),
        memory.clone(),
        memory.clone(),
    ));
    let got = ours.forward(MhaInput::new(x.clone(), memory.clone(), memory));
    assert_close(
        &values(got.context),
        &values(want.context),
        &format!("{backend}: MHA cross-attention of 7 queries on 5 keys"),
    );
    // Quiet softmax takes burn-nn's matmul path (and returns the weights).
    let config = burn::nn::attention::MultiHeadAttentionConfig::new(16, 4)
        .with_dropout(0.0)
        .with_quiet_softmax(true);
    let bytes = record_bytes::<B, _>(config.init::<B>(&device));
    let theirs = load(config.init::<B>(&device), &bytes);
    let ours: MultiHeadAttention<B> = load(
        MultiHeadAttentionConfig::new(16, 4)
            .with_dropout(0.0)
            .with_quiet_softmax(true)
            .init(&device),
        &bytes,
    );
    let want =
        theirs.forward(burn::nn::attention::MhaInput::self_attn(x.clone()).mask_pad(pad.clone()));
    let got = ours.forward(MhaInput::self_attn(x.clone()).mask_pad(pad.clone()));
    assert_close(&values(got.context), &values(want.context), "quiet softmax");
    assert_close(
        &values(got.weights.expect("the matmul path returns the weights")),
        &values(want.weights),
        "quiet softmax weights",
    );
}

#[test]
fn mha_without_a_context_equals_burn_nn() {
    mha_equals_burn_nn::<Plain>("Autodiff<Flex>");
    mha_equals_burn_nn::<Cp>("ContextParallel<Autodiff<Flex>>");
    mha_equals_burn_nn::<Flex>("Flex");
}

fn encoder_equals_burn_nn<B: Backend>(norm_first: bool) {
    let device = Default::default();
    B::seed(&device, 8);
    let config = burn::nn::transformer::TransformerEncoderConfig::new(16, 32, 4, 2)
        .with_dropout(0.0)
        .with_norm_first(norm_first);
    let bytes = record_bytes::<B, _>(config.init::<B>(&device));
    let theirs = load(config.init::<B>(&device), &bytes);
    let ours: TransformerEncoder<B> = load(
        TransformerEncoderConfig::new(16, 32, 4, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first)
            .init(&device),
        &bytes,
    );
    let lens = [6, 3];
    let x = input::<B>(2, 6, 16, 4);
    let pad = padding_mask::<B>(&lens, 6);
    let causal = generate_autoregressive_mask::<B>(2, 6, &device);
    let want = theirs.forward(
        burn::nn::transformer::TransformerEncoderInput::new(x.clone())
            .mask_pad(pad.clone())
            .mask_attn(causal.clone()),
    );
    let got = ours.forward(
        TransformerEncoderInput::new(x.clone())
            .mask_pad(pad)
            .mask_attn(causal),
    );
    assert_close(
        &values(got),
        &values(want),
        &format!("encoder norm_first {norm_first}"),
    );
}

#[test]
fn encoder_and_position_modules_without_a_context_equal_burn_nn() {
    encoder_equals_burn_nn::<Plain>(false);
    encoder_equals_burn_nn::<Plain>(true);
    encoder_equals_burn_nn::<Cp>(true);
    let device = Default::default();
    // RoPE on 3D and 4D inputs, with a start offset, and after shifts.
    let mut theirs = burn::nn::RotaryEncodingConfig::new(16, 8).init::<Plain>(&device);
    let mut ours = RotaryEncodingConfig::new(16, 8).init::<Plain>(&device);
    let x3 = input::<Plain>(2, 5, 8, 2);
    let x4: Tensor<Plain, 4> = Tensor::from_data(
        TensorData::new(random(2 * 3 * 5 * 8, 6), [2, 3, 5, 8]),
        &device,
    );
    assert_close(
        &values(ours.forward(x3.clone())),
        &values(theirs.forward(x3.clone())),
        "rope 3d",
    );
    assert_close(
        &values(ours.forward(x4.clone())),
        &values(theirs.forward(x4.clone())),
        "rope 4d",
    );
    assert_close(
        &values(ours.apply(x3.clone(), 4)),
        &values(theirs.apply(x3.clone(), 4)),
        "rope start 4",
    );
    for shift in [3, 20] {
        theirs.shift(shift);
        ours.shift(shift);
        assert_close(
            &values(ours.freq_complex.clone()),
            &values(theirs.freq_complex.clone()),
            &format!("rope shift {shift}"),
        );
    }
    let theirs = burn::nn::PositionalEncodingConfig::new(8).init::<Plain>(&device);
    let ours = PositionalEncodingConfig::new(8).init::<Plain>(&device);
    assert_close(
        &values(ours.forward(x3.clone())),
        &values(theirs.forward(x3)),
        "sinusoids",
    );
}
