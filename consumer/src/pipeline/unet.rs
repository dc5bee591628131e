//! The denoising loop: UNet calls with classifier-free guidance and Euler steps between them.
//!
//! Device residency: the conditioning (prompt embeddings `[2n, 77, 2048]`, pooled embeddings and
//! time ids) is copied to the execution provider's device once per sub-batch and stays bound
//! through an `IoBinding` for every step. Between two UNet calls, guidance and the Euler step run
//! as a tiny graph of their own (`onnx/ops/euler_step_*.onnx`, built by `onnx/make_step_graphs.py`)
//! on the same provider, whose outputs are bound as the next call's inputs: the latents stay on the
//! device from the first step to the last and only come back for the VAE. The graph writes the
//! step exactly as diffusers does, so it agrees with the host step to the last bits that float
//! order allows (tested). The host step remains for v-prediction and for traced renders (the
//! parity tests read the latents after every step).
//!
//! Lanes (`PipelineOptions::unet_sessions`): a render holds its UNet session (and its step
//! graphs) for its whole schedule, because the `ort` binding runs a session through `&mut`. With
//! one lane, two render slots' schedules take turns and the card idles in each call's gaps between
//! kernels; with a lane per slot each slot has a session of its own (the weights once more on the
//! card) and their calls overlap. A run thread always takes the same lane
//! ([`Unet::lane`]): ONNX Runtime's CUDA provider keeps memory per session and calling thread,
//! which a thread moving between sessions would pay again on each.
//!
//! CUDA graphs (`[cuda.unet] graph`): every call of a latent shape binds the same buffers
//! (`GraphBuffers`), so the graph captured on the shape's first call replays on the addresses it
//! recorded; the step graph writes the next sample into the buffer the UNet reads, and only the
//! timestep is copied in per step. Such a session never shrinks the UNet's arena (a captured
//! graph keeps its regions): `Pipeline::shrink_arenas` then gives back the other graphs' only.

use std::ops::ControlFlow;

use std::sync::Mutex;

use ort::environment::Environment;
use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::{IoBinding, RunOptions, Session};
use ort::value::{DynTensor, DynValue, Tensor, TensorElementType};

use super::control::Runs;
use super::error::{LoadError, RenderError, Stage};
use super::model::{FolderConfig, UNET};
use super::scheduler::Schedule;
use super::session::{Elem, ModelSession, Port, extract_f32, float_tensor, timestep_tensor};
use super::text_encoder::PromptEmbeds;
use super::{Device, PipelineOptions, StepProgress};

pub(crate) struct Unet {
    /// One or more sessions of the same graph, each with its step graphs and fixed buffers.
    lanes: Vec<Lane>,
    sample: Port,
    timestep: Port,
    encoder_hidden_states: Port,
    text_embeds: Port,
    time_ids: Port,
    output: Port,
    /// Latent channels when the graph fixes them (4 for SDXL).
    pub latent_channels: Option<usize>,
    /// Whether the sessions capture CUDA graphs on their fixed buffers (`[cuda.unet] graph`).
    graphs_captured: bool,
}

/// One UNet session and what a schedule on it holds from its first step to its last.
struct Lane {
    session: ModelSession,
    /// Guidance + Euler step on the device, for the UNet's float type.
    steps: StepGraphs,
    /// Fixed buffers per latent shape when the loop binds them (`PipelineOptions::fixed_unet_buffers`).
    graphs: Option<Mutex<Vec<GraphBuffers>>>,
}

/// The guidance batch of one sub-batch: `[negative x n, positive x n]`, as diffusers concatenates
/// it, or only the positive half when guidance is off. One entry per image: images of different
/// jobs can share a sub-batch.
pub(crate) struct Conditioning<'a> {
    pub positive: Vec<&'a PromptEmbeds>,
    pub negative: Option<Vec<&'a PromptEmbeds>>,
    /// `[h, w, 0, 0, h, w]`: original size, crop top-left, target size.
    pub time_ids: [f32; 6],
}

/// Where a sub-batch stands, for progress and tracing.
pub(crate) struct Denoise<'a> {
    pub schedule: &'a Schedule,
    pub guidance: f32,
    /// `[n, c, h, w]`.
    pub latent_shape: [usize; 4],
    pub device: &'a Device,
    /// This render's run options; the last step's run shrinks the arena when `shrink_arena`.
    pub runs: &'a Runs,
    pub shrink_arena: bool,
    /// Step on the host even where the device can (traced renders read every step's latents).
    pub host_steps: bool,
    /// LoRA-merged weights, bound by initializer name for this sub-batch's calls only.
    pub overrides: &'a [(String, DynTensor)],
    /// The lane this render runs on ([`Unet::lane`]): its run thread's.
    pub lane: usize,
}

