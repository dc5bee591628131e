//! From an error to an [`ErrorKind`].
//!
//! ONNX Runtime reports a CUDA failure as status FAIL (sometimes RUNTIME_EXCEPTION or EP_FAIL)
//! with the CUDA, cuBLAS or cuDNN text embedded, in one of these shapes (the sources are in
//! `consumer/tests/failure_classify.rs`, one real text per pattern):
//!
//! - `CUDA failure 700: an illegal memory access was encountered ; GPU=0 ; ... expr=...`
//!   (`cuda_call.cc`: the CUDA runtime's number and `cudaGetErrorString`);
//! - `CUDA error cudaErrorNoKernelImageForDevice:no kernel image is available ...` (newer
//!   kernels' launch checks: `cudaGetErrorName` and the string);
//! - `CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED ...`, `CUDNN failure 9:
//!   CUDNN_STATUS_NOT_SUPPORTED ...` (the library's status name);
//! - `BFCArena::AllocateRawInternal ... Failed to allocate memory for requested buffer of size N`
//!   (CUDA arena) or `... Available memory of N is smaller than requested bytes of M` (an arena
//!   at its `max_mem` / `gpu_mem_limit`).
//!
//! Driver faults are matched before memory: a sticky CUDA error can surface as a failed
//! allocation, and treating a dead context as "out of memory" would only retry it.

use nvml_wrapper::error::NvmlError;

use super::ErrorKind;
use crate::pipeline::RenderError;

/// The GPU or driver is broken for this process: the CUDA context is unusable after these.
const DRIVER_FAULT: &[&str] = &[
    // cudaErrorIllegalAddress: 700 since CUDA 10.1, 77 before.
    "illegal memory access",
    "cudaErrorIllegalAddress",
    // cudaErrorLaunchFailure (719), a kernel died.
    "unspecified launch failure",
    "cudaErrorLaunchFailure",
    // cudaErrorECCUncorrectable (214), driver API CUDA_ERROR_ECC_UNCORRECTABLE.
    "uncorrectable ECC error",
    "cudaErrorECCUncorrectable",
    // XID 79: the kernel log's words; NVML says GPU_IS_LOST.
    "fallen off the bus",
    "GPU is lost",
    // cudaErrorUnknown (999): in practice a driver or hardware state that needs a new context.
    "CUDA failure 999",
    "cudaErrorUnknown",
    // cudaErrorHardwareStackError, cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
    // cudaErrorInvalidPc: sticky like 700.
    "hardware stack error",
    "illegal instruction was encountered",
    "misaligned address",
    "invalid program counter",
    // A kernel failed inside the library (its own launch failed): the context is suspect.
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_EXECUTION_FAILED",
    // The process cannot use the card at all (driver or build mismatch, device gone).
    "CUBLAS_STATUS_NOT_INITIALIZED",
    "no CUDA-capable device is detected",
    "CUDA driver version is insufficient",
    "all CUDA-capable devices are busy or unavailable",
    "no kernel image is available for execution on the device",
];

/// Not enough memory for this job at this size.
const OOM: &[&str] = &[
    // ONNX Runtime's BFC arena, CPU or CUDA, both messages.
    "BFCArena::AllocateRawInternal",
    "Available memory of",
    "Failed to allocate memory for requested buffer",
    // cudaErrorMemoryAllocation (2) and the driver API's name.
    "out of memory",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    // cuDNN refuses a tensor past its size limits (a VAE batch of 32 at 512 px): the same job
    // smaller (batch split, tiles) runs, so it belongs on the degrade ladder.
    "CUDNN_STATUS_NOT_SUPPORTED",
    "std::bad_alloc",
];

/// ONNX Runtime's own words when `RunOptions::terminate` stopped a run.
const TERMINATED: &[&str] = &["Exiting due to terminate flag being set to true"];

/// ONNX Runtime refusing the inputs the request led to (a model exported for fixed sizes).
/// (libonnxruntime 1.31.1's format strings: "Got invalid dimensions for input: ...", "Invalid
/// rank for input: ...").
const INVALID_INPUT: &[&str] = &["Got invalid dimensions for input", "Invalid rank for input"];

