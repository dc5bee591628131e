//! What the end-to-end tests share: a NATS server with the topology, workers as real processes
//! (the `shotfleet-consumer` binary), submitting jobs and checking what ends up in the store.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream;
use sha2::{Digest, Sha256};
use shotfleet_producer::storyboard::Shot;
use shotfleet_producer::submit::{self, SubmitOptions};
use shotfleet_producer::wait::{self, Awaited, Outcome};
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{Priority, ShotJob, ShotResult};
use shotfleet_testkit::paths;
use shotfleet_testkit::ports::free_port;
use shotfleet_testkit::process::{http_get, Guarded};

pub mod accounting;

/// A built binary of the workspace (`cargo build --bins` puts them beside the test's folder).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(path.exists(), "{} not built; run `cargo build --workspace --bins` (scripts/test.sh does)", path.display());
    path
}

/// The tiny SDXL fixture.
pub fn tiny_model() -> PathBuf {
    paths::repo_root().join("onnx/tiny/model")
}

/// JetStream on `url` with the topology created as `topology` says.
pub async fn jetstream_with(url: &str, topology: &Topology) -> jetstream::Context {
    let client = async_nats::connect(url).await.expect("connect to the test server");
    let js = jetstream::new(client);
    topology.ensure(&js, false).await.expect("topology");
    js
}

/// Knobs of one worker process; the rest is the demo's CPU config.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub id: String,
    pub classes: &'static str,
    pub concurrency: usize,
    pub total_mib: u64,
    pub grace: &'static str,
    pub time_limit: &'static str,
    pub p1_max_wait: &'static str,
    pub p2_max_wait: &'static str,
    /// Extra top-level TOML keys (before any section), e.g. `cpu_arena_max_mib = 200`.
    pub top: String,
    /// Extra `[budget]` keys, e.g. `vae_keeps_arena = true`.
    pub budget: &'static str,
    /// The calibration shapes, as TOML.
    pub calibration: &'static str,
    /// Extra TOML appended as is (e.g. a `[faults]` section).
    pub extra: String,
    pub store_url: String,
    pub env: Vec<(String, String)>,
}

impl WorkerSpec {
    pub fn new(id: &str, store: &Path) -> Self {
        Self {
            id: id.to_owned(),
            classes: "[\"xs\", \"s\"]",
            concurrency: 1,
            total_mib: 4096,
            grace: "20s",
            time_limit: "2m",
            p1_max_wait: "20s",
            p2_max_wait: "60s",
            top: String::new(),
            budget: "",
            calibration: "[[128, 128, 1], [256, 256, 1], [512, 512, 1]]",
            extra: String::new(),
            store_url: format!("file://{}", store.display()),
            env: Vec::new(),
        }
    }

    /// The same worker storing its images in the moto bucket `renders` under `shotfleet`,
    /// reached at `endpoint` (the server's, or a proxy's in front of it), with the store's
    /// retries given up after `max_elapsed_ms`.
    pub fn on_s3(mut self, endpoint: &str, max_elapsed_ms: u64) -> Self {
        self.store_url = "s3://renders/shotfleet".into();
        self.extra = format!("\n[store.retry]\nmax_elapsed_ms = {max_elapsed_ms}\n");
        self.env = shotfleet_testkit::S3Server::credentials().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.env.push(("AWS_ENDPOINT_URL".into(), endpoint.to_owned()));
        self
    }

    /// The worker's config file.
    pub fn toml(&self, state: &Path, metrics_port: u16) -> String {
        format!(
            r#"worker_id = "{id}"
device = "cpu"
model = "{model}"
classes = {classes}
concurrency = {concurrency}
grace_period = "{grace}"
job_time_limit = "{limit}"
intra_threads = 1
idle_poll = "50ms"
state_dir = "{state}"
{top}

[store]
url = "{store}"
allow_http = true

[budget]
reserve_mib = 64
margin_mib = 64
{budget}

[budget.simulate]
total_mib = {total}

[calibration]
shapes = {calibration}
steps = 1

[telemetry]
listen = "127.0.0.1:{metrics_port}"

[priorities]
p1_max_wait = "{p1}"
p2_max_wait = "{p2}"
{extra}
"#,
            id = self.id,
            model = tiny_model().display(),
            classes = self.classes,
            concurrency = self.concurrency,
            grace = self.grace,
            limit = self.time_limit,
            state = state.display(),
            store = self.store_url,
            total = self.total_mib,
            p1 = self.p1_max_wait,
            p2 = self.p2_max_wait,
            extra = self.extra,
            top = self.top,
            calibration = self.calibration,
            budget = self.budget,
        )
    }
}

