//! The model folder (Hugging Face Optimum's SDXL ONNX layout): its files and JSON configs,
//! read and checked before any graph is loaded, so a broken folder is refused at start with the
//! file at fault named.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::error::LoadError;
use super::scheduler::SchedulerConfig;

/// The files of the layout, relative to the folder.
pub(crate) const TEXT_ENCODER: &str = "text_encoder/model.onnx";
pub(crate) const TEXT_ENCODER_2: &str = "text_encoder_2/model.onnx";
pub(crate) const UNET: &str = "unet/model.onnx";
pub(crate) const UNET_QUANTIZATION: &str = "unet/quantization.json";
pub(crate) const VAE_DECODER: &str = "vae_decoder/model.onnx";
pub(crate) const TOKENIZER: &str = "tokenizer";
pub(crate) const TOKENIZER_2: &str = "tokenizer_2";

/// `model_index.json`: only the pipeline-level switch the render needs.
#[derive(Debug, Deserialize)]
struct ModelIndex {
    /// SDXL: an absent negative prompt means zero negative embeddings, not encoded "".
    #[serde(default = "yes")]
    force_zeros_for_empty_prompt: bool,
}

fn yes() -> bool {
    true
}

/// `text_encoder*/config.json`.
#[derive(Debug, Deserialize)]
pub(crate) struct TextEncoderConfig {
    pub vocab_size: usize,
}

/// `vae_decoder/config.json`.
#[derive(Debug, Deserialize)]
struct VaeConfig {
    #[serde(default = "default_scaling_factor")]
    scaling_factor: f32,
    #[serde(default = "default_blocks")]
    block_out_channels: Vec<u32>,
    #[serde(default)]
    latent_channels: Option<usize>,
    #[serde(default)]
    latents_mean: Option<serde_json::Value>,
    /// diffusers decodes in float32 whatever the pipeline's dtype when this is set (its default):
    /// SDXL's own VAE overflows in float16. Fixed VAEs (the fp16-fix VAE) say `false`.
    #[serde(default = "yes")]
    force_upcast: bool,
}

/// `unet/config.json`: diffusers' `UNet2DConditionModel` halves the latent in every down block
/// but the last, and its exported upsamplers double it back (a fixed factor of 2, not the skip
/// connection's size), so a latent side must be a multiple of 2^(blocks - 1).
#[derive(Debug, Deserialize)]
struct UnetConfig {
    block_out_channels: Vec<u32>,
}

/// `unet/quantization.json` (written by `onnx/quantize_unet.py`): the UNet's linear weights are
/// packed into a few bits (ONNX Runtime's MatMulNBits). Absent for a float UNet.
#[derive(Debug, Deserialize)]
struct QuantizationRecord {
    format: String,
    bits: u8,
    block_size: u32,
}

/// How a quantized UNet's linear weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedWeights {
    pub bits: u8,
    pub block_size: u32,
}

impl std::fmt::Display for PackedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-bit in blocks of {}", self.bits, self.block_size)
    }
}

/// diffusers' `AutoencoderKL` default; SDXL's config says 0.13025.
fn default_scaling_factor() -> f32 {
    0.18215
}

fn default_blocks() -> Vec<u32> {
    vec![128, 256, 512, 512]
}

/// What the folder's JSON says, validated.
#[derive(Debug, Clone)]
pub(crate) struct FolderConfig {
    pub dir: PathBuf,
    pub name: String,
    pub force_zeros_for_empty_prompt: bool,
    pub scheduler: SchedulerConfig,
    pub vae_scaling_factor: f32,
    /// Pixels per latent element along each side: 2^(VAE blocks - 1).
    pub vae_scale_factor: u32,
    /// What a latent side must be a multiple of for the UNet: 2^(UNet blocks - 1) (4 for SDXL,
    /// so its images' sides are multiples of 32).
    pub unet_side_multiple: u32,
    pub vae_latent_channels: Option<usize>,
    /// The VAE needs float32 (`force_upcast`): a float16 decoder of it is refused at load.
    pub vae_force_upcast: bool,
    pub text_encoder_vocab: usize,
    pub text_encoder_2_vocab: usize,
    /// The UNet's linear weights, where `unet/quantization.json` says they are packed.
    pub unet_packed: Option<PackedWeights>,
}

