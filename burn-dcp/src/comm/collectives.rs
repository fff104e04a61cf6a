//! The collectives, written once over a [`Transport`]: every world's communicator is its
//! transport plus this file, so the in-process, TCP, MPI and NCCL worlds send the same
//! messages in the same order, count the same bytes and compute identical sums.
//!
//! A collective is an exchange: every rank posts a receive from each peer, then sends each
//! peer its part, then waits; a rank's own part never leaves it. Sums are taken on the host or
//! the device in rank order (`sum_payloads`), the all-reduce as a reduce-scatter of flat chunks
//! then an all-gather ([`all_reduce_by`]).

use std::sync::Arc;

use burn::tensor::TensorData;

use crate::comm::common::{
    all_reduce_by, check_parts, check_peer, split_membership, split_request, Accounting,
};
use crate::comm::payload::sum_payloads;
use crate::comm::transport::{Channel, Group, Received, Traffic, Transport};
use crate::comm::{
    control_payloads, Comm, CommError, CommStats, Communicator, OpKind, Payload, PendingRecv,
    PendingSend,
};

/// Sends `parts[p]` to every other rank `p` and receives one message from each; this rank's
/// own part is kept as it is. Receives are posted first, then sends, in rank order.
pub(crate) fn exchange<T: Transport>(
    transport: &T,
    mut parts: Vec<Payload>,
    channel: Channel,
    op: &str,
    accounting: Accounting,
) -> Result<Vec<Payload>, CommError> {
    let me = transport.group().rank;
    let size = transport.group().size();
    let traffic = Traffic {
        channel,
        op,
        accounting,
    };
    let receives = (0..size)
        .filter(|&peer| peer != me)
        .map(|peer| transport.post_recv(peer, channel, op))
        .collect::<Result<Vec<_>, _>>()?;
    let own = std::mem::replace(
        &mut parts[me],
        TensorData::new(Vec::<u8>::new(), [0]).into(),
    );
    let sends = parts
        .into_iter()
        .enumerate()
        .filter(|&(peer, _)| peer != me)
        .map(|(peer, part)| transport.post_send(peer, part, traffic))
        .collect::<Result<Vec<_>, _>>()?;
    let mut received = T::wait(receives)?;
    received.insert(me, own);
    for send in sends {
        send.wait()?;
    }
    Ok(received)
}

/// A collective of `kind` on the collective channel, its bytes counted as `kind`.
fn collective<T: Transport>(
    transport: &T,
    parts: Vec<Payload>,
    kind: OpKind,
) -> Result<Vec<Payload>, CommError> {
    let op = kind.to_string();
    exchange(
        transport,
        parts,
        Channel::Collective,
        &op,
        Accounting::Data(kind),
    )
}

/// The members of the sub-group of `color` (ordered by `(key, rank)`) and its name: every
/// member tells every other its color and key on the control channel — also the arrival, with a
/// deadline, that every member makes before a world's own blocking split call.
pub(crate) fn agree_split<T: Transport>(
    transport: &T,
    color: usize,
    key: usize,
    label: &str,
) -> Result<Group, CommError> {
    let group = transport.group();
    let parts = split_request(color, key, group.size());
    let received = exchange(
        transport,
        parts,
        Channel::Control,
        "split",
        Accounting::Uncounted,
    )?;
    let (members, rank) =
        split_membership(&group.name, &group.members, group.rank, color, received)?;
    Ok(Group::new(
        group.split_name(color),
        Arc::from(label),
        members,
        rank,
    ))
}

impl<T: Transport> Communicator for T {
    fn rank(&self) -> usize {
        self.group().rank
    }

    fn size(&self) -> usize {
        self.group().size()
    }

    fn name(&self) -> &str {
        &self.group().name
    }

    fn global_rank(&self, rank: usize) -> usize {
        self.group().members[rank]
    }

    fn isend(&self, peer: usize, data: Payload) -> Result<PendingSend, CommError> {
        check_peer(&self.group().name, self.group().size(), peer, "isend")?;
        self.begin("send")?;
        let traffic = Traffic {
            channel: Channel::PointToPoint,
            op: "send/recv",
            accounting: Accounting::Data(OpKind::SendRecv),
        };
        self.post_send(peer, data, traffic)
    }

    fn irecv(&self, peer: usize) -> Result<PendingRecv, CommError> {
        check_peer(&self.group().name, self.group().size(), peer, "irecv")?;
        self.begin("recv")?;
        let receive = self.post_recv(peer, Channel::PointToPoint, "send/recv")?;
        Ok(PendingRecv::new(move || receive.wait()))
    }

    fn all_to_all(&self, parts: Vec<Payload>) -> Result<Vec<Payload>, CommError> {
        check_parts(
            &self.group().name,
            self.group().size(),
            &parts,
            "all-to-all",
        )?;
        self.begin("all-to-all")?;
        collective(self, parts, OpKind::AllToAll)
    }

    fn all_gather(&self, data: Payload) -> Result<Vec<Payload>, CommError> {
        self.begin("all-gather")?;
        let data = match T::HOST_BYTES {
            // Read a device tensor back once, not once per peer.
            true => Payload::Host(self.group().host(data, "all-gather")?),
            false => data,
        };
        collective(self, vec![data; self.group().size()], OpKind::AllGather)
    }

    fn reduce_scatter(&self, parts: Vec<Payload>) -> Result<Payload, CommError> {
        let group = self.group();
        check_parts(&group.name, group.size(), &parts, "reduce-scatter")?;
        self.begin("reduce-scatter")?;
        let received = collective(self, parts, OpKind::ReduceScatter)?;
        sum_payloads(received).map_err(|e| group.invalid(format!("reduce-scatter: {e}")))
    }

    fn all_reduce(&self, data: Payload) -> Result<Payload, CommError> {
        self.begin("all-reduce")?;
        all_reduce_by(&self.group().name, self.group().size(), data, |parts| {
            collective(self, parts, OpKind::AllReduce)
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.begin("barrier")?;
        if let Some(control) = self.control() {
            return control.barrier();
        }
        let empty: Payload = TensorData::new(Vec::<i64>::new(), [0]).into();
        let parts = vec![empty; self.group().size()];
        exchange(
            self,
            parts,
            Channel::Control,
            "barrier",
            Accounting::Uncounted,
        )?;
        Ok(())
    }

    fn all_gather_control(&self, what: &str, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        self.begin(what)?;
        if let Some(control) = self.control() {
            return control.all_gather_control(what, payload);
        }
        let count = payload.len();
        let data: Payload = TensorData::new(payload, [count]).into();
        let parts = vec![data; self.group().size()];
        let received = exchange(self, parts, Channel::Control, what, Accounting::Control)?;
        control_payloads(&self.group().name, what, received)
    }

    fn split(&self, color: usize, key: usize) -> Result<Comm, CommError> {
        let label = self.group().label.clone();
        self.split_labeled(color, key, &label)
    }

    fn split_labeled(&self, color: usize, key: usize, label: &str) -> Result<Comm, CommError> {
        self.begin("split")?;
        self.split_group(color, key, label)
    }

    fn stats(&self) -> CommStats {
        self.counters()
            .lock()
            .map(|stats| stats.clone())
            .unwrap_or_default()
    }

    fn abort(&self, reason: &str) {
        self.fail(reason)
    }
}
