//! Which strategy, and the group of ranks it runs on.

use std::fmt;

use crate::batch::layout::Layout;
use crate::comm::Comm;
use crate::error::CpError;
use crate::strategy::StrategyKind;
use burn_dcp_kernels::heads::{HeadParts, Heads};

/// Which algorithm computes attention across the CP group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// All-to-all from sequence shards to head shards; needs `heads % cp == 0`.
    Ulysses,
    /// Key/value blocks travel around a ring of all CP ranks.
    Ring,
    /// Every rank gathers all keys/values (llama3-style).
    AllGather,
    /// Ulysses within groups of `ulysses_degree` ranks, ring across `ring_degree` such groups.
    Usp {
        ulysses_degree: usize,
        ring_degree: usize,
    },
    /// A DCP block plan: tokens live where the plan homes them, blocks move once per (block,
    /// destination) and results come home ([`CpBatch::blocks`](super::CpBatch::blocks) carries the plan).
    Dcp,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The kind's name; ring's without its layout, USP's with its mesh.
        let name = StrategyKind::of(*self, Layout::Zigzag).family();
        match self {
            Strategy::Usp {
                ulysses_degree,
                ring_degree,
            } => write!(f, "{name}({ulysses_degree}x{ring_degree})"),
            _ => f.write_str(name),
        }
    }
}

impl Strategy {
    /// Parses a strategy name for a CP group of `cp` ranks: `ring` (its layout is given apart),
    /// `ulysses`, `usp`, `all-gather` or `dcp`. `usp` needs `ulysses_degree` (the ring degree is
    /// `cp / ulysses_degree`); the other strategies reject it, so a degree is never silently
    /// ignored. The names are [`StrategyKind`]'s.
    pub fn parse(name: &str, ulysses_degree: Option<usize>, cp: usize) -> Result<Self, CpError> {
        StrategyKind::from_static_name(name)?.strategy(ulysses_degree, cp)
    }

    /// Checks the strategy against the CP size.
    pub fn validate_mesh(&self, cp: usize) -> Result<(), CpError> {
        if cp == 0 {
            return Err(CpError::Config("cp size must be at least 1, got 0".into()));
        }
        if let Strategy::Usp {
            ulysses_degree,
            ring_degree,
        } = self
        {
            if ulysses_degree * ring_degree != cp {
                return Err(CpError::Config(format!(
                    "ulysses_degree {ulysses_degree} × ring_degree {ring_degree} = {} does not equal the cp size {cp}",
                    ulysses_degree * ring_degree
                )));
            }
        }
        Ok(())
    }

    /// Checks the head counts against the strategy ([`burn_dcp_kernels::heads`]'s rules): grouped-query
    /// heads, and Ulysses' degree (all of `cp`, or USP's) dividing the query heads.
    pub fn validate_heads(&self, heads: usize, kv_heads: usize, cp: usize) -> Result<(), CpError> {
        let heads = Heads::new(heads, kv_heads)?;
        let degree = match self {
            Strategy::Ulysses => cp,
            Strategy::Usp { ulysses_degree, .. } => *ulysses_degree,
            Strategy::Ring | Strategy::AllGather | Strategy::Dcp => return Ok(()),
        };
        heads.split_queries(HeadParts::Ulysses(degree))?;
        Ok(())
    }
}

/// One rank's membership of a CP group, with the sub-groups its strategy needs.
#[derive(Clone, Debug)]
pub struct CpGroup {
    pub comm: Comm,
    pub strategy: Strategy,
    /// USP only: this rank's Ulysses group (ranks `g·U .. g·U+U`) and ring group (ranks `u, u+U, …`).
    pub(crate) usp_groups: Option<(Comm, Comm)>,
}

impl CpGroup {
    /// Builds the group. For USP this is a collective call (it splits `comm`): every rank of
    /// `comm` must call it with the same strategy.
    pub fn new(comm: Comm, strategy: Strategy) -> Result<Self, CpError> {
        strategy.validate_mesh(comm.size())?;
        let usp_groups = match strategy {
            Strategy::Usp { ulysses_degree, .. } => {
                let rank = comm.rank();
                let ulysses = comm.split(rank / ulysses_degree, rank % ulysses_degree)?;
                let ring = comm.split(rank % ulysses_degree, rank / ulysses_degree)?;
                Some((ulysses, ring))
            }
            _ => None,
        };
        Ok(Self {
            comm,
            strategy,
            usp_groups,
        })
    }

    pub fn cp(&self) -> usize {
        self.comm.size()
    }
}
