//! Jobs of a class no live worker can hold. A fleet of small cards never fetches a class larger
//! than its budget admits, and a worker stops admitting a class after it ran out of memory on
//! it, so such a job would wait in the queue forever. Every worker looks twice every `[degrade]
//! handoff`, beside its fetch loop: when no live worker (itself included) has admitted a class
//! above the smallest it serves for a whole handoff, and the oldest job of it has waited that
//! long, the worker takes it and sends it one rung down the degrade ladder without rendering (a
//! smaller class, which the fleet can hold), or fails it with reason `oom` below its floor. A job
//! of a class some live worker admits is left to that worker, however busy it is: degrading is
//! the last resort.
//!
//! Held means admitted by a live worker taking jobs, draining (it may be the old process of a
//! deploy) or starting (for its `[degrade] restart_grace`, the classes it admitted when it last
//! served: restart.rs). Unheld over a whole handoff, not at one look: between a worker's old
//! process and its new one answering, its classes are briefly held by nobody.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::stream::Stream;
use futures::StreamExt;
use shotfleet_schema::MemoryClass;
use shotfleet_schema::subject::{self, Priority, SubjectClass};
use tracing::info;

use crate::failure::{ErrorKind, JobError};
use crate::worker::Shared;
use crate::worker::delivery::{Delivery, Kept, Origin};
use crate::worker::job::{self, Next};
use crate::worker::settle::Handled;

/// How long the fleet's answers to a ping are collected.
const PING_WAIT: Duration = Duration::from_secs(1);

/// The consumers of the classes above the smallest this worker serves.
pub struct Unserved {
    stream: Stream,
    consumers: Vec<(Origin, PullConsumer)>,
    unheld: Unheld,
}

/// Since when each class has been held by no live worker, across looks.
#[derive(Debug, Default)]
struct Unheld {
    since: BTreeMap<MemoryClass, Instant>,
}

impl Unheld {
    /// Notes whether `class` is held `now`; whether nobody has held it for `handoff`.
    fn for_handoff(&mut self, class: MemoryClass, held: bool, now: Instant, handoff: Duration) -> bool {
        if held {
            self.since.remove(&class);
            return false;
        }
        now.duration_since(*self.since.entry(class).or_insert(now)) >= handoff
    }
}

impl Unserved {
    /// Binds the consumers of every class larger than the smallest of `served`: those it does
    /// not serve, and those it serves but may stop admitting (after an out-of-memory). The
    /// smallest has no smaller class to go down to.
    ///
    /// # Errors
    /// A consumer that is missing, with the command that creates it.
    pub async fn bind(stream: &Stream, served: &[MemoryClass]) -> Result<Self, String> {
        let smallest = served.iter().min().copied();
        let mut consumers = Vec::new();
        for &priority in Priority::ALL {
            for &class in MemoryClass::ALL.iter().filter(|&&c| smallest.is_some_and(|s| c > s)) {
                let (name, _) = subject::consumer(priority, SubjectClass::Class(class));
                let consumer: PullConsumer = stream
                    .get_consumer(&name)
                    .await
                    .map_err(|e| format!("consumer {name} is missing ({e}); run `shotfleet setup` against this server"))?;
                consumers.push((Origin { priority, class: SubjectClass::Class(class) }, consumer));
            }
        }
        Ok(Self { stream: stream.clone(), consumers, unheld: Unheld::default() })
    }

