//! Which node each rank is on: the one home of the rule "nodes hold equal shares of consecutive
//! ranks" (`nodes` must divide the ranks) and of a rank's node, used by the topology, the
//! in-process world's links and byte classes, the block plans' routes, the harness and the
//! training configuration.

use crate::error::CpError;

/// `ranks` ranks over nodes of `per_node` consecutive ranks each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeMap {
    ranks: usize,
    per_node: usize,
}

impl NodeMap {
    /// `ranks` spread evenly over `nodes` nodes; `nodes` must divide `ranks` (a world of no rank
    /// has one node).
    pub fn new(ranks: usize, nodes: usize) -> Result<Self, CpError> {
        if nodes == 0 || !ranks.is_multiple_of(nodes) {
            return Err(CpError::Config(format!(
                "{nodes} nodes must divide the {ranks} ranks (every node holds as many ranks)"
            )));
        }
        Ok(Self {
            ranks,
            per_node: (ranks / nodes).max(1),
        })
    }

    /// `ranks` over nodes of `per_node` ranks each; `per_node` must divide `ranks`.
    pub fn with_ranks_per_node(ranks: usize, per_node: usize) -> Result<Self, CpError> {
        if per_node == 0 || !ranks.is_multiple_of(per_node) {
            return Err(CpError::Config(format!(
                "{ranks} ranks cannot form nodes of {per_node} ranks each (it must divide the world size)"
            )));
        }
        Ok(Self { ranks, per_node })
    }

    /// `nodes` nodes of `per_node` ranks each (a topology's shape: always consistent).
    pub fn uniform(nodes: usize, per_node: usize) -> Self {
        Self {
            ranks: nodes * per_node,
            per_node: per_node.max(1),
        }
    }

    /// Every rank on one node.
    pub fn single(ranks: usize) -> Self {
        Self {
            ranks,
            per_node: ranks.max(1),
        }
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    pub fn nodes(&self) -> usize {
        self.ranks.div_ceil(self.per_node).max(1)
    }

    pub fn ranks_per_node(&self) -> usize {
        self.per_node
    }

    /// The node of `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.per_node
    }

    /// Whether two ranks share a node.
    pub fn same_node(&self, a: usize, b: usize) -> bool {
        self.node_of(a) == self.node_of(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_hold_equal_shares_of_consecutive_ranks() {
        let map = NodeMap::new(8, 2).unwrap();
        assert_eq!((map.nodes(), map.ranks_per_node()), (2, 4));
        assert_eq!(
            (0..8).map(|r| map.node_of(r)).collect::<Vec<_>>(),
            [0, 0, 0, 0, 1, 1, 1, 1]
        );
        assert!(map.same_node(1, 3) && !map.same_node(3, 4));
        assert_eq!(NodeMap::with_ranks_per_node(8, 4).unwrap(), map);
        assert_eq!(NodeMap::single(5).nodes(), 1);
        let error = NodeMap::new(4, 3).unwrap_err().to_string();
        assert!(error.contains("3 nodes must divide the 4 ranks"), "{error}");
        assert!(NodeMap::new(4, 0).is_err());
        let error = NodeMap::with_ranks_per_node(6, 4).unwrap_err().to_string();
        assert!(
            error.contains("6 ranks cannot form nodes of 4 ranks each"),
            "{error}"
        );
    }
}
