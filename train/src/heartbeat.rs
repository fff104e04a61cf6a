//! A wait longer than the communication timeout: while world rank 0 writes a checkpoint (which
//! can take minutes for a large model), it tells every other rank every `period` that it is
//! still at it, so that each of their waits ends within the communication timeout, and then how
//! it ended. The others wait up to their own, longer limit in all (`--checkpoint-timeout-secs`).

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use burn::prelude::TensorData;
use burn_dcp::comm::{Comm, PendingSend};

use crate::error::TrainError;

const WRITING: u8 = 0;
const COMMITTED: u8 = 1;
const FAILED: u8 = 2;

/// Runs `work` on world rank 0 while a thread sends "still writing" to every other rank every
/// `period`; then sends them how it ended (committed, or failed with the error's message).
pub(crate) fn leader_with_heartbeats<T>(
    world: &Comm,
    period: Duration,
    work: impl FnOnce() -> Result<T, TrainError>,
) -> Result<T, TrainError> {
    let peers = 1..world.size();
    let (stop, stopped) = mpsc::channel::<()>();
    let (result, beats) = thread::scope(|scope| {
        let beat_peers = peers.clone();
        let beating = scope.spawn(move || -> Result<Vec<PendingSend>, TrainError> {
            let mut sends = Vec::new();
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(period) {
                for peer in beat_peers.clone() {
                    sends.push(world.isend(peer, message(WRITING, ""))?);
                }
            }
            Ok(sends)
        });
        let result = work();
        drop(stop);
        let beats = beating.join().unwrap_or_else(|_| {
            Err(TrainError::Malformed(
                "the heartbeat thread panicked".into(),
            ))
        });
        (result, beats)
    });
    let end = match &result {
        Ok(_) => message(COMMITTED, ""),
        Err(e) => message(FAILED, &e.to_string()),
    };
    let mut sends = beats?;
    for peer in peers {
        sends.push(world.isend(peer, end.clone())?);
    }
    for send in sends {
        send.wait()?;
    }
    result
}

/// On a rank other than 0: waits for rank 0's word that the checkpoint is committed, up to
/// `limit` in all; an error names the limit, or rank 0's failure.
pub(crate) fn await_commit(world: &Comm, limit: Duration) -> Result<(), TrainError> {
    let started = Instant::now();
    loop {
        let bytes = received_bytes(world.irecv(0)?.wait()?)?;
        match bytes.first() {
            Some(&COMMITTED) => return Ok(()),
            Some(&FAILED) => {
                return Err(TrainError::Checkpoint(format!(
                    "rank 0 could not write the checkpoint: {}",
                    String::from_utf8_lossy(&bytes[1..])
                )))
            }
            Some(&WRITING) if started.elapsed() <= limit => {}
            Some(&WRITING) => {
                return Err(TrainError::Checkpoint(format!(
                    "rank 0 has been writing the checkpoint for {:.1} s, over \
                     --checkpoint-timeout-secs {}",
                    started.elapsed().as_secs_f64(),
                    limit.as_secs_f64()
                )))
            }
            _ => {
                return Err(TrainError::Malformed(format!(
                    "a checkpoint status message of {} bytes",
                    bytes.len()
                )))
            }
        }
    }
}

/// The bytes of a received `u8` message (a checkpoint's status, header or chunk).
pub(crate) fn received_bytes(data: burn_dcp::comm::Payload) -> Result<Vec<u8>, TrainError> {
    data.into_host()
        .map_err(|e| TrainError::Malformed(e.to_string()))?
        .into_vec::<u8>()
        .map_err(|e| TrainError::Malformed(format!("a checkpoint message is not bytes: {e:?}")))
}

fn message(kind: u8, text: &str) -> burn_dcp::comm::Payload {
    let mut bytes = vec![kind];
    bytes.extend(text.as_bytes());
    let len = bytes.len();
    TensorData::new(bytes, [len]).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_dcp::comm::{InProcessWorld, WorldConfig};

    /// A world of 3 whose every single wait times out after 200 ms.
    fn world() -> InProcessWorld {
        let config = WorldConfig {
            timeout: Duration::from_millis(200),
            ..WorldConfig::default()
        };
        InProcessWorld::new(3, config).unwrap()
    }

    #[test]
    fn a_write_longer_than_the_timeout_is_waited_for_up_to_the_limit() {
        let results = world().run(|comm| {
            if comm.rank() == 0 {
                leader_with_heartbeats(&comm, Duration::from_millis(50), || {
                    thread::sleep(Duration::from_millis(700));
                    Ok(7)
                })
            } else {
                await_commit(&comm, Duration::from_secs(10)).map(|()| 7)
            }
        });
        for result in results {
            assert_eq!(result.unwrap(), 7);
        }
    }

    #[test]
    fn past_the_limit_or_on_a_failed_write_the_others_fail_saying_why() {
        let results = world().run(|comm| {
            if comm.rank() == 0 {
                // Still writing after the others' limit: they stop waiting; its end message
                // then finds them gone or unheard, and rank 0 reports its own result.
                let _ = leader_with_heartbeats(&comm, Duration::from_millis(50), || {
                    thread::sleep(Duration::from_millis(600));
                    Ok(())
                });
                Ok(())
            } else {
                await_commit(&comm, Duration::from_millis(250))
            }
        });
        for result in &results[1..] {
            let err = result.as_ref().unwrap_err().to_string();
            assert!(err.contains("--checkpoint-timeout-secs 0.25"), "{err}");
        }
        let results = world().run(|comm| {
            if comm.rank() == 0 {
                leader_with_heartbeats(&comm, Duration::from_millis(50), || {
                    Err::<(), _>(TrainError::Checkpoint("disk full".into()))
                })
            } else {
                await_commit(&comm, Duration::from_secs(10))
            }
        });
        for result in results {
            let err = result.unwrap_err().to_string();
            assert!(err.contains("disk full"), "{err}");
        }
    }
}