/// A `shotfleet-consumer` process.
pub struct Worker {
    pub spec: WorkerSpec,
    pub metrics_port: u16,
    process: Guarded,
    dir: tempfile::TempDir,
}

impl Drop for Worker {
    /// A failing test shows the worker's log: its assertion alone seldom says why.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- worker {} log ---\n{}--- end of worker {} log ---", self.spec.id, self.log(), self.spec.id);
        }
    }
}

impl Worker {
    /// Starts a worker against `nats_url` and waits until `/readyz` says it takes jobs.
    pub fn start(nats_url: &str, spec: WorkerSpec) -> Self {
        let mut worker = Self::spawn(nats_url, spec);
        worker.wait_ready(Duration::from_secs(60));
        worker
    }

    /// Starts a worker against `nats_url` without waiting for it to be ready.
    pub fn spawn(nats_url: &str, spec: WorkerSpec) -> Self {
        let dir = tempfile::tempdir().expect("worker dir");
        let (metrics_port, process) = Self::launch(dir.path(), nats_url, &spec);
        Self { spec, metrics_port, process, dir }
    }

    /// Starts this worker again, with `spec`, in its own folder (its state folder as the last
    /// process left it; its log goes on after the last one's) once the last process has ended;
    /// does not wait for it to be ready.
    pub fn respawn(&mut self, nats_url: &str, spec: WorkerSpec) {
        assert!(!self.process.running(), "worker {} still runs", self.spec.id);
        (self.metrics_port, self.process) = Self::launch(self.dir.path(), nats_url, &spec);
        self.spec = spec;
    }

    fn launch(dir: &Path, nats_url: &str, spec: &WorkerSpec) -> (u16, Guarded) {
        let metrics_port = free_port();
        let config = dir.join("worker.toml");
        std::fs::write(&config, spec.toml(&dir.join("state"), metrics_port)).expect("write config");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("worker.log")).expect("log");
        let mut command = Command::new(binary("shotfleet-consumer"));
        command
            .args(["--config", config.to_str().unwrap(), "--plain-logs"])
            .env("NATS_URL", nats_url)
            .env("ORT_DYLIB_PATH", ort_library())
            .env("RUST_LOG", "info,ort=warn")
            .envs(spec.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        (metrics_port, Guarded::spawn(command).expect("spawn shotfleet-consumer"))
    }

    pub fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some((200, _)) = http_get(self.metrics_port, "/readyz") {
                return;
            }
            assert!(self.process.running(), "worker {} exited during start:\n{}", self.spec.id, self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("worker {} not ready after {timeout:?}:\n{}", self.spec.id, self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("worker.log")).unwrap_or_default()
    }

    /// The log without its colours (`jobs=2`, not `\x1b[3mjobs\x1b[0m\x1b[2m=\x1b[0m2`).
    pub fn plain_log(&self) -> String {
        let log = self.log();
        let mut out = String::with_capacity(log.len());
        let mut chars = log.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                chars.by_ref().find(|c| c.is_ascii_alphabetic());
            } else {
                out.push(c);
            }
        }
        out
    }

    pub fn metrics(&self) -> String {
        http_get(self.metrics_port, "/metrics").map(|(_, body)| body).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Sends `signal` (`TERM`, `INT`) without waiting.
    pub fn signal(&self, signal: &str) {
        self.process.signal(signal);
    }

    /// SIGTERM and wait for the exit code.
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        self.process.terminate(timeout)
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        self.process.wait_exit(timeout)
    }

    pub fn running(&mut self) -> bool {
        self.process.running()
    }
}

/// The ONNX Runtime library from the venv (or `ORT_DYLIB_PATH`).
pub fn ort_library() -> PathBuf {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH") {
        return PathBuf::from(path);
    }
    let lib = paths::venv().join("lib");
    std::fs::read_dir(&lib)
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| e.path().join("site-packages/onnxruntime/capi/libonnxruntime.so.1.31.1"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| panic!("libonnxruntime.so.1.31.1 not found under {}; run `bash scripts/setup.sh`", lib.display()))
}

/// A small valid job.
pub fn job(job_id: &str, project: &str, size: (u32, u32), steps: u32, images: u32) -> ShotJob {
    ShotJob {
        v: 1,
        job_id: job_id.to_owned(),
        project: project.to_owned(),
        shot_id: format!("shot-{job_id}"),
        prompt: format!("storyboard frame {job_id}, ink wash"),
        negative_prompt: Some("blurry".into()),
        width: size.0,
        height: size.1,
        steps,
        guidance: 5.0,
        seed: 42,
        images,
        loras: vec![],
        floor: None,
        degrade: None,
    }
}

