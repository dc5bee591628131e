//! The SDXL render pipeline on ONNX Runtime: text to PNG, proven against diffusers.
//!
//! A [`Pipeline`] loads a model folder in Hugging Face Optimum's SDXL ONNX layout once and then
//! renders [`RenderRequest`]s. It knows nothing of NATS, budgets or storage: the worker calls
//! [`Pipeline::render`] from a blocking thread and decides what errors mean.
//!
//! One file per part, in the order a render goes through them:
//! - [`tokenizer`]: the two CLIP BPE tokenizers, from `vocab.json` + `merges.txt`;
//! - [`text_encoder`]: prompt embeddings (penultimate layers of both encoders) and pooled embeds;
//! - [`noise`]: initial noise per (seed, image index);
//! - [`scheduler`]: Euler discrete as diffusers computes it;
//! - `unet`: the denoising loop with classifier-free guidance;
//! - `vae`: latents to pixels;
//! - [`image`]: pixels to uint8 as diffusers, PNG with parameters;
//! - `model` and `session`: the folder's files and configs, ONNX Runtime sessions.

mod error;
pub mod image;
mod model;
pub mod noise;
pub mod scheduler;
mod session;
pub mod text_encoder;
pub mod tokenizer;
mod unet;
mod vae;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub use error::{LoadError, RenderError, Stage};
pub use text_encoder::PromptEmbeds;

use model::FolderConfig;
use scheduler::{EulerDiscrete, Schedule};
use session::Elem;
use text_encoder::TextEncoders;
use unet::{Conditioning, Denoise, Unet};
use vae::VaeDecoder;

/// Where the graphs run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA execution provider (needs the `cuda` feature). `mem_limit_bytes` caps ONNX Runtime's
    /// arena on that GPU (`gpu_mem_limit`): the worker's budget.
    Cuda { gpu: u32, mem_limit_bytes: Option<u64> },
}

/// How to load a pipeline.
#[derive(Debug, Clone, Default)]
pub struct PipelineOptions {
    pub device: Device,
    /// A hard cap on the CPU arena, to provoke real out-of-memory errors in tests. Not implemented
    /// yet: loading with `Some` is refused rather than silently uncapped.
    pub cpu_arena_max_mem: Option<u64>,
    /// Threads per graph on the CPU (ONNX Runtime's default: one per core).
    pub intra_threads: Option<usize>,
    /// The ONNX Runtime library (`libonnxruntime.so.1.31.1`); `ORT_DYLIB_PATH` when `None`.
    /// The first pipeline of a process loads it; later ones share it.
    pub ort_library: Option<PathBuf>,
}

/// One text-to-image job, or part of one.
#[derive(Debug, Clone)]
pub struct RenderRequest {
    pub prompt: String,
    /// `None` or empty: zero negative conditioning when the model says
    /// `force_zeros_for_empty_prompt` (SDXL does). Note diffusers zeroes only for `None` and
    /// encodes an explicit `""`; here both mean "no negative prompt".
    pub negative_prompt: Option<String>,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    /// Classifier-free guidance scale; at or below 1 the negative half is not computed.
    pub guidance: f32,
    pub seed: u64,
    /// Which images of the job to render; each one's noise depends only on (seed, index).
    pub image_indices: Vec<u32>,
    /// Images per UNet sub-batch (the guidance batch is twice this).
    pub max_batch: usize,
}

#[derive(Debug, Clone)]
pub struct RenderedImage {
    pub index: u32,
    pub seed: u64,
    pub width: u32,
    pub height: u32,
    pub png: Vec<u8>,
}

/// Wall time per stage, summed over sub-batches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimings {
    pub text_encode: Duration,
    pub unet: Duration,
    pub vae: Duration,
    pub png: Duration,
}

#[derive(Debug, Clone)]
pub struct RenderOutput {
    pub images: Vec<RenderedImage>,
    pub timings: StageTimings,
}

/// Reported after every UNet step. Returning `ControlFlow::Break` from the callback stops the
/// render with [`RenderError::Cancelled`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepProgress {
    /// 1-based step within the current sub-batch.
    pub step: u32,
    pub steps: u32,
    /// Images in the current sub-batch.
    pub images: u32,
    /// Images of the request finished before this sub-batch.
    pub images_done: u32,
}

