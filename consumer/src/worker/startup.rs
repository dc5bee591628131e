//! Start-up: load the models, measure what they take, calibrate the budget, prove the card works.
//!
//! Nothing is fetched before this has passed: a worker whose models do not load or whose probe
//! render fails never takes a job (and `/readyz` stays 503 with the reason). A probe that runs
//! out of memory is no failure: calibration plans around it (`calibrate.rs`).

use std::sync::Arc;
use std::time::Instant;

use tracing::info;

use crate::budget::{self, Budget, Calibration, ClassReport, FingerprintKey, FingerprintStore, GpuProbe, GpuSnapshot, PeakMeter, Shape};
use crate::config::{DeviceKind, WorkerConfig};
use crate::pipeline::{Device, Pipeline, PipelineOptions, RenderError, RenderRequest};
use crate::worker::run_thread::{on_run_thread, waiting_on_run_threads};
use crate::worker::{WorkerError, calibrate};

/// The models and the budget, ready to serve.
pub struct Ready {
    pub pipeline: Arc<Pipeline>,
    pub budget: Budget,
    pub probe: Arc<dyn GpuProbe>,
    /// Peaks above the post-load baseline, for learning from jobs.
    pub meter: Arc<PeakMeter>,
    /// What became of each probe (empty when a stored fingerprint was reused).
    pub calibration: Calibration,
    /// Which classes the calibrated budget holds, of those `classes` allows.
    pub classes: ClassReport,
}

