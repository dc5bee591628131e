//! float16 models: the same pipeline reads the graphs' element types and converts at the edges.
//! The tiny fixture is converted here with `onnx/to_fp16.py` (the test venv's onnx and
//! onnxruntime), both ways: fully float16, as a GPU model is (ONNX Runtime 1.31.1's CPU provider
//! runs the tiny model's ops in float16), and with float16 only at the graph edges. The VAE
//! decoder follows its config: float32 while it says `force_upcast` (the fixture's does, as SDXL's
//! own VAE), float16 once it does not, and a float16 decoder against `force_upcast` is refused.

mod pipeline_support;

use std::path::Path;

use pipeline_support::{cpu_options, lighthouse_pixels, load, model_dir, onnx_script, pixel_difference};
use shotfleet_testkit::paths::copy_dir;
use shotfleet_consumer::pipeline::{ModelDtype, Pipeline};

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

fn convert_from(source: &Path, out: &Path, edges_only: bool) {
    let mut args = vec![source.as_os_str(), out.as_os_str()];
    if edges_only {
        args.push("--cpu-compatible".as_ref());
    }
    onnx_script("to_fp16.py", &args);
}

/// The UNet's and the VAE decoder's element types, and the image's pixels.
fn render(dir: &Path) -> (ModelDtype, ModelDtype, Vec<u8>) {
    let pipeline = load(dir);
    (pipeline.info().dtype, pipeline.info().vae_dtype, lighthouse_pixels(&pipeline))
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
        let (max, mean) = pixel_difference(&reference, &pixels);
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
    let (max, mean) = pixel_difference(&reference, &pixels);
    println!("fp16 with a float16 VAE decoder: largest difference {max} levels, mean {mean:.3}");
    assert!(max <= 6 && mean < 0.5, "largest {max}, mean {mean}");

    // The same decoder in a folder whose config says the VAE needs float32: refused at load,
    // with the file and the way out named.
    set_force_upcast(&out, true);
    let error = Pipeline::load(&out, &cpu_options()).err().expect("a float16 decoder against force_upcast loads");
    let message = error.to_string();
    assert!(message.contains("vae_decoder/model.onnx") && message.contains("force_upcast: true") && message.contains("float32"), "{message}");
}
