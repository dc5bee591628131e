//! One delivered message and what the server told us about it, the acks we send, and the
//! keep-alive that holds it until it is settled.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind};
use shotfleet_schema::subject::{self, Priority, SubjectClass};

use crate::telemetry;

/// Where a job came from: the consumer's priority and class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub priority: Priority,
    pub class: SubjectClass,
}

/// The header a worker's copy of a job (routed from `auto`, or one rung down its ladder) carries:
/// when the job was first queued, milliseconds since the Unix epoch, so that its queue wait
/// counts from there and not from the copy.
pub const QUEUED_SINCE_HEADER: &str = "Shotfleet-Queued-Since";

/// A fetched message with its delivery facts.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: jetstream::Message,
    pub origin: Origin,
    /// 1 for the first delivery (give-backs count: this is the server's count).
    pub attempt: u64,
    pub stream_sequence: u64,
    /// When the job was published (the stream's timestamp).
    pub published: SystemTime,
    /// When the job was first queued: [`Self::published`], or for a worker's copy the original's
    /// time ([`QUEUED_SINCE_HEADER`]).
    pub queued_since: SystemTime,
    /// How long the job waited before it was dealt to a render slot: in the stream (its
    /// original's time included), then in this worker's reserve (reserve.rs).
    pub queued: Duration,
    /// Jobs its consumer still had waiting behind it when it was delivered.
    pub pending: u64,
}

/// When the job in `message` was first queued: its copy's header where that names an earlier
/// time than the copy's own, else `published`. Only the metrics and the result's `queue_ms`
/// read it, so a producer that writes the header fools nothing but its own figures.
fn queued_since(message: &jetstream::Message, published: SystemTime) -> SystemTime {
    let header = message.headers.as_ref().and_then(|h| shotfleet_schema::nats::header_value(h, QUEUED_SINCE_HEADER));
    header
        .and_then(|ms| ms.trim().parse::<u64>().ok())
        .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
        .filter(|&since| since <= published)
        .unwrap_or(published)
}

impl Delivery {
    pub fn new(message: jetstream::Message, origin: Origin) -> Self {
        let (attempt, stream_sequence, published, pending) = match message.info() {
            Ok(info) => (info.delivered.max(1) as u64, info.stream_sequence, SystemTime::from(info.published), info.pending),
            Err(_) => (1, 0, SystemTime::now(), 0),
        };
        let queued_since = queued_since(&message, published);
        let queued = SystemTime::now().duration_since(queued_since).unwrap_or_default();
        Self { message, origin, attempt, stream_sequence, published, queued_since, queued, pending }
    }

    /// The [`QUEUED_SINCE_HEADER`] value a copy of this job carries.
    pub fn queued_since_header(&self) -> String {
        let ms = self.queued_since.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis();
        ms.to_string()
    }

    pub fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    /// The payload's `Content-Type` header, if any.
    pub fn content_type(&self) -> Option<String> {
        self.header(shotfleet_schema::encoding::HEADER)
    }

    /// A header of the message, its name's case ignored.
    pub fn header(&self, name: &str) -> Option<String> {
        self.message.headers.as_ref().and_then(|h| shotfleet_schema::nats::header_value(h, name))
    }

    /// The project token of the subject (for failed records of undecodable payloads).
    pub fn subject_project(&self) -> String {
        subject::parse_job(self.subject()).map(|s| s.project).unwrap_or_else(|_| "unknown".into())
    }

    /// Acknowledges and waits for the server to confirm, so a crash right after cannot
    /// redeliver a job whose outcome is published.
    pub async fn done(&self) -> Result<(), String> {
        self.message.double_ack().await.map_err(|e| e.to_string())
    }

    /// Gives the job back, to be redelivered after `delay` (to this or another worker).
    pub async fn nak(&self, delay: Option<Duration>) {
        if let Err(e) = self.message.ack_with(AckKind::Nak(delay)).await {
            tracing::warn!(seq = self.stream_sequence, error = %e, "nak failed; the job comes back after ack_wait");
        }
    }

    /// Tells the server never to deliver this job again (it has a failed record).
    pub async fn term(&self) {
        if let Err(e) = self.message.ack_with(AckKind::Term).await {
            tracing::warn!(seq = self.stream_sequence, error = %e, "term failed; the job comes back after ack_wait");
        }
    }

    /// Resets the server's ack timer: the job is still being worked on.
    pub async fn progress(&self) {
        let _ = self.message.ack_with(AckKind::Progress).await;
    }
}

/// Sends `AckKind::Progress` every `interval` for a held job, from its fetch until it is settled
/// (waiting in the reserve, rendering, uploading, publishing, or waiting for its group), so the
/// server never redelivers a job a live worker is still working on. Stops when dropped.
pub struct KeepAlive {
    task: Option<tokio::task::JoinHandle<()>>,
}

impl KeepAlive {
    /// Keeps `delivery` alive. `interval` of `None` sends nothing (fault injection's stalled
    /// publish, which must let the server redeliver).
    pub fn start(delivery: &Delivery, interval: Option<Duration>) -> Self {
        let delivery = delivery.clone();
        Self::every(interval, move || {
            let delivery = delivery.clone();
            async move { delivery.progress().await }
        })
    }

    /// Runs `tick` every `interval`, the first one an interval from now.
    pub fn every<F, Fut>(interval: Option<Duration>, mut tick: F) -> Self
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let task = interval.map(|interval| {
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker.tick().await;
                loop {
                    ticker.tick().await;
                    tick().await;
                }
            })
        });
        Self { task }
    }
}

/// A delivery whose keep-alive already runs and which counts as in flight: the reserve hands its
/// jobs on this way, so that no gap opens between its in-progress acks and the job's, nor in
/// the count of jobs held that a fleet ping reads (reserve.rs, job.rs, tail.rs).
pub struct Kept {
    pub delivery: Delivery,
    alive: KeepAlive,
    in_flight: telemetry::InFlight,
}

impl Kept {
    /// Starts keeping `delivery` alive (see [`KeepAlive::start`]) and counting it in flight.
    pub fn start(delivery: Delivery, interval: Option<Duration>) -> Self {
        let alive = KeepAlive::start(&delivery, interval);
        Self { delivery, alive, in_flight: telemetry::in_flight() }
    }

    /// The delivery, its keep-alive and its place in the in-flight count: the job is in flight
    /// until the last is dropped, after it is settled.
    pub fn into_parts(self) -> (Delivery, KeepAlive, telemetry::InFlight) {
        (self.delivery, self.alive, self.in_flight)
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn counting(interval: Option<Duration>) -> (KeepAlive, Arc<AtomicU32>) {
        let ticks = Arc::new(AtomicU32::new(0));
        let counter = ticks.clone();
        let alive = KeepAlive::every(interval, move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        (alive, ticks)
    }

    #[tokio::test(start_paused = true)]
    async fn ticks_every_interval_until_dropped() {
        let (alive, ticks) = counting(Some(Duration::from_secs(20)));
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 0, "the first tick is an interval away");
        tokio::time::sleep(Duration::from_secs(55)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 3, "at 20, 40 and 60 s");
        drop(alive);
        tokio::time::sleep(Duration::from_secs(100)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 3, "nothing after the job is settled");
    }

    #[tokio::test(start_paused = true)]
    async fn no_interval_sends_nothing() {
        let (_alive, ticks) = counting(None);
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 0);
    }
}
