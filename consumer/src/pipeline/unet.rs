//! The denoising loop: UNet calls with classifier-free guidance and Euler steps between them.
//!
//! Device residency: the conditioning (prompt embeddings `[2n, 77, 2048]`, pooled embeddings and
//! time ids) is copied to the execution provider's device once per sub-batch and stays bound
//! through an `IoBinding` for every step. The latents make the round trip each step instead:
//! guidance and the Euler update run on the host. That is a deliberate choice over a second
//! ONNX graph for the step on the device: the latents are small (4 x 128 x 128 f32 = 256 KiB per
//! image at 1024 px, two copies per step: tens of microseconds over PCIe against ~35 ms of UNet),
//! and the host step is the same code on every device, which is what makes it provably equal to
//! diffusers (tested bit-for-bit against the reference on the CPU provider).

use std::ops::ControlFlow;

use ort::environment::Environment;
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::value::DynTensor;

use super::control::Runs;
use super::error::{LoadError, RenderError, Stage};
use super::model::{FolderConfig, UNET};
use super::scheduler::Schedule;
use super::session::{ModelSession, Port, extract_f32, float_tensor, timestep_tensor};
use super::text_encoder::PromptEmbeds;
use super::{Device, PipelineOptions, StepProgress};

pub(crate) struct Unet {
    session: ModelSession,
    sample: Port,
    timestep: Port,
    encoder_hidden_states: Port,
    text_embeds: Port,
    time_ids: Port,
    output: String,
    /// Latent channels when the graph fixes them (4 for SDXL).
    pub latent_channels: Option<usize>,
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
}

impl Unet {
    pub(crate) fn load(env: &Environment, config: &FolderConfig, options: &PipelineOptions) -> Result<Unet, LoadError> {
        let session = ModelSession::load(env, &config.dir.join(UNET), options)?;
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
            .name
            .clone();
        let latent_channels = usize::try_from(sample.dims[1]).ok();
        Ok(Unet { session, sample, timestep, encoder_hidden_states, text_embeds, time_ids, output, latent_channels })
    }

    pub(crate) fn arena_stats(&self) -> Option<super::ArenaStats> {
        self.session.arena_stats()
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
            return Err(self.session.graph_err(format!(
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

        let mut session = self.session.lock();
        let mut binding = session.create_binding().map_err(err)?;
        let (device_kind, device_id) = match run.device {
            Device::Cpu => (AllocationDevice::CPU, 0),
            Device::Cuda { gpu, .. } => (AllocationDevice::CUDA, *gpu as i32),
        };
        let resident = |t: DynTensor| -> ort::Result<DynTensor> {
            if device_kind == AllocationDevice::CPU { Ok(t) } else { t.to(device_kind.clone(), device_id) }
        };

        // Conditioning: bound once, resident on the device for all steps.
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
        let ehs = resident(float_tensor(&self.encoder_hidden_states, &[batch, pos.seq_len, pos.dim], &ehs).map_err(err)?).map_err(err)?;
        let pooled = resident(float_tensor(&self.text_embeds, &[batch, pos.pooled.len()], &pooled).map_err(err)?).map_err(err)?;
        let time_ids = resident(float_tensor(&self.time_ids, &[batch, 6], &time_ids).map_err(err)?).map_err(err)?;
        binding.bind_input(self.encoder_hidden_states.name.as_str(), &ehs).map_err(err)?;
        binding.bind_input(self.text_embeds.name.as_str(), &pooled).map_err(err)?;
        binding.bind_input(self.time_ids.name.as_str(), &time_ids).map_err(err)?;
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
            binding.bind_output_to_device(self.output.as_str(), &host).map_err(err)?;

            run.runs.check(Stage::Unet)?;
            let options = run.runs.last(run.shrink_arena && i + 1 == steps);
            let outputs = session.run_binding_with_options(&binding, options).map_err(err)?;
            let (shape, out) = extract_f32(&outputs[0]).map_err(|detail| RenderError::Output { stage: Stage::Unet, detail })?;
            if shape != [batch, c, h, w] {
                return Err(RenderError::Output {
                    stage: Stage::Unet,
                    detail: format!("{} has shape {shape:?}, expected {:?}", self.output, [batch, c, h, w]),
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
            let progress = StepProgress { step: i as u32 + 1, steps: steps as u32, images: n as u32, images_done: 0 };
            if on_step(progress).is_break() {
                return Err(RenderError::Cancelled { steps_done: i as u32 + 1 });
            }
        }
        Ok(())
    }
}
