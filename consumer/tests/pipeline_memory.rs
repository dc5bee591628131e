//! Real out-of-memory on the CPU: the tiny pipeline under a capped CPU arena
//! (`PipelineOptions::cpu_arena_max_mem`), the failure's text, recovery in the same process, and
//! the in-place degrade rungs that fit where the full render does not.
//!
//! Figures with a 96 MiB cap (ONNX Runtime 1.31.1, CPU, tiny fixture, one step; "peak" is the
//! arena's `max_in_use` in a fresh process):
//!
//! | render | peak | under 96 MiB |
//! | --- | --- | --- |
//! | 64x64, 1 image, guidance 6 | 2.0 MiB | fits |
//! | 384x384, 4 images in one UNet batch, guidance 6 | 89 MiB | fits in a fresh arena |
//! | 384x384, 6 images in one UNet batch, guidance 6 | more | fails in the UNet |
//! | 384x384, images one at a time, guidance 6 | 44 MiB | fits |
//! | 512x512, 1 image, no guidance, whole decode | 130 MiB | fails in the VAE (asks for 64 MiB at once) |
//! | 512x512, 1 image, no guidance, tiles 256/64 | 35 MiB | fits |
//!
//! The cap is process-wide, so every test of this binary loads with the same one.
mod pipeline_support;

use std::ops::ControlFlow;

use pipeline_support::{cpu_options, model_dir, require_ort};
use shotfleet_consumer::failure::{ErrorKind, classify_render};
use shotfleet_consumer::pipeline::{
    LoadError, Pipeline, PipelineOptions, RenderControl, RenderError, RenderRequest, Stage, StepProgress, VaeDecode,
};

const CAP: u64 = 96 << 20;

fn capped() -> Pipeline {
    require_ort();
    Pipeline::load(&model_dir(), &PipelineOptions { cpu_arena_max_mem: Some(CAP), ..cpu_options() }).unwrap()
}

fn uncapped() -> Pipeline {
    require_ort();
    Pipeline::load(&model_dir(), &cpu_options()).unwrap()
}

fn request(side: u32, images: u32, max_batch: usize, guidance: f32) -> RenderRequest {
    RenderRequest {
        prompt: "a lighthouse at dusk".into(),
        negative_prompt: None,
        width: side,
        height: side,
        steps: 1,
        guidance,
        seed: 42,
        image_indices: (0..images).collect(),
        max_batch,
    }
}

fn go(_: StepProgress) -> ControlFlow<()> {
    ControlFlow::Continue(())
}

