//! The device mesh of hybrid parallelism: tensor (TP), context (CP), data (DP) and pipeline (PP)
//! parallelism over one world of ranks.
//!
//! Ranks are numbered by the ordered axis list `tp, cp, dp, pp`, TP innermost, like
//! Megatron-LM's `RankGenerator` (order `tp-cp-ep-dp-pp` without experts):
//!
//! ```text
//! rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank))
//! ```
//!
//! so a TP group is `tp` consecutive ranks (the fastest links), and with `tp = pp = 1` the CP
//! group of replica `d` is ranks `d·cp .. (d+1)·cp`, as before the mesh existed. An axis group is
//! the ranks that differ only in that axis; the *pool* of a rank is its DP × CP ranks (same TP and
//! PP rank), numbered `cp_rank + cp · dp_rank` — the ranks dynamic CP schedules over.
//!
//! [`Mesh::new`] creates one communicator per axis group (and the pool) with collective splits of
//! the world, once.

use std::fmt;

use crate::comm::Comm;
use crate::error::CpError;
use burn_dcp_kernels::heads::{HeadParts, HeadSplitError, Heads};

/// A pipeline rule broken: the values, and the rule's text ([`PipelineError::naming_stages`]
/// lets a command line name its flag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineError {
    /// Stages that do not split the layers evenly.
    Layers { pp: usize, layers: usize },
    /// Too few micro-batches per DP replica for every stage to have work.
    MicroBatches {
        pp: usize,
        dp: usize,
        micro_batches: usize,
    },
}

impl PipelineError {
    /// The message with the stages named by the caller (`--pp 3 must divide the 2 layers …`).
    pub fn naming_stages(&self, stages: &str) -> String {
        match self {
            Self::Layers { layers, .. } => format!(
                "{stages} must divide the {layers} layers (every pipeline stage holds as many)"
            ),
            Self::MicroBatches {
                pp,
                dp,
                micro_batches,
            } => format!(
                "{stages} needs at least {pp} micro-batches per DP replica (has {micro_batches} over dp {dp})"
            ),
        }
    }
}

impl fmt::Display for PipelineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (Self::Layers { pp, .. } | Self::MicroBatches { pp, .. }) = self;
        f.write_str(&self.naming_stages(&format!("pipeline parallelism over {pp} stages")))
    }
}

impl std::error::Error for PipelineError {}

impl From<PipelineError> for CpError {
    fn from(error: PipelineError) -> Self {
        CpError::Config(error.to_string())
    }
}

/// `pp` pipeline stages of equal depth over `layers` layers: `pp` at least 1 and dividing them.
pub fn check_stage_layers(pp: usize, layers: usize) -> Result<(), PipelineError> {
    if pp == 0 || !layers.is_multiple_of(pp) {
        return Err(PipelineError::Layers { pp, layers });
    }
    Ok(())
}

/// One of the mesh's axes, in rank order (innermost first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    Tp,
    Cp,
    Dp,
    Pp,
}

impl Axis {
    pub const ALL: [Axis; 4] = [Axis::Tp, Axis::Cp, Axis::Dp, Axis::Pp];

