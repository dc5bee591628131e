//! Rendering one job: plan the largest sub-batch the budget holds (beside the job's LoRA set
//! when it must be placed), place the set, render off the async threads under the job's time
//! limit, and on out-of-memory step down in place (smaller UNet batches down to one image, then
//! a tiled VAE decode: the same images, one job, one result). What cannot be rendered here
//! comes back as a [`JobError`] for `settle`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use shotfleet_schema::ShotJob;
use shotfleet_schema::subject::SubjectClass;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::budget::{MIB, Measured, Reservation, Shape};
use crate::failure::{ErrorKind, JobError, classify_render};
use crate::pipeline::image::Recipe;
use crate::pipeline::lora::ResidentSet;
use crate::pipeline::{CancelHandle, RenderControl, RenderError, RenderOutput, RenderRequest, RenderedImage, Stage, VaeDecode};
use crate::telemetry;
use crate::worker::attempts::Counts;
use crate::worker::commit;
use crate::worker::delivery::Delivery;
use crate::worker::job::Taken;
use crate::worker::progress::{self, Reporter};
use crate::worker::run_thread::on_run_thread;
use crate::worker::{Shared, shrink_arenas};

/// How long a job with no room here waits before it is offered again.
const NO_ROOM_DELAY: Duration = Duration::from_millis(500);
/// How often a job waiting here for room looks again.
const ROOM_POLL: Duration = Duration::from_millis(200);
/// How long a job waits after an out-of-memory before it is offered again: long enough for
/// another worker's pull.
const OOM_DELAY: Duration = Duration::from_secs(1);

/// A finished render and how long it took.
pub struct Rendered {
    pub output: RenderOutput,
    pub elapsed: Duration,
}

/// How one render attempt uses memory: the in-place rungs of the degrade ladder.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Attempt {
    /// Images per UNet sub-batch.
    batch: u32,
    vae: VaeDecode,
}

/// Renders the job, stepping down in place on out-of-memory.
///
/// # Errors
/// A [`JobError`]: no room now or a first out-of-memory (give back), out of memory one image
/// at a time with a tiled VAE (degrade), the time limit, the worker stopping, or the render's
/// own error by its kind.
pub(crate) async fn render_job(shared: &Arc<Shared>, taken: &Taken) -> Result<Rendered, JobError> {
    let (delivery, job) = (&taken.delivery, taken.job());
    let pending = shared.loras.pending(shared, taken.set.as_ref()).await?;
    let set_bytes = pending.bytes();
    let (batch, mut reservation) = room_for(shared, taken, set_bytes).await?;
    let set = shared.loras.place(shared, pending, &mut reservation).await?;
    let mut attempt = Attempt { batch, vae: VaeDecode::Whole };
    let deadline = Instant::now() + shared.config.job_time_limit;
    loop {
        let stops = Stops { deadline, settled: &taken.watch.settled, reporter: taken.reporter.as_ref() };
        let (error, stage) = match render_once(shared, job, attempt, reservation, set.as_ref(), &stops).await {
            Ok(rendered) => return Ok(rendered),
            Err((error, stage)) if error.kind == ErrorKind::Oom => (error, stage),
            Err((error, _)) => return Err(error),
        };
        // Out of memory: learn, give memory back, then decide.
        let planned = shared.budget.observe_oom(job.width, job.height, attempt.batch);
        telemetry::out_of_memory();
        shrink_arenas(shared).await;
        warn!(job = %job.job_id, batch = attempt.batch, vae = ?attempt.vae, planned_now = planned, detail = %error, "out of memory");
        let first = attempt.batch == batch && attempt.vae == VaeDecode::Whole;
        if first && out_of_memory(shared, delivery, job).await.ooms == 1 {
            // The size it is offered at, which is not the one asked for once it was degraded.
            let offered = format!("out of memory on {}; offered to the fleet at {}x{}", shared.config.worker_id, job.width, job.height);
            return Err(JobError::give_back(OOM_DELAY, offered));
        }
        let Some(next) = next_in_place(job, attempt, stage) else {
            let tiled = if attempt.vae == VaeDecode::Whole { "" } else { " with a tiled VAE" };
            let detail = format!("out of memory at {}x{} one image at a time{tiled}: {}", job.width, job.height, error.detail);
            return Err(hand_off_or_degrade(shared, delivery, job, detail).await);
        };
        attempt = next;
        reservation = match shared.budget.reserve(job.width, job.height, attempt.batch, 0) {
            Ok(Some(reservation)) => reservation,
            _ => return Err(JobError::give_back(OOM_DELAY, "no room for a smaller batch now")),
        };
        info!(job = %job.job_id, batch = attempt.batch, vae = ?attempt.vae, "degrading in place");
    }
}

