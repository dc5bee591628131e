//! One delivered message and what the server told us about it, and the acks we send.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind};
use shotfleet_schema::subject::{self, Priority, SubjectClass};

/// Where a job came from: the consumer's priority and class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub priority: Priority,
    pub class: SubjectClass,
}

/// A fetched message with its delivery facts.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: jetstream::Message,
    pub origin: Origin,
    /// 1 for the first delivery.
    pub attempt: u64,
    pub stream_sequence: u64,
    /// How long the job waited in the stream before this delivery.
    pub queued: Duration,
}

impl Delivery {
    pub fn new(message: jetstream::Message, origin: Origin) -> Self {
        let (attempt, stream_sequence, published) = match message.info() {
            Ok(info) => (info.delivered.max(1) as u64, info.stream_sequence, SystemTime::from(info.published)),
            Err(_) => (1, 0, SystemTime::now()),
        };
        let queued = SystemTime::now().duration_since(published).unwrap_or_default();
        Self { message, origin, attempt, stream_sequence, queued }
    }

    pub fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    /// The payload's `Content-Type` header, if any.
    pub fn content_type(&self) -> Option<String> {
        self.header(shotfleet_schema::encoding::HEADER)
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.message.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str().to_owned())
    }

    /// The project token of the subject (for failed records of undecodable payloads).
    pub fn subject_project(&self) -> String {
        subject::parse_job(self.subject()).map(|s| s.project).unwrap_or_else(|_| "unknown".into())
    }

    /// Acknowledges and waits for the server to confirm, so a crash right after cannot
    /// redeliver a job whose result is published.
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

/// Exponential backoff for transient failures: 2 s, 4 s, 8 s ... at most a minute.
pub fn backoff(attempt: u64) -> Duration {
    let exp = attempt.saturating_sub(1).min(5) as u32;
    Duration::from_secs(2u64.pow(exp + 1)).min(Duration::from_secs(60))
}
