//! Naming the rank that stopped making progress, for the worlds whose ranks are processes (TCP,
//! MPI): what a rank says it is doing when asked ([`Status`]), the chain of waits followed from
//! the rank a timed-out wait was for ([`follow_waits`]), a cycle of waits looked at twice before
//! it is believed ([`confirmed`]), and the words of the report ([`stall_reason`]), the same in
//! every world.

use std::time::Duration;

use crate::comm::CommError;

/// What a rank is doing, as it answers a stall query.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, Default, PartialEq)]
pub(crate) struct Status {
    /// The global rank it is blocked on, and for what, if it is.
    pub(crate) waiting: Option<(usize, String)>,
    /// The last message it received.
    pub(crate) last: Option<String>,
}

/// What [`follow_waits`] finds: `Ok((rank, what it last received, whether it answered))`, or
/// `Err` with the chain of ranks when the waits form a cycle.
pub(crate) type Found = Result<(usize, Option<String>, bool), Vec<usize>>;

/// How long a rank lets the others move before it looks at a cycle of waits again.
const SECOND_LOOK: Duration = Duration::from_millis(100);

/// The rank at the end of the waits: from `sender` (the rank `me` timed out waiting for),
/// each rank's status (`status_of`: `None` when it did not answer) says whom it waits for; the
/// first that waits for nothing, or does not answer, made no progress. `Ok((rank, what it last
/// received, whether it answered))`; `Err` with the chain when the waits form a cycle.
pub(crate) fn follow_waits(
    me: usize,
    sender: usize,
    mut status_of: impl FnMut(usize) -> Option<Status>,
) -> Found {
    let mut chain = vec![me];
    let mut current = sender;
    loop {
        if chain.contains(&current) {
            chain.push(current);
            return Err(chain);
        }
        chain.push(current);
        match status_of(current) {
            None => return Ok((current, None, false)),
            Some(Status {
                waiting: Some((next, _)),
                ..
            }) => current = next,
            Some(status) => return Ok((current, status.last, true)),
        }
    }
}

/// `first`, or, when it is a cycle, what `again` finds after [`SECOND_LOOK`]. An answer can be
/// stale: a rank that says it waits may already hold the message it waits for (taken in by the
/// poll that answered, not yet by the thread that waits), and a stopped rank that the launcher
/// resumes only to end it (Open MPI sends `SIGCONT` before `SIGTERM`) answers with the wait it
/// was stopped in. A real cycle (ranks that wait for one another: a protocol mismatch) is found
/// again; a stale one is not, and the second look names the rank that made no progress.
pub(crate) fn confirmed(first: Found, again: impl FnOnce() -> Found) -> Found {
    match first {
        Err(_) => {
            std::thread::sleep(SECOND_LOOK);
            again()
        }
        found => found,
    }
}

/// What a rank names after its wait for `what` from `sender` timed out (`timeout`, the error;
/// `waited`, the world's timeout): the stalled rank of [`follow_waits`] first, or the cycle.
/// `None` when the stalled rank is this rank itself (it answered its own chain's end).
pub(crate) fn stall_reason(
    found: Found,
    me: usize,
    sender: usize,
    what: &str,
    timeout: &CommError,
    waited: Duration,
) -> Option<(usize, String)> {
    match found {
        Ok((stalled, last, answered)) if stalled != me => {
            let after = match (last, answered) {
                (Some(last), _) => format!("after it received {last}"),
                (None, true) => "before it received any message".into(),
                (None, false) => "what it last received is unknown".into(),
            };
            let how = match answered {
                true => "it is not waiting for any message: stalled outside communication, or stopped sending",
                false => "it does not answer: the process is stopped or hung",
            };
            Some((
                stalled,
                format!(
                    "global rank {stalled} made no progress for {waited:?} ({after}; {how}); global rank {me} timed out waiting for {what} from global rank {sender} ({timeout})"
                ),
            ))
        }
        Ok(_) => None,
        Err(cycle) => {
            let cycle: Vec<String> = cycle.iter().map(|r| r.to_string()).collect();
            Some((
                me,
                format!(
                    "global ranks {} wait for one another (each for the next; a protocol mismatch): {timeout}",
                    cycle.join(" → ")
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting_for(rank: usize) -> Option<Status> {
        Some(Status {
            waiting: Some((rank, "x".into())),
            last: None,
        })
    }

    #[test]
    fn the_chain_ends_at_the_rank_that_waits_for_nothing_or_does_not_answer() {
        // 0 waits for 1, 1 for 2, 2 for 3, 3 answers and waits for nothing
        let statuses = [None, waiting_for(2), waiting_for(3)];
        let idle = Status {
            waiting: None,
            last: Some("m".into()),
        };
        let found = follow_waits(0, 1, |r| match r {
            3 => Some(idle.clone()),
            r => statuses[r].clone(),
        });
        assert_eq!(found, Ok((3, Some("m".into()), true)));
        // 3 does not answer
        let found = follow_waits(0, 1, |r| statuses.get(r).cloned().flatten());
        assert_eq!(found, Ok((3, None, false)));
        // 1 waits for 2, 2 for 1
        let found = follow_waits(0, 1, |r| match r {
            1 => waiting_for(2),
            _ => waiting_for(1),
        });
        assert_eq!(found, Err(vec![0, 1, 2, 1]));
    }

    #[test]
    fn a_cycle_is_believed_only_when_a_second_look_finds_it_again() {
        let cycle = || follow_waits(0, 2, |_| waiting_for(0));
        // rank 2 answered once from the wait it was stopped in, then no more
        let found = confirmed(cycle(), || follow_waits(0, 2, |_| None));
        assert_eq!(found, Ok((2, None, false)));
        // a real protocol mismatch: found again
        assert_eq!(confirmed(cycle(), cycle), Err(vec![0, 2, 0]));
        // no cycle: no second look
        let idle = Ok((2, None, true));
        assert_eq!(confirmed(idle.clone(), || unreachable!()), idle);
    }
}
