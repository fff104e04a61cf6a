//! Whether a device's planes shuffle within rows of four lanes: the test that picks the plain
//! bodies' [`FlashBody`].
//!
//! The plain product and row reductions exchange values between the four lanes `t = 0..3` of
//! a fragment row (`lane ^ 1`, `lane ^ 2`, `lane ^ 3`). A device that advertises plane
//! operations does this in hardware. cubecl does not advertise them on CPU adapters
//! (lavapipe), whose subgroups of 8 do shuffle all the same, so there a tiny kernel asks the
//! device once: each lane of two planes shuffles an f32 and a pair of f32 with its three
//! row-mates, and the results are checked. A device that fails the test, or whose test panics
//! on this thread, gets the shared-memory body. (Only lavapipe has been asked so far; a CPU
//! adapter whose compiler rejects subgroup operations has not been tried.)

use std::collections::HashMap;
use std::sync::Mutex;

use burn_cubecl::CubeRuntime;
use cubecl::ir::features::Plane;
use cubecl::prelude::*;

use super::fragment::Pair;
use super::plan::FlashBody;

/// Lanes of the test: two planes of 32, so that a device whose planes are smaller than 32 (8 on
/// lavapipe) shows how it numbers them.
const LANES: usize = 64;

/// The body of the flash kernels on `client`'s device without tensor cores: [`FlashBody::Shuffles`]
/// where its planes shuffle within rows of four lanes, else [`FlashBody::Shared`]. The test
/// runs once per device kind (its properties) and process.
pub fn plain_body<R: CubeRuntime>(client: &ComputeClient<R>) -> FlashBody {
    let properties = client.properties();
    if properties.hardware.plane_size_min < 4 {
        return FlashBody::Shared;
    }
    if properties.features.plane.contains(Plane::Ops) {
        return FlashBody::Shuffles;
    }
    static KNOWN: Mutex<Option<HashMap<String, FlashBody>>> = Mutex::new(None);
    let key = format!("{} {:?}", R::name(client), properties.hardware);
    let mut known = KNOWN.lock().unwrap_or_else(|poison| poison.into_inner());
    *known
        .get_or_insert_with(HashMap::new)
        .entry(key)
        .or_insert_with(|| {
            let works =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shuffles_work(client)));
            match works {
                Ok(true) => FlashBody::Shuffles,
                _ => FlashBody::Shared,
            }
        })
}

/// Lane `l` writes `[l, l ^ 1, l ^ 2, l ^ 3]` as it received them from shuffles of an f32 and
/// of a pair.
#[cube(launch_unchecked)]
fn quad_shuffle_test(out: &mut Tensor<f32>) {
    let lane = UNIT_POS as usize;
    let value = f32::cast_from(UNIT_POS);
    let mut pair = Pair::<f32>::new(0.0);
    pair[0] = value;
    pair[1] = value + 0.5;
    out[8 * lane] = value;
    out[8 * lane + 4] = pair[1];
    #[unroll]
    for m in 1..4u32 {
        let scalar = plane_shuffle_xor(value, m);
        let got = plane_shuffle_xor(pair, m);
        out[8 * lane + m as usize] = scalar;
        // The pair's first half must match the scalar, the second half carries `+ 0.5`.
        out[8 * lane + 4 + m as usize] = got[1] + (got[0] - scalar);
    }
}

fn shuffles_work<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    let out = client.create_from_slice(&[0u8; 8 * LANES * 4]);
    // SAFETY: the 64 units write `8 · UNIT_POS + 0..8` of the tensor's `LANES × 8` f32.
    unsafe {
        let arg = TensorArg::from_raw_parts(
            out.clone(),
            cubecl::zspace::Strides::new(&[8, 1]),
            cubecl::zspace::Shape::new([LANES, 8]),
        );
        quad_shuffle_test::launch_unchecked::<R>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_2d(32, 2),
            arg,
        );
    }
    let Ok(bytes) = client.read_one(out) else {
        return false;
    };
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
        .collect();
    (0..LANES).all(|lane| {
        (0..4).all(|m| {
            let from = (lane ^ m) as f32;
            values[8 * lane + m] == from && values[8 * lane + 4 + m] == from + 0.5
        })
    })
}
