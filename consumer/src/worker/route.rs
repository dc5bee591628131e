//! Routing: jobs on `auto` (or on a class their payload does not match) are re-published to
//! their class subject, cheaply and without rendering, with `Nats-Msg-Id = <job>:route`; the
//! original is acked only after the server has the copy.

use async_nats::HeaderMap;
use shotfleet_schema::subject::{self, SubjectClass};
use shotfleet_schema::{encoding, ShotJob};

use crate::telemetry::{self, JobOutcome};
use crate::worker::delivery::Delivery;
use crate::worker::Shared;

pub async fn reroute(shared: &Shared, delivery: &Delivery, job: &ShotJob) {
    let class = SubjectClass::Class(job.class());
    let target = subject::job(delivery.origin.priority, class, &job.project);
    let mut headers = HeaderMap::new();
    if let Some(ct) = delivery.content_type() {
        headers.insert(encoding::HEADER, ct.as_str());
    }
    headers.insert("Nats-Msg-Id", subject::msg_id::route(&job.job_id).as_str());
    let published = match shared.js.publish_with_headers(target.clone(), headers, delivery.message.payload.clone()).await {
        Ok(ack) => ack.await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match published {
        Ok(_) => {
            if let Err(e) = delivery.done().await {
                tracing::warn!(job = %job.job_id, error = %e, "routed copy stored but the original's ack failed; the duplicate window absorbs the retry");
            }
            tracing::info!(job = %job.job_id, from = delivery.subject(), to = %target, "routed");
            telemetry::job_finished(JobOutcome::Routed, delivery.origin.priority, delivery.origin.class);
        }
        Err(e) => {
            tracing::warn!(job = %job.job_id, error = %e, "routing failed; naking");
            delivery.nak(Some(std::time::Duration::from_secs(2))).await;
        }
    }
}
