//! Outputs compared: every one of out, lse, dq, dk, dv, within a relative bound or torch's
//! `allclose`.

use burn_dcp::diagnostics::harness::{max_rel_err, PackedOutputs};

use super::TOLERANCE;

/// The outputs of `got` and `want`, named, side by side.
fn paired<'a>(
    got: &'a PackedOutputs,
    want: &'a PackedOutputs,
) -> [(&'static str, &'a [f32], &'a [f32]); 5] {
    [
        ("out", &got.out, &want.out),
        ("lse", &got.lse, &want.lse),
        ("dq", &got.dq, &want.dq),
        ("dk", &got.dk, &want.dk),
        ("dv", &got.dv, &want.dv),
    ]
}

/// Asserts every output of `got` is within `TOLERANCE` of `want`.
pub fn assert_close(got: &PackedOutputs, want: &PackedOutputs, what: &str) {
    for (name, g, w) in paired(got, want) {
        let err = max_rel_err(g, w);
        assert!(
            err <= TOLERANCE,
            "{what}: {name} max_rel_err {err:e} > {TOLERANCE:e}"
        );
    }
}

/// `|got − want| ≤ atol + rtol·|want|` for every element of out, lse, dq, dk, dv (torch's
/// `allclose`, as TransformerEngine's CP tests compare CP with one device).
pub fn assert_allclose(got: &PackedOutputs, want: &PackedOutputs, tolerance: f32, what: &str) {
    for (name, g, w) in paired(got, want) {
        assert_eq!(g.len(), w.len(), "{what}: {name} lengths");
        for (i, (a, b)) in g.iter().zip(w.iter()).enumerate() {
            // Masked rows hold −∞ in lse on both sides.
            let same = a == b || (a - b).abs() <= tolerance + tolerance * b.abs();
            assert!(
                same,
                "{what}: {name}[{i}] {a} vs {b} beyond atol = rtol = {tolerance}"
            );
        }
    }
}