/// Loads, calibrates (or reuses a stored fingerprint) and runs a fitness render.
///
/// # Errors
/// [`WorkerError::Start`] naming the step that failed.
pub async fn prepare(config: &WorkerConfig) -> Result<Ready, WorkerError> {
    let started = Instant::now();
    let probe = budget::open_probe(&config.budget, config.gpu_index()).map_err(|e| WorkerError::start("open the GPU probe", e))?;
    let before = probe.snapshot().map_err(|e| WorkerError::start("read the GPU", e))?;
    let options = pipeline_options(config, &before);
    if let Some(share_mib) = config.budget.max_mib {
        info!(share_mib, arena_limit_mib = config.budget.arena_limit(before.clone()) / budget::MIB, "this worker's share of the card");
    }
    let model = config.model.clone();
    let pipeline = blocking(move || Pipeline::load(&model, &options)).await?.map_err(|e| {
        if e.is_the_folders() { WorkerError::Model(e.to_string()) } else { WorkerError::start("load the model", e) }
    })?;
    let pipeline = Arc::new(pipeline);
    let after = probe.snapshot().map_err(|e| WorkerError::start("read the GPU", e))?;
    let resident = after.resident_since(&before);
    let meter = Arc::new(PeakMeter::new(probe.clone()).map_err(|e| WorkerError::start("measure the baseline", e))?);
    let loaded = pipeline.info();
    let times = pipeline.load_times();
    info!(
        model = %loaded.name,
        device = %after.device,
        resident_mib = resident / budget::MIB,
        unet = ?loaded.dtype,
        unet_sessions = loaded.unet_sessions,
        unet_weights = %loaded.unet_packed.map_or_else(|| "as the graph's type".to_string(), |p| p.to_string()),
        vae_decoder = ?loaded.vae_dtype,
        text_encoders_on_cpu = loaded.text_encoders_on_cpu,
        warmed_run_threads = pipeline.run_thread_names().len(),
        load_s = started.elapsed().as_secs_f64(),
        text_encoders_s = times.text_s,
        unet_s = times.unet_s,
        vae_decoder_s = times.vae_s,
        warm_s = times.warm_s,
        "models loaded"
    );

    // A render's peak on the card differs with the text encoders off it, and with the UNet's
    // weights unpacked at each call: each its own key.
    let mut model_key = loaded.name.clone();
    if loaded.text_encoders_on_cpu {
        model_key.push_str(" (text encoders on the CPU)");
    }
    if let Some(packed) = loaded.unet_packed {
        model_key.push_str(&format!(" (UNet weights {packed})"));
    }
    if loaded.unet_sessions > 1 {
        // Planned at a size's first render (calibrate.rs): other needs than one session's.
        model_key.push_str(&format!(" ({} UNet sessions)", loaded.unet_sessions));
    }
    if config.budget.cold_renders {
        // Its probes give the UNet's arena back before the decode, as its jobs do
        // (ProbeRuns): other needs than a worker that keeps its arenas.
        model_key.push_str(" (cold renders)");
    }
    if config.device == DeviceKind::Cuda {
        // cuDNN's algorithms, their workspaces and ONNX Runtime's memory patterns change
        // what a render holds: a calibration made under other options is not this worker's.
        model_key.push_str(&format!(" ({})", config.cuda.describe()));
    }
    let key = FingerprintKey {
        device: after.device.clone(),
        model: model_key,
        runtime: pipeline.info().ort_version.clone(),
    };
    let fingerprints = FingerprintStore::new(&config.state_dir);
    let stored = if config.calibration.reuse_fingerprint { fingerprints.load(&key).ok().flatten() } else { None };
    let stored = match stored {
        // Still one render: the fitness check proves the card and the runtime work.
        Some(estimate) => fitness(config, &pipeline, &meter).await?.then_some(estimate),
        None => None,
    };
    let (estimate, calibration) = match stored {
        Some(estimate) => {
            info!("calibration reused from a stored fingerprint");
            (estimate, Calibration::new(config.budget.safety))
        }
        None => {
            let (estimate, calibration) = calibrate::calibrate(config, &pipeline, &meter, &probe, resident)
                .await
                .map_err(|e| e.with_weights_hint(loaded.unet_packed.is_some()))?;
            // Only a calibration of every probe is the card's own: one cut short by a crowded
            // card is tried in full at the next start.
            if !calibration.complete() {
                info!("calibration not stored: not every probe was measured");
            } else if let Err(e) = fingerprints.save(&key, &estimate) {
                tracing::warn!(error = %e, "could not store the calibration; the next start calibrates again");
            }
            (estimate, calibration)
        }
    };
    let budget = Budget::new(config.budget.clone(), probe.clone(), estimate, resident).map_err(|e| WorkerError::start("configure the budget", e))?;
    // The budget plans beside the models and what the libraries keep outside the arenas.
    budget.outside_arenas(meter.floor());
    log_budget(&budget, &config.classes);
    let classes = ClassReport::of(&config.classes, &budget, &calibration).map_err(|e| WorkerError::start("read the GPU", e))?;
    info!(warmup_s = started.elapsed().as_secs_f64(), "worker ready");
    Ok(Ready { pipeline, budget, probe, meter, calibration, classes })
}

/// The fitness render of a worker that reuses a stored fingerprint: the smallest probe.
/// `false` when it ran out of memory (the card is more crowded than when the fingerprint was
/// made): then the worker calibrates, each probe planned against the room it has now.
async fn fitness(config: &WorkerConfig, pipeline: &Arc<Pipeline>, meter: &Arc<PeakMeter>) -> Result<bool, WorkerError> {
    let [w, h, n] = config.calibration.shapes[0];
    if config.calibration.cold {
        shrink(pipeline).await?;
    }
    match probe_render(pipeline, meter, Shape::new(w, h, n), config.calibration.steps, ProbeRuns::of(config)).await? {
        Ok(_) => Ok(true),
        Err(error) if crate::failure::classify_render(&error) == crate::failure::ErrorKind::Oom => {
            tracing::warn!(error = %error, "the fitness render ran out of memory; calibrating against the room there is now");
            Ok(false)
        }
        Err(error) => Err(WorkerError::start(&format!("render a {w}x{h}x{n} probe"), error)),
    }
}