    pub fn name(&self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
        }
    }

    fn index(&self) -> usize {
        match self {
            Axis::Tp => 0,
            Axis::Cp => 1,
            Axis::Dp => 2,
            Axis::Pp => 3,
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The sizes of the four axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MeshShape {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
}

/// A rank's position on every axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coords {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
}

impl Coords {
    pub fn get(&self, axis: Axis) -> usize {
        [self.tp, self.cp, self.dp, self.pp][axis.index()]
    }

    fn with(mut self, axis: Axis, value: usize) -> Self {
        match axis {
            Axis::Tp => self.tp = value,
            Axis::Cp => self.cp = value,
            Axis::Dp => self.dp = value,
            Axis::Pp => self.pp = value,
        }
        self
    }
}

impl MeshShape {
    /// DP × CP only (TP = PP = 1).
    pub fn dp_cp(cp: usize, dp: usize) -> Self {
        Self {
            tp: 1,
            cp,
            dp,
            pp: 1,
        }
    }

    pub fn size(&self, axis: Axis) -> usize {
        [self.tp, self.cp, self.dp, self.pp][axis.index()]
    }

    /// Every axis at least 1 and the world within `max_world` ranks.
    pub fn validate(&self, max_world: usize) -> Result<(), CpError> {
        if let Some(axis) = Axis::ALL.into_iter().find(|&a| self.size(a) == 0) {
            return Err(CpError::Config(format!(
                "--{axis} must be at least 1, got 0 (mesh {self})"
            )));
        }
        match self.checked_world() {
            Some(world) if world <= max_world => Ok(()),
            _ => Err(CpError::Config(format!(
                "the ranks of mesh {self} exceed the {max_world} ranks a world can hold"
            ))),
        }
    }

    fn checked_world(&self) -> Option<usize> {
        Axis::ALL
            .into_iter()
            .try_fold(1usize, |world, axis| world.checked_mul(self.size(axis)))
    }

    /// tp · cp · dp · pp.
    pub fn world(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// DP × CP ranks of one (TP, PP) position: the pool dynamic CP schedules over.
    pub fn pool_size(&self) -> usize {
        self.cp * self.dp
    }

    /// The coordinates of `rank` (`rank < world`).
    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            tp: rank % self.tp,
            cp: rank / self.tp % self.cp,
            dp: rank / (self.tp * self.cp) % self.dp,
            pp: rank / (self.tp * self.cp * self.dp),
        }
    }

    /// The rank at `coords`.
    pub fn rank(&self, coords: Coords) -> usize {
        coords.tp + self.tp * (coords.cp + self.cp * (coords.dp + self.dp * coords.pp))
    }

    /// The ranks of `rank`'s group on `axis`, in axis order.
    pub fn group(&self, axis: Axis, rank: usize) -> Vec<usize> {
        let coords = self.coords(rank);
        (0..self.size(axis))
            .map(|i| self.rank(coords.with(axis, i)))
            .collect()
    }

    /// The ranks of `rank`'s DP × CP pool, in pool order (`cp_rank + cp · dp_rank`).
    pub fn pool(&self, rank: usize) -> Vec<usize> {
        let coords = self.coords(rank);
        (0..self.pool_size())
            .map(|p| {
                self.rank(Coords {
                    cp: p % self.cp,
                    dp: p / self.cp,
                    ..coords
                })
            })
            .collect()
    }

    /// `rank`'s index in its pool.
    pub fn pool_index(&self, rank: usize) -> usize {
        let coords = self.coords(rank);
        coords.cp + self.cp * coords.dp
    }

    /// Which group of `axis` `rank` is in (a number shared by the group's ranks, distinct between
    /// groups): its rank with that axis' coordinate at 0.
    fn group_color(&self, axis: Axis, rank: usize) -> usize {
        self.rank(self.coords(rank).with(axis, 0))
    }

    /// The pipeline's rules for this mesh: PP gives every stage the same number of layers
    /// (`layers % pp`), and with PP every replica runs at least `pp` micro-batches per step so
    /// that every stage has work in the 1F1B steady state. (The TP rules — heads, kv heads, MLP
    /// width, vocabulary — belong to the model: `burn_dcp_models::tensor_parallel::validate_tp`.)
    pub fn validate_pipeline(
        &self,
        layers: usize,
        micro_batches: usize,
    ) -> Result<(), PipelineError> {
        check_stage_layers(self.pp, layers)?;
        let per_replica = micro_batches / self.dp.max(1);
        if self.pp > 1 && per_replica < self.pp {
            return Err(PipelineError::MicroBatches {
                pp: self.pp,
                dp: self.dp,
                micro_batches,
            });
        }
        Ok(())
    }

    /// The query and kv heads one TP rank holds ([`Heads::split`] over the TP ranks: kv heads
    /// replicated when tp > kv heads).
    pub fn heads_per_tp_rank(&self, heads: Heads) -> Result<Heads, HeadSplitError> {
        heads.split(HeadParts::TensorParallel(self.tp))
    }
}

impl fmt::Display for MeshShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp {} × cp {} × dp {} × pp {}",
            self.tp, self.cp, self.dp, self.pp
        )
    }
}

/// One rank's communicators: the world, one per axis group, and its DP × CP pool.
#[derive(Clone)]
pub struct Mesh {
    pub shape: MeshShape,
    pub world: Comm,
    pub tp: Comm,
    pub cp: Comm,
    pub dp: Comm,
    pub pp: Comm,
    pub pool: Comm,
}

impl Mesh {
    /// Splits `world` into the mesh's groups: a collective call of every rank of `world`, whose
    /// size must be `shape.world()`.
    pub fn new(world: Comm, shape: MeshShape) -> Result<Self, CpError> {
        shape.validate(usize::MAX)?;
        if world.size() != shape.world() {
            return Err(CpError::Config(format!(
                "mesh {shape} needs {} ranks, the world has {}",
                shape.world(),
                world.size()
            )));
        }
        let rank = world.rank();
        let coords = shape.coords(rank);
        let split = |axis: Axis| {
            world.split_labeled(shape.group_color(axis, rank), coords.get(axis), axis.name())
        };
        let (tp, cp, dp, pp) = (
            split(Axis::Tp)?,
            split(Axis::Cp)?,
            split(Axis::Dp)?,
            split(Axis::Pp)?,
        );
        // The pool: same TP and PP rank. Its own traffic is the gradient all-reduce over DP × CP
        // (Megatron's dp-cp group), counted as `dp`; CP groups split from it are labelled `cp`.
        let pool = world.split_labeled(
            coords.tp + shape.tp * coords.pp,
            shape.pool_index(rank),
            Axis::Dp.name(),
        )?;
        Ok(Self {
            shape,
            world,
            tp,
            cp,
            dp,
            pp,
            pool,
        })
    }

    /// The communicator of `axis`.
    pub fn axis(&self, axis: Axis) -> &Comm {
        match axis {
            Axis::Tp => &self.tp,
            Axis::Cp => &self.cp,
            Axis::Dp => &self.dp,
            Axis::Pp => &self.pp,
        }
    }

