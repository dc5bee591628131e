//! What the LoRA tests share: the fixture LoRAs pushed to a store with `shotfleet lora push`,
//! the images a job should have (the same request rendered here through the pipeline with the
//! same set), and the worker's switch count.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shotfleet_consumer::pipeline::lora::Adapter;
use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions};
use shotfleet_consumer::worker::render::render_request;
use shotfleet_schema::lora::{FileLimits, LoraFile};
use shotfleet_schema::{Lora, ShotJob, ShotResult};
use shotfleet_tests::{binary, ort_library, tiny_model};

/// The four characters of these tests: a library name, the fixture file pushed under it.
pub const MEI: (&str, &str) = ("mei.v2", "kohya_sgm.safetensors");
pub const KAI: (&str, &str) = ("kai", "peft.safetensors");
pub const RIN: (&str, &str) = ("rin", "kohya_diffusers_names.safetensors");
/// The same file as mei's (so the same sha256): at another weight, another set.
pub const TAO: (&str, &str) = ("tao", "kohya_sgm.safetensors");

/// A fixture of `onnx/tiny/lora`.
pub fn fixture(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/lora").join(file)
}

/// `shotfleet lora push FIXTURE --name NAME` into the library of `store_url`, with `env`.
pub async fn push(store_url: &str, (name, file): (&str, &str), env: &[(String, String)]) {
    let out = tokio::process::Command::new(binary("shotfleet"))
        .args(["lora", "push", fixture(file).to_str().unwrap(), "--name", name, "--store", store_url])
        .envs(env.iter().cloned())
        .output()
        .await
        .expect("run shotfleet lora push");
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// The library's folder of a `file://` store rooted at `root` (`shotfleet_schema`'s default prefix).
pub fn library_dir(root: &Path) -> PathBuf {
    root.join(shotfleet_schema::lora::library::DEFAULT_PREFIX)
}

/// `job` naming `loras` (name, weight).
pub fn with_loras(mut job: ShotJob, loras: &[(&str, f32)]) -> ShotJob {
    job.loras = loras.iter().map(|(name, weight)| Lora { name: (*name).into(), weight: *weight }).collect();
    job
}

/// The tiny model on the CPU in this process, to render what a job's images should be.
pub fn reference_pipeline() -> Pipeline {
    let options = PipelineOptions { intra_threads: Some(1), ort_library: Some(ort_library()), ..PipelineOptions::default() };
    Pipeline::load(&tiny_model(), &options).expect("the tiny model loads")
}

/// `job` rendered here, alone, with the fixtures its LoRAs name (`files`: name to fixture),
/// as RGB bytes per image: what the worker must have rendered, whatever it was batched with.
pub fn reference_images(pipeline: &Pipeline, job: &ShotJob, files: &[(&str, &str)]) -> Vec<Vec<u8>> {
    let adapters: Vec<Adapter> = job
        .loras
        .iter()
        .map(|lora| {
            let file = files.iter().find(|(name, _)| *name == lora.name).unwrap_or_else(|| panic!("no fixture for {}", lora.name)).1;
            let bytes = std::fs::read(fixture(file)).unwrap();
            Adapter { name: lora.name.clone(), file: Arc::new(LoraFile::parse(&bytes, &FileLimits::default()).unwrap()), weight: lora.weight }
        })
        .collect();
    let merged = pipeline.merge_loras(&adapters).expect("merge");
    let set = pipeline.place_loras(&merged).expect("place");
    let request = render_request(job, job.images);
    let set = (!merged.is_empty()).then_some(&set);
    let mut outputs = pipeline.render_with_loras(&[request], set, &Default::default(), &mut |_| std::ops::ControlFlow::Continue(())).expect("render");
    outputs.remove(0).images.into_iter().map(|image| image.rgb).collect()
}

/// A PNG's pixels, 8-bit RGB.
pub fn rgb(png_bytes: &[u8]) -> Vec<u8> {
    let mut reader = png::Decoder::new(std::io::Cursor::new(png_bytes)).read_info().expect("a PNG");
    let mut pixels = vec![0; reader.output_buffer_size().expect("a size")];
    let info = reader.next_frame(&mut pixels).expect("a frame");
    pixels.truncate(info.buffer_size());
    pixels
}

/// The largest difference between two images, in levels of 255.
pub fn max_diff(a: &[u8], b: &[u8]) -> u8 {
    assert_eq!(a.len(), b.len(), "images of different sizes");
    a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).max().unwrap_or(0)
}

/// Checks that every image of `result` (stored under `root`) is within one level of `expected`
/// and returns how far the farthest was.
pub fn check_images(root: &Path, result: &ShotResult, expected: &[Vec<u8>]) -> u8 {
    assert_eq!(result.images.len(), expected.len(), "{}: image count", result.job_id);
    let mut worst = 0;
    for (image, expected) in result.images.iter().zip(expected) {
        let ours = rgb(&std::fs::read(root.join(&image.key)).unwrap());
        let diff = max_diff(&ours, expected);
        assert!(diff <= 1, "{} image {}: {diff} levels from its set's render here", result.job_id, image.index);
        worst = worst.max(diff);
    }
    worst
}


/// The worker's `shotfleet_lora_switches_total`, all sources together.
pub fn switches(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|line| line.starts_with("shotfleet_lora_switches_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