/// The job's first sub-batch, reserved. With no room now but room on this card once its other
/// renders end, the job is given back while it has deliveries to spare (another worker may have
/// room now); after that it waits here for room, so that give-backs alone never use up its
/// deliveries and send a healthy job to `SHOTS_FAILED` as `max_deliveries`.
async fn room_for(shared: &Shared, taken: &Taken, set_bytes: u64) -> Result<(u32, Reservation), JobError> {
    let (delivery, job) = (&taken.delivery, taken.job());
    let gives_up = Instant::now() + shared.config.job_time_limit;
    let mut waiting = false;
    loop {
        if let Some(planned) = plan(shared, job, set_bytes) {
            return Ok(planned);
        }
        if !shared.budget.holds_one(job.width, job.height, set_bytes).unwrap_or(true) {
            // Not one image fits this card with nothing else in flight: as if it ran out of
            // memory one image at a time. A LoRA set does not shrink with the image: a card too
            // small for the set is left behind by the degraded job too, down to its floor.
            let set = taken.set.as_ref().map(|set| format!(" and its LoRA set {set} ({} MiB to place)", set_bytes / MIB)).unwrap_or_default();
            let detail = format!("{}x{}{set}: not one image fits {} beside what else is on its card", job.width, job.height, shared.config.worker_id);
            return Err(hand_off_or_degrade(shared, delivery, job, detail).await);
        }
        if spares_deliveries(delivery.attempt, shared.max_deliver) || Instant::now() >= gives_up || shared.stop.is_cancelled() {
            return Err(JobError::give_back(NO_ROOM_DELAY, "no room for this job now"));
        }
        if !waiting {
            info!(job = %job.job_id, delivery = delivery.attempt, max_deliver = shared.max_deliver, "no room now; waiting here for this worker's renders to end (half the job's deliveries are used)");
            waiting = true;
        }
        tokio::select! {
            () = tokio::time::sleep(ROOM_POLL) => {}
            () = shared.stop.cancelled() => {}
            () = taken.watch.settled.cancelled() => return Err(JobError::give_back(Duration::ZERO, "settled while it waited for room")),
        }
    }
}

/// Whether the job has deliveries to spare for a give-back: its first half of the consumer's
/// `max_deliver`. Past it, a job with no room waits for room and one that a card cannot hold is
/// degraded without waiting out the hand-off window.
pub(crate) fn spares_deliveries(attempt: u64, max_deliver: u64) -> bool {
    attempt.saturating_mul(2) < max_deliver
}

/// Counts an out-of-memory of the job message in the attempts bucket and returns the fleet's
/// counts (without the bucket: the delivery count, and a first one long past).
async fn out_of_memory(shared: &Shared, delivery: &Delivery, job: &ShotJob) -> Counts {
    shared.attempts.out_of_memory(delivery, &job.job_id).await.unwrap_or_else(|e| {
        warn!(job = %job.job_id, error = %e, "cannot count the out-of-memory; going by the delivery count");
        Counts { ooms: delivery.attempt as u32, first_oom_ms: Some(0), ..Counts::default() }
    })
}

/// This worker cannot render the job even one image at a time: while the fleet has had less
/// than `[degrade] handoff` since the job's first out-of-memory, give it back (a roomier card
/// renders it at full size); after that, out of memory (settle degrades it).
async fn hand_off_or_degrade(shared: &Shared, delivery: &Delivery, job: &ShotJob, detail: String) -> JobError {
    let counts = out_of_memory(shared, delivery, job).await;
    let since_first = counts.first_oom_ms.map_or(Duration::ZERO, |first| Duration::from_millis(commit::now_ms().saturating_sub(first)));
    let handoff = shared.config.degrade.handoff;
    if since_first < handoff && spares_deliveries(delivery.attempt, shared.max_deliver) {
        let left = handoff - since_first;
        let (width, height, left) = (job.width, job.height, left.as_secs_f64());
        return JobError::give_back(OOM_DELAY, format!("{detail}; offered to the fleet at {width}x{height} for {left:.0}s more before it goes one rung down"));
    }
    JobError::new(ErrorKind::Oom, detail)
}

/// The largest sub-batch the room holds beside `set_bytes` of a LoRA set to place, reserved.
fn plan(shared: &Shared, job: &ShotJob, set_bytes: u64) -> Option<(u32, Reservation)> {
    let batch = shared.budget.largest_batch(job.width, job.height, job.images, set_bytes).ok()?;
    if batch == 0 {
        return None;
    }
    let reservation = shared.budget.reserve(job.width, job.height, batch, set_bytes).ok()??;
    Some((batch, reservation))
}

