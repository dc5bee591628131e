//! Bounded retries with exponential backoff for storage calls (backon).
//!
//! This is the only retry layer: object_store's own HTTP retries are switched off (see
//! `config.rs`) so that attempts, total time and what gets logged are decided here, once.
//! Every call retried through here is idempotent: keys are content-addressed, deletes of missing
//! objects succeed, lists and gets read.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};

use serde::Deserialize;
use tokio::time::Instant;
use tracing::warn;

use super::error::{Op, StoreError, StoreErrorKind, classify};

/// How long and how often a transient failure is retried.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// Attempts in all, the first included (`1`: no retry).
    pub max_attempts: u32,
    /// Wait before the second attempt; doubled after each failure.
    pub initial_backoff_ms: u64,
    /// Longest single wait.
    pub max_backoff_ms: u64,
    /// No attempt starts later than this after the first; a call can then still take up to one
    /// request timeout more.
    pub max_elapsed_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self { max_attempts: 8, initial_backoff_ms: 200, max_backoff_ms: 5_000, max_elapsed_ms: 30_000 }
    }
}

impl RetryConfig {
    pub(crate) fn validate(&self) -> Result<(), StoreError> {
        let bad = |key, reason: &str| Err(StoreError::Config { key, reason: reason.into() });
        if self.max_attempts == 0 {
            return bad("retry.max_attempts", "must be at least 1");
        }
        if self.max_backoff_ms < self.initial_backoff_ms {
            return bad("retry.max_backoff_ms", "must not be below retry.initial_backoff_ms");
        }
        Ok(())
    }
}

/// Runs `attempt` until it succeeds, fails with a non-transient error, or the budget in `config`
/// is spent (attempts, or total time waiting). `target` names the key or prefix in logs and
/// errors. The backoff is exponential with jitter (backon), so fifty workers that lost the
/// endpoint together do not come back in step.
pub(crate) async fn retrying<T, F, Fut>(config: &RetryConfig, op: Op, target: &str, mut attempt: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, object_store::Error>>,
{
    let start = Instant::now();
    let attempts = AtomicU32::new(0);
    let backoff = ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(config.initial_backoff_ms))
        .with_max_delay(Duration::from_millis(config.max_backoff_ms))
        .with_max_times(config.max_attempts.saturating_sub(1) as usize)
        .with_total_delay(Some(Duration::from_millis(config.max_elapsed_ms)))
        .with_jitter();
    let result = (|| {
        attempts.fetch_add(1, Ordering::Relaxed);
        attempt()
    })
    .retry(backoff)
    .sleep(tokio::time::sleep)
    .when(|e| classify(op, e) == StoreErrorKind::Transient)
    .notify(|e, delay| {
        warn!(%op, target, attempt = attempts.load(Ordering::Relaxed), retry_in_ms = delay.as_millis() as u64, error = %e, "store call failed; retrying");
    })
    .await;
    result.map_err(|source| StoreError::Operation {
        op,
        target: target.to_owned(),
        attempts: attempts.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
        kind: classify(op, &source),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transient() -> object_store::Error {
        object_store::Error::Generic { store: "test", source: "connection reset".into() }
    }

    fn fast(max_attempts: u32) -> RetryConfig {
        RetryConfig { max_attempts, initial_backoff_ms: 1, max_backoff_ms: 4, max_elapsed_ms: 10_000 }
    }

    #[tokio::test]
    async fn transient_failures_are_retried_until_success() {
        let calls = AtomicU32::new(0);
        let value = retrying(&fast(5), Op::Put, "k", || async {
            if calls.fetch_add(1, Ordering::SeqCst) < 3 { Err(transient()) } else { Ok(7) }
        })
        .await
        .unwrap();
        assert_eq!((value, calls.load(Ordering::SeqCst)), (7, 4));
    }

    #[tokio::test]
    async fn attempts_are_bounded_and_reported() {
        let calls = AtomicU32::new(0);
        let err = retrying(&fast(3), Op::List, "p/j", || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(transient())
        })
        .await
        .unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert_eq!(err.kind(), StoreErrorKind::Transient);
        assert!(err.to_string().starts_with("list p/j failed after 3 attempt(s)"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn total_time_is_bounded() {
        let config =
            RetryConfig { max_attempts: 1000, initial_backoff_ms: 20, max_backoff_ms: 20, max_elapsed_ms: 100 };
        let started = Instant::now();
        let err = retrying(&config, Op::Put, "k", || async { Err::<(), _>(transient()) }).await.unwrap_err();
        assert!(started.elapsed() <= Duration::from_millis(100), "{:?}", started.elapsed());
        let StoreError::Operation { attempts, .. } = err else { panic!("{err}") };
        assert!((3..=12).contains(&attempts), "{attempts}");
    }

    #[tokio::test]
    async fn permanent_failures_are_not_retried() {
        let calls = AtomicU32::new(0);
        let err = retrying(&fast(5), Op::Put, "k", || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(object_store::Error::PermissionDenied { path: "k".into(), source: "403".into() })
        })
        .await
        .unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(err.kind(), StoreErrorKind::Permanent);
    }
}
