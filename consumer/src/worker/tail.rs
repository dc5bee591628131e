//! The end of a queue, shared. A worker's reserve (reserve.rs) holds jobs ahead of its slots;
//! once the queue behind it is drained, those jobs are all the work there is, and a worker that
//! has run out would sit idle while this one renders them in turn. So while its reserve holds
//! more than the next group of each slot with the queue drained, the worker asks the fleet (a
//! ping, every `ASK_EVERY` at most, answered off the fetch loop) whether another worker that
//! admits those jobs' classes is idle, and if so gives them back for it to fetch. What each
//! slot takes next stays: it starts as soon as the slot frees.
//!
//! A job given back uses a delivery, and only a job on its first delivery goes back so: each
//! job passes between workers this way once at most, however the fleet's tails meet. The
//! answer must be fresh (`FRESH`) and the reserve still drained when it is acted on. Workers
//! of releases before this one count only renders in their answer's `in_flight`, so one of
//! them between two renders may look idle; it then fetches jobs it renders in turn.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shotfleet_schema::MemoryClass;
use shotfleet_schema::progress::WorkerState;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::worker::Shared;
use crate::worker::reserve::Reserve;

/// How often a worker with more than it can start asks the fleet at most.
const ASK_EVERY: Duration = Duration::from_secs(2);
/// How long the fleet's answers are collected (off the fetch loop).
const PING_WAIT: Duration = Duration::from_millis(500);
/// How old an answer may be when the fetch loop reads it (its rounds come up to a second
/// apart while every slot renders).
const FRESH: Duration = Duration::from_millis(2000);

/// The fleet's answer awaited, and when it was last asked.
#[derive(Default)]
pub(crate) struct Tail {
    asked: Option<Instant>,
    answer: Option<JoinHandle<Result<Vec<WorkerState>, String>>>,
}

impl Tail {
    /// Looks once, each round of the fetch loop: gives back what waits beyond the next groups
    /// when an answer says an idle worker admits it; else asks, if the reserve holds more than
    /// it starts next with the queue drained.
    pub async fn look(&mut self, shared: &Arc<Shared>, reserve: &mut Reserve) {
        let slots = shared.config.concurrency;
        let per_slot = shared.config.batch_jobs.max(1);
        if let Some(answer) = self.answer.take_if(|answer| answer.is_finished()) {
            let idle = match answer.await {
                Ok(Ok(states)) => idle_admit(&states, &shared.config.worker_id),
                Ok(Err(e)) => {
                    warn!(error = %e, "cannot ask the fleet whether another worker is idle");
                    BTreeSet::new()
                }
                Err(e) => {
                    warn!(error = %e, "the fleet's answer was lost");
                    BTreeSet::new()
                }
            };
            let fresh = self.asked.is_some_and(|at| at.elapsed() <= FRESH);
            if fresh && !idle.is_empty() && reserve.holds_beyond_next_groups(slots, per_slot) {
                let given = reserve.give_back_beyond_next_groups(slots, per_slot, |class| idle.contains(&class)).await;
                if given > 0 {
                    info!(jobs = given, classes = ?idle, "the queue is drained and another worker is idle: giving back what waits beyond the next groups");
                }
            }
            return;
        }
        let due = self.asked.is_none_or(|at| at.elapsed() >= ASK_EVERY);
        if self.answer.is_none() && due && reserve.holds_beyond_next_groups(slots, per_slot) {
            self.asked = Some(Instant::now());
            let client = shared.js.client();
            self.answer = Some(tokio::spawn(async move { shotfleet_schema::nats::ping(&client, PING_WAIT).await }));
        }
    }
}

/// The classes that a worker other than `me`, taking jobs and rendering nothing, admits.
fn idle_admit(states: &[WorkerState], me: &str) -> BTreeSet<MemoryClass> {
    states.iter().filter(|s| s.worker != me && s.taking_jobs && s.in_flight == 0).flat_map(|s| s.admits.iter().copied()).collect()
}

#[cfg(test)]
mod tests {
    use shotfleet_schema::progress::GpuMemory;

    use super::*;

    fn state(worker: &str, in_flight: u32, taking_jobs: bool, admits: &[MemoryClass]) -> WorkerState {
        WorkerState {
            v: 1,
            worker: worker.into(),
            device: "cpu".into(),
            serves: admits.to_vec(),
            admits: admits.to_vec(),
            gpu: GpuMemory::default(),
            in_flight,
            taking_jobs,
            starting: false,
            at_ms: 0,
        }
    }

    #[test]
    fn only_another_worker_taking_jobs_and_rendering_nothing_counts_as_idle() {
        use MemoryClass::{L, M, S};
        let states = [
            state("me", 0, true, &[S, M, L]),
            state("busy", 1, true, &[S, M, L]),
            state("draining", 0, false, &[S, M, L]),
            state("small", 0, true, &[S]),
            state("mid", 0, true, &[S, M]),
        ];
        assert_eq!(idle_admit(&states, "me"), BTreeSet::from([S, M]));
        assert!(idle_admit(&states[..3], "me").is_empty());
    }
}