/// Element type of the model's UNet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelDtype {
    F32,
    F16,
}

#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The folder's name.
    pub name: String,
    pub dtype: ModelDtype,
    pub latent_channels: usize,
    /// Pixels per latent element along a side (8 for SDXL); sizes must be multiples of it.
    pub vae_scale_factor: u32,
    /// ONNX Runtime's version as the library reports it.
    pub ort_version: String,
    pub device: Device,
}

/// Intermediate tensors of a render, for parity tests against diffusers.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub prompt_embeds: Option<PromptEmbeds>,
    /// The negative conditioning actually used (zeros when forced), `None` without guidance.
    pub negative_prompt_embeds: Option<PromptEmbeds>,
    pub add_time_ids: [f32; 6],
    pub timesteps: Vec<f32>,
    pub sigmas: Vec<f32>,
    pub init_noise_sigma: f32,
    /// Latents of all requested images `[n, c, h, w]` after each step (index 0: after step 1).
    pub latents_after_step: Vec<Vec<f32>>,
    pub latents_final: Vec<f32>,
    /// RGB bytes `[h, w, 3]` per image.
    pub images_rgb: Vec<Vec<u8>>,
}

/// A loaded model, ready to render. Sessions are created once and reused; renders through one
/// pipeline take turns graph by graph.
pub struct Pipeline {
    config: FolderConfig,
    text: TextEncoders,
    scheduler: EulerDiscrete,
    unet: Unet,
    vae: VaeDecoder,
    info: ModelInfo,
    shrink_next: AtomicBool,
}