impl Lane {
    fn load(env: &Environment, path: &std::path::Path, options: &PipelineOptions) -> Result<Lane, LoadError> {
        let session = ModelSession::load_unet(env, path, options)?;
        let elem = session.require_input("sample", Some(4), true)?.elem;
        let graphs = options.fixed_buffers().then(|| Mutex::new(Vec::new()));
        Ok(Lane { steps: StepGraphs::load(env, elem, options)?, session, graphs })
    }
}

/// The step graphs for one float type: with guidance (`[uncond; text]` in) and without.
struct StepGraphs {
    guided: ModelSession,
    plain: ModelSession,
}

impl StepGraphs {
    fn load(env: &Environment, elem: Elem, options: &PipelineOptions) -> Result<StepGraphs, LoadError> {
        let (guided, plain): (&[u8], &[u8]) = match elem {
            Elem::F16 => (
                include_bytes!("../../../onnx/ops/euler_step_f16_guided.onnx"),
                include_bytes!("../../../onnx/ops/euler_step_f16_plain.onnx"),
            ),
            _ => (
                include_bytes!("../../../onnx/ops/euler_step_f32_guided.onnx"),
                include_bytes!("../../../onnx/ops/euler_step_f32_plain.onnx"),
            ),
        };
        let load = |name: &str, bytes| ModelSession::load_bytes(env, std::path::Path::new(name), bytes, options);
        Ok(StepGraphs { guided: load("onnx/ops/euler_step_guided.onnx", guided)?, plain: load("onnx/ops/euler_step_plain.onnx", plain)? })
    }
}

