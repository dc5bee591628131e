//! LoRA renders against diffusers 0.42.1 (`load_lora_weights` + `set_adapters`) on the tiny
//! model: the fixtures and references `onnx/make_lora_fixtures.py` made (kohya at 1.0, PEFT at
//! 0.7, the two stacked at 0.8 and 0.5, kohya at 0), rendered here from the same initial noise.
//! Tolerances as the base parity's: latents 1e-4 absolute, images 1 level of 255.
mod pipeline_support;

use std::ops::ControlFlow;
use std::sync::Arc;

use pipeline_support::{lora_adapter, lora_dir, max_abs_diff, npy_f32, npy_u8, reference_case, reference_dir, tiny_pipeline, ReferenceCase};
use serde::Deserialize;
use shotfleet_consumer::pipeline::lora::{Adapter, ResidentSet};
use shotfleet_consumer::pipeline::{Pipeline, Trace};
use shotfleet_schema::lora::LoraFile;

const LATENT_TOL: f32 = 1e-4;
const PIXEL_TOL: u8 = 1;

#[derive(Debug, Deserialize)]
struct LoraCase {
    name: String,
    base: String,
    loras: Vec<LoraUse>,
}

#[derive(Debug, Deserialize)]
struct LoraUse {
    file: String,
    weight: f32,
}

fn lora_case(name: &str) -> LoraCase {
    let text = std::fs::read_to_string(lora_dir().join("reference/cases.json")).expect("lora cases.json");
    let cases: Vec<LoraCase> = serde_json::from_str(&text).expect("lora cases.json parses");
    cases.into_iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no LoRA case {name}"))
}

fn render(pipeline: &Pipeline, base: &ReferenceCase, set: Option<&ResidentSet>) -> Trace {
    let noise = npy_f32(&reference_dir().join(&base.name).join("latents_init.npy"));
    let (_, trace) = pipeline
        .render_traced_with_loras(&base.request(), Some(noise.as_slice().unwrap()), set, &mut |_| ControlFlow::Continue(()))
        .expect("render");
    trace
}

/// Renders the case and compares it with diffusers' render; returns the largest pixel difference.
fn parity(pipeline: &Pipeline, name: &str) -> u8 {
    let case = lora_case(name);
    let base = reference_case(&case.base);
    let adapters: Vec<Adapter> = case.loras.iter().map(|l| lora_adapter(&l.file, l.weight)).collect();
    let merged = pipeline.merge_loras(&adapters).expect("merge");
    assert_eq!(merged.bytes(), pipeline.lora_set_bytes(&adapters).unwrap(), "set bytes computed without merging");
    let set = pipeline.place_loras(&merged).expect("place");
    assert_eq!(set.bytes(), merged.bytes());
    let trace = render(pipeline, &base, Some(&set));

    let dir = lora_dir().join("reference").join(name);
    let latents = npy_f32(&dir.join("latents_final.npy"));
    let latent_diff = max_abs_diff(&trace.latents_final, latents.as_slice().unwrap(), "latents_final");
    let reference = npy_u8(&dir.join("image.npy"));
    let reference = reference.as_slice().unwrap();
    let ours: Vec<u8> = trace.images_rgb.concat();
    assert_eq!(ours.len(), reference.len());
    let pixel_diff = ours.iter().zip(reference).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
    let off = ours.iter().zip(reference).filter(|(a, b)| a != b).count();
    println!("{name}: {} merged initializers ({} bytes), final latents max diff {latent_diff:.2e}, image max diff {pixel_diff} ({off} of {} values differ)", merged.len(), merged.bytes(), ours.len());
    assert!(latent_diff <= LATENT_TOL, "{name}: final latents differ by {latent_diff}");
    assert!(pixel_diff <= PIXEL_TOL, "{name}: image differs by {pixel_diff} levels");
    // The LoRA did change the image: diffusers' base render differs from this one.
    let base_image = npy_u8(&reference_dir().join(&case.base).join("image.npy"));
    let moved = ours.iter().zip(base_image.as_slice().unwrap()).filter(|(a, b)| a != b).count();
    if case.loras.iter().any(|l| l.weight != 0.0) {
        assert!(moved > ours.len() / 10, "{name}: only {moved} values differ from the base image");
    }
    pixel_diff
}

#[test]
fn kohya_lora_at_full_weight_matches_diffusers() {
    parity(&tiny_pipeline(), "kohya_1.0");
}

#[test]
fn peft_lora_at_0_7_matches_diffusers_on_two_non_square_images() {
    parity(&tiny_pipeline(), "peft_0.7");
}

#[test]
fn stack_of_two_loras_matches_diffusers() {
    parity(&tiny_pipeline(), "stack_0.8_0.5");
}

#[test]
fn lora_at_weight_zero_renders_the_base_image_exactly() {
    let pipeline = tiny_pipeline();
    let adapters = [lora_adapter("kohya_sgm.safetensors", 0.0)];
    let merged = pipeline.merge_loras(&adapters).unwrap();
    assert!(merged.is_empty(), "a weight-0 LoRA changes no weight");
    let set = pipeline.place_loras(&merged).unwrap();
    let base = reference_case("cat_64");
    let with_zero = render(&pipeline, &base, Some(&set));
    let without = render(&pipeline, &base, None);
    assert_eq!(with_zero.images_rgb, without.images_rgb);
    assert_eq!(with_zero.latents_final, without.latents_final);
    assert!(parity(&pipeline, "zero") <= PIXEL_TOL);
}

#[test]
fn kohya_names_with_diffusers_blocks_merge_as_sgm_names_do() {
    // The diffusers-named fixture holds a sample of the SGM-named file's tensors: merged alone,
    // each gives the same weights as the same modules taken from the SGM-named file.
    let pipeline = tiny_pipeline();
    let named = lora_adapter("kohya_diffusers_names.safetensors", 1.0);
    let sgm = lora_adapter("kohya_sgm.safetensors", 1.0);
    let modules: Vec<(_, String)> = named.file.targets.iter().map(|t| (t.part, t.module.clone())).collect();
    let sample = LoraFile {
        format: sgm.file.format,
        targets: sgm.file.targets.iter().filter(|t| modules.contains(&(t.part, t.module.clone()))).cloned().collect(),
    };
    let sgm_sample = Adapter { file: Arc::new(sample), ..sgm };
    let a = pipeline.merge_loras(&[named]).unwrap();
    let b = pipeline.merge_loras(&[sgm_sample]).unwrap();
    assert_eq!((a.len(), a.bytes()), (b.len(), b.bytes()));
    let base = reference_case("cat_64");
    let ra = render(&pipeline, &base, Some(&pipeline.place_loras(&a).unwrap()));
    let rb = render(&pipeline, &base, Some(&pipeline.place_loras(&b).unwrap()));
    assert_eq!(ra.images_rgb, rb.images_rgb);
}
