//! The SDXL render pipeline on ONNX Runtime: text to images (PNG when stored), proven against diffusers.
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
//! - `model` and `session`: the folder's files and configs, ONNX Runtime sessions;
//! - `control`: [`CancelHandle`], stopping a render from another thread;
//! - [`lora`]: LoRA sets merged into overridable weights, their pool, and renders with them.
//!
//! # Out of memory and recovery
//!
//! An allocation failure comes back as [`RenderError::Runtime`] with ONNX Runtime's text
//! (`crate::failure` classifies it). The pipeline stays usable: ONNX Runtime frees a failed
//! run's tensors, and [`Pipeline::request_arena_shrink`] gives the arena's free regions back at
//! the end of the next render, which a fragmented arena needs before a large request fits
//! again. Where a failure did leave a session unusable, [`Pipeline::reload`] rebuilds every
//! session in place of the old ones. The in-place rungs of the degrade ladder are
//! [`RenderRequest::max_batch`] (smaller UNet batches, same images) and
//! [`RenderControl::vae_decode`] (tiled VAE decode).
//!
//! On the CPU, [`PipelineOptions::cpu_arena_max_mem`] caps the arena so tests provoke the same
//! failures for real; the cap is process-wide (see there).

mod control;
mod error;
pub mod image;
pub mod lora;
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
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use control::CancelHandle;
pub use error::{LoadError, RenderError, Stage};
pub use model::PackedWeights;
pub use session::ArenaStats;
pub use text_encoder::PromptEmbeds;

use model::FolderConfig;
use control::{Decode, Runs, Shrink};
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
    /// arena on that GPU (`gpu_mem_limit`, per session): the worker's budget.
    Cuda { gpu: u32, mem_limit_bytes: Option<u64>, cuda: CudaConfig },
}

/// The CUDA provider's options per graph: `[cuda.unet]` and `[cuda.vae]` in the worker's config.
/// The text encoders keep ONNX Runtime's defaults (they run once per render, at one shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CudaConfig {
    /// The speed options, measured on the UNet at fixed shapes (deploy/gpu/RESULTS.md).
    pub unet: CudaTuning,
    /// The VAE decoder: its convolutions over full-size images are where cuDNN's algorithm
    /// search asks for the largest workspaces (`conv_max_workspace`). `graph` is refused here.
    pub vae: CudaTuning,
}

impl CudaConfig {
    /// The options as they bear on a render's memory (the algorithms' workspaces, the memory
    /// patterns, a captured graph's buffers), e.g. "UNet heuristic search; VAE exhaustive
    /// search, workspace capped": a calibration is only good for the options it ran with.
    pub fn describe(&self) -> String {
        let graph = |name: &str, tuning: &CudaTuning| {
            let mut parts = vec![format!("{name} {} search", format!("{:?}", tuning.conv_algo_search).to_lowercase())];
            if !tuning.conv_max_workspace {
                parts.push("workspace capped".into());
            }
            if !tuning.mem_pattern {
                parts.push("no memory patterns".into());
            }
            if tuning.fuse_conv_bias {
                parts.push("bias fused".into());
            }
            if tuning.graph {
                parts.push("CUDA graph".into());
            }
            if tuning.attention != AttentionKernels::Auto {
                parts.push(format!("{:?} attention", tuning.attention).to_lowercase());
            }
            parts.join(", ")
        };
        format!("{}; {}", graph("UNet", &self.unet), graph("VAE", &self.vae))
    }
}

/// One graph's CUDA provider options. Defaults are ONNX Runtime's own, but the convolution
/// search's ([`ConvSearch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CudaTuning {
    /// How cuDNN picks convolution algorithms.
    pub conv_algo_search: ConvSearch,
    /// Let cuDNN's search and the chosen algorithms use as much workspace as the fastest
    /// algorithm wants (`cudnn_conv_use_max_workspace`, ONNX Runtime's default). During the
    /// exhaustive search of a new shape ONNX Runtime allocates from the arena the largest
    /// workspace any algorithm asks for (up to 90% of the free memory), which the arena then
    /// keeps: a first render of a new shape can peak far above later ones (+39% for a
    /// 1152x896 VAE decode on the H200). `false` caps it at ONNX Runtime's 32 MiB.
    pub conv_max_workspace: bool,
    /// Fuse a convolution's bias (and activation) into the cuDNN call. Measured only at one
    /// fixed shape; see `ModelSession::load_unet` for what happened with it on every graph.
    pub fuse_conv_bias: bool,
    /// Replay the UNet as a CUDA graph: captured on the first call of each latent shape, into
    /// fixed device buffers that later calls of that shape reuse (see `unet::GraphBuffers`).
    pub graph: bool,
    /// ONNX Runtime's memory patterns (`enable_mem_pattern`, its default): the first run of each
    /// set of input shapes allocates tensor by tensor while it records a plan, later runs
    /// allocate the plan as one block (onnxruntime/core/framework/execution_frame.cc). On the
    /// H200 a new size's first render peaked 0.55-0.6 GiB over its later ones, which fits this;
    /// `false` allocates tensor by tensor on every run (untested on a GPU so far: a lease's
    /// `check-nopattern` run measures both the peaks and the time).
    pub mem_pattern: bool,
    /// Which kernels ONNX Runtime may run the graph's fused attention on (`sdpa_kernel`).
    pub attention: AttentionKernels,
}

