//! `shotfleet lora push` and `shotfleet lora list` against a local folder and moto's S3.

use std::path::{Path, PathBuf};
use std::process::Output;

use shotfleet_schema::lora::library::{self, LoraEntry};
use shotfleet_testkit::S3Server;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/lora").join(name)
}

/// Runs `shotfleet lora ARGS` with `env` (and no AWS settings of the caller's).
async fn lora(args: &[&str], env: &[(&str, String)]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_shotfleet"));
    command.arg("lora").args(args).env_remove("SHOTFLEET_STORE").env_remove("SHOTFLEET_LORA_PREFIX");
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("AWS_")) {
        command.env_remove(key);
    }
    command.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    command.output().await.expect("run shotfleet")
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[tokio::test]
async fn push_checks_uploads_and_lists_in_a_local_folder() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}/images", dir.path().display());
    let env = [("SHOTFLEET_STORE", store.clone())];
    let out = lora(&["push", &path(&fixture("kohya_sgm.safetensors")), "--name", "hero.v1"], &env).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("pushed hero.v1: kohya, rank 4, 237 layers (unet 177, text_encoder 30, text_encoder_2 30)"), "{}", text(&out));
    let folder = dir.path().join("images").join(library::DEFAULT_PREFIX);
    let bytes = std::fs::read(fixture("kohya_sgm.safetensors")).unwrap();
    assert_eq!(std::fs::read(folder.join("hero.v1.safetensors")).unwrap(), bytes);
    let entry: LoraEntry = serde_json::from_slice(&std::fs::read(folder.join("hero.v1.json")).unwrap()).unwrap();
    assert_eq!((entry.sha256, entry.bytes), (library::sha256_hex(&bytes), bytes.len() as u64));

    // Again: nothing changes. Another file under the name: refused unless --replace.
    let again = lora(&["push", &path(&fixture("kohya_sgm.safetensors")), "--name", "hero.v1"], &env).await;
    assert!(again.status.success() && text(&again).contains("unchanged"), "{}", text(&again));
    let other = lora(&["push", &path(&fixture("peft.safetensors")), "--name", "hero.v1"], &env).await;
    assert_eq!(other.status.code(), Some(2), "{}", text(&other));
    assert!(text(&other).contains("pass --replace"), "{}", text(&other));
    let replaced = lora(&["push", &path(&fixture("peft.safetensors")), "--name", "hero.v1", "--replace"], &env).await;
    assert!(replaced.status.success() && text(&replaced).contains("replaced hero.v1: peft"), "{}", text(&replaced));

    let out = lora(&["push", &path(&fixture("kohya_sgm.safetensors")), "--name", "ink-wash.v2", "--store", &store], &[]).await;
    assert!(out.status.success(), "{}", text(&out));
    let list = lora(&["list"], &env).await;
    assert!(list.status.success(), "{}", text(&list));
    let listing = text(&list);
    let hero = listing.lines().find(|l| l.starts_with("hero.v1 ")).expect(&listing);
    assert!(hero.contains(" peft ") && hero.contains(" 160 "), "{hero}");
    assert!(listing.lines().any(|l| l.starts_with("ink-wash.v2 ") && l.contains(" kohya ")), "{listing}");
    assert!(listing.contains("2 LoRA(s) in file://"), "{listing}");
}

#[tokio::test]
async fn push_refuses_what_workers_could_not_use_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let env = [("SHOTFLEET_STORE", format!("file://{}", dir.path().display()))];
    for (file, extra, says) in [
        ("sd15.safetensors", vec![], "made for Stable Diffusion 1.x/2.x"),
        ("sd3.safetensors", vec![], "made for SD3 or Flux"),
        ("pickle.pt", vec![], "pickle files can run code"),
        ("kohya_sgm.safetensors", vec!["--max-mib", "0"], "LoRA files may be at most 0 bytes"),
    ] {
        let mut args = vec!["push".to_string(), path(&fixture(file)), "--name".into(), "x.v1".into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = lora(&args, &env).await;
        assert_eq!(out.status.code(), Some(2), "{file}: {}", text(&out));
        assert_eq!(text(&out).matches(says).count(), 1, "{file}: said once: {}", text(&out));
    }
    let out = lora(&["push", &path(&fixture("peft.safetensors")), "--name", "a/b"], &env).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("--name `a/b`"), "{}", text(&out));
    assert!(!dir.path().join(library::DEFAULT_PREFIX).join("x.v1.json").exists(), "nothing refused was uploaded");
    let out = lora(&["list"], &[]).await;
    assert_eq!(out.status.code(), Some(2), "no store given: {}", text(&out));
    assert!(text(&out).contains("--store"), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_list_on_s3_and_an_outage_is_retryable() {
    let mut server = S3Server::start();
    server.create_bucket("renders");
    let mut env: Vec<(&str, String)> = S3Server::credentials().iter().map(|(k, v)| (*k, v.to_string())).collect();
    env.push(("AWS_ENDPOINT_URL", server.endpoint()));
    env.push(("AWS_ALLOW_HTTP", "true".into()));
    env.push(("SHOTFLEET_STORE", "s3://renders/shotfleet".into()));
    let out = lora(&["push", &path(&fixture("peft.safetensors")), "--name", "ink-wash.v2"], &env).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("-> s3://renders/shotfleet/_loras"), "{}", text(&out));
    let list = lora(&["list"], &env).await;
    assert!(text(&list).lines().any(|l| l.starts_with("ink-wash.v2 ")), "{}", text(&list));
    tokio::task::block_in_place(|| server.stop());
    let out = lora(&["list"], &env).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("retryable"), "{}", text(&out));
}
