//! A rank's communicators: the whole world (gradient all-reduce) and the CP groups the step plans
//! use, created once per rank range and kept.
//!
//! Creating a group is a collective split of the world, so every rank creates the same ranges in
//! the same order: before a step runs, each rank walks the plan's sub-steps ([`RankGroups::ensure`])
//! and splits the world once per sub-step that uses new ranges, whether or not it is in them.
//! Static CP creates its replicas' groups (`d·cp .. (d+1)·cp`) up front; dynamic CP's groups appear
//! as the scheduler first uses them. A range keeps one communicator; the strategies run on it
//! (one per range under `auto`) are built on it as batches first need them.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

use burn_dcp::comm::Comm;
use burn_dcp::mesh::{Axis, Coords, Mesh};
use burn_dcp::{CpError, CpGroup, Strategy};

use crate::config::TrainConfig;
use crate::model::ModelShape;
use crate::plan::StepPlan;
use crate::tensor_parallel::TpGroup;

/// The TP ranks that hold the same kv heads as `rank` (more than one only when tp > kv heads,
/// which replicates them): their k/v gradients are summed over these ranks.
pub(crate) fn kv_replicas(model: &ModelShape, rank: usize, tp: usize) -> Vec<usize> {
    if model.n_kv_heads >= tp {
        return vec![rank];
    }
    let replicas = tp / model.n_kv_heads;
    let first = rank / replicas * replicas;
    (first..first + replicas).collect()
}

/// One rank's communicators.
pub struct RankGroups {
    /// The whole world, its axis groups and this rank's DP × CP pool (`burn_dcp::mesh`).
    pub mesh: Mesh,
    /// The DP × CP pool of this rank's TP position: the plans' ranks are pool indices, CP groups
    /// split it, and gradients and losses are summed over it.
    pub world: Comm,
    /// This rank's TP group (the model's `f`/`g`).
    pub tp: TpGroup,
    /// The TP ranks sharing this rank's replicated kv heads (tp > kv heads), if any.
    pub kv_replicas: Option<Comm>,
    /// With a tied LM head and pp > 1, on the first and the last stage: the two ranks (same TP, CP
    /// and DP coordinates) holding a copy of the embedding, whose gradients they sum (Megatron's
    /// embedding group).
    pub embedding: Option<Comm>,
    cache: RefCell<GroupCache>,
}

/// The CP groups created so far, and this rank's membership of them.
struct GroupCache {
    /// Every rank range created so far (the same on every rank: creation is collective).
    created: HashSet<Range<usize>>,
    /// This rank's communicator of each range it is in.
    comms: HashMap<Range<usize>, Comm>,
    /// This rank's group of each (range, strategy) it ran (a strategy may need sub-groups: USP).
    groups: HashMap<(Range<usize>, Strategy), CpGroup>,
}

impl RankGroups {
    /// The mesh of `world` and, for static CP, every replica's communicator (a collective call
    /// of the world's ranks).
    pub fn new(world: Comm, config: &TrainConfig) -> Result<Self, CpError> {
        let mesh = Mesh::new(world, config.mesh_shape())?;
        let model = config
            .model_shape()
            .map_err(|e| CpError::Config(e.to_string()))?;
        let tp_rank = mesh.tp.rank();
        let replicas = kv_replicas(&model, tp_rank, config.tp);
        // Either every TP rank has replicas (tp > kv heads) and splits, or none does.
        let kv_replicas = if replicas.len() > 1 {
            Some(mesh.tp.split(replicas[0], tp_rank)?)
        } else {
            None
        };
        let embedding = Self::embedding_group(&mesh, &model)?;
        let groups = Self {
            world: mesh.pool.clone(),
            tp: TpGroup {
                comm: mesh.tp.clone(),
            },
            kv_replicas,
            embedding,
            mesh,
            cache: RefCell::new(GroupCache {
                created: HashSet::new(),
                comms: HashMap::new(),
                groups: HashMap::new(),
            }),
        };
        if config.mode.dynamic().is_none() {
            let replicas = (0..config.dp).map(|d| d * config.cp..(d + 1) * config.cp);
            groups.create(&replicas.collect::<Vec<_>>())?;
        }
        Ok(groups)
    }

    /// The embedding group of this rank (see [`Self::embedding`]): a collective split of the
    /// world when pp > 1 and the LM head is tied.
    fn embedding_group(mesh: &Mesh, model: &ModelShape) -> Result<Option<Comm>, CpError> {
        let shape = mesh.shape;
        if shape.pp == 1 || !model.tied_embeddings {
            return Ok(None);
        }
        let coords = mesh.coords();
        let ends = coords.pp == 0 || coords.pp + 1 == shape.pp;
        let rank = mesh.world.rank();
        // The pair's color is its stage-0 rank; every other rank gets one of its own.
        let color = if ends {
            shape.rank(Coords { pp: 0, ..coords })
        } else {
            shape.world() + rank
        };
        let comm = mesh
            .world
            .split_labeled(color, coords.pp, Axis::Pp.name())?;
        Ok(ends.then_some(comm))
    }

    /// Creates the communicators `plan` uses that do not exist yet (a collective call: every
    /// rank calls it with the same plan).
    pub fn ensure(&self, plan: &StepPlan) -> Result<(), CpError> {
        for ranges in plan.sub_step_ranges() {
            self.create(&ranges)?;
        }
        Ok(())
    }

    /// This rank's group running `strategy` on the world ranks `ranks` (whose communicator
    /// [`Self::ensure`] created). The first call for a (range, strategy) builds the group: for
    /// USP a collective call of the range's ranks, which all reach it in plan order.
    pub fn group(&self, ranks: &Range<usize>, strategy: Strategy) -> Result<CpGroup, CpError> {
        let key = (ranks.clone(), strategy);
        let mut cache = self.cache.borrow_mut();
        if let Some(group) = cache.groups.get(&key) {
            return Ok(group.clone());
        }
        let comm = cache.comms.get(ranks).cloned().ok_or_else(|| {
            CpError::Config(format!(
                "rank {}: no CP group for world ranks {ranks:?} (it is not one of them, or the plan's groups were not created)",
                self.world.rank()
            ))
        })?;
        let group = CpGroup::new(comm, strategy)?;
        cache.groups.insert(key, group.clone());
        Ok(group)
    }

    /// Creates the new ones among disjoint `ranges`: one split of the world.
    fn create(&self, ranges: &[Range<usize>]) -> Result<(), CpError> {
        let mut cache = self.cache.borrow_mut();
        let new: Vec<&Range<usize>> = ranges
            .iter()
            .filter(|r| !cache.created.contains(*r))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        let me = self.world.rank();
        let mine = new.iter().position(|r| r.contains(&me));
        // Ranks outside every new range get a color of their own (a group they do not use).
        let color = mine.unwrap_or(new.len() + me);
        let comm = self.world.split_labeled(color, me, "cp")?;
        for range in &new {
            cache.created.insert((*range).clone());
        }
        if let Some(index) = mine {
            let range = new[index];
            cache.comms.insert(range.clone(), comm);
        }
        Ok(())
    }
}