    pub fn coords(&self) -> Coords {
        self.shape.coords(self.world.rank())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{InProcessWorld, WorldConfig};
    use burn::tensor::TensorData;

    fn shape(tp: usize, cp: usize, dp: usize, pp: usize) -> MeshShape {
        MeshShape { tp, cp, dp, pp }
    }

    #[test]
    fn ranks_follow_megatron_order_tp_innermost() {
        let mesh = shape(2, 2, 2, 2);
        assert_eq!(mesh.world(), 16);
        for rank in 0..16 {
            assert_eq!(mesh.rank(mesh.coords(rank)), rank);
        }
        assert_eq!(mesh.group(Axis::Tp, 5), vec![4, 5]);
        assert_eq!(mesh.group(Axis::Cp, 5), vec![5, 7]);
        assert_eq!(mesh.group(Axis::Dp, 5), vec![1, 5]);
        assert_eq!(mesh.group(Axis::Pp, 5), vec![5, 13]);
        assert_eq!(mesh.pool(5), vec![1, 3, 5, 7]);
        assert_eq!(mesh.pool_index(5), 2);
        // Without TP and PP, CP groups are the replicas' rank ranges, as before the mesh.
        let flat = MeshShape::dp_cp(4, 2);
        assert_eq!(flat.group(Axis::Cp, 6), vec![4, 5, 6, 7]);
        assert_eq!(flat.pool(6), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn axis_groups_partition_the_world() {
        let mesh = shape(2, 3, 1, 2);
        for axis in Axis::ALL {
            let mut groups: Vec<Vec<usize>> =
                (0..mesh.world()).map(|r| mesh.group(axis, r)).collect();
            for (rank, group) in groups.iter().enumerate() {
                assert_eq!(group.len(), mesh.size(axis));
                assert_eq!(group[mesh.coords(rank).get(axis)], rank, "{axis} of {rank}");
            }
            groups.sort();
            groups.dedup();
            let mut members: Vec<usize> = groups.concat();
            members.sort_unstable();
            assert_eq!(members, (0..mesh.world()).collect::<Vec<_>>(), "{axis}");
        }
    }

    #[test]
    fn mesh_rules_name_the_values() {
        let mesh = shape(4, 1, 1, 2);
        assert!(mesh.validate_pipeline(4, 2).is_ok());
        let layers = shape(1, 1, 1, 3).validate_pipeline(4, 3).unwrap_err();
        assert!(layers
            .to_string()
            .contains("pipeline parallelism over 3 stages must divide the 4 layers"));
        let few = shape(1, 1, 2, 2).validate_pipeline(4, 2).unwrap_err();
        assert!(few
            .to_string()
            .contains("at least 2 micro-batches per DP replica"));
        assert!(shape(0, 1, 1, 1).validate(64).is_err());
        assert!(shape(usize::MAX, 2, 1, 1).validate(64).is_err());
        let heads = Heads::new(8, 2).unwrap();
        assert_eq!(
            shape(4, 1, 1, 1).heads_per_tp_rank(heads).unwrap(),
            Heads::new(2, 1).unwrap()
        );
    }

    #[test]
    fn communicators_hold_the_axis_groups() {
        let mesh = shape(2, 2, 1, 2);
        let world = InProcessWorld::new(mesh.world(), WorldConfig::default()).unwrap();
        let results = world.run(|comm| -> Result<Vec<Vec<f32>>, CpError> {
            let rank = comm.rank();
            let built = Mesh::new(comm, mesh)?;
            let mut sums = Vec::new();
            for axis in Axis::ALL
                .iter()
                .map(|&a| built.axis(a))
                .chain([&built.pool])
            {
                let data = TensorData::new(vec![rank as f32], [1]);
                let sum = axis.all_reduce(data.into())?.into_host().unwrap();
                sums.push(sum.to_vec::<f32>().unwrap());
            }
            Ok(sums)
        });
        let stats = world.stats();
        for label in ["tp", "cp", "pp", "dp"] {
            let bytes: u64 = stats
                .iter()
                .map(|s| s.bytes_by_label.get(label).copied().unwrap_or(0))
                .sum();
            assert!(
                bytes > 0
                    || mesh.size(match label {
                        "tp" => Axis::Tp,
                        "cp" => Axis::Cp,
                        "pp" => Axis::Pp,
                        _ => Axis::Dp,
                    }) == 1,
                "{label}: {stats:?}"
            );
        }
        for (rank, result) in results.into_iter().enumerate() {
            let sums = result.unwrap();
            let expected = |ranks: Vec<usize>| vec![ranks.iter().sum::<usize>() as f32];
            for (i, axis) in Axis::ALL.into_iter().enumerate() {
                assert_eq!(
                    sums[i],
                    expected(mesh.group(axis, rank)),
                    "{axis} of {rank}"
                );
            }
            assert_eq!(sums[4], expected(mesh.pool(rank)));
        }
    }
}
