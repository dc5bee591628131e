//! A UNet whose linear weights are packed into 4 or 8 bits (`onnx/quantize_unet.py`, ONNX
//! Runtime's MatMulNBits), the form that lets SDXL start on an 8 GiB card: the same pipeline
//! loads and renders it, says so in its info, refuses LoRA jobs with the reason, and refuses a
//! packing record it cannot vouch for. The tiny fixture is quantized here with the test venv's
//! onnxruntime.

mod pipeline_support;

use std::path::Path;

use pipeline_support::{cpu_options, lighthouse_pixels, load, model_dir, onnx_script, pixel_difference, tiny_pipeline};
use shotfleet_consumer::pipeline::{PackedWeights, Pipeline};

fn quantize(out: &Path, bits: &str) {
    onnx_script("quantize_unet.py", &[model_dir().as_os_str(), out.as_os_str(), "--bits".as_ref(), bits.as_ref()]);
}

#[test]
fn a_unet_packed_into_few_bits_renders_close_to_the_float_one() {
    let reference = lighthouse_pixels(&tiny_pipeline());
    let dir = tempfile::tempdir().unwrap();
    // Measured (2026-12-01, 64x64, 4 steps, blocks of 64): 8 bits at most 1 level off, mean
    // 0.036; 4 bits at most 4, mean 0.454. The bounds leave room for other CPUs' rounding.
    for (bits, max_allowed, mean_allowed) in [(8u8, 3u8, 0.2), (4, 12, 1.5)] {
        let out = dir.path().join(format!("q{bits}"));
        quantize(&out, &bits.to_string());
        let pipeline = load(&out);
        assert_eq!(pipeline.info().unet_packed, Some(PackedWeights { bits, block_size: 64 }));
        let pixels = lighthouse_pixels(&pipeline);
        let (max, mean) = pixel_difference(&reference, &pixels);
        println!("{bits}-bit UNet: largest difference {max} levels, mean {mean:.3}");
        assert!(max <= max_allowed && mean < mean_allowed, "{bits} bits: largest {max}, mean {mean}");
        assert_ne!(pixels, reference, "{bits} bits: the packed weights were not used");

        // A LoRA merges into float weights: the worker gives such jobs to another worker.
        let refusal = pipeline.require_loras().expect_err("a packed UNet takes LoRAs").to_string();
        assert!(refusal.contains(&format!("packed into {bits} bits")) && refusal.contains("quantize_unet.py"), "{refusal}");
    }
}

#[test]
fn a_packing_record_the_worker_cannot_vouch_for_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q4");
    quantize(&out, "4");
    let record = out.join("unet/quantization.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    json["bits"] = 3.into();
    std::fs::write(&record, serde_json::to_vec(&json).unwrap()).unwrap();
    let message = Pipeline::load(&out, &cpu_options()).err().expect("3 bits loaded").to_string();
    assert!(message.contains("unet/quantization.json") && message.contains("4 or 8 bits"), "{message}");
}
