//! `all_reduce_grads`: any model's gradients summed over a pool equal the gradients of the summed
//! loss on one device (the engine's bucketed all-reduce, for training loops of one's own).

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::prelude::{Backend, Tensor, TensorData};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn_dcp::comm::{InProcessWorld, WorldConfig};
use burn_dcp_train::{all_reduce_grads, gradient_values};

type B = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Two<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
}

fn input(rank: usize) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..12)
        .map(|i| ((i * 7 + rank * 5) % 11) as f32 / 5.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [3, 4]), &Default::default())
}

fn loss(model: &Two<B>, x: Tensor<B, 2>) -> Tensor<B, 1> {
    model
        .second
        .forward(model.first.forward(x).tanh())
        .powi_scalar(2)
        .sum()
}

#[test]
fn summed_over_the_pool_equals_the_gradients_of_the_summed_loss() {
    let device = Default::default();
    let model = Two::<Flex> {
        first: LinearConfig::new(4, 6).init(&device),
        second: LinearConfig::new(6, 2).init(&device),
    };
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = Recorder::<Flex>::record(&recorder, model.into_record(), ()).unwrap();
    let fresh = || {
        let record = Recorder::<B>::load(&recorder, bytes.clone(), &device).unwrap();
        Two::<B> {
            first: LinearConfig::new(4, 6).init(&device),
            second: LinearConfig::new(6, 2).init(&device),
        }
        .load_record(record)
    };
    // One device: the loss of both ranks' inputs.
    let model = fresh();
    let grads = (loss(&model, input(0)) + loss(&model, input(1))).backward();
    let want = gradient_values(&model, &GradientsParams::from_grads(grads, &model));
    // Two ranks: each its own input, then the all-reduce.
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    let results = world.run(|comm| -> Result<Vec<Vec<f32>>, String> {
        let model = fresh();
        let grads = loss(&model, input(comm.rank())).backward();
        let grads = GradientsParams::from_grads(grads, &model);
        let summed = all_reduce_grads(&model, grads, &comm).map_err(|e| e.to_string())?;
        Ok(gradient_values(&model, &summed))
    });
    for result in results {
        let got = result.unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            for (a, b) in g.iter().zip(w) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }
}
