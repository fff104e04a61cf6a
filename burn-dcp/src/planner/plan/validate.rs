//! The plan validator, independent of how a plan was made: every non-empty mask tile computed
//! exactly once, every data block with exactly one home, every rank and stage in range.

use std::collections::{BTreeMap, HashMap};

use super::{BlockProblem, DataKind, Plan};
use crate::error::CpError;

/// Checks a plan against its problem: every non-empty tile of every head group computed exactly
/// once, nothing else computed, every q/kv/o block exactly one home, every rank in range.
pub fn validate_plan(plan: &Plan, problem: &BlockProblem) -> Result<(), CpError> {
    problem.validate()?;
    check_tiles(plan, problem)?;
    check_homes(plan, problem)
}

fn invalid(message: String) -> Result<(), CpError> {
    Err(CpError::Config(format!("invalid plan: {message}")))
}

/// One tile of one head group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct TileKey {
    seq: usize,
    head: usize,
    q_block: usize,
    kv_block: usize,
}

/// Every non-empty tile computed exactly once, on a rank of the plan, and nothing else.
fn check_tiles(plan: &Plan, problem: &BlockProblem) -> Result<(), CpError> {
    let mut computed: HashMap<TileKey, usize> = HashMap::new();
    for b in &plan.blocks {
        if b.rank >= plan.ranks {
            return invalid(format!(
                "compute block {b:?} is on rank {} of {}",
                b.rank, plan.ranks
            ));
        }
        let key = TileKey {
            seq: b.seq,
            head: b.head,
            q_block: b.q_block,
            kv_block: b.kv_block,
        };
        *computed.entry(key).or_default() += 1;
    }
    let mut expected = 0usize;
    for seq in 0..problem.seq_lens.len() {
        for (q_block, kv_blocks) in problem.nonempty_tiles(seq).iter().enumerate() {
            for &kv_block in kv_blocks {
                for head in 0..problem.head_groups {
                    expected += 1;
                    let tile =
                        || format!("tile (seq {seq}, head {head}, q {q_block}, kv {kv_block})");
                    match computed.get(&TileKey {
                        seq,
                        head,
                        q_block,
                        kv_block,
                    }) {
                        Some(1) => {}
                        Some(n) => return invalid(format!("{} computed {n} times", tile())),
                        None => return invalid(format!("{} is never computed", tile())),
                    }
                }
            }
        }
    }
    if computed.len() != expected {
        return invalid(format!(
            "{} tiles computed but only {expected} are non-empty",
            computed.len()
        ));
    }
    Ok(())
}

/// One data block of one head group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct DataKey {
    kind: DataKind,
    seq: usize,
    head: usize,
    block: usize,
}

/// Every Q, KV and O block of the problem exactly one home, on a rank of the plan, and no
/// other data block.
fn check_homes(plan: &Plan, problem: &BlockProblem) -> Result<(), CpError> {
    let mut homes: BTreeMap<DataKey, usize> = BTreeMap::new();
    for d in &plan.data {
        if d.home_rank >= plan.ranks {
            return invalid(format!(
                "data block {d:?} lives on rank {} of {}",
                d.home_rank, plan.ranks
            ));
        }
        let key = DataKey {
            kind: d.kind,
            seq: d.seq,
            head: d.head,
            block: d.block,
        };
        *homes.entry(key).or_default() += 1;
    }
    for seq in 0..problem.seq_lens.len() {
        for block in 0..problem.blocks_of(seq) {
            for head in 0..problem.head_groups {
                for kind in [DataKind::Q, DataKind::Kv, DataKind::O] {
                    let data = || format!("{kind:?} block (seq {seq}, head {head}, block {block})");
                    match homes.get(&DataKey {
                        kind,
                        seq,
                        head,
                        block,
                    }) {
                        Some(1) => {}
                        Some(n) => return invalid(format!("{} has {n} homes", data())),
                        None => return invalid(format!("{} has no home", data())),
                    }
                }
            }
        }
    }
    let total_blocks: usize = (0..problem.seq_lens.len())
        .map(|s| problem.blocks_of(s))
        .sum();
    if homes.len() != 3 * total_blocks * problem.head_groups {
        return invalid("data blocks outside the problem".into());
    }
    Ok(())
}
