//! float16 models: the same pipeline reads the graphs' element types and converts at the edges.
//! The tiny fixture is converted here with `onnx/to_fp16.py` (the test venv's onnx and
//! onnxruntime), both ways: fully float16, as a GPU model is (ONNX Runtime 1.31.1's CPU provider
//! runs the tiny model's ops in float16), and with float16 only at the graph edges. The VAE
//! decoder follows its config: float32 while it says `force_upcast` (the fixture's does, as SDXL's
//! own VAE), float16 once it does not, and a float16 decoder against `force_upcast` is refused.

mod pipeline_support;

use std::ops::ControlFlow;
use std::path::Path;

use pipeline_support::{cpu_options, load, model_dir};
use shotfleet_consumer::pipeline::{ModelDtype, Pipeline, RenderRequest};

fn convert(out: &Path, edges_only: bool) {
    convert_from(&model_dir(), out, edges_only);
}

/// `vae_decoder/config.json` of `dir` with `force_upcast` set to `value`.
fn set_force_upcast(dir: &Path, value: bool) {
    let path = dir.join("vae_decoder/config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["force_upcast"] = serde_json::Value::Bool(value);
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    for entry in walkdir(from) {
        let target = to.join(entry.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &target).unwrap();
    }
}

fn walkdir(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() { files.extend(walkdir(&path)) } else { files.push(path) }
    }
    files
}

fn convert_from(source: &Path, out: &Path, edges_only: bool) {
    let python = std::env::var_os("SHOTFLEET_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/to_fp16.py");
    let mut command = std::process::Command::new(&python);
    command.arg(&script).arg(source).arg(out);
    if edges_only {
        command.arg("--cpu-compatible");
    }
    let status = command.output().unwrap_or_else(|e| panic!("{}: {e}; run `bash scripts/setup.sh`", python.display()));
    assert!(status.status.success(), "to_fp16.py: {}", String::from_utf8_lossy(&status.stderr));
}

fn decode(png: &[u8]) -> Vec<u8> {
    let decoder = png::Decoder::new(std::io::Cursor::new(png));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    buf
}

/// The UNet's and the VAE decoder's element types, and the image's pixels.
fn render(dir: &Path) -> (ModelDtype, ModelDtype, Vec<u8>) {
    let pipeline = load(dir);
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
    let out = pipeline.render(&request, &mut |_| ControlFlow::Continue(())).unwrap();
    (pipeline.info().dtype, pipeline.info().vae_dtype, decode(&out.images[0].png))
}

/// Largest and mean per-pixel difference, in uint8 levels.
fn difference(a: &[u8], b: &[u8]) -> (u8, f64) {
    assert_eq!(a.len(), b.len());
    let diffs: Vec<u8> = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).collect();
    (*diffs.iter().max().unwrap(), diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64)
}

#[test]
fn float16_models_render_close_to_float32() {
    pipeline_support::require_ort();
    let (dtype, _, reference) = render(&model_dir());
    assert_eq!(dtype, ModelDtype::F32);
    let dir = tempfile::tempdir().unwrap();
    for (name, edges_only, max_allowed) in [("fp16", false, 6u8), ("fp16-edges", true, 3u8)] {
        let out = dir.path().join(name);
        convert(&out, edges_only);
        let (dtype, vae_dtype, pixels) = render(&out);
        assert_eq!(dtype, ModelDtype::F16, "{name}: the UNet's element type is read from the session");
        assert_eq!(vae_dtype, ModelDtype::F32, "{name}: the fixture's VAE says force_upcast, so its decoder stays float32");
        let (max, mean) = difference(&reference, &pixels);
        println!("{name}: largest difference {max} levels, mean {mean:.3}");
        // Measured (2026-11-30, 64x64, 4 steps): 1 level at most both ways, mean 0.029 (fp16)
        // and 0.016 (edges only). The bounds leave room for other CPUs' float16 rounding.
        assert!(max <= max_allowed && mean < 0.5, "{name}: largest {max}, mean {mean}");
    }
}

#[test]
fn the_vae_decoder_is_float16_only_where_its_config_allows() {
    pipeline_support::require_ort();
    let (_, _, reference) = render(&model_dir());
    let dir = tempfile::tempdir().unwrap();
    // The fixture with an fp16-safe VAE config (as the fp16-fix VAE has), then converted.
    let safe = dir.path().join("safe-vae");
    copy_dir(&model_dir(), &safe);
    set_force_upcast(&safe, false);
    let out = dir.path().join("fp16-vae");
    convert_from(&safe, &out, false);
    let (dtype, vae_dtype, pixels) = render(&out);
    assert_eq!((dtype, vae_dtype), (ModelDtype::F16, ModelDtype::F16));
    let (max, mean) = difference(&reference, &pixels);
    println!("fp16 with a float16 VAE decoder: largest difference {max} levels, mean {mean:.3}");
    assert!(max <= 6 && mean < 0.5, "largest {max}, mean {mean}");

    // The same decoder in a folder whose config says the VAE needs float32: refused at load,
    // with the file and the way out named.
    set_force_upcast(&out, true);
    let error = Pipeline::load(&out, &cpu_options()).err().expect("a float16 decoder against force_upcast loads");
    let message = error.to_string();
    assert!(message.contains("vae_decoder/model.onnx") && message.contains("force_upcast: true") && message.contains("float32"), "{message}");
}
