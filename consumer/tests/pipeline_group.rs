//! Several compatible jobs in shared UNet batches render exactly what each renders alone.

mod pipeline_support;

use std::ops::ControlFlow;

use pipeline_support::tiny_pipeline;
use shotfleet_consumer::pipeline::{RenderControl, RenderRequest};

fn request(prompt: &str, negative: Option<&str>, seed: u64, images: u32) -> RenderRequest {
    RenderRequest {
        prompt: prompt.into(),
        negative_prompt: negative.map(Into::into),
        width: 64,
        height: 96,
        steps: 3,
        guidance: 6.0,
        seed,
        image_indices: (0..images).collect(),
        max_batch: 8,
    }
}

#[test]
fn a_group_renders_what_each_job_renders_alone() {
    let pipeline = tiny_pipeline();
    let jobs = [
        request("a lighthouse at dawn", None, 7, 2),
        request("a red tram in the rain", Some("blurry"), 99, 1),
        request("moths around a lantern", Some("text, watermark"), 7, 3),
    ];
    let group = pipeline
        .render_group(&jobs, &RenderControl::default(), &mut |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(group.len(), 3);
    for (job, together) in jobs.iter().zip(&group) {
        let alone = pipeline.render(job, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(alone.images.len(), together.images.len());
        for (a, t) in alone.images.iter().zip(&together.images) {
            assert_eq!(a.index, t.index);
            assert_eq!(a.rgb, t.rgb, "{}: image {} differs when batched with other jobs", job.prompt, a.index);
        }
    }
}

#[test]
fn incompatible_jobs_are_refused_together() {
    let pipeline = tiny_pipeline();
    let mut other = request("b", None, 1, 1);
    other.steps = 4;
    let err = pipeline
        .render_group(&[request("a", None, 1, 1), other], &RenderControl::default(), &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(err.to_string().contains("share size, steps and guidance"), "{err}");
}
