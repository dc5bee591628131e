//! Shared by the `pipeline_*` tests: where the tiny fixture and ONNX Runtime are, and `.npy`
//! reading.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use ndarray::ArrayD;
use ndarray_npy::ReadNpyExt;
use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions};

/// `onnx/tiny`, made by `onnx/make_tiny.py`.
pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny")
}

pub fn model_dir() -> PathBuf {
    fixture().join("model")
}

pub fn reference_dir() -> PathBuf {
    fixture().join("reference")
}

/// Fails the test with the fix when ONNX Runtime is not where `scripts/env.sh` points.
pub fn require_ort() {
    match std::env::var_os("ORT_DYLIB_PATH") {
        Some(p) if Path::new(&p).is_file() => {}
        Some(p) => panic!("ORT_DYLIB_PATH={} does not exist: run `bash scripts/setup.sh`, then `source scripts/env.sh`", p.to_string_lossy()),
        None => panic!("ORT_DYLIB_PATH is not set: run `bash scripts/setup.sh` once, then `source scripts/env.sh`"),
    }
}

/// The tiny pipeline on the CPU provider.
pub fn tiny_pipeline() -> Pipeline {
    load(&model_dir())
}

pub fn load(dir: &Path) -> Pipeline {
    require_ort();
    Pipeline::load(dir, &cpu_options()).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

pub fn cpu_options() -> PipelineOptions {
    // Two threads: the test machines have two cores and nextest runs tests side by side.
    PipelineOptions { intra_threads: Some(2), ..PipelineOptions::default() }
}

pub fn npy_f32(path: &Path) -> ArrayD<f32> {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ArrayD::<f32>::read_npy(file).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn npy_u8(path: &Path) -> ArrayD<u8> {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ArrayD::<u8>::read_npy(file).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Largest absolute difference; panics on a length mismatch.
pub fn max_abs_diff(ours: &[f32], theirs: &[f32], what: &str) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "{what}: {} values vs {} in the reference", ours.len(), theirs.len());
    ours.iter().zip(theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}
