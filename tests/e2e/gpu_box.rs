//! A box of GPUs under one supervisor (`shotfleet-consumer --gpus`): one worker process per
//! card, each with its own budget, port, state folder and id, restarted after a driver fault,
//! left stopped when a restart cannot help. Real processes on the CPU with the tiny model; the
//! cards are simulated (`--gpus sim:4096,800`, MiB), and a capped ONNX Runtime arena
//! (`cpu_arena_max_mib`, per card through `[supervisor.gpu.N]`) runs out of memory for real.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use serde_json::Value;
use shotfleet_producer::storyboard::Shot;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::Priority;
use shotfleet_testkit::NatsServer;
use shotfleet_testkit::ports::free_port;
use shotfleet_testkit::process::{http_get, Guarded};
use shotfleet_tests::accounting::{account, local_store, print_header};
use shotfleet_tests::*;

/// A `shotfleet-consumer --gpus ...` process and its folder.
struct GpuBox {
    process: Guarded,
    dir: tempfile::TempDir,
    /// The box's own port (`[supervisor] listen`).
    port: u16,
    /// Each worker's metrics port, gpu0 first.
    ports: Vec<u16>,
}

impl Drop for GpuBox {
    /// Stops the box as an operator would (SIGTERM: its workers finish and drain) while the test's
    /// NATS server still runs: a worker stopping after its server is gone waits for it (its NATS
    /// drain has no deadline), and SIGKILLing the box would leave its workers doing just that.
    fn drop(&mut self) {
        if self.process.running() {
            let _ = self.process.terminate(Duration::from_secs(40));
        }
        if std::thread::panicking() {
            eprintln!("--- box log ---\n{}--- end of box log ---", self.log());
        }
    }
}

