//! A user's model of drop-ins under a CP context (cp 2 and 4; ring, Ulysses, USP, all-gather,
//! dcp; B = 3 padded rows and B = 1 packed row) equals the per-sequence single-device result,
//! forward and gradients.

use super::*;

/// A user's model built only from the drop-ins: RoPE and sinusoids on the input, then a causal
/// GQA encoder stack (4 query heads, 2 kv heads).
#[derive(Module, Debug)]
struct UserModel<B: Backend> {
    rope: RotaryEncoding<B>,
    sinusoids: PositionalEncoding<B>,
    encoder: TransformerEncoder<B>,
}

const D_MODEL: usize = 16;

impl<B: Backend> UserModel<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            rope: RotaryEncodingConfig::new(64, D_MODEL).init(device),
            sinusoids: PositionalEncodingConfig::new(D_MODEL)
                .with_max_sequence_size(64)
                .init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 32, 4, 2)
                .with_n_kv_heads(Some(2))
                .with_dropout(0.0)
                .with_norm_first(true)
                .init(device),
        }
    }

    /// `x [B, S, d]` with right padding `mask_pad [B, S]`; `dense_causal` passes burn-nn's
    /// autoregressive mask, else the `causal()` extension.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask_pad: Tensor<B, 2, Bool>,
        dense_causal: bool,
    ) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let device = x.device();
        let x = self.sinusoids.forward(self.rope.forward(x));
        let input = TransformerEncoderInput::new(x)
            .mask_pad(mask_pad)
            .rotary(10_000.0);
        let input = if dense_causal {
            input.mask_attn(generate_autoregressive_mask(batch, seq, &device))
        } else {
            input.causal()
        };
        self.encoder.forward(input)
    }

    /// The gradients of the attention's and feed-forward's weights, flattened in a fixed order.
    fn grads<A: AutodiffBackend>(model: &UserModel<A>, grads: &A::Gradients) -> Vec<f32> {
        let mut all = Vec::new();
        for layer in &model.encoder.layers {
            for linear in [
                &layer.mha.query,
                &layer.mha.key,
                &layer.mha.value,
                &layer.mha.output,
            ] {
                all.extend(values(
                    linear.weight.val().grad(grads).expect("weight grad"),
                ));
                all.extend(values(
                    linear
                        .bias
                        .as_ref()
                        .unwrap()
                        .val()
                        .grad(grads)
                        .expect("bias grad"),
                ));
            }
            all.extend(values(
                layer
                    .pwff
                    .linear_inner
                    .weight
                    .val()
                    .grad(grads)
                    .expect("pwff grad"),
            ));
            all.extend(values(
                layer.norm_2.gamma.val().grad(grads).expect("norm grad"),
            ));
        }
        all
    }
}

/// Outputs, input gradients (both `[Σ len, d]`, sequence after sequence) and summed weight
/// gradients.
struct Run {
    out: Vec<f32>,
    dx: Vec<f32>,
    dweights: Vec<f32>,
}

impl Run {
    /// Adds one rank's (or row's) weight gradients to the sum.
    fn add_weight_grads(&mut self, dweights: Vec<f32>) {
        if self.dweights.is_empty() {
            self.dweights = dweights;
        } else {
            self.dweights
                .iter_mut()
                .zip(dweights)
                .for_each(|(a, b)| *a += b);
        }
    }
}

/// One rank's run: the full-batch token index at each local slot (`usize::MAX` at padding), its
/// outputs and input gradients there, its share of the weight gradients.
struct RankRun {
    tokens: Vec<usize>,
    out: Vec<f32>,
    dx: Vec<f32>,
    dweights: Vec<f32>,
}

/// Full-batch data: sequence `s`'s `x` and upstream gradient rows.
struct Data {
    lens: Vec<usize>,
    x: Vec<Vec<f32>>,
    g: Vec<Vec<f32>>,
}

impl Data {
    fn new(lens: &[usize], seed: u64) -> Self {
        Self {
            lens: lens.to_vec(),
            x: lens
                .iter()
                .enumerate()
                .map(|(s, &l)| random(l * D_MODEL, seed + s as u64))
                .collect(),
            g: lens
                .iter()
                .enumerate()
                .map(|(s, &l)| random(l * D_MODEL, seed + 100 + s as u64))
                .collect(),
        }
    }
}