impl Pipeline {
    /// Loads and checks the folder: every file present, every JSON valid, tokenizers matching
    /// the encoders' vocabularies, every graph loadable with the inputs and outputs the render
    /// feeds, and the encoders' widths matching what the UNet expects.
    ///
    /// # Errors
    /// [`LoadError`] naming the file at fault and what is wrong with it.
    pub fn load(model_dir: &Path, options: &PipelineOptions) -> Result<Pipeline, LoadError> {
        if options.cpu_arena_max_mem.is_some() {
            return Err(LoadError::Unsupported { detail: "cpu_arena_max_mem is not implemented yet".into() });
        }
        let config = FolderConfig::read(model_dir)?;
        let scheduler = EulerDiscrete::new(&config.scheduler).map_err(|detail| LoadError::Invalid {
            path: model_dir.join("scheduler/scheduler_config.json"),
            detail,
        })?;
        let (env, ort_version) = session::environment(options.ort_library.as_deref())?;
        let text = TextEncoders::load(&env, &config, options)?;
        let unet = Unet::load(&env, &config, options)?;
        let vae = VaeDecoder::load(&env, &config, options)?;

        // One real encode proves the encoders run and tells the conditioning widths.
        let probe = text.encode("").map_err(|e| LoadError::Graph {
            path: model_dir.join(model::TEXT_ENCODER),
            detail: format!("test encode failed: {e}"),
        })?;
        unet.check_conditioning(&probe)?;
        let latent_channels = match (unet.latent_channels, vae.latent_channels.or(config.vae_latent_channels)) {
            (Some(u), Some(v)) if u != v => {
                return Err(LoadError::Graph {
                    path: model_dir.join(model::VAE_DECODER),
                    detail: format!("takes {v} latent channels but the UNet makes {u}"),
                });
            }
            (Some(c), _) | (None, Some(c)) => c,
            (None, None) => 4,
        };
        let info = ModelInfo {
            name: config.name.clone(),
            dtype: if unet_sample_elem(&unet) == Elem::F16 { ModelDtype::F16 } else { ModelDtype::F32 },
            latent_channels,
            vae_scale_factor: config.vae_scale_factor,
            ort_version,
            device: options.device.clone(),
        };
        Ok(Pipeline { config, text, scheduler, unet, vae, info, shrink_next: AtomicBool::new(false) })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Asks ONNX Runtime to give the arena's free chunks back to the device at the end of the next
    /// render's last UNet and VAE runs (run option `memory.enable_memory_arena_shrinkage`). Call
    /// it after an unusually large job.
    pub fn request_arena_shrink(&self) {
        self.shrink_next.store(true, Ordering::Relaxed);
    }

    /// Token ids of both tokenizers for `text`, padded to 77.
    ///
    /// # Errors
    /// The tokenizer's message.
    pub fn token_ids(&self, text: &str) -> Result<(Vec<u32>, Vec<u32>), RenderError> {
        self.text.token_ids(text).map_err(RenderError::Tokenize)
    }

    /// The conditioning of one prompt.
    ///
    /// # Errors
    /// As [`Pipeline::render`], stage text_encode.
    pub fn encode_prompt(&self, text: &str) -> Result<PromptEmbeds, RenderError> {
        self.text.encode(text)
    }

    /// The schedule a render with `steps` steps uses.
    pub fn schedule(&self, steps: u32) -> Schedule {
        self.scheduler.plan(steps)
    }

    /// Renders the requested images, `max_batch` at a time.
    ///
    /// # Errors
    /// [`RenderError`]: an invalid request, ONNX Runtime's error (code and message kept), or
    /// [`RenderError::Cancelled`] when `on_step` breaks.
    pub fn render(
        &self,
        req: &RenderRequest,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<RenderOutput, RenderError> {
        self.render_inner(req, None, None, on_step)
    }

    /// [`Pipeline::render`] with the initial noise given (unit variance, `[n, c, h/8, w/8]` for
    /// the n requested images in order, as diffusers' `randn_tensor` would give before scaling)
    /// and every intermediate tensor captured.
    ///
    /// # Errors
    /// As [`Pipeline::render`]; also when `noise` has the wrong length.
    pub fn render_traced(
        &self,
        req: &RenderRequest,
        noise: Option<&[f32]>,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<(RenderOutput, Trace), RenderError> {
        let mut trace = Trace::default();
        let output = self.render_inner(req, noise, Some(&mut trace), on_step)?;
        Ok((output, trace))
    }

    fn render_inner(
        &self,
        req: &RenderRequest,
        noise: Option<&[f32]>,
        mut trace: Option<&mut Trace>,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<RenderOutput, RenderError> {
        let (lh, lw) = self.validate(req)?;
        let c = self.info.latent_channels;
        let per_image = c * lh * lw;
        if let Some(noise) = noise
            && noise.len() != req.image_indices.len() * per_image
        {
            return Err(RenderError::InvalidRequest(format!(
                "noise has {} values, expected {} images x {c} x {lh} x {lw}",
                noise.len(),
                req.image_indices.len()
            )));
        }
        let mut timings = StageTimings::default();

        let started = Instant::now();
        let positive = self.text.encode(&req.prompt)?;
        let guided = req.guidance > 1.0;
        let negative_text = req.negative_prompt.as_deref().filter(|n| !n.is_empty());
        let negative = match (guided, negative_text) {
            (false, _) => None,
            (true, Some(text)) => Some(self.text.encode(text)?),
            (true, None) if self.config.force_zeros_for_empty_prompt => Some(positive.zeros_like()),
            (true, None) => Some(self.text.encode("")?),
        };
        timings.text_encode = started.elapsed();

        let schedule = self.scheduler.plan(req.steps);
        let (h, w) = (req.height as f32, req.width as f32);
        let cond = Conditioning { positive: &positive, negative: negative.as_ref(), time_ids: [h, w, 0.0, 0.0, h, w] };
        if let Some(t) = trace.as_deref_mut() {
            t.prompt_embeds = Some(positive.clone());
            t.negative_prompt_embeds = negative.clone();
            t.add_time_ids = cond.time_ids;
            t.timesteps = schedule.timesteps.clone();
            t.sigmas = schedule.sigmas.clone();
            t.init_noise_sigma = schedule.init_noise_sigma;
            t.latents_after_step = vec![Vec::new(); schedule.len()];
        }

        let shrink = self.shrink_next.swap(false, Ordering::Relaxed);
        let shrink_key = match &self.info.device {
            Device::Cpu => "cpu:0".to_owned(),
            Device::Cuda { gpu, .. } => format!("gpu:{gpu}"),
        };
        let mut images = Vec::with_capacity(req.image_indices.len());
        let mut done = 0usize;
        for chunk in req.image_indices.chunks(req.max_batch) {
            let n = chunk.len();
            let mut latents = vec![0.0f32; n * per_image];
            for (k, (&index, out)) in chunk.iter().zip(latents.chunks_exact_mut(per_image)).enumerate() {
                match noise {
                    Some(noise) => out.copy_from_slice(&noise[(done + k) * per_image..(done + k + 1) * per_image]),
                    None => noise::fill_image_noise(req.seed, index, out),
                }
            }
            for x in &mut latents {
                *x *= schedule.init_noise_sigma;
            }

            let started = Instant::now();
            let run = Denoise {
                schedule: &schedule,
                guidance: req.guidance,
                latent_shape: [n, c, lh, lw],
                device: &self.info.device,
                shrink_arena: shrink,
            };
            let images_done = done as u32;
            let mut progress = |p: StepProgress| on_step(StepProgress { images_done, ..p });
            let mut capture = |i: usize, l: &[f32]| {
                if let Some(t) = trace.as_deref_mut() {
                    t.latents_after_step[i].extend_from_slice(l);
                }
            };
            self.unet.denoise(&run, &cond, &mut latents, &mut progress, &mut capture)?;
            timings.unet += started.elapsed();
            if let Some(t) = trace.as_deref_mut() {
                t.latents_final.extend_from_slice(&latents);
            }

            for (k, &index) in chunk.iter().enumerate() {
                let started = Instant::now();
                let last = shrink && k + 1 == n && done + n == req.image_indices.len();
                let decoded = self.vae.decode_one(
                    &latents[k * per_image..(k + 1) * per_image],
                    c,
                    lh,
                    lw,
                    last.then_some(shrink_key.as_str()),
                )?;
                timings.vae += started.elapsed();

                let started = Instant::now();
                if (decoded.width, decoded.height) != (req.width as usize, req.height as usize) {
                    return Err(RenderError::Output {
                        stage: Stage::Vae,
                        detail: format!("decoded {}x{}, expected {}x{}", decoded.width, decoded.height, req.width, req.height),
                    });
                }
                let rgb = image::to_rgb8(&decoded.chw, decoded.width, decoded.height);
                let meta = image::ImageMeta {
                    prompt: &req.prompt,
                    negative_prompt: negative_text,
                    steps: req.steps,
                    guidance: req.guidance,
                    seed: req.seed,
                    index,
                    width: req.width,
                    height: req.height,
                    model: &self.info.name,
                };
                let png = image::encode_png(&rgb, &meta)?;
                timings.png += started.elapsed();
                if let Some(t) = trace.as_deref_mut() {
                    t.images_rgb.push(rgb);
                }
                images.push(RenderedImage { index, seed: req.seed, width: req.width, height: req.height, png });
            }
            done += n;
        }
        Ok(RenderOutput { images, timings })
    }

    /// Checks a request against the model; returns the latent height and width.
    fn validate(&self, req: &RenderRequest) -> Result<(usize, usize), RenderError> {
        let f = self.info.vae_scale_factor;
        let invalid = |s: String| Err(RenderError::InvalidRequest(s));
        if req.width == 0 || req.height == 0 || !req.width.is_multiple_of(f) || !req.height.is_multiple_of(f) {
            return invalid(format!("size {}x{} is not a positive multiple of {f}", req.width, req.height));
        }
        if req.steps == 0 {
            return invalid("steps must be at least 1".into());
        }
        if req.image_indices.is_empty() {
            return invalid("no images requested".into());
        }
        if req.max_batch == 0 {
            return invalid("max_batch must be at least 1".into());
        }
        if !req.guidance.is_finite() {
            return invalid(format!("guidance {} is not finite", req.guidance));
        }
        Ok(((req.height / f) as usize, (req.width / f) as usize))
    }
}

fn unet_sample_elem(unet: &Unet) -> Elem {
    unet.sample_elem()
}
