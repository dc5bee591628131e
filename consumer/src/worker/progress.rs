//! Progress events of a held job on `shots.progress.<project>.<job_id>` (schema `progress`):
//! plain NATS publishes, best effort, never in the render's way.
//!
//! The render thread hands each finished step to a `watch` channel (it only replaces a value:
//! it never blocks and never waits for the network); an async task publishes the latest step at
//! most every [`STEP_INTERVAL`], so a 4 ms tiny-model step or a 60 ms SDXL step costs the same
//! few events a second.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shotfleet_schema::progress::{self, GpuMemory, ProgressEvent, ShotProgress};
use shotfleet_schema::ShotJob;
use tokio::sync::watch;
use tracing::debug;

use crate::budget::Budget;
use crate::pipeline::StepProgress;
use crate::worker::Shared;
use crate::worker::commit::now_ms;
use crate::worker::render::AbortOnDrop;

/// The shortest time between two step events of one job.
pub const STEP_INTERVAL: Duration = Duration::from_millis(250);

/// Publishes one held job's events. Cheap to clone.
#[derive(Clone)]
pub struct Reporter {
    client: async_nats::Client,
    budget: Budget,
    subject: String,
    template: Arc<ShotProgress>,
    taken: Instant,
}

impl Reporter {
    /// A reporter for `job`, taken now by this worker.
    pub fn new(shared: &Shared, job: &ShotJob) -> Self {
        let template = ShotProgress {
            v: shotfleet_schema::VERSION,
            project: job.project.clone(),
            job_id: job.job_id.clone(),
            shot_id: job.shot_id.clone(),
            event: ProgressEvent::Taken,
            worker: shared.config.worker_id.clone(),
            step: 0,
            steps: job.steps,
            batch: 0,
            images_done: 0,
            images: job.images,
            elapsed_ms: 0,
            degrade_level: job.degrade.map_or(0, |d| d.level),
            detail: None,
            gpu: None,
            at_ms: 0,
        };
        Self {
            client: shared.js.client(),
            budget: shared.budget.clone(),
            subject: progress::subject(&job.project, &job.job_id),
            template: Arc::new(template),
            taken: Instant::now(),
        }
    }

    /// Publishes an event without waiting for the server.
    pub async fn send(&self, event: ProgressEvent, step: Option<StepProgress>, detail: Option<String>) {
        let mut message = (*self.template).clone();
        message.event = event;
        if let Some(step) = step {
            message.step = step.step;
            message.steps = step.steps;
            message.batch = step.images;
            message.images_done = step.images_done;
        }
        message.detail = detail;
        message.elapsed_ms = self.taken.elapsed().as_millis() as u64;
        message.gpu = self.budget.status().ok().map(|s| GpuMemory { used_bytes: s.used, total_bytes: s.total, budget_bytes: s.budget });
        message.at_ms = now_ms();
        let payload = serde_json::to_vec(&message).expect("progress events serialize");
        if let Err(e) = self.client.publish(self.subject.clone(), payload.into()).await {
            debug!(job = %message.job_id, error = %e, "progress event not sent");
        }
    }

    /// A step callback for the render thread, and the task publishing what it reports (it
    /// stops when dropped: the event that follows a render says more than its last step).
    pub fn steps(&self) -> (Steps, AbortOnDrop) {
        let (tx, mut rx) = watch::channel(None::<StepProgress>);
        let reporter = self.clone();
        let task = tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let step = *rx.borrow_and_update();
                reporter.send(ProgressEvent::Step, step, None).await;
                tokio::time::sleep(STEP_INTERVAL).await;
            }
        });
        (Steps { tx, offset: 0, images: None }, AbortOnDrop::new(task))
    }
}

/// The render thread's end of [`Reporter::steps`].
pub struct Steps {
    tx: watch::Sender<Option<StepProgress>>,
    /// In a group render: the images of the members before this one.
    offset: u32,
    /// In a group render: this member's images.
    images: Option<u32>,
}

impl Steps {
    /// This job's share of a group render whose earlier members hold `offset` images.
    pub fn in_group(mut self, offset: u32, images: u32) -> Self {
        self.offset = offset;
        self.images = Some(images);
        self
    }

    /// Records a finished step; never blocks.
    pub fn report(&self, step: StepProgress) {
        let done = step.images_done.saturating_sub(self.offset);
        let images_done = self.images.map_or(done, |images| done.min(images));
        let batch = self.images.map_or(step.images, |images| step.images.min(images - images_done));
        self.tx.send_replace(Some(StepProgress { images_done, images: batch, ..step }));
    }
}

/// A step callback reporting to every one of `steps` and never stopping the render (a stop
/// comes through the render's cancel handle).
pub fn callback(steps: &[Steps]) -> impl FnMut(StepProgress) -> ControlFlow<()> + '_ {
    move |step| {
        steps.iter().for_each(|s| s.report(step));
        ControlFlow::Continue(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_member_sees_its_own_images() {
        let (tx, rx) = watch::channel(None);
        // Members of 2, 3 and 1 images; this is the second, rendered in sub-batches of 4.
        let steps = Steps { tx, offset: 0, images: None }.in_group(2, 3);
        let step = |images_done, images| StepProgress { step: 5, steps: 20, images, images_done };
        steps.report(step(0, 4));
        assert_eq!(*rx.borrow(), Some(StepProgress { step: 5, steps: 20, images: 3, images_done: 0 }));
        steps.report(step(4, 2));
        assert_eq!(rx.borrow().map(|s| (s.images_done, s.images)), Some((2, 1)), "2 of its 3 done, 1 in this sub-batch");
        steps.report(step(6, 0));
        assert_eq!(rx.borrow().map(|s| s.images_done), Some(3), "never more than its own");
    }
}
