//! The worker's configuration: file, then environment, then flags; bad values are refused at
//! start with the setting's name and what would fix it.

use std::collections::HashMap;
use std::path::PathBuf;

use shotfleet_consumer::config::{DeviceKind, Overrides, WorkerConfig};
use shotfleet_consumer::pipeline::ConvSearch;
use shotfleet_schema::MemoryClass;
use shotfleet_schema::nats::NatsArgs;

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/model")
}

fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("worker.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

/// A CPU config: `top` holds top-level keys, `sections` more sections after the simulated GPU.
fn cpu(top: &str, sections: &str) -> String {
    format!("device = \"cpu\"\n{top}\n[budget.simulate]\ntotal_mib = 4096\n{sections}")
}

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn error(file: &str, env_pairs: &[(&str, &str)], flags: Overrides) -> String {
    let (_dir, path) = write(file);
    WorkerConfig::resolve(Some(&path), &env(env_pairs), flags).unwrap_err().to_string()
}

#[test]
fn environment_overrides_the_file_and_flags_override_the_environment() {
    let model = model();
    let (_dir, path) = write(&cpu("model = \"/nonexistent\"\nclasses = [\"xs\"]", "[nats]\nserver = \"nats://file:4222\"\n"));
    let config = WorkerConfig::resolve(
        Some(&path),
        &env(&[("NATS_URL", "nats://env:4222"), ("SHOTFLEET_MODEL", model.to_str().unwrap()), ("SHOTFLEET_STORE", "file:///tmp/x")]),
        Overrides {
            nats: NatsArgs { server: Some("nats://flag:4222".into()), ..Default::default() },
            classes: Some("xs,s".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(config.nats.server, "nats://flag:4222");
    assert_eq!(config.model, model);
    assert_eq!(config.store.url, "file:///tmp/x");
    assert_eq!(*config.classes, [MemoryClass::Xs, MemoryClass::S]);
    assert_eq!(config.device, DeviceKind::Cpu);
    assert!(config.worker_id.ends_with("/cpu"), "{}", config.worker_id);
}

#[test]
fn bad_settings_are_named() {
    let m = model();
    let m = m.to_str().unwrap();
    let with_model = [("SHOTFLEET_MODEL", m)];
    let e = error(&cpu("", ""), &[], Overrides::default());
    assert!(e.contains("model") && e.contains("no model folder"), "{e}");
    let e = error(&cpu("", ""), &[("SHOTFLEET_MODEL", "/nope")], Overrides::default());
    assert!(e.contains("/nope is not a folder"), "{e}");
    let e = error("device = \"cpu\"\n", &with_model, Overrides::default());
    assert!(e.contains("budget.simulate") && e.contains("never assumed"), "{e}");
    let e = error(&cpu("gpus = 2", ""), &with_model, Overrides::default());
    assert!(e.contains("unknown field `gpus`"), "{e}");
    let e = error(&cpu("", ""), &with_model, Overrides { device: Some("tpu".into()), ..Default::default() });
    assert!(e.contains("`tpu` is not `cpu` or `cuda`"), "{e}");
    let e = error(&cpu("", ""), &with_model, Overrides { classes: Some("xs,huge".into()), ..Default::default() });
    assert!(e.contains("--classes") && e.contains("huge"), "{e}");
    let e = error(&cpu("classes = \"every\"", ""), &with_model, Overrides::default());
    assert!(e.contains("unknown memory class `every`") && e.contains("\"auto\""), "{e}");
    let e = error(&cpu("", "[budget]\nmax_mib = 100"), &with_model, Overrides::default());
    assert!(e.contains("budget.max_mib") && e.contains("leaves nothing"), "{e}");
    let e = error(&cpu("", ""), &with_model, Overrides { metrics_addr: Some("localhost".into()), ..Default::default() });
    assert!(e.contains("--metrics-addr"), "{e}");
    let e = error(&cpu("concurrency = 0", ""), &with_model, Overrides::default());
    assert!(e.contains("concurrency: 0 is outside 1..=64"), "{e}");
    let e = error(&cpu("unet_sessions = 2", ""), &with_model, Overrides::default());
    assert!(e.contains("unet_sessions: 2 is neither 1") && e.contains("`concurrency` (1, a session per slot)"), "{e}");
    let e = error(&cpu("concurrency = 3\nunet_sessions = 2", ""), &with_model, Overrides::default());
    assert!(e.contains("unet_sessions: 2 is neither 1") && e.contains("(3, a session per slot)"), "{e}");
    let e = error(&cpu("concurrency = 2\nunet_sessions = 0", ""), &with_model, Overrides::default());
    assert!(e.contains("unet_sessions: 0 is neither 1"), "{e}");
    for bad in ["\"many\"", "-2", "1.5"] {
        let e = error(&cpu(&format!("unet_sessions = {bad}"), ""), &with_model, Overrides::default());
        assert!(e.contains("unet_sessions") && e.contains("expected \"auto\" or a number of sessions"), "{bad}: {e}");
    }
    let e = error(&cpu("", "[cuda.unet]\nattention = \"fastest\""), &with_model, Overrides::default());
    assert!(e.contains("unknown variant `fastest`") && e.contains("`flash`"), "{e}");
    let e = error(&cpu("grace_period = \"soon\"", ""), &with_model, Overrides::default());
    assert!(e.contains("grace_period") && e.contains("\"soon\", expected a duration"), "{e}");
    let e = error("device = \"cuda\"\n[budget.simulate]\ntotal_mib = 1\n", &with_model, Overrides::default());
    assert!(e.contains("remove [budget.simulate]") || e.contains("without the `cuda` feature"), "{e}");
    let e = error(&cpu("", "[budget]\nmax_fill = 1.5\n"), &with_model, Overrides::default());
    assert!(e.contains("max_fill"), "{e}");
    let e = error(&cpu("", "[calibration]\nshapes = [[64, 64, 1]]\n"), &with_model, Overrides::default());
    assert!(e.contains("calibration.shapes"), "{e}");
    // The default shapes follow narrower limits; listed ones are checked against them.
    let (_dir, path) = write(&cpu("", "[limits]\nmax_images = 2\nmax_side = 768\n"));
    let narrow = WorkerConfig::resolve(Some(&path), &env(&with_model), Overrides::default()).unwrap();
    assert_eq!(narrow.calibration.shapes, vec![[512, 512, 1], [768, 768, 1]]);
    let e = error(&cpu("", "[limits]\nmin_side = 1024\n"), &with_model, Overrides::default());
    assert!(e.contains("calibration.shapes") && e.contains("default shapes outside them are left out"), "{e}");
    // Probe shapes are checked as a job's size would be, and two of one size are one size.
    for (shapes, needle) in [
        ("[[64, 64, 1], [64, 64, 2]]", "at least two shapes of different sizes"),
        ("[[64, 64, 1], [100, 64, 1]]", "calibration.shapes[1]: [100, 64, 1]: width: 100 must be a positive multiple of 8"),
        ("[[64, 64, 0], [128, 128, 1]]", "calibration.shapes[0]: [64, 64, 0]: images: 0 is outside 1..=8"),
        ("[[64, 64, 1], [65536, 65536, 1]]", "width: 65536 is outside 64..=2048 pixels"),
    ] {
        let e = error(&cpu("", &format!("[calibration]\nshapes = {shapes}\n")), &with_model, Overrides::default());
        assert!(e.contains(needle), "{shapes}: {e}");
    }
    // Bounds that would fail every job as `invalid`, never retried, are refused at start.
    for (limits, needle) in [
        ("max_megapixel_steps = 0", "limits.max_megapixel_steps"),
        ("min_side = 4096\nmax_side = 64", "limits.max_side"),
        ("max_steps = 0", "limits.max_steps"),
        ("max_guidance = -1.0", "limits.max_guidance"),
        ("min_side = 12", "limits.min_side"),
    ] {
        let e = error(&cpu("", &format!("[limits]\n{limits}\n")), &with_model, Overrides::default());
        assert!(e.contains(needle), "{limits}: {e}");
    }
    let e = error("device = \"cpu\"\n[budget.simulate]\ntotal_mib = 18446744073709551615\n", &with_model, Overrides::default());
    assert!(e.contains("simulate.total_mib") && e.contains("outside"), "{e}");
    let e = error(&cpu("", "[attempts]\nbackoff = \"2m\"\nmax_backoff = \"1m\"\n"), &with_model, Overrides::default());
    assert!(e.contains("attempts.backoff") && e.contains("above max_backoff"), "{e}");
    // Addresses that can never work are configuration errors (exit 2), not failed starts.
    let e = error(&cpu("", "[nats]\nserver = \"http://nats:4222\"\n"), &with_model, Overrides::default());
    assert!(e.contains("nats.server") && e.contains("invalid scheme"), "{e}");
    for (url, needle) in [("gs://renders/x", "unknown scheme `gs`"), ("file://relative/x", "absolute path")] {
        let (_dir, path) = write(&cpu("", &format!("[store]\nurl = \"{url}\"\n")));
        let config = WorkerConfig::resolve(Some(&path), &env(&with_model), Overrides::default()).unwrap();
        let e = config.require_store().unwrap_err().to_string();
        assert!(e.contains("store.url") && e.contains(needle), "{url}: {e}");
    }
    // CUDA options and the CUDA arena fault belong to CUDA workers; a typo'd option is named.
    let e = error(&cpu("", "[cuda.unet]\nfuse_conv_bias = true\n"), &with_model, Overrides::default());
    assert!(e.contains("cuda") && e.contains("remove the [cuda.*] tables"), "{e}");
    let e = error(&cpu("", "[cuda.vae]\nconv_algo_search = \"fastest\"\n"), &with_model, Overrides::default());
    assert!(e.contains("unknown variant `fastest`") && e.contains("heuristic"), "{e}");
    // Options are per graph: the flat table of earlier releases is refused with the tables' names.
    let e = error(&cpu("", "[cuda]\nconv_algo_search = \"heuristic\"\n"), &with_model, Overrides::default());
    assert!(e.contains("unknown field `conv_algo_search`") && e.contains("unet") && e.contains("vae"), "{e}");
    let e = error("device = \"cuda\"\n[cuda.vae]\ngraph = true\n", &with_model, Overrides::default());
    assert!(e.contains("cuda.vae.graph") && e.contains("[cuda.unet] graph"), "{e}");
    let e = error(&cpu("", "[faults]\narena_limit_mib = 512\n"), &with_model, Overrides::default());
    assert!(e.contains("faults.arena_limit_mib") && e.contains("cpu_arena_max_mib"), "{e}");
    // A slip of zeros in the thread count would start that many threads a graph and eat the
    // host's memory before the first job.
    let e = error(&cpu("", "[budget]\nreserve_mib = 999999\n"), &with_model, Overrides::default());
    assert!(e.contains("reserve_mib") && e.contains("more than any card holds"), "{e}");
    let e = error(&cpu("", "[budget]\nreserve_mib = 4000\nmargin_mib = 96\n"), &with_model, Overrides::default());
    assert!(e.contains("leave nothing of the simulated card's total_mib (4096)"), "{e}");
    let e = error(&cpu("idle_poll = \"0s\"", ""), &with_model, Overrides::default());
    assert!(e.contains("idle_poll: 0ns is outside 10ms..=60s"), "{e}");
    for threads in [0, 100_000] {
        let e = error(&cpu(&format!("intra_threads = {threads}"), ""), &with_model, Overrides::default());
        assert!(e.contains(&format!("intra_threads: {threads} is outside 1..=256")), "{e}");
    }
}

#[test]
fn the_lookahead_and_affinity_are_bounded_and_the_lookahead_defaults_to_three_batches() {
    let m = model();
    let with_model = [("SHOTFLEET_MODEL", m.to_str().unwrap()), ("SHOTFLEET_STORE", "file:///tmp/x")];
    let e = error(&cpu("batch_jobs = 4\nlookahead = 300", ""), &with_model, Overrides::default());
    assert!(e.contains("lookahead: 300 is outside 0..=256"), "{e}");
    let e = error(&cpu("affinity_passes = 65", ""), &with_model, Overrides::default());
    assert!(e.contains("affinity_passes: 65 is outside 0..=64"), "{e}");
    let resolved = |top: &str| {
        let (_dir, path) = write(&cpu(top, ""));
        let config = WorkerConfig::resolve(Some(&path), &env(&with_model), Overrides::default()).unwrap();
        (config.lookahead(), config.affinity_passes)
    };
    assert_eq!(resolved(""), (0, 2), "no batching, nothing fetched ahead");
    assert_eq!(resolved("batch_jobs = 4").0, 12);
    assert_eq!(resolved("batch_jobs = 4\nlookahead = 0").0, 0);
    // Without batching a reserve still finds jobs like the last render's (a LoRA set kept).
    assert_eq!(resolved("lookahead = 8\naffinity_passes = 0"), (8, 0));
}

#[test]
fn the_binary_refuses_bad_config_with_exit_code_2() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shotfleet-consumer"))
        .args(["--device", "cpu", "--model", "/definitely/missing"])
        .env_remove("SHOTFLEET_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("configuration:") && stderr.contains("/definitely/missing"), "{stderr}");
}

#[test]
fn per_graph_cuda_options_but_the_search_default_to_onnx_runtimes_own() {
    let config: WorkerConfig = toml::from_str("[cuda.unet]\nconv_algo_search = \"exhaustive\"\nmem_pattern = false\n").unwrap();
    assert_eq!(config.cuda.unet.conv_algo_search, ConvSearch::Exhaustive, "set: as set");
    assert!(!config.cuda.unet.mem_pattern);
    assert!(config.cuda.unet.conv_max_workspace, "not set: ONNX Runtime's default");
    assert!(config.cuda.vae.mem_pattern, "not set: ONNX Runtime's default");
    let e = toml::from_str::<WorkerConfig>("[cuda.vae]\nmem_patterns = false\n").unwrap_err().to_string();
    assert!(e.contains("unknown field `mem_patterns`") && e.contains("mem_pattern"), "{e}");
}

#[test]
fn every_graphs_convolution_search_defaults_to_the_heuristic() {
    // Unset, the heuristic: a table that sets something else keeps it.
    for text in ["", "[cuda.unet]\nmem_pattern = false\n", "[cuda.vae]\nconv_max_workspace = false\n"] {
        let config: WorkerConfig = toml::from_str(text).unwrap();
        assert_eq!(config.cuda.unet.conv_algo_search, ConvSearch::Heuristic, "{text:?}");
        assert_eq!(config.cuda.vae.conv_algo_search, ConvSearch::Heuristic, "{text:?}");
    }
    let config: WorkerConfig = toml::from_str("[cuda.vae]\nconv_algo_search = \"exhaustive\"\n").unwrap();
    assert_eq!(config.cuda.vae.conv_algo_search, ConvSearch::Exhaustive);
    // What a stored calibration is keyed by (worker/startup.rs): the searches as resolved.
    assert_eq!(config.cuda.describe(), "UNet heuristic search; VAE exhaustive search");
    let config: WorkerConfig = toml::from_str("[cuda.vae]\nconv_max_workspace = false\nmem_pattern = false\n").unwrap();
    assert_eq!(config.cuda.describe(), "UNet heuristic search; VAE heuristic search, workspace capped, no memory patterns");
}

#[test]
fn metrics_listen_on_loopback_unless_told_otherwise() {
    assert_eq!(WorkerConfig::default().metrics_addr().to_string(), "127.0.0.1:9400");
    assert!(WorkerConfig::default().require_store().is_err(), "no store unless one is set");
}
