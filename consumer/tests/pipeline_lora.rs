//! LoRA sets in the pipeline: a render binds its own set and nothing else (after another job's
//! set, in a group, on fixed UNet buffers, from two threads at once), and LoRAs that do not fit
//! the model are refused naming the layer.
mod pipeline_support;

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use pipeline_support::{cpu_options, load, lora_adapter, model_dir, tiny_pipeline};
use shotfleet_testkit::paths::copy_dir;
use shotfleet_consumer::pipeline::lora::{Adapter, LoraError, ResidentSet};
use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions, RenderControl, RenderRequest};
use shotfleet_schema::lora::LoraFile;

fn set(pipeline: &Pipeline, adapters: &[Adapter]) -> ResidentSet {
    pipeline.place_loras(&pipeline.merge_loras(adapters).unwrap()).unwrap()
}

fn request(prompt: &str, seed: u64, images: u32) -> RenderRequest {
    RenderRequest {
        prompt: prompt.into(),
        negative_prompt: None,
        width: 64,
        height: 64,
        steps: 3,
        guidance: 5.0,
        seed,
        image_indices: (0..images).collect(),
        max_batch: images as usize,
    }
}

/// PNG bytes of every image of every request.
fn render(pipeline: &Pipeline, reqs: &[RenderRequest], set: Option<&ResidentSet>) -> Vec<Vec<Vec<u8>>> {
    pipeline
        .render_with_loras(reqs, set, &RenderControl::default(), &mut |_| ControlFlow::Continue(()))
        .expect("render")
        .into_iter()
        .map(|out| out.images.into_iter().map(|i| i.rgb).collect())
        .collect()
}

#[test]
fn each_render_binds_its_own_set_and_a_base_render_none() {
    let pipeline = tiny_pipeline();
    let kohya = set(&pipeline, &[lora_adapter("kohya_sgm.safetensors", 1.0)]);
    let peft = set(&pipeline, &[lora_adapter("peft.safetensors", 0.7)]);
    let job = [request("a lighthouse keeper", 7, 1)];
    let base = render(&pipeline, &job, None);
    let with_kohya = render(&pipeline, &job, Some(&kohya));
    let with_peft = render(&pipeline, &job, Some(&peft));
    assert_ne!(with_kohya, base);
    assert_ne!(with_peft, base);
    assert_ne!(with_kohya, with_peft);
    // Again, interleaved: nothing of one render's set is left for the next.
    assert_eq!(render(&pipeline, &job, None), base, "a base render after LoRA renders");
    assert_eq!(render(&pipeline, &job, Some(&kohya)), with_kohya);
    assert_eq!(render(&pipeline, &job, None), base);
    assert_eq!(render(&pipeline, &job, Some(&peft)), with_peft);
    assert_eq!(render(&pipeline, &job, Some(&kohya)), with_kohya);
}

#[test]
fn a_group_sharing_a_set_renders_as_its_jobs_do_alone() {
    let pipeline = tiny_pipeline();
    let kohya = set(&pipeline, &[lora_adapter("kohya_sgm.safetensors", 0.8)]);
    let (a, b) = (request("a red fox in snow", 11, 2), request("an old map", 12, 1));
    let mut group = [a.clone(), b.clone()];
    group[0].max_batch = 3; // the first request's max_batch bounds the group's sub-batches
    let together = render(&pipeline, &group, Some(&kohya));
    assert_eq!(together[0], render(&pipeline, &[a], Some(&kohya))[0]);
    assert_eq!(together[1], render(&pipeline, std::slice::from_ref(&b), Some(&kohya))[0]);
    assert_ne!(together[1], render(&pipeline, &[b], None)[0]);
}

#[test]
fn fixed_unet_buffers_bind_the_set_too() {
    let plain = tiny_pipeline();
    let fixed = load_with(&model_dir(), PipelineOptions { fixed_unet_buffers: true, ..cpu_options() });
    let job = [request("a paper boat", 5, 1)];
    let (plain_set, fixed_set) = (set(&plain, &[lora_adapter("peft.safetensors", 1.0)]), set(&fixed, &[lora_adapter("peft.safetensors", 1.0)]));
    let styled = render(&plain, &job, Some(&plain_set));
    let base = render(&plain, &job, None);
    assert_eq!(render(&fixed, &job, Some(&fixed_set)), styled);
    assert_eq!(render(&fixed, &job, None), base, "the shape's buffers keep nothing of the LoRA render");
    assert_eq!(render(&fixed, &job, Some(&fixed_set)), styled);
}

