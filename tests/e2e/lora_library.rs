//! The LoRA library across the two sides: what `shotfleet lora push` uploads, a worker's
//! library reads, on a local folder and on moto's S3, and merges into the tiny model.

use std::path::Path;

use shotfleet_consumer::library::{LibraryConfig, LoraLibrary};
use shotfleet_consumer::pipeline::lora::Adapter;
use shotfleet_consumer::pipeline::{Pipeline, PipelineOptions};
use shotfleet_consumer::store::StoreConfig;
use shotfleet_testkit::S3Server;
use shotfleet_tests::{binary, ort_library, tiny_model};

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/lora").join(name).display().to_string()
}

async fn push(file: &str, name: &str, env: &[(String, String)]) {
    let out = tokio::process::Command::new(binary("shotfleet"))
        .args(["lora", "push", &fixture(file), "--name", name])
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// Fetches `names` through a worker's library and merges them into the tiny model.
async fn fetch_and_merge(store: &StoreConfig, env: Vec<(String, String)>, names: &[&str]) {
    let cache = tempfile::tempdir().unwrap();
    let config = LibraryConfig { cache_dir: cache.path().to_path_buf(), ..LibraryConfig::default() };
    let library = LoraLibrary::open(store, &config, env).unwrap();
    let mut adapters = Vec::new();
    for name in names {
        let fetched = library.fetch(name).await.unwrap();
        assert_eq!(fetched.entry.name, *name);
        adapters.push(Adapter { name: name.to_string(), file: fetched.file, weight: 0.5 });
    }
    let options = PipelineOptions { intra_threads: Some(2), ort_library: Some(ort_library()), ..PipelineOptions::default() };
    let pipeline = tokio::task::spawn_blocking(move || Pipeline::load(&tiny_model(), &options).unwrap()).await.unwrap();
    let merged = pipeline.merge_loras(&adapters).unwrap();
    assert_eq!(merged.bytes(), pipeline.lora_set_bytes(&adapters).unwrap());
}

#[tokio::test]
async fn what_the_cli_pushes_a_worker_fetches_from_a_local_folder() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}/images", dir.path().display());
    let env = vec![("SHOTFLEET_STORE".to_string(), url.clone())];
    push("kohya_sgm.safetensors", "hero.v1", &env).await;
    push("peft.safetensors", "ink-wash.v2", &env).await;
    let store = StoreConfig { url, ..StoreConfig::default() };
    fetch_and_merge(&store, Vec::new(), &["hero.v1", "ink-wash.v2"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_cli_pushes_a_worker_fetches_from_s3() {
    let server = S3Server::start();
    server.create_bucket("renders");
    let mut env: Vec<(String, String)> = S3Server::credentials().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    env.push(("AWS_ENDPOINT_URL".into(), server.endpoint()));
    let mut cli_env = env.clone();
    cli_env.push(("AWS_ALLOW_HTTP".into(), "true".into()));
    cli_env.push(("SHOTFLEET_STORE".into(), "s3://renders/shotfleet".into()));
    push("peft.safetensors", "ink-wash.v2", &cli_env).await;
    let store = StoreConfig { url: "s3://renders/shotfleet".into(), allow_http: true, ..StoreConfig::default() };
    fetch_and_merge(&store, env, &["ink-wash.v2"]).await;
}
