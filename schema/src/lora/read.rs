//! Bytes to named f32 tensors: safetensors only, within the size cap.

use std::collections::HashMap;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use super::{FileLimits, LoraFileError, Tensor};

/// A file's tensors by key, and its `__metadata__`.
pub(super) struct RawFile {
    pub tensors: Vec<(String, Tensor)>,
    pub metadata: HashMap<String, String>,
}

pub(super) fn read(bytes: &[u8], limits: &FileLimits) -> Result<RawFile, LoraFileError> {
    if let Some(what) = pickle_kind(bytes) {
        return Err(LoraFileError::Pickle { what });
    }
    if bytes.len() as u64 > limits.max_bytes {
        return Err(LoraFileError::TooLarge { bytes: bytes.len() as u64, limit: limits.max_bytes });
    }
    let not_safetensors = |detail: String| LoraFileError::NotSafetensors { detail };
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| not_safetensors(e.to_string()))?;
    let file = SafeTensors::deserialize(bytes).map_err(|e| not_safetensors(e.to_string()))?;
    if file.is_empty() {
        return Err(LoraFileError::Empty);
    }
    let mut tensors = Vec::with_capacity(file.len());
    for (name, view) in file.iter() {
        let data = to_f32(view.dtype(), view.data()).ok_or_else(|| LoraFileError::Malformed {
            key: name.to_owned(),
            detail: format!("element type {:?}; LoRA tensors are float16, bfloat16 or float32", view.dtype()),
        })?;
        if data.iter().any(|x| !x.is_finite()) {
            return Err(LoraFileError::Malformed { key: name.to_owned(), detail: "holds NaN or infinite values".into() });
        }
        tensors.push((name.to_owned(), Tensor { shape: view.shape().to_vec(), data }));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(RawFile { tensors, metadata: meta.metadata().clone().unwrap_or_default() })
}

/// What kind of pickle `bytes` starts like, if any.
fn pickle_kind(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [b'P', b'K', 3, 4, ..] => Some("PyTorch checkpoint (a zip archive with a pickle inside: .ckpt/.pt/.bin)"),
        // A pickle stream opens with PROTO (0x80) and its protocol number; torch's legacy format too.
        [0x80, 2..=5, ..] => Some("Python pickle (.ckpt/.pt/.bin/.pkl)"),
        _ => None,
    }
}

fn to_f32(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F16 => data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F64 => data.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32).collect(),
        _ => return None,
    })
}
