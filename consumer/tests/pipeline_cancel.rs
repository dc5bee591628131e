//! Stopping a render from another thread through a `CancelHandle` (the worker's per-job time
//! limit): ONNX Runtime's `RunOptions::terminate` stops the graph in progress, and the render
//! says `RenderError::Terminated`, distinct from the callback's `Cancelled`.
mod pipeline_support;

use std::ops::ControlFlow;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pipeline_support::tiny_pipeline;
use shotfleet_consumer::failure::{ErrorKind, classify_render};
use shotfleet_consumer::pipeline::{CancelHandle, RenderControl, RenderError, RenderRequest, Stage};

fn request(side: u32, steps: u32) -> RenderRequest {
    RenderRequest {
        prompt: "a lighthouse at dusk".into(),
        negative_prompt: None,
        width: side,
        height: side,
        steps,
        guidance: 6.0,
        seed: 3,
        image_indices: vec![0],
        max_batch: 1,
    }
}

/// The cancel lands while the one whole VAE run of a 640x640 image is in progress (that run
/// takes a few hundred milliseconds here; the cancel comes 40 ms after the last UNet step). No
/// check of the pipeline's own sits between the start of that run and its end, so only ONNX
/// Runtime's terminate flag can stop it.
#[test]
fn cancel_terminates_the_graph_run_in_progress() {
    let pipeline = tiny_pipeline();
    let control = RenderControl::default();
    let (tx, rx) = mpsc::channel();
    let cancel = control.cancel.clone();
    let timer = std::thread::spawn(move || {
        rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(40));
        cancel.cancel();
        Instant::now()
    });
    let err = pipeline
        .render_with(&request(640, 2), &control, &mut |p| {
            if p.step == p.steps {
                tx.send(()).unwrap();
            }
            ControlFlow::Continue(())
        })
        .unwrap_err();
    let returned = Instant::now();
    let cancelled = timer.join().unwrap();
    assert!(matches!(err, RenderError::Terminated { stage: Stage::Vae }), "{err}");
    assert_eq!(classify_render(&err), ErrorKind::Timeout);
    assert_eq!(err.stage(), Some(Stage::Vae));
    assert!(err.message().is_none(), "not reported as an ONNX Runtime failure: {err}");
    eprintln!("returned {:?} after the cancel", returned.duration_since(cancelled));

    // A cancelled handle stays cancelled; the pipeline itself is fine.
    let again = pipeline.render_with(&request(64, 1), &control, &mut |_| ControlFlow::Continue(())).unwrap_err();
    assert!(matches!(again, RenderError::Terminated { stage: Stage::TextEncode }), "{again}");
    pipeline.render_with(&request(64, 1), &RenderControl::default(), &mut |_| ControlFlow::Continue(())).unwrap();
}

#[test]
fn cancel_between_steps_stops_before_the_next_step() {
    let pipeline = tiny_pipeline();
    let handle = CancelHandle::new();
    let control = RenderControl { cancel: handle.clone(), ..RenderControl::default() };
    let mut steps = 0;
    let err = pipeline
        .render_with(&request(64, 5), &control, &mut |p| {
            steps = p.step;
            if p.step == 2 {
                handle.cancel();
            }
            ControlFlow::Continue(())
        })
        .unwrap_err();
    assert!(matches!(err, RenderError::Terminated { stage: Stage::Unet }), "{err}");
    assert_eq!(steps, 2);
    assert!(handle.is_cancelled());
}

/// The callback path stays: `Break` gives `Cancelled` with the steps done.
#[test]
fn on_step_break_is_still_cancelled_not_terminated() {
    let pipeline = tiny_pipeline();
    let err = pipeline
        .render_with(&request(64, 4), &RenderControl::default(), &mut |p| if p.step == 3 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) })
        .unwrap_err();
    assert!(matches!(err, RenderError::Cancelled { steps_done: 3 }), "{err}");
}