/// What the operator wants to see at start: the card, the room, and what one image of each
/// served class is planned to need.
fn log_budget(budget: &Budget, classes: &[shotfleet_schema::MemoryClass]) {
    let Ok(status) = budget.status() else { return };
    let terms = budget.estimate().coefficients();
    info!(
        device = %status.device,
        total_mib = status.total / budget::MIB,
        used_mib = status.used / budget::MIB,
        resident_mib = status.resident / budget::MIB,
        budget_mib = status.budget / budget::MIB,
        fixed_mib = terms.fixed / budget::MIB as f64,
        bytes_per_unit = terms.per_unit,
        bytes_per_image_latent_pixel = terms.per_pixel,
        bytes_per_image_latent_pixel_sq = terms.per_pixel_sq,
        bytes_per_unit_latent_pixel = terms.per_unit_pixel,
        "budget"
    );
    for class in classes {
        let side = class.max_pixels().map_or(budget.config().xl_max_side, |p| (p as f64).sqrt() as u32);
        info!(class = %class, side, planned_mib = budget.planned(side, side, 1) / budget::MIB, "one image of the class at its largest");
    }
}

/// The pipeline's options: on a GPU, ONNX Runtime's arena is capped at what the budget could
/// ever plan with, so the arena and the budget agree on the card's size
/// ([`BudgetConfig::arena_limit`](budget::BudgetConfig::arena_limit)); on the CPU, so is the
/// capped arena under `[budget] max_mib`, as it would be on a card of that size. The text
/// encoders go where `text_encoders` says, judged on the same room.
fn pipeline_options(config: &WorkerConfig, before: &GpuSnapshot) -> PipelineOptions {
    let room = config.budget.arena_limit(before.clone());
    let share_limit = config.budget.max_mib.map(|_| room);
    let text_encoders_on_cpu = config.text_encoders.on_cpu(config.device, room);
    let unet_sessions = config.unet_sessions.count(config.device, config.concurrency, room);
    if unet_sessions > 1 {
        info!(room_mib = room / budget::MIB, sessions = unet_sessions, setting = ?config.unet_sessions, "a UNet session per render slot");
    }
    if text_encoders_on_cpu {
        info!(room_mib = room / budget::MIB, setting = ?config.text_encoders, "the text encoders run on the CPU");
    }
    let device = match config.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => {
            let mut limit = room;
            if let Some(mib) = config.faults.arena_limit_mib {
                tracing::warn!(arena_limit_mib = mib, budget_cap_mib = limit / budget::MIB, "fault injection: the CUDA arena is capped below what the budget plans with");
                limit = limit.min(mib * budget::MIB);
            }
            Device::Cuda { gpu: config.gpu, mem_limit_bytes: Some(limit), cuda: config.cuda }
        }
    };
    PipelineOptions {
        device,
        intra_threads: config.intra_threads,
        cpu_arena_max_mem: [config.cpu_arena_max_mib.map(|mib| mib * budget::MIB), share_limit].into_iter().flatten().min(),
        vae_keeps_arena: config.budget.vae_keeps_arena,
        text_encoders_on_cpu,
        // One per render slot: every render, probe and shrink runs on these (worker/run_thread.rs).
        run_threads: config.concurrency,
        unet_sessions,
        ..PipelineOptions::default()
    }
}

/// One probe render of `shape`, returning its peak memory above the models. `runs.cold`: the
/// arenas are shrunk first, so the probe starts from the models alone and its peak is its own
/// (an arena holding a smaller probe's regions would add them to a larger one's). The render
/// itself runs as a job's does ([`probe_render`]), as a worker's first job of the shape.
pub(crate) async fn measure(pipeline: &Arc<Pipeline>, meter: &Arc<PeakMeter>, shape: Shape, steps: u32, runs: ProbeRuns) -> Result<ProbeRender, WorkerError> {
    if runs.cold {
        shrink(pipeline).await?;
    }
    let what = format!("render a {}x{}x{} probe", shape.width, shape.height, shape.images);
    probe_render(pipeline, meter, shape, steps, runs).await?.map_err(|e| WorkerError::start(&what, e))
}

