//! The probe renders at start, each planned against the room before it runs
//! ([`Calibration`]): a probe over the room is skipped, one that runs out of memory anyway is
//! the card's ceiling for its shape, and calibration goes on with what fits. Only a probe that
//! fails for another reason (a broken model, a driver fault) stops the start. Each probe is
//! measured on its shape's second render, as every job of a probed size is ([`warm_probe`]).

use std::sync::Arc;

use tracing::{info, warn};

use crate::budget::{self, Calibration, Estimate, GpuProbe, PeakMeter, ProbeOutcome, Shape};
use crate::config::WorkerConfig;
use crate::failure::{ErrorKind, classify_render};
use crate::pipeline::{Pipeline, RenderError};
use crate::worker::WorkerError;
use crate::worker::startup::{ProbeRender, ProbeRuns, probe_render, shrink};

/// Renders the configured probes that fit, smallest first, and fits the estimate to them.
///
/// # Errors
/// [`WorkerError::NothingFits`] when not one probe could be rendered; [`WorkerError::Start`]
/// when the card cannot be read, a probe fails for another reason than memory, or the peaks
/// make no estimate.
pub(crate) async fn calibrate(
    config: &WorkerConfig,
    pipeline: &Arc<Pipeline>,
    meter: &Arc<PeakMeter>,
    probe: &Arc<dyn GpuProbe>,
    resident: u64,
) -> Result<(Estimate, Calibration), WorkerError> {
    let mut calibration = Calibration::new(config.budget.safety);
    let room_now = || budget::room_now(&config.budget, &**probe, resident).map_err(|e| WorkerError::start("read the GPU", e));
    let runs = ProbeRuns::of(config);
    let cold = runs.cold;
    if cold {
        // Shrunk before the room is read, so the room is the models' alone; every cold probe
        // ends shrunk (probe_render after a render, the out-of-memory arm after a failed one),
        // so this holds before each later probe too.
        shrink(pipeline).await?;
    }
    for &[w, h, n] in &config.calibration.shapes {
        let shape = Shape::new(w, h, n);
        let room = room_now()?;
        if let Some(skipped) = calibration.plan(shape, room) {
            log_skip(shape, skipped);
            continue;
        }
        let started = std::time::Instant::now();
        match warm_probe(pipeline, meter, shape, config.calibration.steps, runs).await? {
            Ok((render, first)) => {
                let mib = |bytes: u64| bytes as f64 / budget::MIB as f64;
                let ms = |time: std::time::Duration| time.as_millis() as u64;
                // The times tell a cold worker's start apart: the stages of the measured render,
                // the priming render's, and the probe's whole, shrinks included.
                info!(
                    width = w,
                    height = h,
                    images = n,
                    peak_mib = mib(render.peak),
                    first_render_mib = first.map(|first| mib(first.peak)),
                    above_models_mib = mib(render.above_models),
                    floor_mib = mib(render.floor),
                    unet_ms = ms(render.timings.unet),
                    vae_ms = ms(render.timings.vae),
                    first_render_ms = first.map(|first| ms(first.timings.total())),
                    probe_ms = ms(started.elapsed()),
                    "probe render"
                );
                // With a UNet session per slot a lane's first render of a size can be a job's:
                // the priming render ran on one lane, so each size is planned at what a first
                // render needed where that is more.
                let planned = match first {
                    Some(first) if pipeline.info().unet_sessions > 1 => render.peak.max(first.peak),
                    _ => render.peak,
                };
                calibration.measured(shape, planned);
            }
            Err(error) if classify_render(&error) == ErrorKind::Oom => {
                warn!(width = w, height = h, images = n, room_mib = room / budget::MIB, error = %error, "probe ran out of memory: this card's ceiling for the shape");
                calibration.ran_out(shape, room);
                shrink(pipeline).await?;
            }
            Err(error) => return Err(WorkerError::start(&format!("render a {w}x{h}x{n} probe"), error)),
        }
    }
    // The room the classes are judged against is the idle worker's: the last probe's cache given
    // back (cold probes already gave it).
    if !cold {
        shrink(pipeline).await?;
    }
    let estimate = calibration.estimate().map_err(|e| match e {
        budget::CalibrationError::NothingMeasured { .. } => {
            WorkerError::NothingFits(format!("{e} (the models take {} MiB of the card)", resident / budget::MIB))
        }
        other => WorkerError::start("calibrate the budget", other),
    })?;
    Ok((estimate, calibration))
}

/// One probe, measured on its shape's second render where probes start from shrunk arenas.
///
/// A job of a size the fleet probed is never its size's first render (on the priming render's
/// UNet lane: with a session per slot, see the planning above), and a first render can
/// need more: on the H200 (2026-12-02, deploy/gpu/RESULTS.md) two probes of eleven needed 7%
/// more on their first render than on their second, the others the same. So a one-step render
/// primes the shape (an out-of-memory there is the probe's own) and the second is measured.
/// Probes that keep their arenas (`[calibration] cold = false`) are not primed: a second render
/// would find the first's memory cached and read no growth. With the measured render comes the
/// priming one's need (logged as `first_render_mib`: what a size's first job needs).
async fn warm_probe(
    pipeline: &Arc<Pipeline>,
    meter: &Arc<PeakMeter>,
    shape: Shape,
    steps: u32,
    runs: ProbeRuns,
) -> Result<Result<(ProbeRender, Option<ProbeRender>), RenderError>, WorkerError> {
    let first = if runs.cold {
        match probe_render(pipeline, meter, shape, 1, runs).await? {
            Ok(primed) => Some(primed),
            Err(error) => return Ok(Err(error)),
        }
    } else {
        None
    };
    Ok(probe_render(pipeline, meter, shape, steps, runs).await?.map(|render| (render, first)))
}

fn log_skip(shape: Shape, outcome: ProbeOutcome) {
    let (w, h, n) = (shape.width, shape.height, shape.images);
    match outcome {
        ProbeOutcome::OverRoom { planned, room } => {
            info!(width = w, height = h, images = n, planned_mib = planned / budget::MIB, room_mib = room / budget::MIB, "probe skipped: over the room");
        }
        ProbeOutcome::OverCeiling { ceiling } => {
            info!(width = w, height = h, images = n, ceiling = %format!("{}x{}x{}", ceiling.width, ceiling.height, ceiling.images), "probe skipped: past a probe that ran out of memory");
        }
        ProbeOutcome::Measured { .. } | ProbeOutcome::OutOfMemory { .. } => {}
    }
}
