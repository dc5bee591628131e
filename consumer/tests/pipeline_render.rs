//! Rendering through the public API: noise per (seed, index) independent of batching,
//! progress and cancellation, request validation, PNG metadata.
mod pipeline_support;

use std::ops::ControlFlow;

use pipeline_support::tiny_pipeline;
use shotfleet_consumer::pipeline::{ModelDtype, RenderError, RenderRequest};

fn request(indices: Vec<u32>, max_batch: usize) -> RenderRequest {
    RenderRequest {
        prompt: "a lighthouse at dusk".into(),
        negative_prompt: Some("blurry".into()),
        width: 64,
        height: 64,
        steps: 3,
        guidance: 6.0,
        seed: 1234,
        image_indices: indices,
        max_batch,
    }
}

fn go(_: shotfleet_consumer::pipeline::StepProgress) -> ControlFlow<()> {
    ControlFlow::Continue(())
}

/// The degrade ladder splits batches in place: image i must be the same whichever way the
/// job's images are grouped. PNG bytes are compared, so pixels and metadata both match.
#[test]
fn split_batch_renders_the_same_images() {
    let pipeline = tiny_pipeline();
    let together = pipeline.render(&request(vec![0, 1], 2), &mut go).unwrap();
    let one_by_one = pipeline.render(&request(vec![0, 1], 1), &mut go).unwrap();
    let only_second = pipeline.render(&request(vec![1], 1), &mut go).unwrap();
    assert_eq!(together.images.len(), 2);
    assert_eq!(together.images[0].index, 0);
    assert_eq!(together.images[1].index, 1);
    assert_eq!(together.images[0].rgb, one_by_one.images[0].rgb, "image 0: batch of 2 vs alone");
    assert_eq!(together.images[1].rgb, one_by_one.images[1].rgb, "image 1: batch of 2 vs alone");
    assert_eq!(together.images[1].rgb, only_second.images[0].rgb, "image 1 rendered on its own");
    assert_ne!(together.images[0].rgb, together.images[1].rgb, "different indices, different noise");
    let again = pipeline.render(&request(vec![0], 1), &mut go).unwrap();
    assert_eq!(again.images[0].rgb, together.images[0].rgb, "same seed and index, same image");
}

#[test]
fn progress_reports_every_step_and_break_cancels() {
    let pipeline = tiny_pipeline();
    let mut seen = Vec::new();
    pipeline
        .render(&request(vec![0, 1, 2], 2), &mut |p| {
            seen.push((p.step, p.steps, p.images, p.images_done));
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(seen, vec![(1, 3, 2, 0), (2, 3, 2, 0), (3, 3, 2, 0), (1, 3, 1, 2), (2, 3, 1, 2), (3, 3, 1, 2)]);

    let err = pipeline
        .render(&request(vec![0], 1), &mut |p| if p.step == 2 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) })
        .unwrap_err();
    assert!(matches!(err, RenderError::Cancelled { steps_done: 2 }), "{err}");
}

#[test]
fn invalid_requests_are_refused_before_any_work() {
    let pipeline = tiny_pipeline();
    let cases = [
        RenderRequest { width: 60, ..request(vec![0], 1) },
        RenderRequest { steps: 0, ..request(vec![0], 1) },
        RenderRequest { image_indices: vec![], ..request(vec![0], 1) },
        RenderRequest { max_batch: 0, ..request(vec![0], 1) },
    ];
    for req in cases {
        let err = pipeline.render(&req, &mut go).unwrap_err();
        assert!(matches!(err, RenderError::InvalidRequest(_)), "{err}");
        assert!(err.message().is_none(), "not an ONNX Runtime error");
    }
    // A multiple of 8 that the UNet cannot halve and double back (72 / 8 = 9 latent elements;
    // the tiny UNet halves once): refused with the multiple and a size near it, instead of
    // failing inside ONNX Runtime at the up block's Concat on every attempt.
    assert_eq!(pipeline.info().side_multiple, 16);
    let err = pipeline.render(&RenderRequest { width: 72, height: 64, ..request(vec![0], 1) }, &mut go).unwrap_err();
    assert!(matches!(err, RenderError::InvalidRequest(_)), "{err}");
    let message = err.to_string();
    assert!(message.contains("multiples of 16") && message.contains("64x64"), "{message}");
}

#[test]
fn png_carries_parameters_and_info_describes_the_model() {
    let pipeline = tiny_pipeline();
    let info = pipeline.info();
    assert_eq!(info.dtype, ModelDtype::F32);
    assert_eq!(info.latent_channels, 4);
    assert_eq!(info.vae_scale_factor, 8);
    assert!(info.ort_version.starts_with("1."), "{}", info.ort_version);

    let out = pipeline.render(&RenderRequest { width: 128, height: 64, ..request(vec![3], 1) }, &mut go).unwrap();
    let image = &out.images[0];
    assert_eq!((image.index, image.seed, image.width, image.height), (3, 1234, 128, 64));
    let png = image.encode_png().unwrap();
    let decoder = png::Decoder::new(std::io::Cursor::new(&png));
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    reader.next_frame(&mut pixels).unwrap();
    assert_eq!(pixels, image.rgb, "the PNG holds the rendered pixels");
    let info = reader.info();
    assert_eq!((info.width, info.height), (128, 64));
    let text = |key: &str| info.uncompressed_latin1_text.iter().find(|t| t.keyword == key).map(|t| t.text.clone());
    assert_eq!(
        text("parameters").unwrap(),
        "a lighthouse at dusk\nNegative prompt: blurry\nSteps: 3, Sampler: Euler, CFG scale: 6, Seed: 1234, Image index: 3, Size: 128x64, Model: model"
    );
    assert_eq!(text("seed").as_deref(), Some("1234"));
    assert_eq!(text("image_index").as_deref(), Some("3"));
    assert!(out.timings.unet > std::time::Duration::ZERO);
}

