//! The one place a job's handling ends: [`settle`] turns what happened into ack, nak with a
//! delay, term with a failed record, a degraded copy, or stopping the worker.
//!
//! | handled | what settle does |
//! | --- | --- |
//! | an outcome is committed (ours or another worker's) | sweep the job's objects against it, ack |
//! | routed to its class subject | ack |
//! | [`Invalid`](ErrorKind::Invalid) | failed record `invalid`, claim the outcome, sweep, term |
//! | [`GiveBack`](ErrorKind::GiveBack) | nak after its delay; not a failed attempt |
//! | [`Transient`](ErrorKind::Transient), [`Timeout`](ErrorKind::Timeout) | count a failed attempt: nak with backoff, or at `max_failures` failed record `attempts` |
//! | [`Oom`](ErrorKind::Oom) (one image at a time, tiled VAE) | re-publish one rung down and ack, or below the floor failed record `oom` |
//! | [`DriverFault`](ErrorKind::DriverFault) | nak at once (failed record `driver` when present at repeated faults), stop the worker |
//! | [`StoreUnusable`](ErrorKind::StoreUnusable) | the store's probe still passes: a failed attempt (the refusal is of this job's keys); else nak at once, stop the worker |
//! | [`LibraryUnusable`](ErrorKind::LibraryUnusable) | nak at once, stop the worker (the image store's probe says nothing of the library) |
//!
//! Failing a job writes its failed record first, then claims the job's result subject with a
//! `failed` outcome (commit.rs): if another worker committed a result meanwhile, the record is
//! withdrawn and the result stands, so a job never ends both ways.

use std::time::Duration;

use shotfleet_schema::failure::FailureReason;
use shotfleet_schema::subject::SubjectClass;
use shotfleet_schema::{ResultStatus, ShotJob, ShotResult};
use tracing::{info, warn};

use crate::failure::{ErrorKind, JobError};
use crate::telemetry::{self, JobOutcome};
use crate::worker::commit;
use crate::worker::delivery::Delivery;
use crate::worker::failed::{self, Case, Recorded};
use crate::worker::{Shared, degrade};

/// How long a job waits when it could not be failed (its record or outcome not written).
const RECORD_RETRY: Duration = Duration::from_secs(5);

/// How a job's handling ended, for [`settle`].
#[derive(Debug)]
pub(crate) enum Handled {
    /// An outcome is on the job's result subject: this worker's (`ours`) or one that stands.
    Committed { result: Box<ShotResult>, ours: bool },
    /// A copy of the job is stored on its class subject.
    Routed,
    /// A step did not complete.
    Stopped(JobError),
}

/// A job as held while it is handled.
pub(crate) struct Held<'a> {
    pub delivery: &'a Delivery,
    /// `None` when the payload could not be decoded.
    pub job: Option<&'a ShotJob>,
    /// The sequence of the job's last outcome when it was taken (0: none): a claim expects it.
    pub last_outcome: u64,
    /// The failed records that outcome names: a failure carries them forward.
    pub failed_records: &'a [u64],
}

impl Held<'_> {
    fn job_id(&self) -> &str {
        self.job.map_or("?", |j| j.job_id.as_str())
    }

    fn class(&self) -> SubjectClass {
        self.job.map_or(self.delivery.origin.class, |j| SubjectClass::Class(j.class()))
    }
}

/// Ends the handling of a held job and counts how it left the worker.
pub(crate) async fn settle(shared: &Shared, held: &Held<'_>, handled: Handled) -> JobOutcome {
    let outcome = match handled {
        Handled::Committed { result, ours } => finish_committed(shared, held, &result, ours).await,
        Handled::Routed => {
            ack(held).await;
            JobOutcome::Routed
        }
        Handled::Stopped(error) => stop(shared, held, error).await,
    };
    telemetry::job_finished(outcome, held.delivery.origin.priority, held.class());
    outcome
}