fn model_bytes() -> Vec<u8> {
    let device = Default::default();
    Flex::seed(&device, 21);
    record_bytes::<Flex, _>(UserModel::<Flex>::new(&device))
}

/// The reference: every sequence alone, on one device, without a CP context (Autodiff<Flex>).
fn per_sequence(data: &Data, bytes: &[u8]) -> Run {
    let device = Default::default();
    let model: UserModel<Plain> = load(UserModel::new(&device), bytes);
    let mut run = Run {
        out: vec![],
        dx: vec![],
        dweights: vec![],
    };
    for (s, &len) in data.lens.iter().enumerate() {
        let x = Tensor::<Plain, 3>::from_data(
            TensorData::new(data.x[s].clone(), [1, len, D_MODEL]),
            &device,
        )
        .require_grad();
        let g = Tensor::<Plain, 3>::from_data(
            TensorData::new(data.g[s].clone(), [1, len, D_MODEL]),
            &device,
        );
        let out = model.forward(x.clone(), padding_mask(&[len], len), true);
        let grads = (out.clone() * g).sum().backward();
        run.out.extend(values(out));
        run.dx.extend(values(x.grad(&grads).unwrap()));
        let dweights = UserModel::<Plain>::grads(&model, &grads);
        run.add_weight_grads(dweights);
    }
    run
}

/// Rows `rows` (sequences per row) of `data` at `cp`, as each rank's `[B, W, d]` local batch under
/// a CP context with `strategy`; outputs and gradients put back in sequence order.
fn context_parallel(
    data: &Data,
    bytes: &[u8],
    rows: Option<BatchRows>,
    cp: usize,
    strategy: Strategy,
    layout: Layout,
    dense_causal: bool,
) -> Run {
    let batch_of = |placement: Placement| {
        let batch = CpBatch::new(placement, vec![MaskSpec::Causal]);
        match rows.clone() {
            Some(rows) => batch.with_rows(rows).unwrap(),
            None => batch,
        }
    };
    let batch = if strategy == Strategy::Dcp {
        let schedule = Arc::new(dcp_schedule(&data.lens, cp));
        let mut batch = batch_of(schedule.placement().clone());
        batch.blocks = Some(schedule);
        batch
    } else {
        batch_of(Placement::of_layout(&data.lens, cp, layout).unwrap())
    };
    // Token t of sequence s: its rows of x and g.
    let offsets: Vec<usize> = data
        .lens
        .iter()
        .scan(0, |acc, &l| {
            let o = *acc;
            *acc += l;
            Some(o)
        })
        .collect();
    let total: usize = data.lens.iter().sum();
    let world = InProcessWorld::new(cp, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<RankRun, burn_dcp::CpError> {
        let device = Default::default();
        let rank = comm.rank();
        let model: UserModel<Cp> = load(UserModel::new(&device), bytes);
        let local = batch.local_rows(rank)?;
        let width = local.width();
        // Which (sequence, position) sits at each local [row, column]: gather a full index table.
        let seqs_per_row: Vec<usize> = match &rows {
            Some(rows) => rows.seqs_per_row().to_vec(),
            None => vec![data.lens.len()],
        };
        let full_width = local.full_width();
        let mut table = vec![usize::MAX; seqs_per_row.len() * full_width];
        let mut seq = 0;
        for (row, &count) in seqs_per_row.iter().enumerate() {
            let mut column = 0;
            for _ in 0..count {
                for t in 0..data.lens[seq] {
                    table[row * full_width + column + t] = offsets[seq] + t;
                }
                column += data.lens[seq];
                seq += 1;
            }
        }
        let tokens = local.gather(&table, full_width, width, usize::MAX)?;
        let row_of = |data_rows: &Vec<Vec<f32>>| -> Vec<f32> {
            tokens
                .iter()
                .flat_map(|&index| {
                    if index == usize::MAX {
                        vec![0.0; D_MODEL]
                    } else {
                        let seq = offsets.partition_point(|&o| o <= index) - 1;
                        let t = index - offsets[seq];
                        data_rows[seq][t * D_MODEL..(t + 1) * D_MODEL].to_vec()
                    }
                })
                .collect()
        };
        let b = local.rows();
        let x = Tensor::<Cp, 3>::from_data(
            TensorData::new(row_of(&data.x), [b, width, D_MODEL]),
            &device,
        )
        .require_grad();
        let g = Tensor::<Cp, 3>::from_data(
            TensorData::new(row_of(&data.g), [b, width, D_MODEL]),
            &device,
        );
        let mask_pad = local.mask_pad_tensor::<Cp>(width, &device)?;
        let group = CpGroup::new(comm.clone(), strategy)?;
        let context = set_context(CpContext {
            group,
            batch: batch.clone(),
        });
        let out = model.forward(x.clone(), mask_pad, dense_causal);
        let calls = context.finish()?;
        assert_eq!(calls, 2, "one intercepted call per encoder layer");
        let grads = (out.clone() * g).sum().backward();
        Ok(RankRun {
            tokens,
            out: values(out),
            dx: values(x.grad(&grads).unwrap()),
            dweights: UserModel::<Cp>::grads(&model, &grads),
        })
    });
    let mut run = Run {
        out: vec![0.0; total * D_MODEL],
        dx: vec![0.0; total * D_MODEL],
        dweights: vec![],
    };
    for result in results {
        let RankRun {
            tokens: placed,
            out,
            dx,
            dweights,
        } = result.unwrap();
        for (slot, &index) in placed.iter().enumerate() {
            if index == usize::MAX {
                continue;
            }
            let (to, from) = (index * D_MODEL, slot * D_MODEL);
            run.out[to..to + D_MODEL].copy_from_slice(&out[from..from + D_MODEL]);
            run.dx[to..to + D_MODEL].copy_from_slice(&dx[from..from + D_MODEL]);
        }
        run.add_weight_grads(dweights);
    }
    run
}