/// The next in-place rung: half the UNet batch, down to one image; then, when the decoder is
/// what ran out, a tiled VAE decode (it cannot help a UNet that does not fit).
fn next_in_place(job: &ShotJob, attempt: Attempt, failed_at: Option<Stage>) -> Option<Attempt> {
    if attempt.batch > 1 {
        return Some(Attempt { batch: attempt.batch / 2, ..attempt });
    }
    if failed_at != Some(Stage::Vae) {
        return None;
    }
    // Tiles of about half the longer side (multiples of 64, 128..=1024); an image no larger than
    // one tile would decode whole, so a tile must be smaller than the image to help.
    let tile = (job.width.max(job.height) / 2 / 64 * 64).clamp(128, 1024);
    let tiled = VaeDecode::tiled(tile);
    (attempt.vae == VaeDecode::Whole && tile < job.width.max(job.height)).then_some(Attempt { vae: tiled, ..attempt })
}

/// What stops a render besides its own end, and who hears of its steps.
struct Stops<'a> {
    deadline: Instant,
    /// An outcome settled the job elsewhere (a cancellation).
    settled: &'a CancellationToken,
    reporter: Option<&'a Reporter>,
}

/// One render of the whole job at `attempt`'s sizes with its LoRA set (`None`: the base model),
/// off the async threads, stopped at the deadline, when the worker aborts or when the job is
/// settled elsewhere. An error comes with the stage it came from.
async fn render_once(
    shared: &Arc<Shared>,
    job: &ShotJob,
    attempt: Attempt,
    reservation: Reservation,
    set: Option<&Arc<ResidentSet>>,
    stops: &Stops<'_>,
) -> Result<Rendered, (JobError, Option<Stage>)> {
    let request = render_request(job, attempt.batch);
    let started = Instant::now();
    let render_number = shared.renders.fetch_add(1, Ordering::Relaxed) + 1;
    if let Some(text) = shared.config.faults.driver_fault(render_number) {
        warn!(job = %job.job_id, "fault injection: this render fails as a driver fault");
        let source = ort::Error::new(text);
        return Err((kind_of(&RenderError::Runtime { stage: Stage::Unet, source }), Some(Stage::Unet)));
    }
    if shared.config.faults.noop_render {
        return Ok(Rendered { output: placeholder(job), elapsed: started.elapsed() });
    }
    let control = RenderControl { vae_decode: attempt.vae, cancel: CancelHandle::new() };
    let timed_out = Arc::new(AtomicBool::new(false));
    let _stopper = stop_at(shared, stops.deadline, &control.cancel, &timed_out, stops.settled);
    let (steps, _publisher) = stops.reporter.map(Reporter::steps).unzip();
    let pipeline = shared.pipeline();
    let meter = shared.meter.clone();
    let set = set.cloned();
    // The pool's sets stay on the device through the render (measured renders run one at a time).
    let sets = shared.loras.device_bytes();
    let gives_arenas_back = shared.config.budget.cold_renders;
    let runs = pipeline.clone();
    let outcome = on_run_thread(&runs, move || {
        let steps: Vec<_> = steps.into_iter().collect();
        let render = || {
            let requests = std::slice::from_ref(&request);
            pipeline.render_with_loras(requests, set.as_deref(), &control, &mut progress::callback(&steps)).map(|mut outputs| outputs.remove(0))
        };
        match meter {
            Some(meter) => {
                let (result, peak) = meter.measure(render);
                // Its last runs gave the arenas back: what the process holds now, the kernels
                // it loaded included, is the floor its need is measured from.
                let floor = if gives_arenas_back && result.is_ok() { meter.note_floor().ok() } else { None };
                let floor = floor.unwrap_or_else(|| meter.floor()).saturating_sub(sets);
                let thread = std::thread::current().id();
                (result, peak.ok().map(|measured| (measured.less_held(sets), floor, thread)))
            }
            None => (render(), None),
        }
    })
    .await;
    let elapsed = started.elapsed();
    let (result, peak) = outcome.map_err(|e| (JobError::transient(format!("render task failed: {e}")), None))?;
    if let (Ok(_), Some((measured, floor, thread))) = (&result, peak) {
        shared.budget.outside_arenas(floor);
        learn(shared, job, reservation.shape(), measured, floor, thread);
    }
    drop(reservation);
    telemetry::render_time(SubjectClass::Class(job.class()), elapsed);
    match result {
        Ok(output) => Ok(Rendered { output, elapsed }),
        Err(error) => Err((stopped(&error, timed_out.load(Ordering::Relaxed), elapsed), error.stage())),
    }
}

