//! The pipeline's schedule: which pass (forward or backward of which unit) each stage runs when,
//! a pure function of the schedule, the stage, the model chunks and the units; simulated here
//! against every shape (no pass waits on one that cannot have run).

use crate::config::PpSchedule;

/// A forward or backward pass of one schedule unit (a sub-step of the plan) on one model chunk,
/// named by its virtual id `unit · chunks + chunk` (the unit itself with one chunk per rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward(usize),
    Backward(usize),
}

/// The passes stage `stage` of `stages` runs over `units` schedule units of its `chunks` model
/// chunks, in order. One chunk: 1F1B or GPipe, backward passes in the forwards' order, so a stage
/// receives gradients in the order it sent activations. Several chunks (`--vpp`; `units` a
/// multiple of `stages`): Megatron-LM's interleaved 1F1B — forward `k` runs chunk
/// `(k mod stages·chunks) / stages` of unit `(k / (stages·chunks))·stages + k mod stages`
/// (backward: the chunks in reverse), after `2·(stages − stage − 1) + (chunks − 1)·stages`
/// warm-up forwards; messages are tagged, since one pair of ranks may carry both directions.
pub(crate) fn stage_passes(
    schedule: PpSchedule,
    stage: usize,
    stages: usize,
    chunks: usize,
    units: usize,
) -> Vec<Pass> {
    if chunks > 1 {
        return interleaved_passes(stage, stages, chunks, units);
    }
    let warmup = match schedule {
        PpSchedule::OneFOneB => (stages - stage - 1).min(units),
        PpSchedule::Gpipe => units,
    };
    let mut passes: Vec<Pass> = (0..warmup).map(Pass::Forward).collect();
    for unit in 0..units - warmup {
        passes.push(Pass::Forward(warmup + unit));
        passes.push(Pass::Backward(unit));
    }
    passes.extend((units - warmup..units).map(Pass::Backward));
    passes
}