fn dcp_schedule(seq_lens: &[usize], cp: usize) -> BlockSchedule {
    let problem = BlockProblem {
        seq_lens: seq_lens.to_vec(),
        masks: vec![MaskSpec::Causal],
        head_groups: 1,
        block: 4,
    };
    let dims = AttentionDims {
        heads: 4,
        kv_heads: 2,
        head_dim: D_MODEL / 4,
        element_bytes: 4,
    };
    let topology = Topology {
        devices_per_node: cp,
        ..Topology::a100_p4d(1)
    };
    let routed = dcp_plan(
        &problem,
        tile_grids(&problem),
        &dims,
        &topology,
        &DcpConfig::default(),
    )
    .unwrap();
    BlockSchedule::new(&routed.plan, &problem, &topology).unwrap()
}

fn strategies() -> Vec<(Strategy, usize, Layout)> {
    vec![
        (Strategy::Ring, 2, Layout::Zigzag),
        (Strategy::Ring, 4, Layout::Zigzag),
        (Strategy::Ulysses, 4, Layout::Contiguous),
        (USP_2X2, 4, Layout::Zigzag),
        (Strategy::AllGather, 2, Layout::Stripe),
        (Strategy::Dcp, 4, Layout::Contiguous),
    ]
}

fn check_against_reference(data: &Data, rows: Option<BatchRows>, what: &str) {
    let bytes = model_bytes();
    let want = per_sequence(data, &bytes);
    let mut cases = vec![(Strategy::Ring, 1, Layout::Contiguous)];
    cases.extend(strategies());
    for (i, (strategy, cp, layout)) in cases.into_iter().enumerate() {
        let dense = i % 2 == 0;
        let got = context_parallel(data, &bytes, rows.clone(), cp, strategy, layout, dense);
        let case = format!("{what}: {strategy} cp {cp} {layout} (dense causal mask {dense})");
        assert_close(&got.out, &want.out, &format!("{case}: out"));
        assert_close(&got.dx, &want.dx, &format!("{case}: dx"));
        assert_close(
            &got.dweights,
            &want.dweights,
            &format!("{case}: weight gradients"),
        );
    }
}

#[test]
fn drop_ins_under_cp_equal_one_device_with_three_padded_rows() {
    let data = Data::new(&[13, 6, 9], 40);
    check_against_reference(&data, Some(BatchRows::one_per_row(3)), "B = 3 padded");
}

#[test]
fn drop_ins_under_cp_equal_one_device_with_one_packed_row() {
    let data = Data::new(&[11, 7], 50);
    check_against_reference(&data, None, "B = 1 packed");
    check_against_reference(
        &data,
        Some(BatchRows::packed(vec![2])),
        "B = 1 packed (BatchRows)",
    );
}
