//! Routing: jobs on `auto` (or on a class their payload does not match) are re-published to
//! their class subject, cheaply and without rendering, with `Nats-Msg-Id = <key>:route:<seq>`
//! and the original's queue time (`Shotfleet-Queued-Since`); the original is acked (by `settle`)
//! only after the server has the copy.

use shotfleet_schema::subject::{self, SubjectClass};
use shotfleet_schema::{ShotJob, encoding};

use crate::failure::JobError;
use crate::worker::Shared;
use crate::worker::delivery::{Delivery, QUEUED_SINCE_HEADER};

/// Whether the job must move: `auto`, or a payload of another class than its subject's.
pub fn needs_routing(delivery: &Delivery, job: &ShotJob) -> bool {
    delivery.origin.class != SubjectClass::Class(job.class())
}

/// Publishes the payload, byte for byte, to the job's class subject.
///
/// # Errors
/// A transient [`JobError`]: the original must be kept.
pub async fn reroute(shared: &Shared, delivery: &Delivery, job: &ShotJob) -> Result<(), JobError> {
    let target = subject::job(delivery.origin.priority, SubjectClass::Class(job.class()), &job.project);
    let content_type = delivery.content_type();
    let id = subject::msg_id::route(&job.project, &job.job_id, delivery.stream_sequence);
    let since = delivery.queued_since_header();
    let mut pairs = vec![("Nats-Msg-Id", id.as_str()), (QUEUED_SINCE_HEADER, since.as_str())];
    pairs.extend(content_type.as_deref().map(|ct| (encoding::HEADER, ct)));
    let headers = shotfleet_schema::nats::header_map(pairs);
    let stored = match shared.js.publish_with_headers(target.clone(), headers, delivery.message.payload.clone()).await {
        Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    stored.map_err(|e| JobError::transient(format!("cannot route the job to {target}: {e}")))?;
    tracing::info!(job = %job.job_id, from = delivery.subject(), to = %target, "routed");
    Ok(())
}