impl Default for CudaTuning {
    fn default() -> Self {
        Self {
            conv_algo_search: ConvSearch::default(),
            conv_max_workspace: true,
            fuse_conv_bias: false,
            graph: false,
            mem_pattern: true,
            attention: AttentionKernels::default(),
        }
    }
}

/// The attention kernels of ONNX Runtime's CUDA provider a fused `MultiHeadAttention` may use
/// (`sdpa_kernel`); each keeps ONNX Runtime's unfused kernel behind it for shapes it cannot take
/// (the VAE's single 512-wide head, for one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernels {
    /// ONNX Runtime's own choice (on the H100 with ONNX Runtime 1.31, cuDNN's flash kernel for
    /// the SDXL UNet: deploy/gpu/RESULTS.md's profile).
    #[default]
    Auto,
    /// ONNX Runtime's built-in flash attention.
    Flash,
    /// The memory-efficient (CUTLASS) kernel.
    Efficient,
    /// cuDNN's flash attention.
    Cudnn,
}

/// cuDNN's convolution algorithm search (`cudnn_conv_algo_search`).
///
/// With cuDNN 9, ONNX Runtime's CUDA convolutions go through cuDNN's frontend and keep the plan
/// of their last input shape only: every change of shape builds the plans again, with the
/// heuristic this picks, at a cost deploy/gpu/RESULTS.md has per graph and search.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConvSearch {
    /// ONNX Runtime's default: cuDNN's slower, more thorough heuristic (mode B).
    Exhaustive,
    /// cuDNN's quick heuristic (mode A), shotfleet's default for every graph: on the H200 the
    /// UNet's call is 3% faster than on `Exhaustive`, and a VAE decode after a change of size
    /// costs ~0.1-0.25 s more than one after the same size, against ~1 s on `Exhaustive`, with
    /// the same storyboard throughput in steady state and a 3.6 s shorter cold start
    /// (deploy/gpu/RESULTS.md, the leases of 2026-11-30 and 2026-12-05).
    #[default]
    Heuristic,
    /// The fixed default algorithm (slow on SDXL: 4x the UNet time on an H200).
    Default,
}

/// How to load a pipeline.
#[derive(Debug, Clone, Default)]
pub struct PipelineOptions {
    pub device: Device,
    /// A hard cap, in bytes, on the CPU arena that holds the graphs' intermediate tensors (the
    /// weights stay outside it), so that out-of-memory happens for real on the CPU: a run that
    /// needs more fails with ONNX Runtime's `BFCArena::AllocateRawInternal ... Available memory
    /// of N is smaller than requested bytes of M`, as a capped GPU arena does.
    ///
    /// Process-wide: ONNX Runtime has one environment per process and one shared CPU arena in
    /// it. The first load that sets a cap registers that arena; every later load that sets one
    /// must set the same value ([`LoadError::CpuArena`] otherwise), and its sessions share the
    /// arena with the first's. A load with `None` keeps ONNX Runtime's own uncapped arena per
    /// session. So a process that wants a cap sets it at its first load and keeps it.
    pub cpu_arena_max_mem: Option<u64>,
    /// Threads per graph on the CPU (ONNX Runtime's default: one per core).
    pub intra_threads: Option<usize>,
    /// The ONNX Runtime library (`libonnxruntime.so.1.31.1`); `ORT_DYLIB_PATH` when `None`.
    /// The first pipeline of a process loads it; later ones share it.
    pub ort_library: Option<PathBuf>,
    /// Bind the UNet's inputs and output to fixed buffers per latent shape, as CUDA graphs need.
    /// `[cuda.unet] graph` turns this on with the capture; alone (on the CPU) it runs the same
    /// buffer plumbing without one, which is how CI tests it.
    pub fixed_unet_buffers: bool,
    /// The VAE decoder keeps its arena's regions from one decode to the next, as the UNet does,
    /// instead of shrinking after every decode (vae.rs). Faster by the regions' allocation
    /// (about 60 ms per 1024x1024 image on an H200), but the decoder's peak then grows over
    /// repeated decodes by what fragmentation adds, which the budget's probes do not see.
    pub vae_keeps_arena: bool,
    /// Run both text encoders on the CPU whatever `device` is. They run once per prompt, at one
    /// shape, so moving them costs a fraction of a second a job (BENCHMARKS.md) and gives a card
    /// their weights back (1.6 GB for SDXL in float16): what lets a 12 GiB card serve at all.
    pub text_encoders_on_cpu: bool,
    /// How many long-lived threads [`Pipeline::spawn_run`] runs work on (0: one). ONNX
    /// Runtime's CUDA provider keeps memory per calling thread that it does not give back while
    /// the session lives (586-602 MiB a thread on an H200, deploy/gpu/RESULTS.md): renders on a
    /// fixed set of threads pay it once per thread, where a pool whose idle threads exit and
    /// come back as new ones pays it again each time. [`Pipeline::load`] warms every one with a
    /// tiny render, so the memory is the load's, not a later job's. A worker sets its
    /// `concurrency`.
    pub run_threads: usize,
    /// Sessions of the UNet (0: one), each taken by every `unet_sessions`-th run thread for a
    /// whole schedule (unet.rs, "Lanes"). A render holds its session from its first step to its
    /// last, so with one, renders on two threads run their UNet schedules one after the other;
    /// with one per run thread they run them at once, and each session holds the UNet's
    /// weights again on the device (5.6 GiB measured for SDXL in float16) and keeps an arena of its own.
    pub unet_sessions: usize,
}