impl FolderConfig {
    /// Reads and checks every JSON file and the presence of every graph and tokenizer file.
    ///
    /// # Errors
    /// The first missing or malformed file, named.
    pub(crate) fn read(dir: &Path) -> Result<FolderConfig, LoadError> {
        if !dir.is_dir() {
            return Err(LoadError::MissingFile { path: dir.to_path_buf() });
        }
        for graph in [TEXT_ENCODER, TEXT_ENCODER_2, UNET, VAE_DECODER] {
            require_file(&dir.join(graph))?;
        }
        for tok in [TOKENIZER, TOKENIZER_2] {
            for file in ["vocab.json", "merges.txt"] {
                require_file(&dir.join(tok).join(file))?;
            }
        }
        let index: ModelIndex = read_json(&dir.join("model_index.json"))?;
        let scheduler_path = dir.join("scheduler/scheduler_config.json");
        let scheduler: SchedulerConfig = read_json(&scheduler_path)?;
        // Validate now: an unsupported sampler option must stop the load, not the first job.
        super::scheduler::EulerDiscrete::new(&scheduler)
            .map_err(|detail| LoadError::Invalid { path: scheduler_path.clone(), detail })?;
        let vae_path = dir.join("vae_decoder/config.json");
        let vae: VaeConfig = read_json(&vae_path)?;
        if vae.latents_mean.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(LoadError::Invalid {
                path: vae_path,
                detail: "latents_mean/latents_std (a non-SDXL VAE) are not supported".into(),
            });
        }
        if !(vae.scaling_factor.is_finite() && vae.scaling_factor > 0.0) || vae.block_out_channels.is_empty() {
            return Err(LoadError::Invalid {
                path: vae_path,
                detail: "scaling_factor must be positive and block_out_channels non-empty".into(),
            });
        }
        let unet_path = dir.join("unet/config.json");
        let unet: UnetConfig = read_json(&unet_path)?;
        if unet.block_out_channels.is_empty() || unet.block_out_channels.len() > 8 {
            return Err(LoadError::Invalid { path: unet_path, detail: "block_out_channels must list 1 to 8 blocks".into() });
        }
        let te1: TextEncoderConfig = read_json(&dir.join("text_encoder/config.json"))?;
        let te2: TextEncoderConfig = read_json(&dir.join("text_encoder_2/config.json"))?;
        let unet_packed = read_quantization(&dir.join(UNET_QUANTIZATION))?;
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into());
        Ok(FolderConfig {
            dir: dir.to_path_buf(),
            name,
            force_zeros_for_empty_prompt: index.force_zeros_for_empty_prompt,
            scheduler,
            vae_scaling_factor: vae.scaling_factor,
            vae_scale_factor: 1 << (vae.block_out_channels.len() - 1),
            unet_side_multiple: 1 << (unet.block_out_channels.len() - 1),
            vae_latent_channels: vae.latent_channels,
            vae_force_upcast: vae.force_upcast,
            text_encoder_vocab: te1.vocab_size,
            text_encoder_2_vocab: te2.vocab_size,
            unet_packed,
        })
    }
}

/// The UNet's packing record, checked; `None` when the folder has none (a float UNet).
fn read_quantization(path: &Path) -> Result<Option<PackedWeights>, LoadError> {
    if !path.exists() {
        return Ok(None);
    }
    let record: QuantizationRecord = read_json(path)?;
    if record.format != "MatMulNBits" || !matches!(record.bits, 4 | 8) || !record.block_size.is_power_of_two() || record.block_size < 16 {
        return Err(LoadError::Invalid {
            path: path.to_path_buf(),
            detail: format!(
                "format {:?}, {} bits, blocks of {}: expected MatMulNBits, 4 or 8 bits, blocks of 16 or more (a power of two); rerun onnx/quantize_unet.py",
                record.format, record.bits, record.block_size
            ),
        });
    }
    Ok(Some(PackedWeights { bits: record.bits, block_size: record.block_size }))
}

fn require_file(path: &Path) -> Result<(), LoadError> {
    if path.is_file() { Ok(()) } else { Err(LoadError::MissingFile { path: path.to_path_buf() }) }
}

fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, LoadError> {
    let bytes = std::fs::read(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => LoadError::MissingFile { path: path.to_path_buf() },
        _ => LoadError::Io { path: path.to_path_buf(), source },
    })?;
    serde_json::from_slice(&bytes).map_err(|source| LoadError::Json { path: path.to_path_buf(), source })
}
