//! LoRA adapter files (feature `lora`): what `shotfleet lora push` checks before uploading and
//! what a worker reads before merging, read the same way on both sides.
//!
//! A file is parsed into [`LoraFile`]: one [`Target`] per adapted module, named canonically
//! (diffusers' UNet paths, `text_model.encoder.layers.N...` for the text encoders) whatever
//! format it came in, with its low-rank factors as f32 and its scale (alpha / rank).
//!
//! - `read`: safetensors only (pickle files are refused: they can run code), a size cap, the
//!   tensors as f32.
//! - `names`: kohya / A1111 / ComfyUI keys (`lora_unet_*`, `lora_te1_*`, `lora_te2_*`, with
//!   diffusers or SGM block names) and diffusers / PEFT keys (`lora_A` / `lora_B`) to targets.
//! - `arch`: SDXL, or which other model a file was made for, and the module paths SDXL has.
//! - [`library`]: where a named LoRA lives in object storage, and its metadata sidecar.

mod arch;
mod error;
pub mod library;
mod names;
mod read;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use arch::Arch;
pub use error::LoraFileError;

/// The largest LoRA file accepted by default: SDXL LoRAs of rank 128 over the UNet and both text
/// encoders stay under 1 GiB in float16.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

/// Which graph of the model a target adapts. The names are the model folder's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    Unet,
    TextEncoder,
    TextEncoder2,
}

impl Part {
    pub const ALL: [Part; 3] = [Part::Unet, Part::TextEncoder, Part::TextEncoder2];

    /// The part's folder in the model (`unet`, `text_encoder`, `text_encoder_2`).
    pub fn as_str(self) -> &'static str {
        match self {
            Part::Unet => "unet",
            Part::TextEncoder => "text_encoder",
            Part::TextEncoder2 => "text_encoder_2",
        }
    }
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The naming convention a file used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// kohya-ss / A1111 / ComfyUI: `lora_unet_*.lora_down.weight`, `.lora_up.weight`, `.alpha`.
    Kohya,
    /// diffusers / PEFT: `unet.*.lora_A.weight`, `.lora_B.weight` (and diffusers' older
    /// `lora.down` / `lora_linear_layer` spellings).
    Peft,
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Kohya => "kohya",
            Format::Peft => "peft",
        })
    }
}

/// A row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// One adapted module: its weight moves by `weight * scale * up @ down` (a convolution's kernel
/// dimensions flattened into `down`'s columns, as torch lays them out).
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub part: Part,
    /// Canonical module path inside the part, e.g. `down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`
    /// or `text_model.encoder.layers.0.self_attn.q_proj`.
    pub module: String,
    /// `[rank, in]` for a linear layer, `[rank, in, kh, kw]` for a convolution.
    pub down: Tensor,
    /// `[out, rank]` (a convolution's `[out, rank, 1, 1]` is stored as `[out, rank]`).
    pub up: Tensor,
    /// alpha / rank (1 when the file gives no alpha, as diffusers assumes).
    pub scale: f32,
}

impl Target {
    pub fn rank(&self) -> usize {
        self.down.shape[0]
    }

    pub fn out_features(&self) -> usize {
        self.up.shape[0]
    }

    /// `down`'s columns: input features times the kernel's size.
    pub fn in_elements(&self) -> usize {
        self.down.shape[1..].iter().product()
    }

    /// The shape of the module's weight in torch's layout: `[out, in]` or `[out, in, kh, kw]`.
    pub fn weight_shape(&self) -> Vec<usize> {
        let mut shape = vec![self.out_features()];
        shape.extend_from_slice(&self.down.shape[1..]);
        shape
    }

    /// Whether the module is a convolution.
    pub fn is_conv(&self) -> bool {
        self.down.shape.len() == 4
    }
}

/// What a file holds, after every check.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFile {
    pub format: Format,
    /// Sorted by part, then module.
    pub targets: Vec<Target>,
}

/// Bounds on a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileLimits {
    pub max_bytes: u64,
}

impl Default for FileLimits {
    fn default() -> Self {
        Self { max_bytes: DEFAULT_MAX_BYTES }
    }
}

impl LoraFile {
    /// Reads a LoRA file: safetensors, at most `limits.max_bytes`, a known naming convention,
    /// made for SDXL, every module one SDXL has.
    ///
    /// # Errors
    /// [`LoraFileError`], with a message that says what to do: convert a pickle file, use the
    /// SDXL version of a LoRA made for another model, and so on.
    pub fn parse(bytes: &[u8], limits: &FileLimits) -> Result<LoraFile, LoraFileError> {
        let raw = read::read(bytes, limits)?;
        names::targets(raw)
    }

    /// The largest rank of any target.
    pub fn rank(&self) -> usize {
        self.targets.iter().map(Target::rank).max().unwrap_or(0)
    }

    /// Targets per part.
    pub fn count(&self, part: Part) -> usize {
        self.targets.iter().filter(|t| t.part == part).count()
    }
}