async fn stop(shared: &Shared, held: &Held<'_>, error: JobError) -> JobOutcome {
    let delivery = held.delivery;
    match error.kind {
        ErrorKind::Invalid => fail(shared, held, FailureReason::Invalid, &error.detail, 1).await,
        ErrorKind::GiveBack { after } => {
            info!(job = held.job_id(), retry_in_ms = after.as_millis() as u64, detail = %error.detail, "giving the job back");
            delivery.nak((!after.is_zero()).then_some(after)).await;
            // Offered to the fleet: others ask for it first when it comes back (fetch.rs).
            if !after.is_zero() {
                shared.hold_off.leave(delivery.origin, after * 2);
            }
            JobOutcome::Nak
        }
        ErrorKind::Transient | ErrorKind::Timeout => failed_attempt(shared, held, &error.detail).await,
        ErrorKind::Oom => degrade_or_fail(shared, held, &error.detail).await,
        ErrorKind::DriverFault => {
            let outcome = if delivery.attempt >= shared.config.driver_fault_attempts {
                fail(shared, held, FailureReason::Driver, &error.detail, delivery.attempt).await
            } else {
                delivery.nak(None).await;
                JobOutcome::Nak
            };
            // After the nak: stopping the worker flushes the connection, so the nak reaches the
            // server before the process exits.
            shared.driver_fault(held.job.map(|j| j.job_id.as_str()), &error.detail).await;
            outcome
        }
        ErrorKind::StoreUnusable | ErrorKind::LibraryUnusable => {
            // The store's own probe tells a refusal of this job's keys (a policy on one
            // project's prefix, one folder made read-only) from a refusal of everything: the
            // first is the job's, counted as a failed attempt; only the second stops the worker,
            // which else every worker taking the job in turn would do. The image store's probe
            // says nothing of the LoRA library's: a refusing library stops the worker.
            if error.kind == ErrorKind::StoreUnusable && shared.store.check().await.is_ok() {
                // The conclusion first: the outcome's detail is cut at 300 bytes, and the store's
                // own error (paths, keys, timings) can fill them.
                let detail = format!("the store refuses this job's keys and takes others: {}", error.detail);
                return failed_attempt(shared, held, &detail).await;
            }
            delivery.nak(None).await;
            shared.store_unusable(&error.detail).await;
            JobOutcome::Nak
        }
    }
}

/// A failure that may pass: counted; nak with backoff, or a failed record at the limit.
async fn failed_attempt(shared: &Shared, held: &Held<'_>, detail: &str) -> JobOutcome {
    let delivery = held.delivery;
    let attempts = &shared.config.attempts;
    let failures = match shared.attempts.failed(delivery, held.job_id()).await {
        Ok(counts) => counts.failures,
        Err(e) => {
            // The server's delivery count and `max_deliver` still bound the job.
            warn!(job = held.job_id(), error = %e, detail, "cannot count the failed attempt; retrying by the delivery count");
            delivery.nak(Some(attempts.backoff_after(delivery.attempt as u32))).await;
            return JobOutcome::Nak;
        }
    };
    // On the consumer's last delivery the server would not deliver the job again.
    if failures >= attempts.max_failures || delivery.attempt >= shared.max_deliver {
        let detail = format!("failed {failures} attempt(s); the last: {detail}");
        return fail(shared, held, FailureReason::Attempts, &detail, u64::from(failures)).await;
    }
    let delay = attempts.backoff_after(failures);
    warn!(job = held.job_id(), failures, retry_in_s = delay.as_secs_f64(), detail, "job failed, will retry");
    delivery.nak(Some(delay)).await;
    JobOutcome::Nak
}

