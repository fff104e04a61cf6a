//! What a rank counts of its communication: operations and bytes, by label and link class.

use std::collections::BTreeMap;
use std::fmt;

/// Operation kinds, for byte accounting.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    SendRecv,
    AllToAll,
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            OpKind::SendRecv => "send/recv",
            OpKind::AllToAll => "all-to-all",
            OpKind::AllGather => "all-gather",
            OpKind::ReduceScatter => "reduce-scatter",
            OpKind::AllReduce => "all-reduce",
        };
        f.write_str(name)
    }
}

/// Bytes this rank sent to *other* ranks (sends to itself are free), per operation kind, summed
/// over every group the rank belongs to. Control messages of `split`/`barrier` are not counted.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CommStats {
    pub bytes_by_op: BTreeMap<OpKind, u64>,
    pub messages: u64,
    /// Bytes of control messages (configuration agreement), kept apart from the data bytes.
    pub control_bytes: u64,
    /// The data bytes by link class (see `WorldConfig::ranks_per_node`).
    pub bytes_by_link: LinkBytes,
    /// The data bytes by the label of the group that sent them (see
    /// [`Communicator::split_labeled`](super::Communicator::split_labeled); unlabeled groups count under `""`).
    pub bytes_by_label: BTreeMap<String, u64>,
}

/// Bytes by link class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkBytes {
    pub intra_node: u64,
    pub inter_node: u64,
}

impl CommStats {
    pub fn total_bytes(&self) -> u64 {
        self.bytes_by_op.values().sum()
    }

    pub fn bytes(&self, op: OpKind) -> u64 {
        self.bytes_by_op.get(&op).copied().unwrap_or(0)
    }
}