impl PipelineOptions {
    /// The options the text encoders load with: these, or on the CPU.
    fn for_text_encoders(&self) -> PipelineOptions {
        match self.text_encoders_on_cpu {
            true => PipelineOptions { device: Device::Cpu, ..self.clone() },
            false => self.clone(),
        }
    }

    /// Whether the UNet's sessions capture CUDA graphs (`[cuda.unet] graph`).
    fn captures_graphs(&self) -> bool {
        matches!(self.device, Device::Cuda { cuda, .. } if cuda.unet.graph)
    }

    /// Whether the UNet loop binds fixed buffers: asked for, or needed by CUDA graphs.
    fn fixed_buffers(&self) -> bool {
        self.fixed_unet_buffers || self.captures_graphs()
    }
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
    /// Images per UNet sub-batch (the guidance batch is twice this). The first in-place rung of
    /// the degrade ladder: any value gives the same images.
    pub max_batch: usize,
}

/// How a render runs, beyond what it renders: the second in-place rung of the degrade ladder
/// and the handle that stops it. `Default`: whole decode, a handle nobody else holds.
#[derive(Debug, Clone, Default)]
pub struct RenderControl {
    /// Whole or tiled VAE decode (tiled: close to, not equal to, whole; less memory).
    pub vae_decode: VaeDecode,
    /// Stops the render from another thread (the worker's time limit).
    pub cancel: CancelHandle,
}

/// How the VAE turns each image's latents into pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VaeDecode {
    /// One decoder run per image: exact, and the decoder's largest activations.
    #[default]
    Whole,
    /// diffusers' `AutoencoderKL.tiled_decode`: square tiles of `tile` pixels, each overlapping
    /// the previous one by `overlap` pixels, blended linearly over the overlap. Both are
    /// multiples of the VAE factor (8) and `overlap < tile`. An image no larger than one tile is
    /// decoded whole. Peak decoder memory follows the tile instead of the image.
    Tiled { tile: u32, overlap: u32 },
}

impl VaeDecode {
    /// diffusers' settings for SDXL (`tile_sample_min_size` 1024, `tile_overlap_factor` 0.25):
    /// `tiled(1024)` gives exactly its tiles and blend.
    pub fn tiled(tile: u32) -> VaeDecode {
        VaeDecode::Tiled { tile, overlap: tile / 4 / 8 * 8 }
    }
}

/// One rendered image, as pixels. A render ends with its last decode: the PNG is made where the
/// image is stored ([`RenderedImage::encode_png`]), so the encoding (tens of milliseconds an image
/// on a CPU core) runs beside the next render instead of holding the GPU's slot.
#[derive(Debug, Clone)]
pub struct RenderedImage {
    pub index: u32,
    pub seed: u64,
    pub width: u32,
    pub height: u32,
    /// Interleaved RGB, 8 bits a channel, `[height, width, 3]`.
    pub rgb: Vec<u8>,
    /// What the PNG's text says of how it was made; shared by the request's images.
    pub recipe: Arc<image::Recipe>,
}

impl RenderedImage {
    /// The image as a PNG carrying its parameters (`image::encode_png`).
    ///
    /// # Errors
    /// The PNG encoder's error ([`RenderError::Png`]).
    pub fn encode_png(&self) -> Result<Vec<u8>, RenderError> {
        let meta = self.recipe.meta(self.seed, self.index, self.width, self.height);
        Ok(image::encode_png(&self.rgb, &meta)?)
    }
}

/// Wall time per stage, summed over sub-batches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimings {
    pub text_encode: Duration,
    pub unet: Duration,
    pub vae: Duration,
}

impl StageTimings {
    /// The render's whole time in the stages (what is outside them is bookkeeping).
    pub fn total(&self) -> Duration {
        self.text_encode + self.unet + self.vae
    }
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

/// Element type of a graph's float inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelDtype {
    F32,
    F16,
}

impl ModelDtype {
    fn of(elem: Elem) -> ModelDtype {
        if elem == Elem::F16 { ModelDtype::F16 } else { ModelDtype::F32 }
    }
}