impl Unet {
    /// Loads `options.unet_sessions` lanes, their sessions built side by side: at least one, and
    /// no more than there are run threads to take them.
    pub(crate) fn load(env: &Environment, config: &FolderConfig, options: &PipelineOptions) -> Result<Unet, LoadError> {
        let path = config.dir.join(UNET);
        let count = options.unet_sessions.clamp(1, options.run_threads.max(1));
        let lanes = std::thread::scope(|scope| {
            let loading: Vec<_> = (0..count).map(|_| scope.spawn(|| Lane::load(env, &path, options))).collect();
            // Every load ends before one's error or panic is given: none is left running.
            let ended: Vec<_> = loading.into_iter().map(|l| l.join()).collect();
            ended.into_iter().map(|l| l.unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect::<Result<Vec<_>, _>>()
        })?;
        let session = &lanes[0].session;
        let sample = session.require_input("sample", Some(4), true)?.clone();
        let timestep = session.input("timestep").cloned().ok_or_else(|| session.graph_err("no input \"timestep\"".into()))?;
        if timestep.rank() > 1 {
            return Err(session.graph_err(format!("input \"timestep\" has rank {}, expected a scalar or 1-D", timestep.rank())));
        }
        let encoder_hidden_states = session.require_input("encoder_hidden_states", Some(3), true)?.clone();
        let text_embeds = session.require_input("text_embeds", Some(2), true)?.clone();
        let time_ids = session.require_input("time_ids", Some(2), true)?.clone();
        if time_ids.dims[1] >= 0 && time_ids.dims[1] != 6 {
            return Err(session.graph_err(format!("input \"time_ids\" has shape {:?}, expected [batch, 6]", time_ids.dims)));
        }
        let output = session
            .outputs
            .first()
            .filter(|o| o.rank() == 4)
            .ok_or_else(|| session.graph_err("expected one 4-D output (out_sample)".into()))?
            .clone();
        let latent_channels = usize::try_from(sample.dims[1]).ok();
        let graphs_captured = options.captures_graphs();
        Ok(Unet { lanes, sample, timestep, encoder_hidden_states, text_embeds, time_ids, output, latent_channels, graphs_captured })
    }

    /// Lane `i`, as `Pipeline::lane` picks it: run thread `i` of the pipeline's pool always takes
    /// lane `i % lanes` (so with a lane per slot, two renders in flight never share one), any
    /// other thread the first.
    fn lane(&self, i: usize) -> &Lane {
        &self.lanes[i]
    }

    /// How many sessions of the graph are loaded.
    pub(crate) fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Every lane's session, the first first.
    pub(crate) fn sessions(&self) -> impl Iterator<Item = &ModelSession> {
        self.lanes.iter().map(|lane| &lane.session)
    }

    /// The first lane's session.
    pub(crate) fn session(&self) -> &ModelSession {
        &self.lanes[0].session
    }

    /// A lane's session no render holds now, else the first: what LoRA sets are allocated
    /// through, so that placing one does not wait for a schedule on another lane to end. Every
    /// lane binds every set: they are device memory of the one card.
    pub(crate) fn idle_session(&self) -> &ModelSession {
        self.sessions().find(|s| s.is_idle()).unwrap_or_else(|| self.session())
    }

    pub(crate) fn sample_elem(&self) -> super::session::Elem {
        self.sample.elem
    }

    /// The conditioning dimensions the graph expects (`encoder_hidden_states` last axis and
    /// `text_embeds` last axis) where it fixes them.
    pub(crate) fn check_conditioning(&self, embeds: &PromptEmbeds) -> Result<(), LoadError> {
        let want_dim = self.encoder_hidden_states.dims[2];
        let want_pooled = self.text_embeds.dims[1];
        if (want_dim >= 0 && want_dim as usize != embeds.dim) || (want_pooled >= 0 && want_pooled as usize != embeds.pooled.len()) {
            return Err(self.session().graph_err(format!(
                "expects encoder_hidden_states [.., .., {want_dim}] and text_embeds [.., {want_pooled}], but the text encoders give {} and {}",
                embeds.dim,
                embeds.pooled.len()
            )));
        }
        Ok(())
    }

    /// Runs the whole schedule on `latents` (`[n, c, h, w]`, already scaled by
    /// `init_noise_sigma`) in place. `on_latents` sees the latents after every step (tracing);
    /// `on_step` may stop the loop.
    pub(crate) fn denoise(
        &self,
        run: &Denoise<'_>,
        cond: &Conditioning<'_>,
        latents: &mut [f32],
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
        on_latents: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), RenderError> {
        let err = run.runs.err(Stage::Unet);
        let [n, c, h, w] = run.latent_shape;
        let guided = cond.negative.is_some();
        let batch = if guided { 2 * n } else { n };
        let per_image = c * h * w;

        let lane = self.lane(run.lane);
        let mut session = lane.session.lock();
        let place = Place::of(run.device);

        // Conditioning, in the guidance batch's order, on the host.
        if cond.positive.len() != n || cond.negative.as_ref().is_some_and(|neg| neg.len() != n) {
            return Err(RenderError::InvalidRequest(format!("conditioning for {} images, latents for {n}", cond.positive.len())));
        }
        let pos = cond.positive[0];
        let mut ehs = Vec::with_capacity(batch * pos.embeds.len());
        let mut pooled = Vec::with_capacity(batch * pos.pooled.len());
        let halves: Vec<&Vec<&PromptEmbeds>> = match &cond.negative {
            Some(neg) => vec![neg, &cond.positive],
            None => vec![&cond.positive],
        };
        for half in halves {
            for embeds in half {
                ehs.extend_from_slice(&embeds.embeds);
                pooled.extend_from_slice(&embeds.pooled);
            }
        }
        let time_ids: Vec<f32> = (0..batch).flat_map(|_| cond.time_ids).collect();
        let conditioning = [
            float_tensor(&self.encoder_hidden_states, &[batch, pos.seq_len, pos.dim], &ehs).map_err(err)?,
            float_tensor(&self.text_embeds, &[batch, pos.pooled.len()], &pooled).map_err(err)?,
            float_tensor(&self.time_ids, &[batch, 6], &time_ids).map_err(err)?,
        ];

        let device_steps = !run.host_steps && run.schedule.device_step_params(0, run.guidance).is_some();
        let step_graph = if guided { &lane.steps.guided } else { &lane.steps.plain };
        // A session that captures CUDA graphs runs every call under a graph id: the fixed
        // buffers' own where this shape has them, -1 (no graph) for everything else.
        let mut uncaptured = None;
        if let Some(graphs) = &lane.graphs {
            // A captured graph replays the weight addresses of its capture: renders with a LoRA
            // set run uncaptured on a capturing session.
            let capturable = !self.graphs_captured || run.overrides.is_empty();
            if device_steps && run.schedule.len() >= MIN_STEPS_TO_CAPTURE && capturable {
                let key = GraphKey { batch, c, h, w, seq_len: pos.seq_len, dim: pos.dim, pooled: pos.pooled.len() };
                let mut graphs = graphs.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(buffers) = self.graph_buffers(&mut graphs, key, &session, &place).map_err(err)? {
                    return self.steps_captured(&mut session, buffers, (step_graph, batch), run, &place, &conditioning, latents, on_step);
                }
            }
            if self.graphs_captured {
                uncaptured = Some(run.runs.for_graph(-1)?);
            }
        }
        let options = |is_last: bool| match &uncaptured {
            Some(options) => options.as_ref(),
            None => run.runs.last(run.shrink_arena && is_last),
        };

        // Conditioning: bound once, resident on the device for all steps.
        let mut binding = session.create_binding().map_err(err)?;
        bind_overrides(&mut binding, run).map_err(err)?;
        let [ehs, pooled, time_ids] = conditioning;
        binding.bind_input(self.encoder_hidden_states.name.as_str(), &place.resident(ehs).map_err(err)?).map_err(err)?;
        binding.bind_input(self.text_embeds.name.as_str(), &place.resident(pooled).map_err(err)?).map_err(err)?;
        binding.bind_input(self.time_ids.name.as_str(), &place.resident(time_ids).map_err(err)?).map_err(err)?;
        if device_steps {
            return self.steps_on_device(&mut session, &mut binding, (step_graph, batch), run, &place, &options, latents, on_step);
        }

        // The noise prediction comes back to host memory for the step.
        let host = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default).map_err(err)?;

        let steps = run.schedule.len();
        let mut model_input = vec![0.0f32; batch * per_image];
        let mut noise_pred = vec![0.0f32; n * per_image];
        for i in 0..steps {
            let t = run.schedule.timesteps[i];
            // latent_model_input = scale_model_input(cat([latents] * 2))
            for copy in model_input.chunks_exact_mut(n * per_image) {
                run.schedule.scale_model_input(i, latents, copy);
            }
            let sample = float_tensor(&self.sample, &[batch, c, h, w], &model_input).map_err(err)?;
            let timestep = timestep_tensor(&self.timestep, t, batch).map_err(err)?;
            binding.bind_input(self.sample.name.as_str(), &sample).map_err(err)?;
            binding.bind_input(self.timestep.name.as_str(), &timestep).map_err(err)?;
            binding.bind_output_to_device(self.output.name.as_str(), &host).map_err(err)?;

            run.runs.check(Stage::Unet)?;
            let outputs = session.run_binding_with_options(&binding, options(i + 1 == steps)).map_err(err)?;
            let (shape, out) = extract_f32(&outputs[0]).map_err(|detail| RenderError::Output { stage: Stage::Unet, detail })?;
            if shape != [batch, c, h, w] {
                return Err(RenderError::Output {
                    stage: Stage::Unet,
                    detail: format!("{} has shape {shape:?}, expected {:?}", self.output.name, [batch, c, h, w]),
                });
            }
            drop(outputs);
            if guided {
                // noise_pred_uncond + guidance * (noise_pred_text - noise_pred_uncond)
                let (uncond, text) = out.split_at(n * per_image);
                for ((p, &u), &t) in noise_pred.iter_mut().zip(uncond).zip(text) {
                    *p = u + run.guidance * (t - u);
                }
            } else {
                noise_pred.copy_from_slice(&out);
            }
            run.schedule.step(i, &noise_pred, latents);
            on_latents(i, latents);
            if let Some(stop) = progress(run, i, n, on_step) {
                return Err(stop);
            }
        }
        Ok(())
    }