impl GpuBox {
    /// `spec`'s config for every card, then `[supervisor]` with `supervisor` (more keys and
    /// `[supervisor.gpu.N]` tables) appended; JSON logs, so each line names its GPU.
    fn spawn(nats_url: &str, spec: &WorkerSpec, gpus: &str, supervisor: &str) -> Self {
        let dir = tempfile::tempdir().expect("box dir");
        let (port, ports) = (free_port(), vec![free_port(), free_port()]);
        let mut config = spec.toml(&dir.path().join("state"), ports[0]);
        config.push_str(&format!(
            "\n[supervisor]\nlisten = \"127.0.0.1:{port}\"\nmetrics_ports = {ports:?}\nrestart_backoff = \"200ms\"\n{supervisor}\n"
        ));
        std::fs::write(dir.path().join("box.toml"), config).expect("write config");
        let log = std::fs::File::create(dir.path().join("box.log")).expect("log");
        let mut command = Command::new(binary("shotfleet-consumer"));
        command
            .args(["--gpus", gpus, "--config"])
            .arg(dir.path().join("box.toml"))
            .env("NATS_URL", nats_url)
            .env("ORT_DYLIB_PATH", ort_library())
            .env("RUST_LOG", "info,ort=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        Self { process: Guarded::spawn(command).expect("spawn the box"), dir, port, ports }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("box.log")).unwrap_or_default()
    }

    /// The log's JSON lines of `gpu`'s worker.
    fn lines_of(&self, gpu: &str) -> Vec<Value> {
        self.log().lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter(|l| l["gpu"] == gpu).collect()
    }

    fn readyz(&self) -> (u16, String) {
        http_get(self.port, "/readyz").expect("the box's /readyz answers")
    }

    fn status(&self) -> Vec<Value> {
        let (code, body) = http_get(self.port, "/status").expect("the box's /status answers");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("/status is JSON")
    }

    fn pid(&self, gpu: usize) -> i32 {
        self.status()[gpu]["pid"].as_i64().unwrap_or_else(|| panic!("gpu{gpu} runs no process: {:?}", self.status()[gpu])) as i32
    }

    fn signal(&self, gpu: usize, signal: &str) {
        let pid = self.pid(gpu);
        assert!(Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().unwrap().success());
    }

    fn worker_metrics(&self, gpu: usize) -> String {
        http_get(self.ports[gpu], "/metrics").map(|(_, body)| body).unwrap_or_default()
    }

    /// Waits until `ready` workers take jobs (the box's `/readyz` says so).
    fn wait_ready(&mut self, ready: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let want = format!("ready: {ready} of ");
        loop {
            if let Some((200, body)) = http_get(self.port, "/readyz")
                && body.starts_with(&want)
            {
                return;
            }
            assert!(self.process.running(), "the box exited:\n{}", self.log());
            assert!(Instant::now() < deadline, "not {ready} ready after {timeout:?}: {:?}", http_get(self.port, "/readyz"));
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn spec(id: &str, store: &std::path::Path) -> WorkerSpec {
    let mut spec = WorkerSpec::new(id, store);
    spec.grace = "5s";
    spec
}

/// Two simulated cards of 4096 and 800 MiB: each serves the classes its calibrated budget holds,
/// and a job that runs out of memory on the small one is given back and rendered by the large
/// one at full size, before any rung of the degrade ladder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_box_of_two_cards_serves_what_fits_each_and_hands_an_out_of_memory_to_the_larger() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = spec("hetero", store.path());
    spec.classes = "\"auto\"";
    spec.calibration = "[[128, 128, 1], [256, 256, 1], [512, 512, 1], [768, 768, 1]]";
    // The small card's arena holds a 384x384 render of the tiny model, not a 512x512 one, and its
    // calibration stops at 384x384: its budget plans xs's 512x512 from the fit and admits it.
    let small = "[supervisor.gpu.1]\ncpu_arena_max_mib = 160\ncalibration = { shapes = [[128, 128, 1], [256, 256, 1], [384, 384, 1]], steps = 1 }";
    let mut gpu_box = GpuBox::spawn(&server.url(), &spec, "sim:4096,800", small);
    gpu_box.wait_ready(2, Duration::from_secs(90));

    let (status, body) = gpu_box.readyz();
    assert_eq!(status, 200, "{body}");
    let gpu0 = body.lines().position(|l| l.starts_with("gpu0 hetero/gpu0 (simulated, 4096 MiB")).expect(&body);
    let gpu1 = body.lines().position(|l| l.starts_with("gpu1 hetero/gpu1 (simulated, 800 MiB")).expect(&body);
    let lines: Vec<&str> = body.lines().collect();
    assert!(lines[gpu0 + 1..gpu1].iter().any(|l| l.starts_with("  s: served")), "{body}");
    assert!(lines[gpu1 + 1..].iter().any(|l| l.starts_with("  xs: served")), "{body}");
    assert!(lines[gpu1 + 1..].iter().any(|l| l.starts_with("  s: not served (over budget")), "{body}");
    // Each worker has its own state folder and config file: the box's with its card merged in.
    let file = |gpu: &str| std::fs::read_to_string(gpu_box.state().join(gpu).join("worker.toml")).unwrap();
    let (file0, file1) = (file("gpu0"), file("gpu1"));
    assert!(file0.contains("total_mib = 4096") && !file0.contains("cpu_arena_max_mib"), "{file0}");
    assert!(file1.contains("total_mib = 800") && file1.contains("cpu_arena_max_mib = 160"), "{file1}");
    assert!(!file1.contains("\n[supervisor"), "{file1}");
    for (gpu, metrics_port) in gpu_box.ports.iter().enumerate() {
        assert!(http_get(*metrics_port, "/readyz").is_some_and(|(code, _)| code == 200), "gpu{gpu}'s own port");
    }

    // s (768x768) fits only the large card.
    let roomy = shot(Priority::P1, job("box-s-1", "acme", (768, 768), 2, 1));
    submit(&js, std::slice::from_ref(&roomy)).await;
    assert_eq!(results(&outcomes(&js, &[roomy], Duration::from_secs(60)).await)[0].worker, "hetero/gpu0");

    // The order is held by freezing the card that must wait (the job path has no hand-off window
    // yet, so a card that gave a job back may take it again at once): the large card is frozen
    // while the small one takes the job and runs out of memory, the small one while the large
    // one takes it back.
    gpu_box.signal(0, "STOP");
    let tight = shot(Priority::P0, job("box-oom-1", "acme", (512, 512), 2, 1));
    submit(&js, std::slice::from_ref(&tight)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !gpu_box.worker_metrics(1).contains("shotfleet_jobs_total{outcome=\"nak\",priority=\"p0\",class=\"xs\"} 1") {
        assert!(Instant::now() < deadline, "the small card gave nothing back:\n{}", gpu_box.worker_metrics(1));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gpu_box.signal(1, "STOP");
    gpu_box.signal(0, "CONT");
    let done = results(&outcomes(&js, std::slice::from_ref(&tight), Duration::from_secs(60)).await);
    gpu_box.signal(1, "CONT");
    assert_eq!(done[0].worker, "hetero/gpu0", "the large card rendered it");
    assert!(done[0].degrade.is_none(), "at full size: {:?}", done[0].degrade);
    assert_eq!(done[0].images.len(), 1);

    let small_lines = gpu_box.lines_of("gpu1");
    let about_it = |message: &str| small_lines.iter().any(|l| l["fields"]["message"] == message && l["fields"]["job"] == "box-oom-1");
    assert!(about_it("out of memory"), "the small card ran out of memory for real");
    assert!(about_it("giving the job back"), "and gave the job back");
    assert!(!about_it("degrading in place"), "before any rung of the ladder");
    assert!(gpu_box.worker_metrics(1).contains("shotfleet_out_of_memory_total 1"));
    assert!(gpu_box.worker_metrics(0).contains("shotfleet_out_of_memory_total 0"));
}

/// A storyboard of small jobs across priorities and projects.
fn storyboard(prefix: &str, n: usize) -> Vec<Shot> {
    (0..n)
        .map(|i| shot(Priority::ALL[i % 3], job(&format!("{prefix}-{i}"), if i % 2 == 0 { "north" } else { "south" }, (64, 64), 2, 1)))
        .collect()
}

/// The timestamps of `gpu`'s log lines whose message is `message`.
fn times(lines: &[Value], message: &str) -> Vec<String> {
    lines.iter().filter(|l| l["fields"]["message"] == message).map(|l| l["timestamp"].as_str().unwrap_or_default().to_owned()).collect()
}

/// A driver fault injected on gpu0's worker (every fourth render of each of its lives) stops and
/// restarts that worker alone; gpu1's keeps its process and keeps rendering meanwhile; every
/// job ends with exactly one outcome. SIGTERM then stops the box and both workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_fault_restarts_only_its_cards_worker_and_no_job_is_lost() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology { ack_wait: Duration::from_secs(3), ..Topology::default() }).await;
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec("faulty", dir.path());
    spec.calibration = "[[64, 64, 1], [128, 128, 1], [192, 192, 1]]";
    let mut gpu_box = GpuBox::spawn(&server.url(), &spec, "sim:4096,4096", "[supervisor.gpu.0.faults]\ndriver_fault_on_render = 4");
    gpu_box.wait_ready(2, Duration::from_secs(90));
    let steady = gpu_box.pid(1);

    let shots = storyboard("fault", 40);
    submit(&js, &shots).await;
    let _ = outcomes(&js, &shots, Duration::from_secs(240)).await;
    wait_settled(&js, Duration::from_secs(60)).await;
    let acc = account("a driver fault on gpu0", &js, &local_store(dir.path()), &shots, &[gpu_box.log()]).await;
    print_header();
    acc.print();
    acc.assert_clean();

    // gpu0's worker is back (it may still have been calibrating when the last job ended).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(gpu_box.status()[0]["ready"] == true && gpu_box.status()[0]["restarts"].as_u64() >= Some(1)) {
        assert!(Instant::now() < deadline, "gpu0 not back: {:?}", gpu_box.status()[0]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = gpu_box.status();
    assert_eq!(status[0]["last_exit"], "exit 75 (driver fault)");
    assert_eq!((status[1]["restarts"].as_u64(), status[1]["pid"].as_i64()), (Some(0), Some(i64::from(steady))), "gpu1's worker was never touched");
    let (_, metrics) = http_get(gpu_box.port, "/metrics").unwrap();
    assert!(metrics.contains("shotfleet_box_worker_restarts_total{gpu=\"gpu0\",reason=\"driver_fault\"}"), "{metrics}");
    assert!(!metrics.contains("shotfleet_box_worker_restarts_total{gpu=\"gpu1\""), "{metrics}");

    // While gpu0's worker was down (its fault to its next start), gpu1's rendered.
    let gpu0 = gpu_box.lines_of("gpu0");
    let fault = times(&gpu0, "driver fault: stopping this worker").first().cloned().expect("gpu0 faulted");
    let back = times(&gpu0, "taking jobs").into_iter().find(|t| *t > fault).expect("gpu0 took jobs again");
    let meanwhile = times(&gpu_box.lines_of("gpu1"), "job done").into_iter().filter(|t| *t > fault && *t < back).count();
    assert!(meanwhile > 0, "gpu1 rendered nothing between {fault} and {back}");
    let by: HashMap<String, usize> = account_workers(&js, &shots).await;
    assert!(by.get("faulty/gpu1").is_some_and(|&n| n > 0) && by.get("faulty/gpu0").is_some_and(|&n| n > 0), "{by:?}");

    assert_eq!(gpu_box.process.terminate(Duration::from_secs(30)), Some(0), "SIGTERM stops the box cleanly:\n{}", gpu_box.log());
    let log = gpu_box.log();
    for gpu in ["gpu0", "gpu1"] {
        assert!(gpu_box.lines_of(gpu).iter().any(|l| l["fields"]["message"] == "stopped"), "{gpu}'s worker stopped by itself:\n{log}");
    }
}

/// Results per worker id.
async fn account_workers(js: &jetstream::Context, shots: &[Shot]) -> HashMap<String, usize> {
    let mut by = HashMap::new();
    for (_, outcome) in outcomes(js, shots, Duration::from_secs(10)).await {
        if let shotfleet_producer::wait::Outcome::Done(result) = outcome {
            *by.entry(result.worker.clone()).or_default() += 1;
        }
    }
    by
}

/// A card that holds none of its worker's classes (exit 78) is left stopped, not restarted; the
/// other card's worker serves, and the box says which is which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_that_holds_nothing_is_left_stopped_and_the_box_serves_with_the_other() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // The 512x512 probe runs out of memory in a 160 MiB arena: xs and s are past the card.
    let mut gpu_box = GpuBox::spawn(&server.url(), &spec("half", store.path()), "sim:4096,4096", "[supervisor.gpu.1]\ncpu_arena_max_mib = 160");
    gpu_box.wait_ready(1, Duration::from_secs(90));
    let deadline = Instant::now() + Duration::from_secs(60);
    while gpu_box.status()[1]["phase"] != "left_stopped" {
        assert!(Instant::now() < deadline, "{:?}", gpu_box.status()[1]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = gpu_box.status();
    assert_eq!((status[1]["restarts"].as_u64(), status[1]["last_exit"].as_str()), (Some(0), Some("exit 78 (nothing fits)")));
    assert!(status[1]["last_error"].as_str().unwrap().contains("this card holds nothing this worker may serve"), "{:?}", status[1]);
    let (code, body) = gpu_box.readyz();
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("ready: 1 of 2 workers take jobs\n"), "{body}");
    assert!(body.contains("gpu1 half/gpu1 (simulated, 4096 MiB") && body.contains("stopped, not restarted (the card holds none of the worker's classes"), "{body}");
    let (_, metrics) = http_get(gpu_box.port, "/metrics").unwrap();
    assert!(metrics.contains("shotfleet_box_worker_left_stopped{gpu=\"gpu1\"} 1"), "{metrics}");

    let jobs: Vec<Shot> = (0..2).map(|i| shot(Priority::P1, job(&format!("half-{i}"), "acme", (256, 256), 2, 1))).collect();
    submit(&js, &jobs).await;
    assert!(results(&outcomes(&js, &jobs, Duration::from_secs(60)).await).iter().all(|r| r.worker == "half/gpu0"));
    assert_eq!(gpu_box.process.terminate(Duration::from_secs(30)), Some(0), "{}", gpu_box.log());
}

/// A bad setting of one card's worker stops the box before any worker starts: exit 2, naming
/// the card and the setting.
#[test]
fn a_bad_setting_for_one_card_stops_the_box_before_anything_starts() {
    let store = tempfile::tempdir().unwrap();
    let mut gpu_box = GpuBox::spawn("nats://127.0.0.1:1", &spec("bad", store.path()), "sim:4096,1024", "[supervisor.gpu.1]\nconcurrency = 0");
    let status = gpu_box.process.wait_exit(Duration::from_secs(20)).expect("the box exits by itself");
    let log = gpu_box.log();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("configuration: gpu1: concurrency: 0 is outside 1..=64"), "{log}");
    assert!(!gpu_box.state().exists(), "no worker was prepared");

    let mut unknown = GpuBox::spawn("nats://127.0.0.1:1", &spec("bad", store.path()), "gpu0,gpu1", "");
    let status = unknown.process.wait_exit(Duration::from_secs(20)).expect("the box exits by itself");
    assert_eq!(status.code(), Some(2));
    assert!(unknown.log().contains("--gpus (SHOTFLEET_GPUS): `gpu0,gpu1` is not `all`"), "{}", unknown.log());
    let mut no_sim = GpuBox::spawn("nats://127.0.0.1:1", &spec("bad", store.path()), "all", "");
    assert_eq!(no_sim.process.wait_exit(Duration::from_secs(20)).and_then(|s| s.code()), Some(2));
    assert!(no_sim.log().contains("a CPU box has no GPUs to find: give it simulated ones"), "{}", no_sim.log());
}