    /// Looks every `[degrade] handoff` until the worker stops.
    pub fn watch(mut self, shared: Arc<Shared>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            if self.consumers.is_empty() {
                return;
            }
            // Twice a handoff: a class unheld for a whole one is seen within half a handoff.
            let mut ticker = tokio::time::interval((shared.config.degrade.handoff / 2).max(Duration::from_millis(100)));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shared.stop.cancelled() => return,
                    _ = ticker.tick() => {}
                }
                while self.look(&shared).await {}
            }
        })
    }

    /// Asks the fleet which classes it admits and degrades the oldest job of each larger class
    /// nobody has admitted for `[degrade] handoff`, if it waited as long. Whether it took any.
    async fn look(&mut self, shared: &Arc<Shared>) -> bool {
        let handoff = shared.config.degrade.handoff;
        let admitted = match shotfleet_schema::nats::ping(&shared.js.client(), PING_WAIT).await {
            // Every live worker's: taking jobs, draining or starting (the module's doc).
            Ok(states) => states.into_iter().flat_map(|s| s.admits).collect::<BTreeSet<_>>(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot ask the fleet what it holds; leaving larger classes queued");
                return false;
            }
        };
        let mut took = false;
        let now = Instant::now();
        for (origin, consumer) in &self.consumers {
            let SubjectClass::Class(class) = origin.class else { continue };
            // Read, not fetched: a job that has not waited long enough is not delivered (a
            // delivery would count towards its consumer's `max_deliver`).
            if !self.unheld.for_handoff(class, admitted.contains(&class), now, handoff) || !waited(&self.stream, *origin, handoff).await {
                continue;
            }
            let Some(delivery) = oldest(consumer, *origin).await else { continue };
            took = true;
            degrade_unheld(shared, delivery, class).await;
        }
        took
    }
}

/// Whether the oldest job queued for `origin`'s consumer has waited `handoff`.
async fn waited(stream: &Stream, origin: Origin, handoff: Duration) -> bool {
    let (_, filter) = subject::consumer(origin.priority, origin.class);
    match stream.direct_get_first_for_subject(filter).await {
        Ok(message) => std::time::SystemTime::now().duration_since(message.time.into()).is_ok_and(|waited| waited >= handoff),
        Err(_) => false,
    }
}

/// The oldest job waiting on `consumer`, if any.
async fn oldest(consumer: &PullConsumer, origin: Origin) -> Option<Delivery> {
    let mut batch = consumer.fetch().max_messages(1).messages().await.ok()?;
    batch.next().await.and_then(Result::ok).map(|message| Delivery::new(message, origin))
}

/// Sends a job of a class no live worker holds one rung down, without rendering it.
async fn degrade_unheld(shared: &Arc<Shared>, delivery: Delivery, class: MemoryClass) {
    let waited = delivery.queued;
    let (taken, next) = job::take(shared, Kept::start(delivery, shared.keep_alive_interval())).await;
    let handled = match next {
        Next::Settle(handled) => handled,
        Next::Render => {
            info!(job = %taken.job().job_id, class = %class, waited_s = waited.as_secs(), "no live worker holds this class: one rung down without rendering, or failed at its floor");
            let detail = format!("no live worker holds class {class} after {}s in the queue", waited.as_secs());
            Handled::Stopped(JobError::new(ErrorKind::Oom, detail))
        }
    };
    // As a render's end does: a follower hears the job left this worker (queued one rung down,
    // or failed), or it would show the job held here for good.
    job::finish(shared, &taken, handled).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_class_counts_as_unheld_only_after_a_whole_handoff_unheld() {
        let handoff = Duration::from_secs(30);
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut unheld = Unheld::default();
        assert!(!unheld.for_handoff(MemoryClass::M, false, at(0), handoff), "first seen unheld now");
        assert!(!unheld.for_handoff(MemoryClass::M, false, at(15), handoff));
        assert!(unheld.for_handoff(MemoryClass::M, false, at(30), handoff), "unheld since 0");
        // Held once (a worker's new process answered): the count starts again.
        assert!(!unheld.for_handoff(MemoryClass::M, true, at(31), handoff));
        assert!(!unheld.for_handoff(MemoryClass::M, false, at(45), handoff));
        assert!(unheld.for_handoff(MemoryClass::M, false, at(75), handoff));
        // Each class its own.
        assert!(!unheld.for_handoff(MemoryClass::L, false, at(75), handoff));
    }
}