    /// The loop with the latents resident on the device: each UNet call's output feeds the step
    /// graph (`graph`, for a UNet batch of `batch`), whose outputs are the next call's sample and
    /// the new latents.
    #[allow(clippy::too_many_arguments)]
    fn steps_on_device<'o>(
        &self,
        session: &mut Session,
        binding: &mut IoBinding,
        (graph, batch): (&ModelSession, usize),
        run: &Denoise<'_>,
        place: &Place,
        options: &dyn Fn(bool) -> &'o RunOptions,
        latents: &mut [f32],
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<(), RenderError> {
        let err = run.runs.err(Stage::Unet);
        let n = run.latent_shape[0];
        let device = place.memory().map_err(err)?;
        let mut sample = place.resident(self.first_sample(run, batch, latents)?).map_err(err)?.into_dyn();
        let mut current = resident_latents(run, place, latents)?;
        let mut step_session = graph.lock();
        let mut step_binding = step_session.create_binding().map_err(err)?;
        let steps = run.schedule.len();
        for i in 0..steps {
            let timestep = timestep_tensor(&self.timestep, run.schedule.timesteps[i], batch).map_err(err)?;
            binding.bind_input(self.sample.name.as_str(), &sample).map_err(err)?;
            binding.bind_input(self.timestep.name.as_str(), &timestep).map_err(err)?;
            binding.bind_output_to_device(self.output.name.as_str(), &device).map_err(err)?;
            run.runs.check(Stage::Unet)?;
            let mut outputs = session.run_binding_with_options(binding, options(i + 1 == steps)).map_err(err)?;
            let noise = outputs.remove(self.output.name.as_str()).ok_or_else(|| missing(&self.output.name))?;
            drop(outputs);

            step_binding.bind_input("noise_pred", &noise).map_err(err)?;
            step_binding.bind_output_to_device("sample_next", &device).map_err(err)?;
            let mut stepped = self.step(&mut step_session, &mut step_binding, run, i, &current, &device)?;
            current = stepped.remove("latents_next").ok_or_else(|| missing("latents_next"))?;
            sample = stepped.remove("sample_next").ok_or_else(|| missing("sample_next"))?;
            drop(stepped);
            if let Some(stop) = progress(run, i, n, on_step) {
                return Err(stop);
            }
        }
        read_back(run, current, latents)
    }