#[test]
fn two_jobs_with_different_sets_in_flight_on_one_pipeline() {
    let pipeline = Arc::new(tiny_pipeline());
    let kohya = Arc::new(set(&pipeline, &[lora_adapter("kohya_sgm.safetensors", 1.0)]));
    let stack = Arc::new(set(&pipeline, &[lora_adapter("kohya_sgm.safetensors", 0.8), lora_adapter("peft.safetensors", 0.5)]));
    let job = vec![request("a cat on a roof", 3, 1)];
    let alone_kohya = render(&pipeline, &job, Some(&kohya));
    let alone_stack = render(&pipeline, &job, Some(&stack));
    let alone_base = render(&pipeline, &job, None);
    let threads: Vec<_> = [Some(kohya), Some(stack), None]
        .into_iter()
        .map(|set| {
            let (pipeline, job) = (Arc::clone(&pipeline), job.clone());
            std::thread::spawn(move || (0..3).map(|_| render(&pipeline, &job, set.as_deref())).collect::<Vec<_>>())
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (renders, alone) in results.iter().zip([&alone_kohya, &alone_stack, &alone_base]) {
        assert!(renders.iter().all(|r| r == alone), "a render saw another job's LoRA state");
    }
}

#[test]
fn loras_that_do_not_fit_the_model_are_refused_naming_the_layer() {
    let pipeline = tiny_pipeline();
    let mut file = (*lora_adapter("kohya_sgm.safetensors", 1.0).file).clone();
    // A layer SDXL has and the tiny model does not (it has two down blocks).
    let mut deeper = file.targets[0].clone();
    deeper.module = "down_blocks.2.attentions.0.proj_in".into();
    let missing = Adapter { name: "deep.v1".into(), file: Arc::new(LoraFile { format: file.format, targets: vec![deeper] }), weight: 1.0 };
    let err = pipeline.merge_loras(&[missing]).unwrap_err();
    assert!(err.is_invalid_job());
    assert!(err.to_string().contains("LoRA `deep.v1` adapts unet layer `down_blocks.2.attentions.0.proj_in`") && err.to_string().contains("made for another model"), "{err}");
    // A layer of another width.
    let t = file.targets.iter_mut().find(|t| t.module == "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q").unwrap();
    t.down.shape[1] += 1;
    t.down.data.extend(std::iter::repeat_n(0.0, t.rank()));
    let wide = Adapter { name: "wide.v1".into(), file: Arc::new(file), weight: 1.0 };
    let err = pipeline.lora_set_bytes(&[wide]).unwrap_err();
    assert!(matches!(err, LoraError::Shape { .. }));
    assert!(err.to_string().contains("has shape [32, 32] in this model, the LoRA expects [32, 33]: made for another model?"), "{err}");
}

#[test]
fn a_model_without_maps_takes_no_loras() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&model_dir(), dir.path());
    for part in ["unet", "text_encoder", "text_encoder_2"] {
        std::fs::remove_file(dir.path().join(part).join("lora_map.json")).unwrap();
    }
    let pipeline = load(dir.path());
    assert!(!pipeline.takes_loras());
    let err = pipeline.merge_loras(&[lora_adapter("peft.safetensors", 1.0)]).unwrap_err();
    assert!(matches!(err, LoraError::NotPrepared { .. }) && err.to_string().contains("onnx/lora_ready.py"), "{err}");
    assert!(!err.is_invalid_job(), "the worker's model is at fault, not the job");
}

#[test]
fn a_set_placed_for_another_pipeline_is_refused() {
    let (one, other) = (tiny_pipeline(), tiny_pipeline());
    let foreign = set(&one, &[lora_adapter("peft.safetensors", 1.0)]);
    let err = other
        .render_with_loras(&[request("x", 1, 1)], Some(&foreign), &RenderControl::default(), &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(err.to_string().contains("made for another pipeline"), "{err}");
}

fn load_with(dir: &Path, options: PipelineOptions) -> Pipeline {
    pipeline_support::require_ort();
    Pipeline::load(dir, &options).unwrap()
}