/// `OrtErrorCode::ORT_INVALID_ARGUMENT`.
const ORT_INVALID_ARGUMENT: i32 = 2;

/// The kind of a failed render.
///
/// | error | kind |
/// | --- | --- |
/// | `InvalidRequest`, `Tokenize` | invalid |
/// | `Runtime` | from ONNX Runtime's code and text: [`classify_text`] |
/// | `Terminated` (the cancel handle: the time limit) | timeout |
/// | `Cancelled` (the progress callback: the worker stopping) | transient |
/// | `Output` (a model gave a shape it should not), `Png` | transient |
pub fn classify_render(err: &RenderError) -> ErrorKind {
    match err {
        RenderError::InvalidRequest(_) | RenderError::Tokenize(_) => ErrorKind::Invalid,
        RenderError::Runtime { source, .. } => {
            let code = ort::sys::OrtErrorCode::from(source.code()) as i32;
            classify_text(Some(code), source.message())
        }
        RenderError::Terminated { .. } => ErrorKind::Timeout,
        RenderError::Cancelled { .. } | RenderError::Output { .. } | RenderError::Png(_) => ErrorKind::Transient,
    }
}

/// The kind of an error known only by its text and, where there is one, ONNX Runtime's status
/// code (`OrtErrorCode` as a number: 1 FAIL, 2 INVALID_ARGUMENT, 6 RUNTIME_EXCEPTION...).
/// Driver faults first, then memory, then termination; then INVALID_ARGUMENT with a refused
/// input is invalid; anything else is transient.
pub fn classify_text(code: Option<i32>, message: &str) -> ErrorKind {
    let has = |patterns: &[&str]| patterns.iter().any(|p| message.contains(p));
    if has(DRIVER_FAULT) {
        ErrorKind::DriverFault
    } else if has(OOM) {
        ErrorKind::Oom
    } else if has(TERMINATED) {
        ErrorKind::Timeout
    } else if code == Some(ORT_INVALID_ARGUMENT) || has(INVALID_INPUT) {
        ErrorKind::Invalid
    } else {
        ErrorKind::Transient
    }
}

/// The kind of an NVML error (the budget's memory probe, the water-level sampler). The card
/// being gone or needing a reset, and NVML's own "unknown", are driver faults, as are a driver
/// that is not loaded or no longer matches its library (after a driver upgrade under a running
/// worker); the rest (not supported, no permission, timeout...) are transient: a failed sample,
/// not a broken card.
pub fn classify_nvml(err: &NvmlError) -> ErrorKind {
    match err {
        NvmlError::GpuLost
        | NvmlError::ResetRequired
        | NvmlError::Unknown
        | NvmlError::DriverNotLoaded
        | NvmlError::LibRmVersionMismatch
        | NvmlError::CorruptedInfoROM
        | NvmlError::IrqIssue
        | NvmlError::InsufficientPower => ErrorKind::DriverFault,
        _ => ErrorKind::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_fault_wins_over_memory_words() {
        // A sticky error reported from an allocation call still means a dead context.
        let text = "CUDA failure 700: an illegal memory access was encountered ; expr=cudaMalloc(...) out of memory";
        assert_eq!(classify_text(Some(1), text), ErrorKind::DriverFault);
    }

    #[test]
    fn codes_decide_only_when_the_text_does_not() {
        assert_eq!(classify_text(Some(ORT_INVALID_ARGUMENT), "something the request led to"), ErrorKind::Invalid);
        assert_eq!(classify_text(Some(ORT_INVALID_ARGUMENT), "out of memory"), ErrorKind::Oom);
        assert_eq!(classify_text(Some(1), "a new, unknown failure"), ErrorKind::Transient);
        assert_eq!(classify_text(None, ""), ErrorKind::Transient);
    }

    #[test]
    fn kinds_name_themselves() {
        assert_eq!(ErrorKind::DriverFault.reason(), "driver");
        assert_eq!(ErrorKind::Oom.to_string(), "oom");
        assert_eq!(ErrorKind::GiveBack { after: std::time::Duration::ZERO }.reason(), "give_back");
    }
}
