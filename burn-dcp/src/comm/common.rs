//! What the worlds and the shared collectives use alike: argument checks, byte accounting, message
//! framing and envelopes, split membership and the all-reduce algorithm.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::TensorData;

use crate::comm::payload::{concat_flat, flatten, split_flat, sum_payloads};
use crate::comm::{CommError, CommStats, OpKind, Payload, PayloadError};

/// How a message's bytes are counted in [`CommStats`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum Accounting {
    Data(OpKind),
    Control,
    Uncounted,
}

impl Accounting {
    /// Counts `bytes` sent to another rank by a group labelled `label`; `same_node`: whether
    /// the receiver is on the sender's node.
    pub(crate) fn count(self, stats: &mut CommStats, label: &str, bytes: u64, same_node: bool) {
        match self {
            Accounting::Data(kind) => {
                *stats.bytes_by_op.entry(kind).or_default() += bytes;
                *stats.bytes_by_label.entry(label.to_string()).or_default() += bytes;
                stats.messages += 1;
                match same_node {
                    true => stats.bytes_by_link.intra_node += bytes,
                    false => stats.bytes_by_link.inter_node += bytes,
                }
            }
            Accounting::Control => stats.control_bytes += bytes,
            Accounting::Uncounted => {}
        }
    }
}

/// Why a message on the wire is not one the receiver can take (or could not be written).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum WireError {
    /// The header could not be serialised (serde's error, rendered).
    #[error("{0}")]
    Encode(String),
    #[error("a message shorter than its header length")]
    ShortLength,
    #[error("a message shorter than its header")]
    ShortHeader,
    #[error("a malformed message header")]
    MalformedHeader,
    /// A body of another size than its header's shape and dtype need.
    #[error("a {shape:?} {dtype:?} message with {bytes} bytes instead of {expected}")]
    Body {
        shape: Vec<usize>,
        dtype: burn::tensor::DType,
        bytes: usize,
        expected: usize,
    },
    /// NCCL's control message: host bytes of another size than its header says.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    #[error("a {shape:?} {dtype:?} message carries {bytes} host bytes instead of {expected}")]
    HostBytes {
        shape: Vec<usize>,
        dtype: burn::tensor::DType,
        bytes: usize,
        expected: usize,
    },
    /// Another message than the receive expects (see [`check_envelope`]).
    #[error(
        "expected {expected_op} message #{expected_index}, got {op} message #{index}: {cause}"
    )]
    Envelope {
        expected_op: String,
        expected_index: u64,
        op: String,
        index: u64,
        cause: &'static str,
    },
    /// The transport's receive failed (MPI's error code, rendered).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    #[error("{0}")]
    Receive(String),
}

/// Checks that a message that arrived is the one a receive expects: the operation and the
/// sender's index of the message on the link. The error says which cause it is.
pub(crate) fn check_envelope(
    (expected_op, expected_index): (&str, u64),
    (op, index): (&str, u64),
) -> Result<(), WireError> {
    if op == expected_op && index == expected_index {
        return Ok(());
    }
    let cause = if op == expected_op {
        "a message on this link was lost or duplicated"
    } else {
        "the ranks called different operations (mismatched configuration or strategy)"
    };
    Err(WireError::Envelope {
        expected_op: expected_op.to_string(),
        expected_index,
        op: op.to_string(),
        index,
        cause,
    })
}

/// The tensor a message's body holds, when its size is what the header's shape and dtype need.
pub(crate) fn host_data(
    shape: Vec<usize>,
    dtype: burn::tensor::DType,
    body: Vec<u8>,
) -> Result<TensorData, WireError> {
    let expected = shape.iter().product::<usize>() * dtype.size();
    if body.len() != expected {
        return Err(WireError::Body {
            shape,
            dtype,
            bytes: body.len(),
            expected,
        });
    }
    Ok(TensorData::from_bytes_vec(body, shape, dtype))
}

/// A message of its serialised header then its body: `[u32 header length][JSON header][body]`.
pub(crate) fn frame<H: serde::Serialize>(header: &H, body: &[u8]) -> Result<Vec<u8>, WireError> {
    let json = serde_json::to_vec(header).map_err(|e| WireError::Encode(e.to_string()))?;
    let mut message = Vec::with_capacity(4 + json.len() + body.len());
    message.extend_from_slice(&(json.len() as u32).to_le_bytes());
    message.extend_from_slice(&json);
    message.extend_from_slice(body);
    Ok(message)
}

