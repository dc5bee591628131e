//! Tiled VAE decode, the second in-place rung of the degrade ladder: close to the whole decode,
//! exactly whole when one tile covers the image, settings checked. (Its lower peak memory is
//! in `pipeline_memory.rs`.)
mod pipeline_support;

use std::ops::ControlFlow;

use pipeline_support::tiny_pipeline;
use shotfleet_consumer::pipeline::{Pipeline, RenderControl, RenderError, RenderRequest, StepProgress, VaeDecode};

fn request(width: u32, height: u32) -> RenderRequest {
    RenderRequest {
        prompt: "a lighthouse at dusk".into(),
        negative_prompt: Some("blurry".into()),
        width,
        height,
        steps: 2,
        guidance: 6.0,
        seed: 7,
        image_indices: vec![0],
        max_batch: 1,
    }
}

fn go(_: StepProgress) -> ControlFlow<()> {
    ControlFlow::Continue(())
}

/// RGB bytes of the one image of a render.
fn rgb(pipeline: &Pipeline, req: &RenderRequest, vae_decode: VaeDecode) -> Vec<u8> {
    let mut out = pipeline.render_with(req, &RenderControl { vae_decode, ..RenderControl::default() }, &mut go).unwrap();
    let image = out.images.remove(0);
    assert_eq!((image.width, image.height, image.rgb.len()), (req.width, req.height, 3 * (req.width * req.height) as usize));
    image.rgb
}

/// (largest, mean) absolute difference in 8-bit levels.
fn diff(a: &[u8], b: &[u8]) -> (u8, f64) {
    assert_eq!(a.len(), b.len());
    let max = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).max().unwrap();
    let mean = a.iter().zip(b).map(|(x, y)| f64::from(x.abs_diff(*y))).sum::<f64>() / a.len() as f64;
    (max, mean)
}

/// Each tile sees only its own latents (the decoder's convolutions and its mid-block attention
/// are cut at the tile's edge), so the image differs from the whole decode, most where the
/// blend is. Measured on the tiny fixture, 512x512, tiles of 256 px overlapping by 64 (3 x 3
/// tiles): mean 1.8 levels of 255, largest 38; 320x192 with tiles of 128/32 (edge tiles cut
/// short): mean 3.5, largest 50. The bounds below leave room for other CPUs' rounding.
#[test]
fn tiled_decode_is_close_to_the_whole_decode() {
    let pipeline = tiny_pipeline();
    for (req, tiles) in [
        (request(512, 512), VaeDecode::Tiled { tile: 256, overlap: 64 }),
        (request(320, 192), VaeDecode::Tiled { tile: 128, overlap: 32 }),
    ] {
        let whole = rgb(&pipeline, &req, VaeDecode::Whole);
        let tiled = rgb(&pipeline, &req, tiles);
        let (max, mean) = diff(&whole, &tiled);
        eprintln!("{}x{} {tiles:?}: mean {mean:.2}, max {max}", req.width, req.height);
        assert!(mean < 6.0, "{}x{} {tiles:?}: mean difference {mean}", req.width, req.height);
        assert!(max < 128, "{}x{} {tiles:?}: largest difference {max}", req.width, req.height);
        assert_ne!(whole, tiled, "tiles must really have been used");
    }
}

/// diffusers decodes whole when the latents fit in one tile; so does the pipeline.
#[test]
fn an_image_within_one_tile_is_decoded_whole() {
    let pipeline = tiny_pipeline();
    let req = request(128, 64);
    assert_eq!(rgb(&pipeline, &req, VaeDecode::Whole), rgb(&pipeline, &req, VaeDecode::tiled(128)));
}

#[test]
fn diffusers_default_tiles_for_sdxl() {
    assert_eq!(VaeDecode::tiled(1024), VaeDecode::Tiled { tile: 1024, overlap: 256 });
    assert_eq!(VaeDecode::tiled(512), VaeDecode::Tiled { tile: 512, overlap: 128 });
    assert_eq!(VaeDecode::default(), VaeDecode::Whole);
}

#[test]
fn tile_settings_are_checked_before_any_work() {
    let pipeline = tiny_pipeline();
    for tiles in [
        VaeDecode::Tiled { tile: 100, overlap: 16 },
        VaeDecode::Tiled { tile: 128, overlap: 12 },
        VaeDecode::Tiled { tile: 128, overlap: 128 },
        VaeDecode::Tiled { tile: 0, overlap: 0 },
    ] {
        let control = RenderControl { vae_decode: tiles, ..RenderControl::default() };
        let err = pipeline.render_with(&request(256, 256), &control, &mut go).unwrap_err();
        assert!(matches!(err, RenderError::InvalidRequest(_)), "{tiles:?}: {err}");
    }
}
