//! Render time per image of the tiny fixture model on the CPU, split by stage.
//!
//! `source scripts/env.sh && cargo run --release -p shotfleet-consumer --example render_bench`
//! (optional arguments: model folder, runs per size, intra-op threads). Prints the median of the runs per stage,
//! per image, at 64x64 and 128x128 (8 steps, guidance on, one image per call).

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions, RenderRequest, StageTimings};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/model"));
    let runs: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(7);
    let intra_threads: Option<usize> = args.next().map(|s| s.parse()).transpose()?;

    let started = Instant::now();
    let pipeline = Pipeline::load(&model, &PipelineOptions { intra_threads, ..PipelineOptions::default() })?;
    let info = pipeline.info();
    println!(
        "model {} ({:?}), ONNX Runtime {}, CPU provider, load {:.0} ms, {runs} runs per size (median)",
        info.name,
        info.dtype,
        info.ort_version,
        ms(started.elapsed())
    );
    println!("{:>9} {:>5} {:>12} {:>10} {:>10} {:>10} {:>10}", "size", "steps", "text_encode", "unet", "vae", "png", "total");
    for side in [64u32, 128] {
        let request = RenderRequest {
            prompt: "a watercolor painting of a lighthouse at dusk".into(),
            negative_prompt: Some("blurry".into()),
            width: side,
            height: side,
            steps: 8,
            guidance: 6.0,
            seed: 7,
            image_indices: vec![0],
            max_batch: 1,
        };
        // One warm-up render: ONNX Runtime plans memory and picks kernels on the first run.
        pipeline.render(&request, &mut |_| ControlFlow::Continue(()))?;
        // Per run: the whole (render and PNG encoding, as diffusers' figure has it), the render's
        // stages, and the encoding alone (the worker does it while the next job renders).
        let mut samples: Vec<(Duration, StageTimings, Duration)> = Vec::with_capacity(runs);
        for _ in 0..runs {
            let started = Instant::now();
            let out = pipeline.render(&request, &mut |_| ControlFlow::Continue(()))?;
            let encoding = Instant::now();
            for image in &out.images {
                image.encode_png()?;
            }
            samples.push((started.elapsed(), out.timings, encoding.elapsed()));
        }
        let median = |f: &dyn Fn(&(Duration, StageTimings, Duration)) -> Duration| {
            let mut v: Vec<Duration> = samples.iter().map(f).collect();
            v.sort();
            v[v.len() / 2]
        };
        println!(
            "{:>9} {:>5} {:>9.2} ms {:>7.2} ms {:>7.2} ms {:>7.2} ms {:>7.2} ms",
            format!("{side}x{side}"),
            request.steps,
            ms(median(&|s| s.1.text_encode)),
            ms(median(&|s| s.1.unet)),
            ms(median(&|s| s.1.vae)),
            ms(median(&|s| s.2)),
            ms(median(&|s| s.0)),
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
