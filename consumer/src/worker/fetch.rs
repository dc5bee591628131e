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

    /// Up to `slots` jobs that fit `admission`, polled in the scheduler's order.
    pub async fn next_jobs(&self, admission: &Admission, slots: usize, scheduler: &mut Scheduler) -> Vec<Delivery> {
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
                if self.recently_empty(index, now) {
                    continue;
                }
                let (origin, consumer) = &self.render[index];
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
