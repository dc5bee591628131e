//! Fetching: only from the (priority, class) consumers whose one-image need fits now, only as
//! many jobs as can start now, in priority order without starvation.
//!
//! Every fetch is a no-wait pull (`fetch()`): a buffered message's ack clock would run while it
//! waited for a slot, so nothing is prefetched. No idle heartbeats (NATS-NOTES: they can lose a
//! message on fetch).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::stream::Stream;
use futures::StreamExt;
use shotfleet_schema::subject::{self, Priority, SubjectClass};
use shotfleet_schema::MemoryClass;

use crate::budget::Admission;
use crate::worker::delivery::{Delivery, Origin};
use crate::worker::priority::Scheduler;

/// Consumers this worker leaves to the rest of the fleet for a moment after it gave one of their
/// jobs back (out of memory, a LoRA set it cannot hold): the job comes back after the
/// give-back's delay to whichever worker asks first, and the worker that gave it back, asking
/// again at once, can be that one every time, so a roomier worker polling beside it never
/// gets the job.
#[derive(Debug, Default)]
pub struct HoldOff {
    until: Mutex<Vec<(Origin, Instant)>>,
}

impl HoldOff {
    /// Leaves `origin`'s consumer to others for `span` from now.
    pub fn leave(&self, origin: Origin, span: Duration) {
        let until = Instant::now() + span;
        let mut held = self.until.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        held.retain(|(o, _)| *o != origin);
        held.push((origin, until));
    }

    /// Whether `origin`'s consumer is left to others `now`.
    fn leaves(&self, origin: Origin, now: Instant) -> bool {
        let mut held = self.until.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        held.retain(|(_, until)| *until > now);
        held.iter().any(|(o, _)| *o == origin)
    }
}

/// The durable consumers this worker pulls from.
pub struct Consumers {
    render: Vec<(Origin, PullConsumer)>,
    auto: Vec<(Origin, PullConsumer)>,
    /// When each of `render` was last found empty: it is skipped for `recheck_empty` after, so
    /// that a busy worker does not spend a server round trip per job on every empty priority
    /// and class ahead of the one with work (a job arriving there waits that long at most).
    found_empty: Mutex<Vec<Option<Instant>>>,
    recheck_empty: Duration,
}

impl Consumers {
    /// Binds to the consumers `shotfleet setup` created, for the classes this worker serves.
    ///
    /// # Errors
    /// The consumer that is missing, with the command that creates it.
    pub async fn bind(stream: &Stream, classes: &[MemoryClass], recheck_empty: Duration) -> Result<Self, String> {
        let mut render = Vec::new();
        let mut auto = Vec::new();
        for &priority in Priority::ALL {
            let served = classes.iter().map(|c| SubjectClass::Class(*c));
            for class in served.chain([SubjectClass::Auto]) {
                let (name, _) = subject::consumer(priority, class);
                let consumer: PullConsumer = stream
                    .get_consumer(&name)
                    .await
                    .map_err(|e| format!("consumer {name} is missing ({e}); run `shotfleet setup` against this server"))?;
                let origin = Origin { priority, class };
                match class {
                    SubjectClass::Auto => auto.push((origin, consumer)),
                    SubjectClass::Class(_) => render.push((origin, consumer)),
                }
            }
        }
        let found_empty = Mutex::new(vec![None; render.len()]);
        Ok(Self { render, auto, found_empty, recheck_empty })
    }

    /// The consumers' `ack_wait` (keep-alives go well inside it) and `max_deliver`; all share
    /// the topology's.
    pub async fn limits(&mut self) -> Result<(std::time::Duration, u64), String> {
        let (_, consumer) = self.render.first_mut().ok_or("no consumers")?;
        let info = consumer.info().await.map_err(|e| e.to_string())?;
        let max_deliver = u64::try_from(info.config.max_deliver).ok().filter(|&n| n > 0).unwrap_or(u64::MAX);
        Ok((info.config.ack_wait, max_deliver))
    }

    /// Up to `slots` jobs that fit `admission`, polled in the scheduler's order, from the
    /// consumers `hold_off` does not leave to others.
    pub async fn next_jobs(&self, admission: &Admission, slots: usize, scheduler: &mut Scheduler, hold_off: &HoldOff) -> Vec<Delivery> {
        let now = Instant::now();
        let mut taken = Vec::new();
        // Larger classes first: a big card is the only place they can go; small jobs have many.
        let mut fitting = admission.classes();
        fitting.sort_by(|a, b| b.cmp(a));
        for priority in scheduler.order(now) {
            let mut polled_all = true;
            let before = taken.len();
            for class in &fitting {
                let room = slots.saturating_sub(taken.len()).min(admission.jobs(*class) as usize);
                if room == 0 {
                    polled_all = false;
                    continue;
                }
                let Some(index) = self.render.iter().position(|(o, _)| o.priority == priority && o.class == SubjectClass::Class(*class)) else {
                    continue;
                };
                let (origin, consumer) = &self.render[index];
                if self.recently_empty(index, now) || hold_off.leaves(*origin, now) {
                    continue;
                }
                let pulled = pull(consumer, *origin, room).await;
                self.found_empty.lock().unwrap_or_else(std::sync::PoisonError::into_inner)[index] = pulled.is_empty().then(Instant::now);
                taken.extend(pulled);
            }
            // Served, or found with nothing waiting in every class it could take.
            if taken.len() > before || polled_all {
                scheduler.served(priority, now);
            }
            if taken.len() >= slots {
                break;
            }
        }
        taken
    }

    fn recently_empty(&self, index: usize, now: Instant) -> bool {
        let found_empty = self.found_empty.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        found_empty[index].is_some_and(|at| now.saturating_duration_since(at) < self.recheck_empty)
    }

    /// Jobs waiting on `auto` subjects (routing is cheap: no budget, no slot).
    pub async fn next_unrouted(&self, max: usize) -> Vec<Delivery> {
        let mut taken = Vec::new();
        for (origin, consumer) in &self.auto {
            taken.extend(pull(consumer, *origin, max).await);
        }
        taken
    }
}

async fn pull(consumer: &PullConsumer, origin: Origin, max: usize) -> Vec<Delivery> {
    let batch = match consumer.fetch().max_messages(max).messages().await {
        Ok(batch) => batch,
        Err(e) => {
            tracing::warn!(priority = %origin.priority, class = %origin.class, error = %e, "fetch failed");
            return Vec::new();
        }
    };
    batch
        .filter_map(|m| async move { m.ok() })
        .map(|m| Delivery::new(m, origin))
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use shotfleet_schema::MemoryClass;

    use super::*;

    #[test]
    fn a_consumer_given_a_job_back_is_left_to_others_for_the_span_only() {
        let origin = |class| Origin { priority: Priority::P1, class: SubjectClass::Class(class) };
        let hold_off = HoldOff::default();
        let now = Instant::now();
        hold_off.leave(origin(MemoryClass::S), Duration::from_secs(2));
        assert!(hold_off.leaves(origin(MemoryClass::S), now));
        assert!(!hold_off.leaves(origin(MemoryClass::M), now), "another class is not left");
        assert!(!hold_off.leaves(Origin { priority: Priority::P0, class: SubjectClass::Class(MemoryClass::S) }, now), "nor another priority");
        assert!(!hold_off.leaves(origin(MemoryClass::S), now + Duration::from_secs(3)), "the span is over");
    }
}