/// Fault injection's skipped render: the job's images as placeholders, one black pixel each.
fn placeholder(job: &ShotJob) -> RenderOutput {
    let recipe = Arc::new(Recipe::of(&render_request(job, 1), "placeholder (noop_render)"));
    let images = (0..job.images)
        .map(|index| RenderedImage { index, seed: job.seed, width: 1, height: 1, rgb: vec![0; 3], recipe: recipe.clone() })
        .collect();
    RenderOutput { images, timings: Default::default() }
}

/// A render error as a job error: stopped from outside (the time limit, the worker stopping)
/// or by its own kind.
pub(crate) fn stopped(error: &RenderError, timed_out: bool, elapsed: Duration) -> JobError {
    match error {
        RenderError::Cancelled { .. } | RenderError::Terminated { .. } if timed_out => JobError::new(
            ErrorKind::Timeout,
            format!("render stopped at the time limit after {:.1}s", elapsed.as_secs_f64()),
        ),
        RenderError::Cancelled { .. } | RenderError::Terminated { .. } => {
            JobError::give_back(Duration::ZERO, "the worker is stopping: giving the job back now")
        }
        other => kind_of(other),
    }
}

/// A render's own error by its kind.
fn kind_of(error: &RenderError) -> JobError {
    let kind = classify_render(error);
    let detail = match kind {
        ErrorKind::Invalid => format!("this model cannot render it: {error}"),
        _ => error.to_string(),
    };
    JobError::new(kind, detail)
}

/// Learns from a render's need (its peak above `floor`, what the process holds with shrunk
/// arenas) where it is the render's own: one that started from arenas an earlier, larger
/// render left full reads their cache too, which says nothing about this shape (and would plan
/// every later job at the largest size seen). `thread` is the one the render ran on: ONNX
/// Runtime's CUDA provider keeps a context per calling thread, which the floor may show.
fn learn(shared: &Shared, job: &ShotJob, shape: Shape, measured: Measured, floor: u64, thread: std::thread::ThreadId) {
    let planned = shared.budget.planned(shape.width, shape.height, shape.images);
    let (need, cold) = measured.need_over(floor);
    telemetry::estimate_error(planned, need, cold);
    let error = cold.then(|| shared.budget.observe(shape.width, shape.height, shape.images, need));
    info!(
        job = %job.job_id,
        width = shape.width,
        height = shape.height,
        images = shape.images,
        need_mib = need / MIB,
        peak_mib = measured.peak / MIB,
        floor_mib = floor / MIB,
        held_at_start_mib = measured.held_at_start / MIB,
        planned_mib = planned / MIB,
        error,
        cold,
        thread = ?thread,
        "observed peak"
    );
}

/// What the pipeline renders for a job: all its images, `max_batch` per UNet sub-batch.
pub fn render_request(job: &ShotJob, max_batch: u32) -> RenderRequest {
    RenderRequest {
        prompt: job.prompt.clone(),
        negative_prompt: job.negative_prompt.clone(),
        width: job.width,
        height: job.height,
        steps: job.steps,
        guidance: job.guidance,
        seed: job.seed,
        image_indices: (0..job.images).collect(),
        max_batch: max_batch as usize,
    }
}

/// Stops the run in progress (ONNX Runtime's terminate) at `deadline` (setting `timed_out`),
/// when the worker aborts or when `settled` fires (the job was settled elsewhere), until dropped.
pub(crate) fn stop_at(
    shared: &Shared,
    deadline: Instant,
    cancel: &CancelHandle,
    timed_out: &Arc<AtomicBool>,
    settled: &CancellationToken,
) -> AbortOnDrop {
    let (cancel, abort, timed_out, settled) = (cancel.clone(), shared.abort.clone(), timed_out.clone(), settled.clone());
    AbortOnDrop(tokio::spawn(async move {
        tokio::select! {
            () = abort.cancelled() => {}
            () = settled.cancelled() => {}
            () = tokio::time::sleep_until(deadline.into()) => timed_out.store(true, Ordering::Relaxed),
        }
        cancel.cancel();
    }))
}

/// A task that ends when this is dropped.
pub struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl AbortOnDrop {
    pub fn new(task: tokio::task::JoinHandle<()>) -> Self {
        Self(task)
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::spares_deliveries;

    #[test]
    fn give_backs_stop_at_half_the_deliveries() {
        // The default consumers (max_deliver 20): deliveries 1 to 9 may give the job back;
        // from the tenth it waits here for room, or is degraded.
        assert!((1..=9).all(|attempt| spares_deliveries(attempt, 20)));
        assert!((10..=20).all(|attempt| !spares_deliveries(attempt, 20)));
        // A consumer with one or two deliveries never gives a job back for room.
        assert!(!spares_deliveries(1, 1) && !spares_deliveries(1, 2));
        // No limit: always.
        assert!(spares_deliveries(1_000_000, u64::MAX));
    }
}
