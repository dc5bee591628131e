//! Why a LoRA file is refused, each with what a person can do about it.

use super::Arch;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LoraFileError {
    /// A Python pickle (`.ckpt`, `.pt`, `.bin`, a PyTorch zip archive).
    #[error(
        "this is a {what}, not safetensors: pickle files can run code when they are loaded, so they are never read; convert it to safetensors on a machine you trust (`safetensors.torch.save_file(torch.load(path), \"lora.safetensors\")`) and use that"
    )]
    Pickle { what: &'static str },

    #[error("the file is {bytes} bytes; LoRA files may be at most {limit} bytes (is this a whole checkpoint rather than a LoRA?)")]
    TooLarge { bytes: u64, limit: u64 },

    /// Not a readable safetensors file: truncated, or another format.
    #[error("not a readable safetensors file ({detail}); is it complete? a download cut short reads like this")]
    NotSafetensors { detail: String },

    #[error("the file holds no tensors")]
    Empty,

    /// Made for another model than SDXL.
    #[error("{}", wrong_arch(arch, detail))]
    WrongArchitecture { arch: Arch, detail: String },

    /// An adapter kind other than plain LoRA, or an extra this worker does not apply.
    #[error("key `{key}`: {what} is not supported; only plain LoRA (down/up, A/B and alpha) is")]
    Unsupported { key: String, what: &'static str },

    /// A module SDXL does not have.
    #[error("`{module}` ({part}) is not a module of SDXL's {part}: is this LoRA made for another model?")]
    UnknownModule { part: &'static str, module: String },

    /// Tensors that cannot form a LoRA: a down without an up, shapes that disagree.
    #[error("key `{key}`: {detail}")]
    Malformed { key: String, detail: String },
}

fn wrong_arch(arch: &Arch, detail: &str) -> String {
    match arch {
        Arch::Sdxl => format!("an SDXL LoRA ({detail})"),
        Arch::Sd1 => format!(
            "this LoRA was made for Stable Diffusion 1.x/2.x ({detail}); this fleet renders SDXL: use the SDXL version of this LoRA"
        ),
        Arch::Sd3OrFlux => format!(
            "this LoRA was made for SD3 or Flux, a transformer rather than SDXL's UNet ({detail}); this fleet renders SDXL: use the SDXL version of this LoRA"
        ),
        Arch::Unknown => format!(
            "no LoRA keys this fleet knows ({detail}); expected kohya keys (lora_unet_*, lora_te1_*, lora_te2_* with .lora_down/.lora_up/.alpha) or diffusers/PEFT keys (unet.*, text_encoder.*, text_encoder_2.* with .lora_A/.lora_B)"
        ),
    }
}
