//! Shared by the `pipeline_*` tests: where the tiny fixture and ONNX Runtime are, and `.npy`
//! reading.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use std::sync::Arc;

use ndarray::ArrayD;
use ndarray_npy::ReadNpyExt;
use serde::Deserialize;
use shotfleet_consumer::pipeline::lora::Adapter;
use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions, RenderRequest};
use shotfleet_schema::lora::{FileLimits, LoraFile};

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

/// Runs `onnx/SCRIPT` with the test venv's Python (its onnx and onnxruntime) and `args`; fails
/// the test with the script's stderr.
pub fn onnx_script(script: &str, args: &[&std::ffi::OsStr]) {
    let python = std::env::var_os("SHOTFLEET_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx").join(script);
    let output = std::process::Command::new(&python)
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run `bash scripts/setup.sh`", python.display()));
    assert!(output.status.success(), "{script}: {}", String::from_utf8_lossy(&output.stderr));
}

/// The pixels of one small render (64x64, 4 steps, seed 11): what the format tests compare.
pub fn lighthouse_pixels(pipeline: &Pipeline) -> Vec<u8> {
    let request = RenderRequest {
        prompt: "a lighthouse on a cliff at dawn".into(),
        negative_prompt: Some("blurry".into()),
        width: 64,
        height: 64,
        steps: 4,
        guidance: 6.0,
        seed: 11,
        image_indices: vec![0],
        max_batch: 1,
    };
    let mut out = pipeline.render(&request, &mut |_| std::ops::ControlFlow::Continue(())).unwrap();
    out.images.remove(0).rgb
}

/// Largest and mean per-pixel difference, in uint8 levels.
pub fn pixel_difference(a: &[u8], b: &[u8]) -> (u8, f64) {
    assert_eq!(a.len(), b.len());
    let diffs: Vec<u8> = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).collect();
    (*diffs.iter().max().unwrap(), diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64)
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

/// A case of `onnx/tiny/reference/cases.json`: what diffusers rendered.
#[derive(Debug, Deserialize)]
pub struct ReferenceCase {
    pub name: String,
    pub prompt: String,
    pub negative_prompt: String,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    pub guidance: f32,
    pub images: usize,
    pub init_noise_sigma: f32,
}

impl ReferenceCase {
    /// The request that renders the case (its noise comes from `latents_init.npy`).
    pub fn request(&self) -> RenderRequest {
        RenderRequest {
            prompt: self.prompt.clone(),
            negative_prompt: Some(self.negative_prompt.clone()),
            width: self.width,
            height: self.height,
            steps: self.steps,
            guidance: self.guidance,
            seed: 0,
            image_indices: (0..self.images as u32).collect(),
            max_batch: self.images,
        }
    }
}

pub fn reference_case(name: &str) -> ReferenceCase {
    let text = std::fs::read_to_string(reference_dir().join("cases.json")).expect("cases.json");
    let cases: Vec<ReferenceCase> = serde_json::from_str(&text).expect("cases.json parses");
    cases.into_iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no case {name}"))
}

/// `onnx/tiny/lora`, made by `onnx/make_lora_fixtures.py`.
pub fn lora_dir() -> PathBuf {
    fixture().join("lora")
}

/// A fixture LoRA file, read, at `weight`.
pub fn lora_adapter(file: &str, weight: f32) -> Adapter {
    let bytes = std::fs::read(lora_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let lora = LoraFile::parse(&bytes, &FileLimits::default()).unwrap_or_else(|e| panic!("{file}: {e}"));
    Adapter { name: file.into(), file: Arc::new(lora), weight }
}
