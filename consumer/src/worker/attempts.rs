//! Failed attempts and out-of-memory errors per job message, counted outside the server's
//! delivery count.
//!
//! The server counts every delivery, and a job is delivered again for reasons that are no
//! failure of its own: no room on the card that fetched it, a worker stopping (a rolling restart
//! gives back every render in flight), a first out-of-memory handed to a roomier card. Counting
//! those would send healthy jobs to the failed stream. So the workers count real failures
//! themselves, in the key-value bucket `SHOT_ATTEMPTS`, keyed by job id and stream sequence (a
//! replay or a degraded copy is a new message and starts from nothing), written only when
//! something failed: a job that renders the first time never touches it. The consumers'
//! `max_deliver` stays as a backstop for jobs that kill their worker, which no worker lives to
//! count (the advisory rescue records those).

use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, kv};
use serde::{Deserialize, Serialize};
use shotfleet_schema::subject;

use crate::worker::delivery::Delivery;

/// `[attempts]`: when a failing job is given up on, and how long it waits between attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AttemptsConfig {
    /// Failed attempts (render errors, the time limit, upload or publish errors) after which a
    /// job goes to the failed stream with reason `attempts`.
    pub max_failures: u32,
    /// Wait before the attempt after the first failure; doubled after each, up to `max_backoff`.
    #[serde(with = "humantime_serde")]
    pub backoff: Duration,
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
}

impl Default for AttemptsConfig {
    fn default() -> Self {
        Self { max_failures: 5, backoff: Duration::from_secs(2), max_backoff: Duration::from_secs(60) }
    }
}

impl AttemptsConfig {
    /// The wait after the `failures`th failure: `backoff`, doubled per failure, at most
    /// `max_backoff`.
    pub fn backoff_after(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(16);
        self.backoff.saturating_mul(1 << doublings).min(self.max_backoff)
    }
}

/// What the fleet knows of one job message's trouble.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Failed attempts.
    pub failures: u32,
    /// Renders that ran out of memory, on any worker.
    pub ooms: u32,
    /// When the first of them happened, milliseconds since the Unix epoch.
    pub first_oom_ms: Option<u64>,
}

/// The bucket, opened at start.
#[derive(Clone)]
pub struct Attempts {
    store: kv::Store,
}

impl Attempts {
    /// Opens the bucket `shotfleet setup` created.
    ///
    /// # Errors
    /// The bucket is missing or unreadable, with the command that creates it.
    pub async fn open(js: &jetstream::Context) -> Result<Self, String> {
        js.get_key_value(subject::ATTEMPTS_BUCKET)
            .await
            .map(|store| Self { store })
            .map_err(|e| format!("key-value bucket {} is missing ({e}); run `shotfleet setup`", subject::ATTEMPTS_BUCKET))
    }

    /// Counts a failed attempt of `delivery`'s job; returns the counts after it.
    ///
    /// # Errors
    /// The bucket could not be read or written.
    pub async fn failed(&self, delivery: &Delivery, job_id: &str) -> Result<Counts, String> {
        self.update(delivery, job_id, |counts| counts.failures += 1).await
    }

    /// Counts an out-of-memory render of `delivery`'s job; returns the counts after it.
    ///
    /// # Errors
    /// The bucket could not be read or written.
    pub async fn out_of_memory(&self, delivery: &Delivery, job_id: &str) -> Result<Counts, String> {
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
        self.update(delivery, job_id, |counts| {
            counts.ooms += 1;
            counts.first_oom_ms.get_or_insert(now);
        })
        .await
    }

    /// Read, change, write back expecting the revision read; again when another worker wrote in
    /// between (two holders of one job).
    async fn update(&self, delivery: &Delivery, job_id: &str, change: impl Fn(&mut Counts)) -> Result<Counts, String> {
        let key = subject::attempts_key(job_id, delivery.stream_sequence);
        let mut last_error = String::new();
        for _ in 0..5 {
            let entry = self.store.entry(key.as_str()).await.map_err(|e| format!("cannot read {key}: {e}"))?;
            let (mut counts, revision) = match entry {
                Some(entry) if entry.operation == kv::Operation::Put => {
                    (serde_json::from_slice(&entry.value).unwrap_or_default(), Some(entry.revision))
                }
                _ => (Counts::default(), None),
            };
            change(&mut counts);
            let value = serde_json::to_vec(&counts).expect("plain numbers serialize").into();
            let written = match revision {
                Some(revision) => self.store.update(key.as_str(), value, revision).await.map_err(|e| e.to_string()),
                None => self.store.create(key.as_str(), value).await.map_err(|e| e.to_string()),
            };
            match written {
                Ok(_) => return Ok(counts),
                Err(e) => last_error = e,
            }
        }
        Err(format!("cannot update {key}: {last_error}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let config = AttemptsConfig { backoff: Duration::from_secs(2), max_backoff: Duration::from_secs(20), max_failures: 5 };
        let waits: Vec<u64> = (1..=6).map(|n| config.backoff_after(n).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 16, 20, 20]);
        assert_eq!(config.backoff_after(u32::MAX), Duration::from_secs(20));
    }
}