    /// The loop on one shape's fixed buffers, replaying the CUDA graph captured on the shape's
    /// first call (on the CPU, or with `[cuda.unet] graph` off, the same loop without a graph). Each
    /// step copies only the timestep in; the step graph writes the next sample into the buffer
    /// the UNet reads.
    #[allow(clippy::too_many_arguments)]
    fn steps_captured(
        &self,
        session: &mut Session,
        buffers: &mut GraphBuffers,
        (graph, batch): (&ModelSession, usize),
        run: &Denoise<'_>,
        place: &Place,
        conditioning: &[DynTensor; 3],
        latents: &mut [f32],
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<(), RenderError> {
        let err = run.runs.err(Stage::Unet);
        let n = run.latent_shape[0];
        let [ehs, pooled, time_ids] = conditioning;
        ehs.copy_into(&mut buffers.encoder_hidden_states).map_err(err)?;
        pooled.copy_into(&mut buffers.text_embeds).map_err(err)?;
        time_ids.copy_into(&mut buffers.time_ids).map_err(err)?;
        self.first_sample(run, batch, latents)?.copy_into(&mut buffers.sample).map_err(err)?;

        let mut binding = session.create_binding().map_err(err)?;
        bind_overrides(&mut binding, run).map_err(err)?;
        binding.bind_input(self.encoder_hidden_states.name.as_str(), &buffers.encoder_hidden_states).map_err(err)?;
        binding.bind_input(self.text_embeds.name.as_str(), &buffers.text_embeds).map_err(err)?;
        binding.bind_input(self.time_ids.name.as_str(), &buffers.time_ids).map_err(err)?;
        binding.bind_input(self.sample.name.as_str(), &buffers.sample).map_err(err)?;
        binding.bind_input(self.timestep.name.as_str(), &buffers.timestep).map_err(err)?;
        binding.bind_output(self.output.name.as_str(), &mut buffers.noise).map_err(err)?;
        // Captured: every call names its graph and never shrinks (the graph keeps its arena's
        // addresses). Uncaptured (the CPU, or fixed buffers alone): the plain loop's options.
        let captured = if self.graphs_captured { Some(run.runs.for_graph(buffers.id)?) } else { None };

        let device = place.memory().map_err(err)?;
        let mut current = resident_latents(run, place, latents)?;
        let mut step_session = graph.lock();
        let mut step_binding = step_session.create_binding().map_err(err)?;
        step_binding.bind_input("noise_pred", &buffers.noise).map_err(err)?;
        step_binding.bind_output("sample_next", &mut buffers.sample).map_err(err)?;
        let steps = run.schedule.len();
        for i in 0..steps {
            timestep_tensor(&self.timestep, run.schedule.timesteps[i], batch).map_err(err)?.copy_into(&mut buffers.timestep).map_err(err)?;
            run.runs.check(Stage::Unet)?;
            let options = captured.as_deref().unwrap_or_else(|| run.runs.last(run.shrink_arena && i + 1 == steps));
            drop(session.run_binding_with_options(&binding, options).map_err(err)?);
            let mut stepped = self.step(&mut step_session, &mut step_binding, run, i, &current, &device)?;
            current = stepped.remove("latents_next").ok_or_else(|| missing("latents_next"))?;
            drop(stepped);
            if let Some(stop) = progress(run, i, n, on_step) {
                return Err(stop);
            }
        }
        read_back(run, current, latents)
    }

    /// One guidance + Euler step on the device; `step_binding` has `noise_pred` and
    /// `sample_next` bound. Returns the step graph's outputs (`latents_next`, and
    /// `sample_next` unless it is bound to a buffer).
    fn step<'b>(
        &self,
        step_session: &'b mut Session,
        step_binding: &'b mut IoBinding,
        run: &Denoise<'_>,
        i: usize,
        current: &DynValue,
        device: &MemoryInfo,
    ) -> Result<ort::session::SessionOutputs<'b>, RenderError> {
        let err = run.runs.err(Stage::Unet);
        let params = run.schedule.device_step_params(i, run.guidance).expect("checked before the loop");
        let params = Tensor::from_array((vec![4usize], params.to_vec())).map_err(err)?;
        step_binding.bind_input("latents", current).map_err(err)?;
        step_binding.bind_input("params", &params).map_err(err)?;
        step_binding.bind_output_to_device("latents_next", device).map_err(err)?;
        step_session.run_binding(step_binding).map_err(err)
    }

    /// The first call's sample: the latents scaled for step 0, once per guidance half.
    fn first_sample(&self, run: &Denoise<'_>, batch: usize, latents: &[f32]) -> Result<DynTensor, RenderError> {
        let [n, c, h, w] = run.latent_shape;
        let mut first = vec![0.0f32; batch * c * h * w];
        for copy in first.chunks_exact_mut(n * c * h * w) {
            run.schedule.scale_model_input(0, latents, copy);
        }
        float_tensor(&self.sample, &[batch, c, h, w], &first).map_err(run.runs.err(Stage::Unet))
    }

    /// The fixed buffers for `key`, made on its first use; `None` once [`MAX_GRAPHS`] shapes
    /// have theirs (a captured graph cannot be given back, so later shapes run uncaptured).
    fn graph_buffers<'g>(
        &self,
        graphs: &'g mut Vec<GraphBuffers>,
        key: GraphKey,
        session: &Session,
        place: &Place,
    ) -> ort::Result<Option<&'g mut GraphBuffers>> {
        if let Some(k) = graphs.iter().position(|g| g.key == key) {
            return Ok(Some(&mut graphs[k]));
        }
        if graphs.len() == MAX_GRAPHS {
            return Ok(None);
        }
        let allocator = place.allocator(session)?;
        let tensor = |port: &Port, shape: &[usize]| -> ort::Result<DynTensor> {
            let elem = match port.elem {
                Elem::F16 => TensorElementType::Float16,
                Elem::F32 => TensorElementType::Float32,
                Elem::I32 => TensorElementType::Int32,
                Elem::I64 => TensorElementType::Int64,
            };
            DynTensor::new(&allocator, elem, shape.to_vec())
        };
        let GraphKey { batch, c, h, w, seq_len, dim, pooled } = key;
        let timestep_shape: Vec<usize> = if self.timestep.rank() == 0 { vec![] } else { vec![batch] };
        let buffers = GraphBuffers {
            key,
            id: graphs.len() as i32,
            sample: tensor(&self.sample, &[batch, c, h, w])?,
            timestep: tensor(&self.timestep, &timestep_shape)?,
            encoder_hidden_states: tensor(&self.encoder_hidden_states, &[batch, seq_len, dim])?,
            text_embeds: tensor(&self.text_embeds, &[batch, pooled])?,
            time_ids: tensor(&self.time_ids, &[batch, 6])?,
            noise: tensor(&self.output, &[batch, c, h, w])?,
            _allocator: allocator,
        };
        graphs.push(buffers);
        Ok(graphs.last_mut())
    }
}

