//! The step graph (guidance + Euler on the execution provider, latents resident between steps)
//! renders what the host step renders. Traced renders step on the host (the parity tests compare
//! those with diffusers); plain renders step on the device.

mod pipeline_support;

use std::ops::ControlFlow;

use pipeline_support::tiny_pipeline;
use shotfleet_consumer::pipeline::RenderRequest;

fn pixels(png: &[u8]) -> Vec<u8> {
    let mut reader = png::Decoder::new(std::io::Cursor::new(png)).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    buf
}

#[test]
fn device_steps_match_host_steps() {
    let pipeline = tiny_pipeline();
    for (guidance, negative) in [(6.0, Some("blurry")), (5.0, None), (1.0, None)] {
        let request = RenderRequest {
            prompt: "a lighthouse keeper on a cliff, ink wash".into(),
            negative_prompt: negative.map(Into::into),
            width: 128,
            height: 96,
            steps: 6,
            guidance,
            seed: 5,
            image_indices: vec![0, 1],
            max_batch: 2,
        };
        let device = pipeline.render(&request, &mut |_| ControlFlow::Continue(())).unwrap();
        let (host, _) = pipeline.render_traced(&request, None, &mut |_| ControlFlow::Continue(())).unwrap();
        for (d, h) in device.images.iter().zip(&host.images) {
            let (d, h) = (pixels(&d.png), pixels(&h.png));
            let max = d.iter().zip(&h).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
            // The same float32 arithmetic in the same order: seen identical here; one level of
            // slack for vectorised kernels on other CPUs.
            assert!(max <= 1, "guidance {guidance}: device and host steps differ by {max} levels");
        }
    }
}
