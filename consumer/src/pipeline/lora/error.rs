//! Why a LoRA set cannot be made or used.

use std::path::PathBuf;

use shotfleet_schema::lora::Part;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoraError {
    /// The model was exported without LoRA maps: no job with a LoRA can run on this worker.
    #[error("the model {model} takes no LoRAs: its UNet has no lora_map.json (run onnx/lora_ready.py on the model folder)")]
    NotPrepared { model: PathBuf },

    /// The UNet's weights are packed into a few bits (`onnx/quantize_unet.py`): a LoRA merges into
    /// float weights, so this worker takes no LoRA job; a worker with the float model does.
    #[error("the model {model} takes no LoRAs: its UNet's weights are packed into {bits} bits (onnx/quantize_unet.py); LoRA jobs need the float model prepared with onnx/lora_ready.py")]
    Packed { model: PathBuf, bits: u8 },

    /// A LoRA adapts a layer the model does not have: it was made for another model.
    #[error("LoRA `{lora}` adapts {part} layer `{module}`, but {detail}: made for another model?")]
    NotInModel { lora: String, part: Part, module: String, detail: String },

    /// A LoRA's layer has another shape than the model's.
    #[error("LoRA `{lora}`: {part} layer `{module}` has shape {model:?} in this model, the LoRA expects {lora_shape:?}: made for another model?")]
    Shape { lora: String, part: Part, module: String, model: Vec<usize>, lora_shape: Vec<usize> },

    /// The model's weights could not be read to merge into.
    #[error("cannot read base weights from {path}: {source}")]
    BaseWeights { path: PathBuf, source: std::io::Error },

    /// ONNX Runtime could not place the merged weights on the device (out of memory, mostly).
    #[error("cannot place a LoRA set on the device: {source}")]
    Device { source: ort::Error },

    /// A set made by another pipeline (another model, or this one before a reload).
    #[error("this LoRA set was made for another pipeline (another model, or before a reload); make it again")]
    ForeignSet,
}

impl LoraError {
    /// Whether the LoRAs themselves are at fault (they do not fit the model): the job that asked
    /// for them is invalid, and no retry or other worker with this model can help.
    pub fn is_invalid_job(&self) -> bool {
        matches!(self, LoraError::NotInModel { .. } | LoraError::Shape { .. })
    }
}