/// The header and body of a [`frame`]d message.
pub(crate) fn unframe<H: serde::de::DeserializeOwned>(
    mut message: Vec<u8>,
) -> Result<(H, Vec<u8>), WireError> {
    let len = message
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or(WireError::ShortLength)?;
    let header: H = message
        .get(4..4 + len)
        .ok_or(WireError::ShortHeader)
        .and_then(|h| serde_json::from_slice(h).map_err(|_| WireError::MalformedHeader))?;
    let body = message.split_off(4 + len);
    Ok((header, body))
}

fn invalid(group: &str, message: String) -> CommError {
    CommError::Invalid {
        group: group.to_string(),
        message,
    }
}

/// A world's timeout is more than zero and at most [`MAX_TIMEOUT`](crate::comm::MAX_TIMEOUT).
pub(crate) fn check_timeout(group: &str, timeout: Duration) -> Result<(), CommError> {
    let max = crate::comm::MAX_TIMEOUT;
    if timeout.is_zero() || timeout > max {
        return Err(invalid(
            group,
            format!(
                "the communication timeout must be more than 0 and at most {} s, got {timeout:?}",
                max.as_secs()
            ),
        ));
    }
    Ok(())
}

/// `peer` must be a rank of a group of `size`.
pub(crate) fn check_peer(group: &str, size: usize, peer: usize, op: &str) -> Result<(), CommError> {
    if peer >= size {
        return Err(invalid(
            group,
            format!("{op}: peer rank {peer} does not exist in a group of {size} ranks"),
        ));
    }
    Ok(())
}

/// A collective of a group of `size` takes one part per rank.
pub(crate) fn check_parts(
    group: &str,
    size: usize,
    parts: &[Payload],
    op: &str,
) -> Result<(), CommError> {
    if parts.len() != size {
        return Err(invalid(
            group,
            format!("{op} needs one part per rank ({size}), got {}", parts.len()),
        ));
    }
    Ok(())
}

/// What a rank sends every member of its group when splitting it: its color and key.
pub(crate) fn split_request(color: usize, key: usize, size: usize) -> Vec<Payload> {
    vec![TensorData::new(vec![color as i64, key as i64], [2]).into(); size]
}

/// The new group of the members of `members` that sent `color` (ordered by `(key, rank)`), and
/// this rank's place in it, from every member's [`split_request`] (`received`, by rank).
pub(crate) fn split_membership(
    group: &str,
    members: &[usize],
    rank: usize,
    color: usize,
    received: Vec<Payload>,
) -> Result<(Arc<[usize]>, usize), CommError> {
    let mut same_color = Vec::new();
    for (peer, data) in received.into_iter().enumerate() {
        let values = data
            .into_host()
            .map_err(|e| invalid(group, format!("split: malformed control message {e}")))?
            .into_vec::<i64>()
            .map_err(|e| invalid(group, format!("split: malformed control message {e:?}")))?;
        if values[0] as usize == color {
            same_color.push((values[1] as usize, peer));
        }
    }
    same_color.sort();
    let new_members: Arc<[usize]> = same_color.iter().map(|&(_, peer)| members[peer]).collect();
    let new_rank = same_color
        .iter()
        .position(|&(_, peer)| peer == rank)
        .unwrap_or(0);
    Ok((new_members, new_rank))
}

/// All-reduce over a group of `size` as a reduce-scatter of flat chunks then an all-gather (the
/// ring all-reduce's traffic, `2·(P−1)/P` of the tensor per rank); the sum is taken in rank
/// order on the chunk's owner. `collective` sends `parts[p]` to rank `p` and returns what every
/// rank sent here.
pub(crate) fn all_reduce_by(
    group: &str,
    size: usize,
    data: Payload,
    mut collective: impl FnMut(Vec<Payload>) -> Result<Vec<Payload>, CommError>,
) -> Result<Payload, CommError> {
    let invalid = |error: PayloadError| invalid(group, format!("all-reduce: {error}"));
    let (shape, dtype) = (data.shape(), data.dtype());
    let flat = flatten(data);
    let chunks = split_flat(&flat, size);
    let mine = collective(chunks)?;
    let reduced = sum_payloads(mine).map_err(invalid)?;
    let gathered = collective(vec![reduced; size])?;
    concat_flat(gathered, &shape, dtype).map_err(invalid)
}