/// The worker shares one pipeline between its blocking render thread and its health checks.
#[test]
fn pipeline_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<shotfleet_consumer::pipeline::Pipeline>();
    assert_send_sync::<RenderError>();
}

/// Loading warms every run thread with a render, and work given to `spawn_run` runs on those
/// threads alone, as many as `run_threads` says: ONNX Runtime's CUDA provider keeps memory per
/// calling thread (worker/run_thread.rs), so renders must not wander over new threads.
#[test]
fn runs_land_on_the_pipelines_own_threads_and_no_others() {
    use pipeline_support::{cpu_options, model_dir, require_ort};
    use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions};
    use std::collections::BTreeSet;
    use std::sync::{Arc, mpsc};

    require_ort();
    let pipeline = Arc::new(Pipeline::load(&model_dir(), &PipelineOptions { run_threads: 2, ..cpu_options() }).unwrap());
    // Loading warmed each thread with a render, so no job is a thread's first graph run.
    let warmed: BTreeSet<_> = pipeline.run_thread_names().iter().cloned().collect();
    assert_eq!(warmed, BTreeSet::from(["onnx-run-0".to_owned(), "onnx-run-1".to_owned()]));

    let (done, runs) = mpsc::channel();
    for i in 0..12 {
        let (done, pipeline) = (done.clone(), pipeline.clone());
        pipeline.clone().spawn_run(move || {
            // Every fourth is a real render: the threads run graphs, not only closures. Its
            // result goes back to the test (a panic here would abort the test binary).
            let rendered = (i % 4 == 0).then(|| pipeline.render(&request(vec![0], 1), &mut go).map(|_| ()).map_err(|e| e.to_string()));
            let _ = done.send((std::thread::current().name().map(str::to_owned), rendered));
        });
    }
    drop(done);
    let (mut names, mut count) = (BTreeSet::new(), 0);
    for (name, rendered) in runs.iter() {
        count += 1;
        if let Some(rendered) = rendered {
            rendered.expect("a render on a run thread");
        }
        names.insert(name.expect("run threads are named"));
    }
    assert_eq!(count, 12, "every piece of work ran");
    assert!(names.is_subset(&warmed), "{names:?} ran outside the warmed threads {warmed:?}");
}

/// A UNet session per run thread (`unet_sessions`, "lanes") lets two renders' schedules run at
/// once: while one render is held in the middle of its schedule, another finishes on the other
/// thread. With one session the other waits for the first schedule to end (a render holds the
/// session from its first step to its last). Either way the images are the same, every lane's
/// arena is listed, and a shrink goes through every lane.
#[test]
fn a_unet_session_per_run_thread_lets_two_schedules_run_at_once() {
    use pipeline_support::{cpu_options, model_dir, require_ort};
    use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions, StepProgress};
    use std::sync::{Arc, mpsc};
    use std::time::Duration;

    require_ort();
    let reference = tiny_pipeline().render(&request(vec![0], 1), &mut go).unwrap().images[0].rgb.clone();
    for lanes in [1, 2] {
        let options = PipelineOptions { run_threads: 2, unet_sessions: lanes, ..cpu_options() };
        let pipeline = Arc::new(Pipeline::load(&model_dir(), &options).unwrap());
        let unets: Vec<String> = pipeline.arena_stats().into_iter().map(|(graph, _)| graph).filter(|g| g.starts_with("unet")).collect();
        assert_eq!(unets, if lanes == 1 { vec!["unet"] } else { vec!["unet", "unet_2"] }, "{lanes} lane(s)");

        let (held, is_held) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let (done, finished) = mpsc::channel();
        let render = |name: &'static str, mut on_step: Box<dyn FnMut(StepProgress) -> ControlFlow<()> + Send>| {
            let (pipeline, done) = (pipeline.clone(), done.clone());
            pipeline.clone().spawn_run(move || {
                let rendered = pipeline.render(&request(vec![0], 1), &mut on_step).map(|out| out.images[0].rgb.clone()).map_err(|e| e.to_string());
                let _ = done.send((name, rendered));
            });
        };
        render(
            "held",
            Box::new(move |p| {
                if p.step == 1 {
                    held.send(()).unwrap();
                    // Bounded: a failing assertion below must not leave this thread waiting forever.
                    let _ = released.recv_timeout(Duration::from_secs(60));
                }
                ControlFlow::Continue(())
            }),
        );
        is_held.recv_timeout(Duration::from_secs(60)).expect("the first render reached its first step");
        render("other", Box::new(go));
        let other = finished.recv_timeout(Duration::from_secs(if lanes == 1 { 3 } else { 60 }));
        if lanes == 1 {
            assert!(other.is_err(), "one session: the other render waits for the held schedule, but {other:?}");
        } else {
            let (name, rendered) = other.expect("a lane per thread: the other render finishes while the first is held");
            assert_eq!(name, "other");
            assert_eq!(rendered.unwrap(), reference, "the second lane renders the same image");
        }
        release.send(()).unwrap();
        let mut results: Vec<_> = finished.iter().take(if lanes == 1 { 2 } else { 1 }).collect();
        results.sort();
        for (name, rendered) in results {
            assert_eq!(rendered.unwrap_or_else(|e| panic!("{name}: {e}")), reference, "{name}, {lanes} lane(s)");
        }
        pipeline.shrink_arenas().expect("a shrink through every lane");
    }
}
