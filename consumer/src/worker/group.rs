//! Cross-job batching: compatible jobs (same size, steps and guidance, no LoRAs) fetched
//! together are rendered in shared UNet batches when the budget holds all their images at once,
//! the main throughput lever on large cards. Each job is still committed, and acked, on its own.
//!
//! Anything unusual falls back to rendering the jobs one by one (each through its own degrade
//! ladder): no room for the whole group, or any error in the shared render.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use shotfleet_schema::ShotJob;
use shotfleet_schema::subject::SubjectClass;
use tracing::{info, warn};

use crate::pipeline::{CancelHandle, RenderControl, RenderRequest};
use crate::telemetry;
use crate::worker::delivery::Delivery;
use crate::worker::job::{self, commit_output, keep_alive, render_and_commit, render_request, stop_at};
use crate::worker::Shared;

/// Jobs that can share UNet batches: one schedule, one guidance scale, one image size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Compatible {
    width: u32,
    height: u32,
    steps: u32,
    guidance_bits: u32,
}

impl Compatible {
    fn of(job: &ShotJob) -> Self {
        Self { width: job.width, height: job.height, steps: job.steps, guidance_bits: job.guidance.to_bits() }
    }
}

/// Handles deliveries fetched together: each to the end, compatible ones rendered as one group.
pub async fn handle(shared: Arc<Shared>, deliveries: Vec<Delivery>) {
    let _in_flight: Vec<_> = deliveries.iter().map(|_| telemetry::in_flight()).collect();
    let mut groups: BTreeMap<Compatible, Vec<(Delivery, ShotJob)>> = BTreeMap::new();
    for delivery in deliveries {
        if let Some(job) = job::take(&shared, &delivery).await {
            groups.entry(Compatible::of(&job)).or_default().push((delivery, job));
        }
    }
    for members in groups.into_values() {
        if members.len() == 1 || !render_together(&shared, &members).await {
            for (delivery, job) in &members {
                let outcome = render_and_commit(&shared, delivery, job).await;
                telemetry::job_finished(outcome, delivery.origin.priority, SubjectClass::Class(job.class()));
            }
        }
    }
}

/// Renders the members in shared batches and commits each. `false` when nothing was rendered
/// (no room for the group, or the shared render failed): the caller renders them one by one.
async fn render_together(shared: &Arc<Shared>, members: &[(Delivery, ShotJob)]) -> bool {
    let first = &members[0].1;
    let images: u32 = members.iter().map(|(_, job)| job.images).sum();
    let Ok(Some(reservation)) = shared.budget.reserve(first.width, first.height, images) else {
        return false;
    };
    let requests: Vec<RenderRequest> = members.iter().map(|(_, job)| render_request(job, images)).collect();
    let control = RenderControl { cancel: CancelHandle::new(), ..RenderControl::default() };
    let timed_out = Arc::new(AtomicBool::new(false));
    let stopper = stop_at(shared, Instant::now() + shared.config.job_time_limit.0, &control.cancel, &timed_out);
    let keepers: Vec<_> = members.iter().map(|(delivery, _)| keep_alive(shared, delivery)).collect();
    let pipeline = shared.pipeline();
    let started = Instant::now();
    let rendered = tokio::task::spawn_blocking(move || {
        pipeline.render_group(&requests, &control, &mut |_| std::ops::ControlFlow::Continue(()))
    })
    .await;
    stopper.abort();
    keepers.iter().for_each(|k| k.abort());
    drop(reservation);
    let outputs = match rendered {
        Ok(Ok(outputs)) => outputs,
        Ok(Err(e)) if !timed_out.load(Ordering::Relaxed) && !shared.abort.is_cancelled() => {
            warn!(jobs = members.len(), error = %e, "rendering the group failed; rendering its jobs one by one");
            return false;
        }
        _ => return false,
    };
    let elapsed = started.elapsed();
    info!(jobs = members.len(), images, width = first.width, height = first.height, elapsed_ms = elapsed.as_millis() as u64, "rendered a group");
    for ((delivery, job), output) in members.iter().zip(outputs) {
        let outcome = commit_output(shared, delivery, job, output, elapsed).await;
        telemetry::job_finished(outcome, delivery.origin.priority, SubjectClass::Class(job.class()));
    }
    true
}
