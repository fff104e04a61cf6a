//! Each rank's instruction list for a pass, built from the plan's routes and every rank's tiles:
//! head units moved to their homes, then stage by stage the copies sent and received and the
//! tiles attended, then the results sent home (and the moved units' results back).

use std::collections::BTreeMap;

use super::{id, BlockId, Instruction, Tile};
use crate::planner::cost::{Hop, Route, Side};

/// What a rank's programs are built from: the plan's routes and every rank's tiles.
pub(super) struct ProgramBuilder<'a> {
    pub(super) routes: &'a [Route],
    pub(super) tiles: &'a [Vec<Tile>],
    pub(super) last_stage: usize,
    /// Token homes, `homes[seq][block]`.
    pub(super) homes: &'a [Vec<usize>],
    /// Head units' homes, `unit_homes[seq][block][unit]`.
    pub(super) unit_homes: &'a [Vec<Vec<usize>>],
}

impl ProgramBuilder<'_> {
    /// The program of `rank` for a pass whose results go home for the sides in `results` (the
    /// forward pass returns only query-side results, the backward pass both).
    pub(super) fn program(&self, rank: usize, results: &[Side]) -> Vec<Instruction> {
        let mut program = Vec::new();
        self.unit_moves(rank, false, &mut program);
        self.copies(rank, 0, &mut program);
        for stage in 1..=self.last_stage {
            self.sends(rank, stage, true, &mut program);
            self.attend(rank, stage - 1, &mut program);
            self.receives(rank, stage, true, &mut program);
            self.sends(rank, stage, false, &mut program);
            self.receives(rank, stage, false, &mut program);
        }
        self.attend(rank, self.last_stage, &mut program);
        self.results(rank, results, &mut program);
        self.unit_moves(rank, true, &mut program);
        program
    }

    /// Every head unit homed away from its token home, in (sequence, block, unit) order: `(block,
    /// unit, token home, unit home)`.
    fn moved_units(&self) -> impl Iterator<Item = (BlockId, usize, usize, usize)> + '_ {
        self.unit_homes
            .iter()
            .enumerate()
            .flat_map(move |(seq, blocks)| {
                blocks.iter().enumerate().flat_map(move |(block, units)| {
                    let token_home = self.homes[seq][block];
                    units
                        .iter()
                        .enumerate()
                        .filter(move |(_, &home)| home != token_home)
                        .map(move |(unit, &home)| (BlockId { seq, block }, unit, token_home, home))
                })
            })
    }

    /// The moves of head units homed away from their token homes: to their homes before the
    /// pass, or (`results`) their results back after it; sends first, then receives.
    fn unit_moves(&self, rank: usize, results: bool, program: &mut Vec<Instruction>) {
        // (block, unit, from, to): a unit goes home before the pass, its results come back after.
        let moves = || {
            self.moved_units()
                .map(move |(block, unit, token_home, home)| match results {
                    false => (block, unit, token_home, home),
                    true => (block, unit, home, token_home),
                })
        };
        for (block, unit, _, to) in moves().filter(|&(_, _, from, _)| from == rank) {
            program.push(match results {
                false => Instruction::SendUnit { block, unit, to },
                true => Instruction::SendUnitResult { block, unit, to },
            });
        }
        for (block, unit, from, _) in moves().filter(|&(_, _, _, to)| to == rank) {
            program.push(match results {
                false => Instruction::ReceiveUnit { block, unit, from },
                true => Instruction::ReceiveUnitResult { block, unit, from },
            });
        }
    }

    fn copies(&self, rank: usize, stage: usize, program: &mut Vec<Instruction>) {
        self.sends(rank, stage, true, program);
        self.receives(rank, stage, true, program);
        self.sends(rank, stage, false, program);
        self.receives(rank, stage, false, program);
    }

    /// Hops of `stage`, from the home (`direct`) or from a relay, in route order.
    fn hops(&self, stage: usize, direct: bool) -> impl Iterator<Item = (&Route, &Hop)> {
        self.routes.iter().flat_map(move |route| {
            route
                .hops
                .iter()
                .filter(move |h| h.stage == stage && (h.from == route.home) == direct)
                .map(move |h| (route, h))
        })
    }

    fn sends(&self, rank: usize, stage: usize, direct: bool, program: &mut Vec<Instruction>) {
        self.transfers(rank, stage, direct, true, program);
    }

    fn receives(&self, rank: usize, stage: usize, direct: bool, program: &mut Vec<Instruction>) {
        self.transfers(rank, stage, direct, false, program);
    }

    /// The hops of `stage` that leave `rank` (`send`) or reach it, in route order.
    fn transfers(
        &self,
        rank: usize,
        stage: usize,
        direct: bool,
        send: bool,
        program: &mut Vec<Instruction>,
    ) {
        let mine = |hop: &Hop| match send {
            true => hop.from == rank,
            false => hop.to == rank,
        };
        for (route, hop) in self.hops(stage, direct).filter(|(_, h)| mine(h)) {
            let (side, block, unit) = (route.side, id(route), route.head);
            program.push(match send {
                true => Instruction::Send {
                    side,
                    block,
                    unit,
                    to: hop.to,
                },
                false => Instruction::Receive {
                    side,
                    block,
                    unit,
                    from: hop.from,
                },
            });
        }
    }

    /// One attention per query block and head unit of the rank's tiles of `stage`.
    fn attend(&self, rank: usize, stage: usize, program: &mut Vec<Instruction>) {
        let mut by_query: BTreeMap<(BlockId, usize), Vec<usize>> = BTreeMap::new();
        for tile in self.tiles[rank].iter().filter(|t| t.stage == stage) {
            by_query
                .entry((tile.q, tile.unit))
                .or_default()
                .push(tile.kv_block);
        }
        for ((q, unit), kv) in by_query {
            program.push(Instruction::Attend { q, unit, kv });
        }
    }

    /// Results back home (see the module docs): leaves first (to relays, then to homes), then
    /// relays, then homes (from leaves, then from relays).
    fn results(&self, rank: usize, sides: &[Side], program: &mut Vec<Instruction>) {
        let routes: Vec<&Route> = self
            .routes
            .iter()
            .filter(|r| sides.contains(&r.side))
            .collect();
        let relays =
            |route: &Route, r: usize| route.hops.iter().any(|h| h.from == r) && r != route.home;
        let parent = |route: &Route| route.hops.iter().find(|h| h.to == rank).map(|h| h.from);
        for to_relay in [true, false] {
            for route in &routes {
                if let Some(from) = parent(route) {
                    if !relays(route, rank) && (from != route.home) == to_relay {
                        program.push(Instruction::SendResult {
                            side: route.side,
                            block: id(route),
                            unit: route.head,
                            to: from,
                        });
                    }
                }
            }
        }
        for route in routes.iter().filter(|r| relays(r, rank)) {
            for hop in route.hops.iter().filter(|h| h.from == rank) {
                program.push(Instruction::ReceiveResult {
                    side: route.side,
                    block: id(route),
                    unit: route.head,
                    from: hop.to,
                });
            }
            program.push(Instruction::SendResult {
                side: route.side,
                block: id(route),
                unit: route.head,
                to: route.home,
            });
        }
        for from_relay in [false, true] {
            for route in routes.iter().filter(|r| r.home == rank) {
                for hop in route.hops.iter().filter(|h| h.from == rank) {
                    if relays(route, hop.to) == from_relay {
                        program.push(Instruction::ReceiveResult {
                            side: route.side,
                            block: id(route),
                            unit: route.head,
                            from: hop.to,
                        });
                    }
                }
            }
        }
    }
}
