//! Broken model folders are refused at load, with the file at fault and the fault named.
//! Each test copies the tiny fixture into a temporary folder and breaks one thing.
mod pipeline_support;

use std::fs;
use std::path::{Path, PathBuf};

use pipeline_support::{cpu_options, model_dir, require_ort};
use shotfleet_testkit::paths::copy_dir;
use shotfleet_consumer::pipeline::{LoadError, Pipeline};
use tempfile::TempDir;

fn copy_fixture() -> (TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("model");
    copy_dir(&model_dir(), &dst);
    (tmp, dst)
}


/// Loads `dir`, expects a refusal, and checks its message names `file` and says `what`.
fn refused(dir: &Path, file: &str, what: &str) -> LoadError {
    require_ort();
    let err = match Pipeline::load(dir, &cpu_options()) {
        Ok(_) => panic!("loaded a broken folder (expected: {file}: {what})"),
        Err(e) => e,
    };
    let message = err.to_string();
    let named = dir.join(file);
    assert!(message.contains(&*named.to_string_lossy()), "message does not name {}: {message}", named.display());
    assert!(message.contains(what), "message does not say {what:?}: {message}");
    err
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

#[test]
fn the_intact_copy_loads() {
    let (_tmp, dir) = copy_fixture();
    require_ort();
    Pipeline::load(&dir, &cpu_options()).expect("an unbroken copy loads");
}

#[test]
fn missing_graph_is_named() {
    let (_tmp, dir) = copy_fixture();
    fs::remove_file(dir.join("unet/model.onnx")).unwrap();
    let err = refused(&dir, "unet/model.onnx", "missing");
    assert!(matches!(err, LoadError::MissingFile { .. }), "{err:?}");
}

#[test]
fn missing_tokenizer_merges_is_named() {
    let (_tmp, dir) = copy_fixture();
    fs::remove_file(dir.join("tokenizer_2/merges.txt")).unwrap();
    refused(&dir, "tokenizer_2/merges.txt", "missing");
}

#[test]
fn corrupt_onnx_is_named() {
    let (_tmp, dir) = copy_fixture();
    let path = dir.join("vae_decoder/model.onnx");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 3]).unwrap();
    let err = refused(&dir, "vae_decoder/model.onnx", "ONNX Runtime cannot load it");
    assert!(matches!(err, LoadError::Session { .. }), "{err:?}");
}

#[test]
fn wrong_input_names_are_named() {
    // A VAE decoder where the UNet should be: no `sample`, `timestep`, ... inputs.
    let (_tmp, dir) = copy_fixture();
    fs::copy(dir.join("vae_decoder/model.onnx"), dir.join("unet/model.onnx")).unwrap();
    let err = refused(&dir, "unet/model.onnx", "no input \"sample\" (inputs: latent_sample)");
    assert!(matches!(err, LoadError::Graph { .. }), "{err:?}");
}

#[test]
fn text_encoder_without_pooled_output_is_named() {
    // The first encoder (CLIPTextModel) has no `text_embeds` projection.
    let (_tmp, dir) = copy_fixture();
    fs::copy(dir.join("text_encoder/model.onnx"), dir.join("text_encoder_2/model.onnx")).unwrap();
    refused(&dir, "text_encoder_2/model.onnx", "no output \"text_embeds\"");
}

#[test]
fn conditioning_width_mismatch_is_named() {
    // Two copies of the second encoder: their concatenated width is not what the UNet takes.
    let (_tmp, dir) = copy_fixture();
    for file in ["model.onnx", "model.onnx_data"] {
        fs::copy(dir.join("text_encoder_2").join(file), dir.join("text_encoder").join(file)).unwrap();
    }
    // The copy's LoRA map would name the other part: a model without one takes no LoRA there.
    fs::remove_file(dir.join("text_encoder/lora_map.json")).unwrap();
    refused(&dir, "unet/model.onnx", "expects encoder_hidden_states");
}

#[test]
fn vocabulary_mismatch_is_named() {
    let (_tmp, dir) = copy_fixture();
    edit_json(&dir.join("text_encoder/config.json"), |v| v["vocab_size"] = 1000.into());
    refused(&dir, "tokenizer/vocab.json", "tokenizer has 49408 tokens but text_encoder/config.json has vocab_size 1000");
}

#[test]
fn invalid_scheduler_config_is_named() {
    let (_tmp, dir) = copy_fixture();
    fs::write(dir.join("scheduler/scheduler_config.json"), "{ not json").unwrap();
    refused(&dir, "scheduler/scheduler_config.json", "invalid JSON");
}

#[test]
fn unsupported_scheduler_option_is_named() {
    let (_tmp, dir) = copy_fixture();
    edit_json(&dir.join("scheduler/scheduler_config.json"), |v| v["use_karras_sigmas"] = true.into());
    refused(&dir, "scheduler/scheduler_config.json", "unsupported scheduler option");
}