/// Seconds [`Pipeline::load`] spent creating each part's sessions, and warming the run threads
/// (a tiny render of every graph on each).
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadTimes {
    pub text_s: f64,
    pub unet_s: f64,
    pub vae_s: f64,
    pub warm_s: f64,
}

#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The folder's name.
    pub name: String,
    /// The UNet's element type.
    pub dtype: ModelDtype,
    /// The VAE decoder's: float16 only where the folder's VAE config allows it (vae.rs).
    pub vae_dtype: ModelDtype,
    /// Whether the text encoders run on the CPU ([`PipelineOptions::text_encoders_on_cpu`]).
    pub text_encoders_on_cpu: bool,
    /// The UNet's linear weights packed into a few bits (`onnx/quantize_unet.py`), if they are.
    pub unet_packed: Option<PackedWeights>,
    /// Sessions of the UNet loaded ([`PipelineOptions::unet_sessions`], held to the run threads).
    pub unet_sessions: usize,
    pub latent_channels: usize,
    /// Pixels per latent element along a side (8 for SDXL).
    pub vae_scale_factor: u32,
    /// What an image's sides must be multiples of: the VAE's factor times what the UNet's
    /// down blocks need of a latent side (32 for SDXL, 16 for the tiny fixture).
    pub side_multiple: u32,
    /// ONNX Runtime's version as the library reports it.
    pub ort_version: String,
    pub device: Device,
}

impl ModelInfo {
    /// Whether this model renders an image side of `side` pixels: a positive multiple of
    /// [`side_multiple`](Self::side_multiple).
    pub fn renders_side(&self, side: u32) -> bool {
        side > 0 && side.is_multiple_of(self.side_multiple)
    }

    /// What is wrong with an image of `width` x `height` for this model, if anything.
    pub fn size_problem(&self, width: u32, height: u32) -> Option<String> {
        let (f, m) = (self.vae_scale_factor, self.side_multiple);
        if self.renders_side(width) && self.renders_side(height) {
            return None;
        }
        let near = |side: u32| (side / m * m).max(m);
        Some(format!(
            "size {width}x{height}: this model renders sides that are multiples of {m} ({f} pixels a latent element, and its UNet halves the latent {} times), e.g. {}x{}",
            (m / f).trailing_zeros(),
            near(width),
            near(height)
        ))
    }
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
/// pipeline take turns graph by graph, but for the UNet where it has a session per run thread
/// ([`PipelineOptions::unet_sessions`]).
pub struct Pipeline {
    config: FolderConfig,
    text: TextEncoders,
    scheduler: EulerDiscrete,
    unet: Unet,
    vae: VaeDecoder,
    info: ModelInfo,
    /// [`Pipeline::request_arena_shrink`]'s flag, one per UNet lane: each lane's next render
    /// gives its own arena back.
    shrink_next: Vec<AtomicBool>,
    /// What [`Pipeline::reload`] loads again.
    model_dir: PathBuf,
    options: PipelineOptions,
    /// Where each LoRA-targetable weight sits (empty: the model takes no LoRAs).
    lora_maps: lora::WeightMaps,
    /// Which load of the process this is: LoRA sets placed for it are bound to it.
    instance: u64,
    /// The threads [`Pipeline::spawn_run`] runs work on ([`PipelineOptions::run_threads`]);
    /// they end with the sessions whose per-thread state they carry.
    run_threads: rayon::ThreadPool,
    /// Every run thread's name, each warmed by one render while loading.
    warmed_threads: Vec<String>,
    load_times: LoadTimes,
}

/// Counts pipeline loads, so a LoRA set placed for one is never bound by another.
static INSTANCES: AtomicU64 = AtomicU64::new(0);

impl Pipeline {
    /// Loads and checks the folder: every file present, every JSON valid, tokenizers matching
    /// the encoders' vocabularies, every graph loadable with the inputs and outputs the render
    /// feeds, and the encoders' widths matching what the UNet expects.
    ///
    /// # Errors
    /// [`LoadError`] naming the file at fault and what is wrong with it.
    pub fn load(model_dir: &Path, options: &PipelineOptions) -> Result<Pipeline, LoadError> {
        let config = FolderConfig::read(model_dir)?;
        let scheduler = EulerDiscrete::new(&config.scheduler).map_err(|detail| LoadError::Invalid {
            path: model_dir.join("scheduler/scheduler_config.json"),
            detail,
        })?;
        if let Some(named) = EulerDiscrete::other_sampler(&config.scheduler) {
            tracing::warn!(
                scheduler = named,
                "the model folder names another sampler; shotfleet samples with Euler discrete on the folder's noise schedule"
            );
        }
        let (env, ort_version) = session::environment(options.ort_library.as_deref())?;
        if let Some(max_mem) = options.cpu_arena_max_mem {
            session::cap_cpu_arena(&env, max_mem)?;
        }
        let lora_maps = lora::WeightMaps::load(model_dir)?;
        let timed = Instant::now();
        let text = TextEncoders::load(&env, &config, &options.for_text_encoders())?;
        let text_s = timed.elapsed().as_secs_f64();
        let unet = Unet::load(&env, &config, options)?;
        let unet_s = timed.elapsed().as_secs_f64() - text_s;
        let vae = VaeDecoder::load(&env, &config, options)?;
        let vae_s = timed.elapsed().as_secs_f64() - text_s - unet_s;

        let run_threads = rayon::ThreadPoolBuilder::new()
            .num_threads(options.run_threads.max(1))
            .thread_name(|i| format!("onnx-run-{i}"))
            .build()
            .map_err(|e| LoadError::Threads(e.to_string()))?;

        // One real encode proves the encoders run and tells the conditioning widths; it runs on
        // a run thread like every other graph run (see `run_threads`).
        let probe = run_threads
            .install(|| {
                let runs = Runs::new(&CancelHandle::new(), Shrink::Never, &options.device).map_err(|e| format!("cannot create run options: {e}"))?;
                text.encode("", None, &runs).map_err(|e| format!("test encode failed: {e}"))
            })
            .map_err(|detail| LoadError::Run { path: model_dir.join(model::TEXT_ENCODER), detail })?;
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
        let unet_sessions = unet.lanes();
        let info = ModelInfo {
            name: config.name.clone(),
            dtype: ModelDtype::of(unet.sample_elem()),
            vae_dtype: ModelDtype::of(vae.elem()),
            text_encoders_on_cpu: options.text_encoders_on_cpu,
            unet_packed: config.unet_packed,
            unet_sessions,
            latent_channels,
            vae_scale_factor: config.vae_scale_factor,
            side_multiple: config.vae_scale_factor * config.unet_side_multiple,
            ort_version,
            device: options.device.clone(),
        };
        let mut pipeline = Pipeline {
            config,
            text,
            scheduler,
            unet,
            vae,
            info,
            shrink_next: (0..unet_sessions).map(|_| AtomicBool::new(false)).collect(),
            model_dir: model_dir.to_path_buf(),
            options: options.clone(),
            lora_maps,
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
            run_threads,
            warmed_threads: Vec::new(),
            load_times: LoadTimes::default(),
        };
        let warming = Instant::now();
        pipeline.warmed_threads = pipeline.warm_run_threads()?;
        pipeline.load_times = LoadTimes { text_s, unet_s, vae_s, warm_s: warming.elapsed().as_secs_f64() };
        Ok(pipeline)
    }