pub fn shot(priority: Priority, job: ShotJob) -> Shot {
    Shot { line: 0, priority, job }
}

/// Publishes shots with the producer library.
pub async fn submit(js: &jetstream::Context, shots: &[Shot]) {
    submit::submit(js, shots, SubmitOptions::default(), |_, _| {}).await.expect("submit");
}

/// Waits for every shot's outcome; the outcomes by job id (the wait's are by key, and the
/// shots' ids must differ).
pub async fn outcomes(js: &jetstream::Context, shots: &[Shot], timeout: Duration) -> HashMap<String, Outcome> {
    let awaited: Vec<Awaited> = shots
        .iter()
        .map(|s| Awaited { project: s.job.project.clone(), job_id: s.job.job_id.clone(), duplicate: false, queued_at: None })
        .collect();
    let since = SystemTime::now() - Duration::from_secs(3600);
    let by_key = wait::wait(js, &awaited, since, Some(timeout), |_, _| {}).await.expect("every job ends");
    let by_id: HashMap<String, Outcome> =
        by_key.into_iter().map(|(key, outcome)| (key.split_once('/').expect("a key").1.to_owned(), outcome)).collect();
    assert_eq!(by_id.len(), shots.len(), "the shots' job ids differ");
    by_id
}

/// The results among outcomes, panicking on a failed one.
pub fn results(outcomes: &HashMap<String, Outcome>) -> Vec<ShotResult> {
    outcomes
        .iter()
        .map(|(id, o)| match o {
            Outcome::Done(r) => (**r).clone(),
            Outcome::Failed { reason, detail, .. } => panic!("{id} failed: {reason}: {detail}"),
        })
        .collect()
}

/// The store invariant, on a local folder store: every image a result names exists with its
/// sha256, and nothing else lies under the job's prefix.
pub fn check_store(root: &Path, result: &ShotResult) {
    for image in &result.images {
        let bytes = std::fs::read(root.join(&image.key)).unwrap_or_else(|e| panic!("{}: {e}", image.key));
        assert_eq!(hex::encode(Sha256::digest(&bytes)), image.sha256, "{}", image.key);
        assert_eq!(bytes.len() as u64, image.bytes);
        assert!(bytes.starts_with(b"\x89PNG"), "{} is a PNG", image.key);
    }
    let job_dir = root.join(&result.project).join(&result.job_id);
    let named: Vec<PathBuf> = result.images.iter().map(|i| root.join(&i.key)).collect();
    for entry in std::fs::read_dir(&job_dir).unwrap_or_else(|e| panic!("{}: {e}", job_dir.display())) {
        let path = entry.unwrap().path();
        assert!(named.contains(&path), "{} is under the job but no result names it", path.display());
    }
}

/// Waits until the work queue is empty: every job acked (and so swept). Errors are retried: on
/// a cluster that just lost a node, requests time out until a new leader is elected.
pub async fn wait_settled(js: &jetstream::Context, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let remaining = match js.get_stream(shotfleet_schema::subject::JOBS_STREAM).await {
            Ok(mut stream) => stream.info().await.map(|i| i.state.messages).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match remaining {
            Ok(0) => return,
            Ok(n) => assert!(Instant::now() < deadline, "{n} jobs still unacked after {timeout:?}"),
            Err(e) => assert!(Instant::now() < deadline, "cannot read the jobs stream: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the consumer `name` has a job delivered and not yet acked.
pub async fn wait_in_flight(js: &jetstream::Context, name: &str) {
    assert!(in_flight_or_settled(js, name).await, "{name}: every job settled before one was seen in flight");
}

/// Whether a job of consumer `name` is in flight (`true`) before every job of the stream has
/// settled (`false`); fails after 20 s of neither.
pub async fn in_flight_or_settled(js: &jetstream::Context, name: &str) -> bool {
    let mut stream = js.get_stream(shotfleet_schema::subject::JOBS_STREAM).await.expect("jobs stream");
    let mut consumer: jetstream::consumer::PullConsumer = stream.get_consumer(name).await.expect("consumer");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if consumer.info().await.expect("consumer info").num_ack_pending > 0 {
            return true;
        }
        if stream.info().await.expect("stream info").state.messages == 0 {
            return false;
        }
        assert!(Instant::now() < deadline, "{name}: no job was fetched");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