/// Renders shorter than this run uncaptured: probe renders (2 steps) and the 1-step render that
/// shrinks the arenas would pay a capture and take a graph slot for a shape jobs may never ask.
const MIN_STEPS_TO_CAPTURE: usize = 3;

/// Latent shapes that get their own captured graph (each graph keeps its fixed buffers, a few
/// MiB); a fleet serves a handful of sizes.
const MAX_GRAPHS: usize = 8;

/// What fixes a UNet call's buffers: the guidance batch, the latent, the conditioning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GraphKey {
    batch: usize,
    c: usize,
    h: usize,
    w: usize,
    seq_len: usize,
    dim: usize,
    pooled: usize,
}

/// One shape's inputs and output at fixed addresses: a CUDA graph replays the addresses of its
/// capture, so every call of the shape binds these and only their contents change.
struct GraphBuffers {
    key: GraphKey,
    /// `gpu_graph_id` of this shape's graph.
    id: i32,
    sample: DynTensor,
    timestep: DynTensor,
    encoder_hidden_states: DynTensor,
    text_embeds: DynTensor,
    time_ids: DynTensor,
    noise: DynTensor,
    /// Declared last: dropped after the tensors it allocated.
    _allocator: Allocator,
}

/// The device a render's tensors live on.
#[derive(Debug, Clone)]
struct Place {
    device: AllocationDevice<'static>,
    id: i32,
}