    /// Runs one tiny render (as [`Pipeline::shrink_arenas`], every graph) on every run thread at
    /// once, so each thread's per-thread memory in ONNX Runtime's CUDA provider (about 588 MiB on
    /// the H200) is paid here, while loading, and counted with the models: a thread's first job would
    /// otherwise add it mid-serving, outside every estimate, and the leak guard would see it as
    /// growth. Each thread renders on its own UNet lane ([`PipelineOptions::unet_sessions`]), so
    /// every lane is warmed too. Returns the threads' names, in pool order.
    fn warm_run_threads(&self) -> Result<Vec<String>, LoadError> {
        self.run_threads
            .broadcast(|_| {
                let name = std::thread::current().name().unwrap_or("unnamed").to_owned();
                // Every graph, the decoder included: each has its per-thread memory.
                self.tiny_render(Decode::Images).map(|()| name.clone()).map_err(|e| format!("{name}: {e}"))
            })
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|detail| LoadError::Run {
                path: self.model_dir.clone(),
                detail: format!("the warm-up render on run thread {detail}"),
            })
    }

    /// How long [`Pipeline::load`] took over each part: where a cold worker's start goes.
    pub fn load_times(&self) -> LoadTimes {
        self.load_times
    }

    /// The names of the run threads, each of which has run every graph once by the time
    /// [`Pipeline::load`] returns.
    pub fn run_thread_names(&self) -> &[String] {
        &self.warmed_threads
    }

    /// Runs `work` on one of the pipeline's run threads ([`PipelineOptions::run_threads`]),
    /// queued behind the work already there; returns at once. Every graph run the caller makes
    /// through it lands on the same few threads for the pipeline's whole life. `work` must not
    /// panic: a panic there aborts the process (rayon's rule for spawned work), so catch it.
    pub fn spawn_run(&self, work: impl FnOnce() + Send + 'static) {
        self.run_threads.spawn(work);
    }