/// Megatron-LM's interleaved 1F1B (see [`stage_passes`]), over virtual ids.
fn interleaved_passes(stage: usize, stages: usize, chunks: usize, units: usize) -> Vec<Pass> {
    let total = units * chunks;
    let round = stages * chunks;
    let id = |k: usize, forward: bool| {
        let (group, within) = (k / round, k % round);
        let chunk = match forward {
            true => within / stages,
            false => chunks - 1 - within / stages,
        };
        (group * stages + within % stages) * chunks + chunk
    };
    let warmup = (2 * (stages - stage - 1) + (chunks - 1) * stages).min(total);
    let mut passes: Vec<Pass> = (0..warmup).map(|k| Pass::Forward(id(k, true))).collect();
    for k in 0..total - warmup {
        passes.push(Pass::Forward(id(warmup + k, true)));
        passes.push(Pass::Backward(id(k, false)));
    }
    passes.extend((total - warmup..total).map(|k| Pass::Backward(id(k, false))));
    passes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TrainError;

    #[test]
    fn one_f_one_b_warms_up_alternates_and_drains() {
        use Pass::{Backward as B, Forward as F};
        // Stage 0 of 3 over 4 units: two warm-up forwards.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 0, 3, 1, 4),
            vec![F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)]
        );
        // The last stage alternates from the start.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 2, 3, 1, 2),
            vec![F(0), B(0), F(1), B(1)]
        );
        // Fewer units than warm-up forwards.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 0, 4, 1, 2),
            vec![F(0), F(1), B(0), B(1)]
        );
        assert_eq!(
            stage_passes(PpSchedule::Gpipe, 1, 3, 1, 3),
            vec![F(0), F(1), F(2), B(0), B(1), B(2)]
        );
        for schedule in [PpSchedule::OneFOneB, PpSchedule::Gpipe] {
            for stages in 1..5 {
                for stage in 0..stages {
                    for units in 0..6 {
                        let passes = stage_passes(schedule, stage, stages, 1, units);
                        let (forwards, backwards): (Vec<Pass>, Vec<Pass>) =
                            passes.iter().partition(|p| matches!(p, Pass::Forward(_)));
                        let unit = |p: &Pass| match p {
                            Pass::Forward(u) | Pass::Backward(u) => *u,
                        };
                        let forwards: Vec<usize> = forwards.iter().map(unit).collect();
                        let backwards: Vec<usize> = backwards.iter().map(unit).collect();
                        assert_eq!(forwards, (0..units).collect::<Vec<_>>());
                        assert_eq!(backwards, forwards);
                        // Every backward comes after its forward.
                        for unit in 0..units {
                            let f = passes.iter().position(|p| *p == Pass::Forward(unit));
                            let b = passes.iter().position(|p| *p == Pass::Backward(unit));
                            assert!(f < b);
                        }
                    }
                }
            }
        }
        assert_eq!(PpSchedule::parse("gpipe").unwrap(), PpSchedule::Gpipe);
        let error = PpSchedule::parse("zb").unwrap_err();
        assert!(matches!(error, TrainError::Config(_)), "{error:?}");
        assert!(error.to_string().contains("expected 1f1b or gpipe"));
    }

    /// Interleaved 1F1B runs every pass once, each backward after its forward, and the whole
    /// pipeline completes when each rank takes its passes in order and waits only for the
    /// message a pass needs (simulated: activations from the previous virtual stage, gradients
    /// from the next).
    #[test]
    fn interleaved_one_f_one_b_completes_for_every_shape() {
        use Pass::{Backward as B, Forward as F};
        // Megatron's order on 2 stages × 2 chunks × 2 units (virtual id = unit · 2 + chunk):
        // stage 0 warms up with 2·1 + 1·2 = 4 forwards.
        assert_eq!(
            stage_passes(PpSchedule::OneFOneB, 0, 2, 2, 2),
            vec![F(0), F(2), F(1), F(3), B(1), B(3), B(0), B(2)]
        );
        for stages in 2..5 {
            for chunks in 2..4 {
                for units in (stages..=3 * stages).step_by(stages) {
                    let plans: Vec<Vec<Pass>> = (0..stages)
                        .map(|s| stage_passes(PpSchedule::OneFOneB, s, stages, chunks, units))
                        .collect();
                    let total = units * chunks;
                    // Virtual stage of (rank, id): chunk · stages + rank.
                    let virtual_stage = |rank: usize, id: usize| (id % chunks) * stages + rank;
                    let last = stages * chunks - 1;
                    let mut done_forward = vec![vec![false; stages * chunks]; units];
                    let mut done_backward = vec![vec![false; stages * chunks]; units];
                    let mut next = vec![0; stages];
                    loop {
                        let mut progressed = false;
                        for rank in 0..stages {
                            while let Some(&pass) = plans[rank].get(next[rank]) {
                                let ready = match pass {
                                    F(id) => {
                                        let v = virtual_stage(rank, id);
                                        v == 0 || done_forward[id / chunks][v - 1]
                                    }
                                    B(id) => {
                                        let v = virtual_stage(rank, id);
                                        done_forward[id / chunks][v]
                                            && (v == last || done_backward[id / chunks][v + 1])
                                    }
                                };
                                if !ready {
                                    break;
                                }
                                match pass {
                                    F(id) => {
                                        done_forward[id / chunks][virtual_stage(rank, id)] = true
                                    }
                                    B(id) => {
                                        done_backward[id / chunks][virtual_stage(rank, id)] = true
                                    }
                                }
                                next[rank] += 1;
                                progressed = true;
                            }
                        }
                        if !progressed {
                            break;
                        }
                    }
                    for (rank, plan) in plans.iter().enumerate() {
                        assert_eq!(plan.len(), 2 * total, "{stages}×{chunks}, {units} units");
                        assert_eq!(
                            next[rank],
                            plan.len(),
                            "{stages} stages × {chunks} chunks, {units} units: rank {rank} stuck at {:?}",
                            plan.get(next[rank])
                        );
                    }
                }
            }
        }
    }
}
