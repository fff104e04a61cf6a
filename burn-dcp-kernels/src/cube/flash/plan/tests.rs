//! The plans' shapes on the devices that matter: H100, A100, lavapipe's 32 KiB.

use super::*;

fn shape(dim: usize, value_dim: usize, heads: usize, kv_heads: usize) -> AttentionShape {
    AttentionShape {
        q_tokens: 1000,
        kv_tokens: 1000,
        heads,
        kv_heads,
        head_dim: dim,
        value_dim,
    }
}

#[test]
fn tiles_are_staged_in_turn_only_where_side_by_side_does_not_fit() {
    // f32 at dim 256 on lavapipe's 32 KiB: K and V (dk/dv: Q and dO) one after the other.
    let wide = shape(256, 256, 2, 1);
    let plan = FlashPlan::sized(32_768, DType::F32, &wide, 1, FlashBody::Shuffles).unwrap();
    let sizes = [forward_bytes, dq_bytes, dkdv_bytes];
    for (c, bytes) in [plan.forward, plan.dq, plan.dkdv].iter().zip(sizes) {
        assert!(c.in_turn && bytes(c, DType::F32) <= 32_768, "{c:?}");
    }
    // Side by side where they fit: f16 at 256, f32 at 200/136, f32 256 on 64 KiB.
    let side_by_side = [
        (32_768, DType::F16, wide),
        (32_768, DType::F32, shape(200, 136, 2, 1)),
        (65_536, DType::F32, wide),
    ];
    for (limit, dtype, shape) in side_by_side {
        let plan = FlashPlan::sized(limit, dtype, &shape, 1, FlashBody::Shuffles).unwrap();
        let turns = [plan.forward, plan.dq, plan.dkdv].map(|c| c.in_turn);
        assert_eq!(turns, [false; 3], "{limit} {dtype:?} {shape:?}");
    }
    // The copies never take turns; nothing fits 8 KiB, and the error says what it needs.
    let copies = FlashPlan::sized(232_448, DType::BF16, &wide, 1, FlashBody::TensorCores).unwrap();
    assert!(!copies.forward.in_turn && copies.forward.async_copy);
    let err = FlashPlan::sized(8_192, DType::F32, &wide, 1, FlashBody::Shuffles).unwrap_err();
    let err = err.to_string();
    assert!(
        err.contains("shared memory") && err.contains("8192"),
        "{err}"
    );
}

#[test]
fn plans_fill_the_shared_memory_they_have() {
    // An H100 (227 KiB), bf16, dim 128: the forward takes 8 planes of two row tiles and
    // key tiles of 32, dq 4 planes and key tiles of 32, dk/dv 4 planes and query tiles of
    // 32; GQA groups of 4 share cubes. (This test runs with PLANES_ENV unset.)
    let h100 = FlashPlan::sized(
        232_448,
        DType::BF16,
        &shape(128, 128, 32, 8),
        1,
        FlashBody::TensorCores,
    )
    .unwrap();
    let f = h100.forward;
    assert_eq!(
        (f.planes, f.row_tiles, f.block, f.heads_per_cube),
        (8, 2, 32, 4)
    );
    assert_eq!(
        (f.tokens_per_cube(), f.async_copy, f.shuffles),
        (64, true, true)
    );
    assert_eq!(
        (
            h100.dq.planes,
            h100.dq.row_tiles,
            h100.dq.block,
            h100.dq.heads_per_cube
        ),
        (4, 1, 32, 4)
    );
    assert_eq!((h100.dkdv.planes, h100.dkdv.block), (4, 32));
    // An A100's 163 KiB still takes the forward's 8 planes; 4 planes everywhere when pinned.
    let a100 = FlashPlan::sized(
        166_912,
        DType::BF16,
        &shape(128, 128, 32, 32),
        1,
        FlashBody::TensorCores,
    )
    .unwrap();
    assert_eq!((a100.forward.planes, a100.forward.row_tiles), (8, 2));
    let pinned = |planes| {
        let shape = shape(128, 128, 32, 8);
        FlashPlan::sized_with_planes(
            232_448,
            DType::BF16,
            &shape,
            1,
            FlashBody::TensorCores,
            Planes::both(planes),
        )
    };
    let four = pinned(4).unwrap();
    assert_eq!(
        (four.forward.planes, four.forward.tokens_per_cube()),
        (4, 32)
    );
    let err = pinned(3).unwrap_err().to_string();
    assert!(
        err.contains("3 planes") && err.contains("1, 2, 4 or 8"),
        "{err}"
    );
    // Dim 64: key tiles of 64 everywhere.
    let d64 = FlashPlan::sized(
        232_448,
        DType::F16,
        &shape(64, 64, 8, 8),
        1,
        FlashBody::TensorCores,
    )
    .unwrap();
    assert_eq!(
        (d64.forward.block, d64.dq.block, d64.forward.row_tiles),
        (64, 64, 2)
    );
    // lavapipe's 32 KiB in f32 (the plain bodies CI runs): by shuffles, four planes of two
    // row tiles; through shared memory (its scratch takes room), two planes.
    let f32_small = |body| {
        FlashPlan::sized(32_768, DType::F32, &shape(16, 32, 3, 1), 1, body)
            .unwrap()
            .forward
    };
    let f = f32_small(FlashBody::Shuffles);
    assert_eq!(
        (f.planes, f.row_tiles, f.block, f.heads_per_cube),
        (4, 2, 64, 1)
    );
    assert!(!f.async_copy && !f.tensor_cores && f.shuffles);
    let f = f32_small(FlashBody::Shared);
    assert_eq!((f.planes, f.row_tiles, f.block), (2, 2, 64));
    assert!(!f.async_copy && !f.tensor_cores && !f.shuffles);
    // Nothing fits: the error says how much the smallest cube needs.
    let err = FlashPlan::sized(
        1_000,
        DType::F32,
        &shape(128, 128, 1, 1),
        1,
        FlashBody::Shuffles,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("flash forward") && err.contains("1000"),
        "{err}"
    );
}