/// The arena's own words, as ONNX Runtime 1.31.1 gives them (`RenderError::message`); with a
/// 64 MiB cap, 512x512, guidance 6, word for word (one line):
/// "Non-zero status code returned while running Softmax node. Name:'/unet/down_blocks.1/attentions.0/transformer_blocks.0/attn1/Softmax'
/// Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:360 void*
/// onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Available memory
/// of 28226560 is smaller than requested bytes of 33554432", code 1 (FAIL).
fn assert_arena_oom(err: &RenderError, stage: Stage) -> (u64, u64) {
    let RenderError::Runtime { stage: got, .. } = err else { panic!("expected an ONNX Runtime error, got {err}") };
    assert_eq!(*got, stage, "{err}");
    assert_eq!(err.code(), Some(ort::error::ErrorCode::GenericFailure), "{err}");
    let message = err.message().unwrap();
    assert!(message.contains("BFCArena::AllocateRawInternal"), "{message}");
    let number_after = |key: &str| -> u64 {
        let at = message.find(key).unwrap_or_else(|| panic!("no {key:?} in {message}")) + key.len();
        message[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    let available = number_after("Available memory of ");
    let requested = number_after("is smaller than requested bytes of ");
    assert!(available < requested && available <= CAP, "{message}");
    (available, requested)
}

#[test]
fn a_unet_batch_too_large_fails_for_real_and_one_at_a_time_fits() {
    let pipeline = capped();
    let err = pipeline.render(&request(384, 6, 6, 6.0), &mut go).unwrap_err();
    assert_arena_oom(&err, Stage::Unet);
    assert_eq!(classify_render(&err), ErrorKind::Oom);

    // The first rung, in place: the same job one image per UNet batch.
    pipeline.shrink_arenas().unwrap();
    let split = pipeline.render(&request(384, 6, 1, 6.0), &mut go).unwrap();
    assert_eq!(split.images.len(), 6);
    let stats = pipeline.cpu_arena_stats().unwrap();
    assert_eq!(stats.limit, CAP);
    assert!(stats.max_in_use < CAP, "{stats:?}");

    // Same images as an uncapped pipeline renders (noise per (seed, index), allocator-blind).
    let reference = uncapped().render(&request(384, 1, 1, 6.0), &mut go).unwrap();
    assert_eq!(split.images[0].rgb, reference.images[0].rgb);
}

#[test]
fn a_whole_decode_too_large_fails_and_the_tiled_decode_fits() {
    let pipeline = capped();
    let tiled = RenderControl { vae_decode: VaeDecode::Tiled { tile: 256, overlap: 64 }, ..RenderControl::default() };
    let out = pipeline.render_with(&request(512, 1, 1, 1.0), &tiled, &mut go).unwrap();
    assert_eq!(out.images.len(), 1);
    let tiled_peak = pipeline.cpu_arena_stats().unwrap().max_in_use;
    assert!(tiled_peak < 48 << 20, "tiled render peaked at {tiled_peak} bytes (measured: 36442768)");

    let err = pipeline.render(&request(512, 1, 1, 1.0), &mut go).unwrap_err();
    // The decoder's mid-block attention over 64x64 latents: 4096 x 4096 f32 in one piece.
    let (_, requested) = assert_arena_oom(&err, Stage::Vae);
    assert_eq!(classify_render(&err), ErrorKind::Oom);
    assert_eq!(requested, 4096 * 4096 * 4);
}

#[test]
fn after_out_of_memory_the_same_pipeline_and_a_reloaded_one_render_as_a_fresh_one() {
    let pipeline = capped();
    let err = pipeline.render(&request(512, 1, 1, 6.0), &mut go).unwrap_err();
    assert!(matches!(err, RenderError::Runtime { .. }), "{err}");
    assert!(err.message().unwrap().contains("is smaller than requested bytes of"), "{err}");

    let fresh = uncapped().render(&request(64, 1, 1, 6.0), &mut go).unwrap();
    // The failed session serves the next, smaller render without any repair.
    let same = pipeline.render(&request(64, 1, 1, 6.0), &mut go).unwrap();
    assert_eq!(same.images[0].rgb, fresh.images[0].rgb);

    // The arena keeps the failed run's regions until shrunk.
    let before = pipeline.cpu_arena_stats().unwrap();
    pipeline.shrink_arenas().unwrap();
    let after = pipeline.cpu_arena_stats().unwrap();
    assert!(after.total_allocated < before.total_allocated, "{before:?} -> {after:?}");
    assert!(after.num_shrinkages > before.num_shrinkages);

    // Sessions rebuilt in place: same folder, same options, same images.
    let pipeline = pipeline.reload().unwrap();
    let reloaded = pipeline.render(&request(64, 1, 1, 6.0), &mut go).unwrap();
    assert_eq!(reloaded.images[0].rgb, fresh.images[0].rgb);
}

#[test]
fn the_cap_is_process_wide_and_set_once() {
    let _first = capped();
    let err = match Pipeline::load(&model_dir(), &PipelineOptions { cpu_arena_max_mem: Some(2 * CAP), ..cpu_options() }) {
        Err(e) => e,
        Ok(_) => panic!("a second, different cap was accepted"),
    };
    assert!(matches!(err, LoadError::CpuArena { .. }), "{err}");
    assert!(err.to_string().contains(&CAP.to_string()), "{err}");
    // The same cap again shares the arena; no cap keeps private, uncapped arenas.
    let again = capped();
    assert_eq!(again.cpu_arena_stats().unwrap().limit, CAP);
    assert!(uncapped().cpu_arena_stats().is_none());
}

#[test]
fn every_decode_gives_the_arena_back_so_each_image_starts_from_the_weights() {
    let pipeline = capped();
    let before = pipeline.cpu_arena_stats().unwrap();
    let out = pipeline.render(&request(128, 3, 3, 6.0), &mut go).unwrap();
    assert_eq!(out.images.len(), 3);
    let after = pipeline.cpu_arena_stats().unwrap();
    // The render asked for no shrink of its own (no request_arena_shrink), yet the decoder's runs
    // gave their regions back: what is reserved after it is far under what its peak held.
    assert!(after.num_shrinkages > before.num_shrinkages, "{before:?} -> {after:?}");
    assert!(after.total_allocated * 2 < after.max_in_use, "{after:?}");

    // Tiled: every tile's run shrinks too.
    let tiled = RenderControl { vae_decode: VaeDecode::Tiled { tile: 64, overlap: 16 }, ..RenderControl::default() };
    pipeline.render_with(&request(128, 1, 1, 6.0), &tiled, &mut go).unwrap();
    let tiled_after = pipeline.cpu_arena_stats().unwrap();
    assert!(tiled_after.num_shrinkages > after.num_shrinkages, "{after:?} -> {tiled_after:?}");

    // A decoder that keeps its arena (`[budget] vae_keeps_arena`) gives nothing back by itself.
    // Counted from after its load: loading warms each run thread with a tiny render that does
    // shrink (Pipeline::load).
    let keeping = Pipeline::load(&model_dir(), &PipelineOptions { cpu_arena_max_mem: Some(CAP), vae_keeps_arena: true, ..cpu_options() }).unwrap();
    let loaded = keeping.cpu_arena_stats().unwrap();
    keeping.render(&request(128, 3, 3, 6.0), &mut go).unwrap();
    let kept = keeping.cpu_arena_stats().unwrap();
    assert_eq!(kept.num_shrinkages, loaded.num_shrinkages, "{loaded:?} -> {kept:?}");
}

/// `shrink_arenas` runs the decoder only where its arena holds more than its weights: after a
/// decode that failed, or where it keeps its arena. A decoder that gave its regions back at the
/// end of its last decode is left out, because on a GPU a tiny decode between two decodes of
/// one size makes every convolution plan again (~1.1 s a decode on the H200). Counted as the
/// allocations one shrink makes, which the decoder's tiny run adds to.
#[test]
fn an_arena_shrink_runs_the_decoder_only_where_its_arena_holds_more_than_its_weights() {
    let shrink_allocs = |p: &Pipeline| {
        let before = p.cpu_arena_stats().unwrap().num_allocs;
        p.shrink_arenas().unwrap();
        p.cpu_arena_stats().unwrap().num_allocs - before
    };
    let pipeline = capped();
    pipeline.render(&request(128, 1, 1, 6.0), &mut go).unwrap();
    let without_decoder = shrink_allocs(&pipeline);

    let err = pipeline.render(&request(512, 1, 1, 1.0), &mut go).unwrap_err();
    assert_arena_oom(&err, Stage::Vae);
    let after_failure = shrink_allocs(&pipeline);
    assert!(after_failure > without_decoder, "after the failed decode {after_failure} allocations, after a good one {without_decoder}");
    // That shrink's own decode gave its regions back: the next leaves the decoder out again.
    assert_eq!(shrink_allocs(&pipeline), without_decoder);

    let keeping = Pipeline::load(&model_dir(), &PipelineOptions { cpu_arena_max_mem: Some(CAP), vae_keeps_arena: true, ..cpu_options() }).unwrap();
    keeping.render(&request(128, 1, 1, 6.0), &mut go).unwrap();
    assert!(shrink_allocs(&keeping) > without_decoder, "a decoder that keeps its arena is shrunk by running it");
}