/// Gives every arena's free regions back before (or between) probes (see
/// `Pipeline::shrink_arenas`).
pub(crate) async fn shrink(pipeline: &Arc<Pipeline>) -> Result<(), WorkerError> {
    let pipeline = pipeline.clone();
    waiting_on_run_threads(move || pipeline.shrink_arenas())
        .await
        .map_err(|e| WorkerError::start("run the arena shrink", e))?
        .map_err(|e| WorkerError::start("shrink the arenas around a probe", e))
}

/// How a probe renders: as the worker's jobs will, so that its need is theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProbeRuns {
    /// Started from shrunk arenas, shrunk again after it and the floor read
    /// (`[calibration] cold`).
    pub cold: bool,
    /// Its last UNet run gives the UNet's arena back before the VAE decodes, as every job's
    /// render does under `[budget] cold_renders`. Without it a render's peak is the UNet's
    /// batch and the decode together, which is what a job needs where the arenas are kept.
    pub unet_gives_back: bool,
}

impl ProbeRuns {
    /// The probes of a worker run with `config`.
    pub(crate) fn of(config: &WorkerConfig) -> Self {
        Self { cold: config.calibration.cold, unet_gives_back: config.budget.cold_renders }
    }

    /// The same, `cold` as given (the budget check's repeated renders).
    pub(crate) fn with_cold(self, cold: bool) -> Self {
        Self { cold, ..self }
    }
}

/// One probe render of `shape` from the arenas as they are, and its peak above the models; the
/// render's own error (out of memory, say) for the caller to judge. The render runs as `runs`
/// says a job's does: where jobs give the UNet's arena back before the decode, a probe that
/// kept it read the batch and the decode together, 10-45% above every job of its shape
/// (deploy/gpu/RESULTS.md, "the UNet's arena through the decode"). A cold probe (started from
/// shrunk arenas) has the arenas shrunk again after it and the process read
/// ([`PeakMeter::note_floor`]): its need is its peak above that floor, without the kernels it
/// loaded for good, as a later render of the shape needs it.
///
/// # Errors
/// The outer error: the peak could not be measured.
pub(crate) async fn probe_render(
    pipeline: &Arc<Pipeline>,
    meter: &Arc<PeakMeter>,
    shape: Shape,
    steps: u32,
    runs: ProbeRuns,
) -> Result<Result<ProbeRender, RenderError>, WorkerError> {
    if runs.unet_gives_back {
        pipeline.request_arena_shrink();
    }
    let (render_pipeline, render_meter) = (pipeline.clone(), meter.clone());
    let request = RenderRequest {
        prompt: "calibration: a lighthouse on a cliff".into(),
        negative_prompt: Some("blurry".into()),
        width: shape.width,
        height: shape.height,
        steps,
        guidance: 5.0,
        seed: 0,
        image_indices: (0..shape.images).collect(),
        max_batch: shape.images as usize,
    };
    let (rendered, measured) =
        on_run_thread(pipeline, move || render_meter.measure(|| render_pipeline.render(&request, &mut |_| std::ops::ControlFlow::Continue(()))))
            .await
            .map_err(|e| WorkerError::start("run a probe render", e))?;
    let timings = match rendered {
        Ok(output) => output.timings,
        Err(e) => return Ok(Err(e)),
    };
    let measured = measured.map_err(|e| WorkerError::start("measure a probe render", e))?;
    if runs.cold {
        shrink(pipeline).await?;
        meter.note_floor().map_err(|e| WorkerError::start("read the GPU after a probe", e))?;
    }
    let floor = meter.floor();
    Ok(Ok(ProbeRender { peak: measured.need_over(floor).0, above_models: measured.peak, floor, timings }))
}

/// A probe render's need, bytes (its peak above the floor: see [`PeakMeter`]), and where its
/// time went.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeRender {
    pub peak: u64,
    /// The peak above the post-load baseline, the floor included.
    pub above_models: u64,
    /// What the process held outside its arenas after the probe, above the baseline.
    pub floor: u64,
    pub timings: crate::pipeline::StageTimings,
}

/// Runs blocking work (ONNX Runtime) off the async threads.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, WorkerError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| WorkerError::start("run a blocking task", e))
}