    /// Rebuilds every session from the same folder with the same options: the recovery when a
    /// failure (an arena or device error) left a session unusable, and the soft restart against
    /// slow leaks. This pipeline's sessions are dropped first, so the device never holds two
    /// copies of the weights; hence it takes `self` (a worker sharing the pipeline through an
    /// `Arc` gets it back with `Arc::into_inner` once no render holds it). The process-wide
    /// environment and its capped CPU arena, if any, stay.
    ///
    /// # Errors
    /// As [`Pipeline::load`]; the old pipeline is gone by then, so a worker that cannot load its
    /// model again should exit.
    pub fn reload(self) -> Result<Pipeline, LoadError> {
        let (model_dir, options) = (self.model_dir.clone(), self.options.clone());
        drop(self);
        Pipeline::load(&model_dir, &options)
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The UNet lane the calling thread renders on: its index in the run threads (any other
    /// thread takes the first).
    fn lane(&self) -> usize {
        self.run_threads.current_thread_index().unwrap_or(0) % self.unet.lanes()
    }

    /// Asks ONNX Runtime to give the arena's free chunks back to the device at the end of the next
    /// render's last UNet and VAE runs (run option `memory.enable_memory_arena_shrinkage`), on
    /// every UNet lane: each lane's next render gives its arena back. Call it after an unusually
    /// large job.
    pub fn request_arena_shrink(&self) {
        for lane in &self.shrink_next {
            lane.store(true, Ordering::Relaxed);
        }
    }

    /// Gives the free regions of every graph's arena back now: after an out-of-memory error a
    /// BFC arena is left holding regions cut to the failed run's sizes, and a later large
    /// request can fail on fragmentation alone. ONNX Runtime shrinks arenas only at the end of a
    /// run that asks for it, so this renders one tiny image (8x8 latents, one step, no
    /// guidance) whose every run asks.
    ///
    /// The decoder runs in it only where its arena holds more than its weights (it keeps its
    /// arena, or its last run did not end well): a decoder that gives its regions back after
    /// every decode has nothing to give here, and on a GPU each of its convolutions keeps the
    /// cuDNN plan of its last input shape only ([`ConvSearch`]), so a tiny decode between two
    /// decodes of one size would make the second plan again, about a second on SDXL. The UNet's runs
    /// here cost the next render its plans too, less, but its arena is the one to give back.
    ///
    /// The tiny renders run on the run threads and the caller waits for them, so call it from
    /// outside them (a run thread waiting here could take up other work meanwhile). With more than
    /// one UNet lane ([`PipelineOptions::unet_sessions`]) every run thread renders one, each on
    /// its own lane, so every lane's arena is given back; it returns once all have, after the
    /// renders those threads are running now.
    ///
    /// # Errors
    /// As [`Pipeline::render`].
    pub fn shrink_arenas(&self) -> Result<(), RenderError> {
        let decode = if self.vae.holds_only_weights() { Decode::Skip } else { Decode::Images };
        if self.unet.lanes() == 1 {
            return self.run_threads.install(|| self.tiny_render(decode));
        }
        self.run_threads.broadcast(|_| self.tiny_render(decode)).into_iter().collect()
    }

    /// One render of 8x8 latents, one step, no guidance, every run shrinking its arena.
    fn tiny_render(&self, decode: Decode) -> Result<(), RenderError> {
        let side = 8 * self.info.vae_scale_factor;
        let tiny = RenderRequest {
            prompt: String::new(),
            negative_prompt: None,
            width: side,
            height: side,
            steps: 1,
            guidance: 1.0,
            seed: 0,
            image_indices: vec![0],
            max_batch: 1,
        };
        let go = &mut |_| ControlFlow::Continue(());
        self.render_parts(std::slice::from_ref(&tiny), None, None, None, &RenderControl::default(), Shrink::EveryRun, decode, go)?;
        Ok(())
    }

    /// The counters of the capped CPU arena (peak bytes in use so far, extensions, shrinkages),
    /// shared by every capped pipeline of the process; `None` without
    /// [`PipelineOptions::cpu_arena_max_mem`].
    pub fn cpu_arena_stats(&self) -> Option<ArenaStats> {
        self.options.cpu_arena_max_mem?;
        self.unet.session().arena_stats_on(&Device::Cpu)
    }

    /// Each graph's arena counters on its device, by graph: what `--check-budget`
    /// prints beside a render's peak, so a peak above the estimate can be traced to a graph (or
    /// to memory outside every arena). On the CPU with a capped arena all graphs share one. The
    /// UNet's second lane and later ([`PipelineOptions::unet_sessions`]) are `unet_2`, ....
    pub fn arena_stats(&self) -> Vec<(String, Option<ArenaStats>)> {
        let [first, second] = self.text.sessions();
        let mut stats = vec![("text_encoder".to_owned(), first.arena_stats()), ("text_encoder_2".to_owned(), second.arena_stats())];
        for (i, unet) in self.unet.sessions().enumerate() {
            let name = if i == 0 { "unet".to_owned() } else { format!("unet_{}", i + 1) };
            stats.push((name, unet.arena_stats()));
        }
        stats.push(("vae_decoder".to_owned(), self.vae.session().arena_stats()));
        stats
    }

    /// Token ids of both tokenizers for `text`, padded to 77.
    ///
    /// # Errors
    /// The tokenizer's message.
    pub fn token_ids(&self, text: &str) -> Result<(Vec<u32>, Vec<u32>), RenderError> {
        self.text.token_ids(text).map_err(RenderError::Tokenize)
    }

    /// How many tokens of `text` fall past what the text encoders read: SDXL's pipeline cuts a
    /// prompt there, and so does this one (0 also when it cannot tokenize: the render says why).
    pub fn prompt_tokens_cut(&self, text: &str) -> usize {
        self.text.tokens_cut(text).unwrap_or(0)
    }

    /// The conditioning of one prompt.
    ///
    /// # Errors
    /// As [`Pipeline::render`], stage text_encode.
    pub fn encode_prompt(&self, text: &str) -> Result<PromptEmbeds, RenderError> {
        self.text.encode(text, None, &Runs::new(&CancelHandle::new(), Shrink::Never, &self.info.device)?)
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
        self.render_inner(req, None, None, &RenderControl::default(), Shrink::Requested, on_step)
    }

    /// [`Pipeline::render`] with a VAE decode mode and a [`CancelHandle`] that can stop it from
    /// another thread, also in the middle of a graph run: the worker's time limit. `on_step`
    /// can still stop it between steps.
    ///
    /// # Errors
    /// As [`Pipeline::render`]; [`RenderError::Terminated`] once `control.cancel` is cancelled;
    /// [`RenderError::InvalidRequest`] for tiles that are not multiples of the VAE factor.
    pub fn render_with(
        &self,
        req: &RenderRequest,
        control: &RenderControl,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<RenderOutput, RenderError> {
        self.render_inner(req, None, None, control, Shrink::Requested, on_step)
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
        let output = self.render_inner(req, noise, Some(&mut trace), &RenderControl::default(), Shrink::Requested, on_step)?;
        Ok((output, trace))
    }

    /// Renders several compatible jobs in shared UNet batches: same size, steps and guidance (so
    /// one schedule and one guidance scale serve them all), each with its own prompts, seed and
    /// images. Each image's noise depends only on its own (seed, index), so an image comes out the
    /// same whatever it is batched with. `max_batch` of the first request bounds the sub-batches.
    ///
    /// # Errors
    /// As [`Pipeline::render`]; also [`RenderError::InvalidRequest`] when the requests differ in
    /// size, steps or guidance.
    pub fn render_group(
        &self,
        reqs: &[RenderRequest],
        control: &RenderControl,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<Vec<RenderOutput>, RenderError> {
        self.render_parts(reqs, None, None, None, control, Shrink::Requested, Decode::Images, on_step)
    }

    fn render_inner(
        &self,
        req: &RenderRequest,
        noise: Option<&[f32]>,
        trace: Option<&mut Trace>,
        control: &RenderControl,
        shrink: Shrink,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<RenderOutput, RenderError> {
        let mut outputs = self.render_parts(std::slice::from_ref(req), noise, trace, None, control, shrink, Decode::Images, on_step)?;
        Ok(outputs.remove(0))
    }

    /// Renders `reqs` together, binding `loras` (when given) in every graph run of the render.
    #[allow(clippy::too_many_arguments)]
    fn render_parts(
        &self,
        reqs: &[RenderRequest],
        noise: Option<&[f32]>,
        mut trace: Option<&mut Trace>,
        loras: Option<&lora::ResidentSet>,
        control: &RenderControl,
        shrink: Shrink,
        decode: Decode,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<Vec<RenderOutput>, RenderError> {
        let Some(first) = reqs.first() else {
            return Err(RenderError::InvalidRequest("no requests".into()));
        };
        let (lh, lw) = self.validate(first, control)?;
        for req in &reqs[1..] {
            self.validate(req, control)?;
            if (req.width, req.height, req.steps) != (first.width, first.height, first.steps)
                || req.guidance.to_bits() != first.guidance.to_bits()
            {
                return Err(RenderError::InvalidRequest(
                    "requests rendered together must share size, steps and guidance".into(),
                ));
            }
        }
        let c = self.info.latent_channels;
        let per_image = c * lh * lw;
        let total_images: usize = reqs.iter().map(|r| r.image_indices.len()).sum();
        if let Some(noise) = noise
            && noise.len() != total_images * per_image
        {
            return Err(RenderError::InvalidRequest(format!(
                "noise has {} values, expected {total_images} images x {c} x {lh} x {lw}",
                noise.len(),
            )));
        }
        let mut timings = StageTimings::default();
        let lane = self.lane();
        // `Requested`: shrink at the end if `request_arena_shrink` asked since the last render.
        let shrink = match shrink {
            Shrink::Requested if self.shrink_next[lane].swap(false, Ordering::Relaxed) => Shrink::AtEnd,
            Shrink::Requested => Shrink::Never,
            other => other,
        };
        let runs = Runs::new(&control.cancel, shrink, &self.info.device)?;

        // Text: each request's own conditioning.
        let started = Instant::now();
        let guided = first.guidance > 1.0;
        let mut conditions = Vec::with_capacity(reqs.len());
        for req in reqs {
            let positive = self.text.encode(&req.prompt, loras, &runs)?;
            let negative_text = req.negative_prompt.as_deref().filter(|n| !n.is_empty());
            let negative = match (guided, negative_text) {
                (false, _) => None,
                (true, Some(text)) => Some(self.text.encode(text, loras, &runs)?),
                (true, None) if self.config.force_zeros_for_empty_prompt => Some(positive.zeros_like()),
                (true, None) => Some(self.text.encode("", loras, &runs)?),
            };
            conditions.push((positive, negative));
        }
        timings.text_encode = started.elapsed();

        let schedule = self.scheduler.plan(first.steps);
        let (h, w) = (first.height as f32, first.width as f32);
        let time_ids = [h, w, 0.0, 0.0, h, w];
        if let Some(t) = trace.as_deref_mut() {
            t.prompt_embeds = Some(conditions[0].0.clone());
            t.negative_prompt_embeds = conditions[0].1.clone();
            t.add_time_ids = time_ids;
            t.timesteps = schedule.timesteps.clone();
            t.sigmas = schedule.sigmas.clone();
            t.init_noise_sigma = schedule.init_noise_sigma;
            t.latents_after_step = vec![Vec::new(); schedule.len()];
        }

        // Every image of every request, in order: (request, image index).
        let all: Vec<(usize, u32)> =
            reqs.iter().enumerate().flat_map(|(r, req)| req.image_indices.iter().map(move |&i| (r, i))).collect();
        let mut images: Vec<Vec<RenderedImage>> = reqs.iter().map(|r| Vec::with_capacity(r.image_indices.len())).collect();
        let recipes: Vec<Arc<image::Recipe>> = reqs.iter().map(|req| Arc::new(image::Recipe::of(req, &self.info.name))).collect();
        let mut done = 0usize;
        for chunk in all.chunks(first.max_batch) {
            let n = chunk.len();
            let mut latents = vec![0.0f32; n * per_image];
            for (k, (&(r, index), out)) in chunk.iter().zip(latents.chunks_exact_mut(per_image)).enumerate() {
                match noise {
                    Some(noise) => out.copy_from_slice(&noise[(done + k) * per_image..(done + k + 1) * per_image]),
                    None => noise::fill_image_noise(reqs[r].seed, index, out),
                }
            }
            for x in &mut latents {
                *x *= schedule.init_noise_sigma;
            }

            let started = Instant::now();
            let run = Denoise {
                schedule: &schedule,
                guidance: first.guidance,
                latent_shape: [n, c, lh, lw],
                device: &self.info.device,
                runs: &runs,
                shrink_arena: shrink != Shrink::Never,
                host_steps: trace.is_some(),
                overrides: loras.map_or(&[], |set| set.part(shotfleet_schema::lora::Part::Unet)),
                lane,
            };
            let cond = Conditioning {
                positive: chunk.iter().map(|&(r, _)| &conditions[r].0).collect(),
                negative: guided.then(|| chunk.iter().filter_map(|&(r, _)| conditions[r].1.as_ref()).collect()),
                time_ids,
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
            if decode == Decode::Skip {
                done += n;
                continue;
            }

            for (k, &(r, index)) in chunk.iter().enumerate() {
                let req = &reqs[r];
                let started = Instant::now();
                let last = k + 1 == n && done + n == all.len();
                let decoded = self.vae.decode(
                    &latents[k * per_image..(k + 1) * per_image],
                    [c, lh, lw],
                    control.vae_decode,
                    self.info.vae_scale_factor as usize,
                    &runs,
                    last,
                )?;
                timings.vae += started.elapsed();

                if (decoded.width, decoded.height) != (req.width as usize, req.height as usize) {
                    return Err(RenderError::Output {
                        stage: Stage::Vae,
                        detail: format!("decoded {}x{}, expected {}x{}", decoded.width, decoded.height, req.width, req.height),
                    });
                }
                let rgb = image::to_rgb8(&decoded.chw, decoded.width, decoded.height);
                if let Some(t) = trace.as_deref_mut() {
                    t.images_rgb.push(rgb.clone());
                }
                let recipe = recipes[r].clone();
                images[r].push(RenderedImage { index, seed: req.seed, width: req.width, height: req.height, rgb, recipe });
            }
            done += n;
        }
        // Stage times are the group's: each job's share is not separable inside shared batches.
        Ok(images.into_iter().map(|images| RenderOutput { images, timings }).collect())
    }

    /// Checks a request against the model; returns the latent height and width.
    fn validate(&self, req: &RenderRequest, control: &RenderControl) -> Result<(usize, usize), RenderError> {
        let f = self.info.vae_scale_factor;
        let invalid = |s: String| Err(RenderError::InvalidRequest(s));
        if let Some(problem) = self.info.size_problem(req.width, req.height) {
            return invalid(problem);
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
        if let VaeDecode::Tiled { tile, overlap } = control.vae_decode
            && (tile == 0 || !tile.is_multiple_of(f) || !overlap.is_multiple_of(f) || overlap >= tile)
        {
            return invalid(format!("VAE tiles of {tile} px overlapping by {overlap} px: both must be multiples of {f}, the tile positive and larger than the overlap"));
        }
        Ok(((req.height / f) as usize, (req.width / f) as usize))
    }
}

