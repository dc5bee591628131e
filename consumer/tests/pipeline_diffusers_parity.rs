//! The render pipeline against diffusers 0.42.1's `StableDiffusionXLPipeline` on the same tiny
//! weights (`onnx/tiny`, made by `onnx/make_tiny.py`): same initial noise in, every stage compared.
//!
//! Tolerances, with the largest differences observed (CPU provider, ORT 1.31.1, x86-64) in
//! brackets; the test prints them (`--no-capture`):
//! - prompt and pooled embeddings: 1e-5 absolute [8.9e-7: ORT vs torch on the encoders]
//! - timesteps and add_time_ids exact, sigmas 1e-6 relative [exact]
//! - latents after every step and final latents: 1e-4 absolute, on values up to ~15
//!   [2.6e-5 (lighthouse, 6 steps, 2 images), 1.3e-5 (cat), 1.9e-6 (no guidance)]
//! - image: 1 level of 255 per channel [1, in 1 of 73,728 channel values (lighthouse);
//!   cat and no-guidance images are byte-identical]
mod pipeline_support;

use std::ops::ControlFlow;
use std::path::Path;

use pipeline_support::{max_abs_diff, npy_f32, npy_u8, reference_case, reference_dir, tiny_pipeline};
use shotfleet_consumer::pipeline::{Pipeline, PromptEmbeds};

const EMBED_TOL: f32 = 1e-5;
const LATENT_TOL: f32 = 1e-4;
const PIXEL_TOL: u8 = 1;

/// `[n, seq, dim]` reference embeddings: every image row must equal ours.
fn compare_embeds(ours: &PromptEmbeds, dir: &Path, embeds: &str, pooled: &str, n: usize) -> f32 {
    let reference = npy_f32(&dir.join(format!("{embeds}.npy")));
    let reference_pooled = npy_f32(&dir.join(format!("{pooled}.npy")));
    let ours_embeds: Vec<f32> = (0..n).flat_map(|_| ours.embeds.iter().copied()).collect();
    let ours_pooled: Vec<f32> = (0..n).flat_map(|_| ours.pooled.iter().copied()).collect();
    let d1 = max_abs_diff(&ours_embeds, reference.as_slice().unwrap(), embeds);
    let d2 = max_abs_diff(&ours_pooled, reference_pooled.as_slice().unwrap(), pooled);
    assert!(d1 <= EMBED_TOL, "{embeds}: max diff {d1}");
    assert!(d2 <= EMBED_TOL, "{pooled}: max diff {d2}");
    d1.max(d2)
}

fn parity(pipeline: &Pipeline, name: &str) {
    let case = reference_case(name);
    let dir = reference_dir().join(name);
    let noise = npy_f32(&dir.join("latents_init.npy"));
    let request = case.request();
    let (output, trace) = pipeline
        .render_traced(&request, Some(noise.as_slice().unwrap()), &mut |_| ControlFlow::Continue(()))
        .expect("render");
    assert_eq!(output.images.len(), case.images);

    let n = case.images;
    let embeds = compare_embeds(trace.prompt_embeds.as_ref().unwrap(), &dir, "prompt_embeds", "pooled_prompt_embeds", n);
    if case.guidance > 1.0 {
        let negative = trace.negative_prompt_embeds.as_ref().expect("guidance on: negative conditioning");
        compare_embeds(negative, &dir, "negative_prompt_embeds", "negative_pooled_prompt_embeds", n);
        if case.negative_prompt.is_empty() {
            assert!(negative.embeds.iter().chain(&negative.pooled).all(|&x| x == 0.0), "forced zeros");
        }
    } else {
        assert!(trace.negative_prompt_embeds.is_none(), "guidance off: no negative half");
    }

    let time_ids = npy_f32(&dir.join("add_time_ids.npy"));
    for row in time_ids.as_slice().unwrap().chunks(6) {
        assert_eq!(row, trace.add_time_ids, "add_time_ids");
    }
    assert_eq!(trace.timesteps.as_slice(), npy_f32(&dir.join("timesteps.npy")).as_slice().unwrap(), "timesteps");
    let sigmas = npy_f32(&dir.join("sigmas.npy"));
    let sigma_diff = max_abs_diff(&trace.sigmas, sigmas.as_slice().unwrap(), "sigmas");
    assert!(sigma_diff <= 1e-6 * sigmas[0], "sigmas: max diff {sigma_diff}");
    assert!((trace.init_noise_sigma - case.init_noise_sigma).abs() <= 1e-6 * case.init_noise_sigma);

    let mut worst_latent = 0.0f32;
    for (k, ours) in trace.latents_after_step.iter().enumerate() {
        let reference = npy_f32(&dir.join(format!("latents_step_{k}.npy")));
        let d = max_abs_diff(ours, reference.as_slice().unwrap(), &format!("latents_step_{k}"));
        assert!(d <= LATENT_TOL, "latents after step {k}: max diff {d}");
        worst_latent = worst_latent.max(d);
    }
    let final_ref = npy_f32(&dir.join("latents_final.npy"));
    let d = max_abs_diff(&trace.latents_final, final_ref.as_slice().unwrap(), "latents_final");
    assert!(d <= LATENT_TOL, "final latents: max diff {d}");

    let image_ref = npy_u8(&dir.join("image.npy"));
    let ours: Vec<u8> = trace.images_rgb.concat();
    let reference = image_ref.as_slice().unwrap();
    assert_eq!(ours.len(), reference.len(), "image size");
    let worst_pixel = ours.iter().zip(reference).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
    let differing = ours.iter().zip(reference).filter(|(a, b)| a != b).count();
    assert!(worst_pixel <= PIXEL_TOL, "image: max diff {worst_pixel}");
    eprintln!(
        "{name}: embeds {embeds:e}, latents {worst_latent:e}, final {d:e}, pixels max {worst_pixel} ({differing} of {} differ)",
        ours.len()
    );
}

#[test]
fn diffusers_parity_cat_64() {
    parity(&tiny_pipeline(), "cat_64");
}

#[test]
fn diffusers_parity_lighthouse_two_images_128x96() {
    parity(&tiny_pipeline(), "lighthouse_128x96");
}

#[test]
fn diffusers_parity_without_guidance() {
    parity(&tiny_pipeline(), "no_cfg_64");
}