impl Place {
    fn of(device: &Device) -> Place {
        match device {
            Device::Cpu => Place { device: AllocationDevice::CPU, id: 0 },
            Device::Cuda { gpu, .. } => Place { device: AllocationDevice::CUDA, id: *gpu as i32 },
        }
    }

    fn is_host(&self) -> bool {
        self.device == AllocationDevice::CPU
    }

    /// `t` copied to the device (itself on the CPU).
    fn resident<T: ort::value::DefiniteTensorValueTypeMarker + ?Sized>(&self, t: ort::value::Value<T>) -> ort::Result<ort::value::Value<T>> {
        if self.is_host() { Ok(t) } else { t.to(self.device.clone(), self.id) }
    }

    fn memory(&self) -> ort::Result<MemoryInfo<'static>> {
        MemoryInfo::new(self.device.clone(), self.id, AllocatorType::Device, MemoryType::Default)
    }

    /// The session's allocator on this device (the CPU's default one on the host).
    fn allocator(&self, session: &Session) -> ort::Result<Allocator> {
        if self.is_host() { Ok(Allocator::default()) } else { Allocator::new(session, self.memory()?) }
    }
}

/// Binds a LoRA set's merged weights in place of their initializers. Bindings are made per
/// sub-batch and dropped with it, so the next render (of another job, maybe without LoRAs) binds
/// only its own.
fn bind_overrides(binding: &mut IoBinding, run: &Denoise<'_>) -> ort::Result<()> {
    for (name, value) in run.overrides {
        binding.bind_input(name.as_str(), value)?;
    }
    Ok(())
}

fn missing(name: &str) -> RenderError {
    RenderError::Output { stage: Stage::Unet, detail: format!("no output \"{name}\"") }
}

/// Reports step `i` done; the error to return when `on_step` stops the loop.
fn progress(run: &Denoise<'_>, i: usize, n: usize, on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>) -> Option<RenderError> {
    let steps = run.schedule.len() as u32;
    let progress = StepProgress { step: i as u32 + 1, steps, images: n as u32, images_done: 0 };
    on_step(progress).is_break().then_some(RenderError::Cancelled { steps_done: i as u32 + 1 })
}

/// The latents as the step graph takes them (f32 `[n, c, h, w]`), on the render's device.
fn resident_latents(run: &Denoise<'_>, place: &Place, latents: &[f32]) -> Result<DynValue, RenderError> {
    let err = run.runs.err(Stage::Unet);
    let [n, c, h, w] = run.latent_shape;
    let host = Tensor::from_array((vec![n, c, h, w], latents.to_vec())).map_err(err)?;
    Ok(place.resident(host.upcast()).map_err(err)?.into_dyn())
}

/// The final latents back to the host for the VAE (a no-op copy on the CPU provider).
fn read_back(run: &Denoise<'_>, current: DynValue, latents: &mut [f32]) -> Result<(), RenderError> {
    let err = run.runs.err(Stage::Unet);
    let current: Tensor<f32> = current.downcast().map_err(err)?;
    let host_side = current.to(AllocationDevice::CPU, 0).map_err(err)?;
    let (_, data) = host_side.extract_tensor();
    latents.copy_from_slice(data);
    Ok(())
}