/// Out of memory one image at a time: one rung down, or below the floor a failed record.
async fn degrade_or_fail(shared: &Shared, held: &Held<'_>, detail: &str) -> JobOutcome {
    let Some(job) = held.job else {
        return failed_attempt(shared, held, detail).await;
    };
    let Some(smaller) = degrade::next_rung(job, &shared.config.degrade) else {
        // The detail says why (out of memory one image at a time, not one image fits this card,
        // no live worker holds the class); this says why it ends here.
        let detail = format!("{detail}; no rung down the degrade ladder is left above its floor");
        return fail(shared, held, FailureReason::Oom, &detail, 1).await;
    };
    match degrade::republish(shared, held.delivery, &smaller).await {
        Ok(()) => {
            ack(held).await;
            JobOutcome::DegradeRepublished
        }
        Err(error) => failed_attempt(shared, held, &error.detail).await,
    }
}

/// Fails the job (failed record, `failed` outcome, sweep) and terminates it.
async fn fail(shared: &Shared, held: &Held<'_>, reason: FailureReason, detail: &str, attempts: u64) -> JobOutcome {
    let delivery = held.delivery;
    let content_type = delivery.content_type();
    let case = Case {
        payload: delivery.message.payload.clone(),
        content_type: content_type.as_deref(),
        original_subject: delivery.subject(),
        stream_sequence: delivery.stream_sequence,
        deliveries: delivery.attempt,
        queued: delivery.queued,
        job: held.job,
        last_outcome: held.last_outcome,
        failed_records: held.failed_records.to_vec(),
    };
    match failed::record(shared, &case, reason, detail, attempts).await {
        Recorded::Failed => {
            // A payload that did not decode may still name its job, as its outcome does.
            let job = case.ids().map_or_else(|| held.job_id().to_owned(), |ids| ids.job_id);
            warn!(job, reason = %reason, detail, "job failed");
            telemetry::job_failed(reason);
            delivery.term().await;
            JobOutcome::Failed
        }
        Recorded::SettledBy(result) => finish_committed(shared, held, &result, false).await,
        Recorded::NotStored(e) => {
            // Without the record the job must not vanish: give it back.
            tracing::error!(job = held.job_id(), error = %e, "could not fail the job; giving it back");
            delivery.nak(Some(RECORD_RETRY)).await;
            JobOutcome::Nak
        }
    }
}

/// Sweeps the job's objects against a committed outcome and acks.
async fn finish_committed(shared: &Shared, held: &Held<'_>, result: &ShotResult, ours: bool) -> JobOutcome {
    sweep(shared, result).await;
    ack(held).await;
    if ours && result.is_rendered() {
        telemetry::images_rendered(held.delivery.origin.priority, held.class(), result.images.len());
    }
    match (ours, result.status) {
        (false, ResultStatus::Cancelled) => JobOutcome::Cancelled,
        (false, status) => {
            // A copy of a finished job (a re-publish under a new message id, a redelivery after
            // another worker committed): said, so that a producer's re-submission that renders
            // nothing is found in the log.
            info!(job = %result.job_id, status = ?status, by = %result.worker, "the job already has its outcome: this message is settled by it, not rendered");
            JobOutcome::DuplicateSkip
        }
        (true, ResultStatus::Done) => JobOutcome::Done,
        (true, ResultStatus::Degraded) => JobOutcome::Degraded,
        (true, ResultStatus::Failed | ResultStatus::Cancelled) => JobOutcome::Failed,
    }
}

/// Deletes what `result` does not name under its job. A failed sweep is logged, not retried:
/// the next delivery of the job (if any) or an operator's sweep removes the leftovers.
async fn sweep(shared: &Shared, result: &ShotResult) {
    match commit::sweep(shared, &result.project, &result.job_id, &result.images).await {
        Ok(0) => {}
        Ok(n) => info!(job = %result.job_id, deleted = n, "removed images no outcome names"),
        Err(e) => warn!(job = %result.job_id, error = %e, "sweep failed"),
    }
}

async fn ack(held: &Held<'_>) {
    if let Err(e) = held.delivery.done().await {
        warn!(job = held.job_id(), error = %e, "ack failed; the redelivery will find the outcome and ack");
    }
}

