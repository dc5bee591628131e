//! The worker's configuration: a TOML file, then the environment, then flags.
//!
//! Everything is validated once at start, with the environment passed in (tests supply their
//! own), and every error names the setting and what would fix it. Secrets (NATS password, S3
//! keys) come from the environment or files and are never logged.
//!
//! ```toml
//! worker_id = "render-07/gpu0"     # default: <hostname>/<device><gpu>
//! device = "cuda"                  # or "cpu"   (SHOTFLEET_DEVICE)
//! gpu = 0                          # --gpu
//! model = "/models/sdxl-onnx"      # SHOTFLEET_MODEL
//! classes = ["xs", "s", "m"]       # the classes this card serves at most, or "auto": what it holds
//! concurrency = 1                  # jobs rendered at once
//! batch_jobs = 4                   # compatible jobs rendered together in shared UNet batches
//! unet_sessions = 2                # 1, or a UNet session per slot (weights again each); default "auto"
//! lookahead = 12                   # jobs fetched ahead to find them on a mixed queue (default 3 x batch_jobs)
//! affinity_passes = 2              # times a job may be passed over for one like the last render's
//! grace_period = "60s"
//! job_time_limit = "10m"
//!
//! [nats]      server = "tls://nats:4222", creds = "/etc/shotfleet/worker.creds", tls_ca = "/etc/shotfleet/nats-ca.pem"
//!             # or nkey / token_file / user + password_file; tls_cert + tls_key; inbox_prefix = "_INBOX_worker"
//! [store]     url = "s3://renders/shotfleet", endpoint = "http://minio:9000"
//! [budget]    max_fill = 0.9, reserve_mib = 512, max_mib = 12288   # max_mib: a share of the card
//! [cuda.unet] conv_algo_search = "exhaustive", fuse_conv_bias = true, graph = false   # search unset: heuristic
//!             attention = "flash"  # or "efficient", "cudnn"; unset: ONNX Runtime's choice
//! [cuda.vae]  conv_max_workspace = false
//! [telemetry] listen = "127.0.0.1:9400"   # the default; a pod or a remote scraper needs another
//! [priorities] p1_max_wait = "20s", p2_max_wait = "60s"
//! [attempts]  max_failures = 5, backoff = "2s", max_backoff = "60s"   # failed attempts, not deliveries
//! [degrade]   min_side = 512       # the ladder's floor for jobs that name none
//!             handoff = "30s"       # a job offered to the fleet at its size before it goes down
//!             restart_grace = "5m"  # a restarting worker keeps its classes while it starts
//! [limits]    max_megapixel_steps = 1000   # and the other bounds of schema::Limits
//! [supervisor] restart_backoff = "1s"       # `--gpus`: one worker per GPU (supervisor/config.rs)
//! [lora]      cache_max_mib = 20480, device_mib = 12000, host_mib = 16384   # worker/lora/config.rs
//! ```
//!
//! Durations are humantime's: `250ms`, `90s`, `10m`, `2h`, `1d`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shotfleet_schema::nats::{NatsArgs, NatsOptions};
use shotfleet_schema::nats::topology::parse_duration;
use shotfleet_schema::{Limits, Priority};

use crate::budget::{BudgetConfig, Classes};
use crate::faults::FaultConfig;
use crate::pipeline::CudaConfig;
use crate::store::StoreConfig;
use crate::supervisor::SupervisorConfig;
use crate::telemetry::TelemetryConfig;
use crate::worker::attempts::AttemptsConfig;
use crate::worker::degrade::DegradeConfig;
use crate::worker::lora::LoraConfig;

/// Where the graphs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

/// Where the text encoders run (`text_encoders`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TextEncoderPlace {
    /// On the CPU when the worker's room on its card (`[budget]`'s arena limit: the card or its
    /// `max_mib` share, less the water line and reserve) is under [`TextEncoderPlace::AUTO_CPU_BELOW_MIB`],
    /// else with the other graphs.
    #[default]
    Auto,
    /// With the other graphs (`device`).
    Device,
    /// On the CPU always.
    Cpu,
}

impl TextEncoderPlace {
    /// Room under which `auto` moves the text encoders off the card. SDXL's graphs hold 8.6 GiB
    /// of an H200 before any render, 1.6 of it the encoders' weights (deploy/gpu/RESULTS.md,
    /// 2026-12-01): below 16 GiB those are worth more to the renders than to the encode, which
    /// runs once per prompt.
    pub const AUTO_CPU_BELOW_MIB: u64 = 16 * 1024;

    /// Whether the encoders go to the CPU on a card with `room` bytes for the worker.
    pub fn on_cpu(self, device: DeviceKind, room: u64) -> bool {
        match (self, device) {
            (_, DeviceKind::Cpu) | (TextEncoderPlace::Device, _) => false,
            (TextEncoderPlace::Cpu, DeviceKind::Cuda) => true,
            (TextEncoderPlace::Auto, DeviceKind::Cuda) => room < Self::AUTO_CPU_BELOW_MIB * 1024 * 1024,
        }
    }
}

/// How many sessions of the UNet a worker loads (`unet_sessions`): `"auto"`, 1, or `concurrency`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnetSessions {
    /// One per render slot on a GPU worker whose room on its card (as for
    /// [`TextEncoderPlace::Auto`]) is at least [`UnetSessions::AUTO_PER_SLOT_FROM_MIB`], else one.
    #[default]
    Auto,
    Count(usize),
}

impl UnetSessions {
    /// The room from which `"auto"` gives each slot a session: each costs the UNet's weights
    /// again (5.6 GiB measured for SDXL in float16 on an H100, the weights' 4.8 and the session's
    /// own), a seventh of this, for +5-8% images/s in steady state (deploy/gpu/RESULTS.md,
    /// 2026-12-06, fourth session). An 80 GiB card has ~65 GiB of room; a 48 GiB card ~38, which
    /// keeps one.
    pub const AUTO_PER_SLOT_FROM_MIB: u64 = 40 * 1024;

    /// The sessions to load for `concurrency` slots on `device` with `room` bytes.
    pub fn count(self, device: DeviceKind, concurrency: usize, room: u64) -> usize {
        match (self, device) {
            (UnetSessions::Count(n), _) => n,
            (UnetSessions::Auto, DeviceKind::Cuda) if room >= Self::AUTO_PER_SLOT_FROM_MIB * 1024 * 1024 => concurrency,
            (UnetSessions::Auto, _) => 1,
        }
    }
}

impl<'de> Deserialize<'de> for UnetSessions {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = UnetSessions;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"auto\" or a number of sessions (1, or `concurrency`)")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<UnetSessions, E> {
                usize::try_from(n).map(UnetSessions::Count).map_err(|_| E::custom(format!("{n} sessions do not fit this platform")))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<UnetSessions, E> {
                u64::try_from(n).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(n), &self)).and_then(|n| self.visit_u64(n))
            }
            fn visit_str<E: serde::de::Error>(self, word: &str) -> Result<UnetSessions, E> {
                match word {
                    "auto" => Ok(UnetSessions::Auto),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// How long lower priorities may wait while higher ones keep arriving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PriorityConfig {
    /// A waiting p1 job is taken before p0 work once p1 went unserved this long.
    #[serde(with = "humantime_serde")]
    pub p1_max_wait: Duration,
    /// Likewise for p2.
    #[serde(with = "humantime_serde")]
    pub p2_max_wait: Duration,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        Self { p1_max_wait: Duration::from_secs(20), p2_max_wait: Duration::from_secs(60) }
    }
}

impl PriorityConfig {
    /// The bound for a priority (`p0` has none: it is always first).
    pub fn max_wait(&self, priority: Priority) -> Option<Duration> {
        match priority {
            Priority::P0 => None,
            Priority::P1 => Some(self.p1_max_wait),
            Priority::P2 => Some(self.p2_max_wait),
        }
    }
}

/// `[leak_guard]`: memory that creeps up while idle, or plain age, rebuilds the sessions; if the
/// creep survives a rebuild, the worker exits with `EXIT_RESTART` for its supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeakGuardConfig {
    /// Rebuild after this many jobs (0: never for age alone).
    pub rebuild_after_jobs: u64,
    /// Rebuild when the idle usage exceeds the post-load baseline by this much (MiB, 0: off).
    pub max_idle_growth_mib: u64,
    /// How often an idle worker measures (each check shrinks the arenas first).
    #[serde(with = "humantime_serde")]
    pub check_every: Duration,
}

impl Default for LeakGuardConfig {
    fn default() -> Self {
        Self { rebuild_after_jobs: 0, max_idle_growth_mib: 2048, check_every: Duration::from_secs(60) }
    }
}

/// Probe renders at start: they measure peaks for the budget and prove the card works.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CalibrationConfig {
    /// `[width, height, images]`, smallest first; at least two distinct sizes. List every size
    /// the fleet serves (one image each): a probed size's extra over the model carries to all its
    /// image counts (budget/estimate.rs).
    pub shapes: Vec<[u32; 3]>,
    /// Steps of each probe render (memory does not depend on it; time does).
    pub steps: u32,
    /// Skip the probe renders when a stored fingerprint matches (card, model, runtime). A fitness
    /// render of the smallest shape still runs.
    pub reuse_fingerprint: bool,
    /// Each probe shrinks the arenas at its end, so the next one is measured from the models
    /// alone. Off: probes run back to back smallest first, and a larger probe's peak also
    /// counts regions a smaller one left that it could not reuse (a few percent high).
    pub cold: bool,
}

impl Default for CalibrationConfig {
    fn default() -> Self {
        Self {
            // The four-image probe fits how the UNet's share grows with the batch, which one- and
            // two-image probes alone left 40% low at 768x768 x 4 on the H200 (2026-11-30).
            shapes: vec![[512, 512, 1], [768, 768, 1], [768, 768, 4], [1024, 1024, 1], [1024, 1024, 2]],
            steps: 2,
            reuse_fingerprint: true,
            cold: true,
        }
    }
}

/// The whole worker configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Names this worker in results, failed records and logs.
    pub worker_id: String,
    pub device: DeviceKind,
    /// The GPU with `device = "cuda"`, as CUDA numbers them (ONNX Runtime's `device_id`); the
    /// budget reads the same card through NVML, honouring `CUDA_VISIBLE_DEVICES`.
    pub gpu: u32,
    /// The model folder (Optimum's SDXL ONNX layout).
    pub model: PathBuf,
    /// Memory classes this worker serves at most (small cards leave out the large ones), or
    /// `"auto"`. Of these it serves those whose largest one-image size the calibrated budget
    /// holds at start (budget/classes.rs); `/readyz` and `shotfleet_class_servable` say which.
    pub classes: Classes,
    /// Jobs rendered at the same time (each in its own UNet batches); as many more may be
    /// uploading and committing, their renders done.
    pub concurrency: usize,
    /// Sessions of the UNet: `"auto"` (the default: one per slot on a card with room for it,
    /// [`UnetSessions::Auto`]), 1 or `concurrency`. With one the render slots take turns on it,
    /// a whole schedule at a time, and the card idles in each call's gaps between kernels; with
    /// one per slot their UNet calls run at once and fill each other's gaps, for the UNet's
    /// weights once more on the card per session (5.6 GiB measured for SDXL in float16), which the budget
    /// counts with the models. deploy/gpu/RESULTS.md has what it gave.
    pub unet_sessions: UnetSessions,
    /// Up to this many compatible jobs (same size, steps, guidance, LoRA set) dealt to one slot
    /// are rendered in shared UNet batches, when the budget holds all their images. 1: off.
    pub batch_jobs: usize,
    /// Jobs fetched beyond `batch_jobs` per free slot while the queue is deep, kept alive in the
    /// worker's reserve, so that a slot finds batch partners for its lead on a queue of mixed
    /// sizes, and jobs like the last render's (`affinity_passes`) (worker/reserve.rs). `None`:
    /// three times `batch_jobs` when batching, else 0.
    pub lookahead: Option<usize>,
    /// How many times a waiting job may be passed over, within its priority, for one more like
    /// the last group dealt (the same batch, LoRA set or size), so that renders in a row keep a
    /// LoRA set on the device and a size's convolution plans (worker/reserve.rs). 0: arrival order.
    pub affinity_passes: u32,
    /// On SIGTERM, how long in-flight jobs may take to finish before they are naked.
    #[serde(with = "humantime_serde")]
    pub grace_period: Duration,
    /// A render running longer than this is stopped and naked (a transient failure).
    #[serde(with = "humantime_serde")]
    pub job_time_limit: Duration,
    /// How often a job in progress tells the server it is alive; `None`: a third of the
    /// consumer's `ack_wait`.
    #[serde(default, with = "humantime_serde")]
    pub progress_interval: Option<Duration>,
    /// How long to sleep when every queue was empty (doubles up to ten times this).
    #[serde(with = "humantime_serde")]
    pub idle_poll: Duration,
    /// Threads per graph on the CPU, 1..=256; unset: ONNX Runtime's default (one per core).
    pub intra_threads: Option<usize>,
    /// Where the two text encoders run on a GPU worker: `"auto"` (on the CPU below 16 GiB of
    /// room), `"device"` or `"cpu"`.
    pub text_encoders: TextEncoderPlace,
    /// Caps ONNX Runtime's CPU arena (MiB), so a CPU worker runs out of memory for real where a
    /// small card would: for tests and rehearsals of the degrade ladder. Unset: uncapped.
    pub cpu_arena_max_mib: Option<u64>,
    /// The CUDA provider's options per graph (`device = "cuda"` only).
    pub cuda: CudaConfig,
    /// The degrade ladder's lower end for jobs without a floor.
    pub degrade: DegradeConfig,
    /// A job present at this many deliveries when a driver fault strikes goes to the failed
    /// stream with reason `driver` instead of back to the queue.
    pub driver_fault_attempts: u64,
    /// Rebuild sessions (or exit for a restart) against slow leaks.
    pub leak_guard: LeakGuardConfig,
    /// Where calibration fingerprints are kept.
    pub state_dir: PathBuf,
    pub nats: NatsOptions,
    pub store: StoreConfig,
    pub budget: BudgetConfig,
    pub telemetry: TelemetryConfig,
    pub priorities: PriorityConfig,
    pub calibration: CalibrationConfig,
    /// Bounds a job must respect (the producer uses the same defaults).
    pub limits: Limits,
    /// When a failing job is given up on, and its backoff.
    pub attempts: AttemptsConfig,
    /// Fault injection for tests: explicit, off by default, loudly logged when on.
    pub faults: FaultConfig,
    /// `--gpus`: the box supervisor's settings and per-GPU overrides; a single worker ignores it.
    pub supervisor: SupervisorConfig,
    /// The LoRA library (a folder of the store), its local cache, the pool of merged sets.
    pub lora: LoraConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            worker_id: String::new(),
            device: DeviceKind::Cpu,
            gpu: 0,
            model: PathBuf::new(),
            classes: Classes::default(),
            concurrency: 1,
            unet_sessions: UnetSessions::Auto,
            batch_jobs: 1,
            lookahead: None,
            affinity_passes: 2,
            grace_period: Duration::from_secs(60),
            job_time_limit: Duration::from_secs(600),
            progress_interval: None,
            idle_poll: Duration::from_millis(100),
            intra_threads: None,
            text_encoders: TextEncoderPlace::Auto,
            cpu_arena_max_mib: None,
            cuda: CudaConfig::default(),
            degrade: DegradeConfig::default(),
            driver_fault_attempts: 3,
            leak_guard: LeakGuardConfig::default(),
            state_dir: PathBuf::from("/var/lib/shotfleet"),
            nats: NatsOptions { name: "shotfleet-consumer".into(), ..NatsOptions::default() },
            store: StoreConfig::default(),
            budget: BudgetConfig::default(),
            telemetry: TelemetryConfig::default(),
            priorities: PriorityConfig::default(),
            calibration: CalibrationConfig::default(),
            limits: Limits::default(),
            attempts: AttemptsConfig::default(),
            faults: FaultConfig::default(),
            supervisor: SupervisorConfig::default(),
            lora: LoraConfig::default(),
        }
    }
}

/// Values given on the command line; each overrides the file and the environment.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// The connection flags; they apply the NATS environment variables too.
    pub nats: NatsArgs,
    pub model: Option<PathBuf>,
    pub store: Option<String>,
    pub device: Option<String>,
    pub gpu: Option<u32>,
    pub classes: Option<String>,
    pub metrics_addr: Option<String>,
    pub grace_period: Option<String>,
    pub worker_id: Option<String>,
    pub state_dir: Option<PathBuf>,
}

/// A setting that cannot be used, and what to do about it.
#[derive(Debug, thiserror::Error)]
#[error("{setting}: {message}")]
pub struct ConfigError {
    pub setting: String,
    pub message: String,
}

fn bad(setting: &str, message: impl Into<String>) -> ConfigError {
    ConfigError { setting: setting.to_owned(), message: message.into() }
}

impl WorkerConfig {
    /// Reads `file` (if any), applies the environment (the `NATS_*` variables of
    /// [`NatsArgs`], `SHOTFLEET_MODEL`, `SHOTFLEET_STORE`, `SHOTFLEET_DEVICE`,
    /// `SHOTFLEET_GPU`, `SHOTFLEET_WORKER_ID`, `SHOTFLEET_STATE_DIR`, `SHOTFLEET_METRICS_ADDR`),
    /// then the flags, and validates the result.
    ///
    /// # Errors
    /// [`ConfigError`] naming the setting.
    pub fn resolve(file: Option<&Path>, env: &HashMap<String, String>, flags: Overrides) -> Result<Self, ConfigError> {
        let config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| bad("--config", format!("cannot read {}: {e}", path.display())))?;
                toml::from_str::<WorkerConfig>(&text).map_err(|e| bad(&path.display().to_string(), e.to_string()))?
            }
            None => WorkerConfig::default(),
        };
        let mut config = config.apply(env, flags)?;
        // The default probe shapes follow `[limits]`: a worker that takes only smaller jobs (or
        // fewer images) probes only what it may render. Shapes an operator lists are checked.
        if config.calibration.shapes == CalibrationConfig::default().shapes {
            let limits = &config.limits;
            config.calibration.shapes.retain(|&[w, h, n]| limits.shape_problem(w, h, n).is_none());
        }
        config.validate()?;
        Ok(config)
    }

    /// Applies the environment, then the flags, over `self` (a file's settings), as
    /// [`resolve`](Self::resolve) does, without validating the result.
    ///
    /// # Errors
    /// [`ConfigError`] naming a variable or flag that cannot be read.
    pub fn apply(self, env: &HashMap<String, String>, flags: Overrides) -> Result<Self, ConfigError> {
        let mut config = self;
        let var = |name: &str| env.get(name).filter(|v| !v.is_empty()).cloned();
        let pick = |flag: Option<String>, name: &str| flag.or_else(|| var(name));

        flags.nats.apply(&mut config.nats, var);
        if let Some(v) = flags.model.or_else(|| var("SHOTFLEET_MODEL").map(PathBuf::from)) {
            config.model = v;
        }
        if let Some(v) = pick(flags.store, "SHOTFLEET_STORE") {
            config.store.url = v;
        }
        if let Some(v) = pick(flags.device, "SHOTFLEET_DEVICE") {
            config.device = match v.as_str() {
                "cpu" => DeviceKind::Cpu,
                "cuda" => DeviceKind::Cuda,
                other => return Err(bad("device (SHOTFLEET_DEVICE)", format!("`{other}` is not `cpu` or `cuda`"))),
            };
        }
        let gpu = flags.gpu.map(Ok).or_else(|| {
            var("SHOTFLEET_GPU").map(|g| g.parse::<u32>().map_err(|_| bad("SHOTFLEET_GPU", format!("`{g}` is not a GPU index"))))
        });
        if let Some(gpu) = gpu {
            config.gpu = gpu?;
        }
        if let Some(v) = flags.classes {
            config.classes = v.parse().map_err(|e| bad("--classes", e))?;
        }
        if let Some(v) = pick(flags.metrics_addr, "SHOTFLEET_METRICS_ADDR") {
            config.telemetry.listen =
                v.parse().map_err(|_| bad("--metrics-addr (SHOTFLEET_METRICS_ADDR)", format!("`{v}` is not an IP address and port like 0.0.0.0:9400 (no host names)")))?;
        }
        if let Some(v) = flags.grace_period {
            config.grace_period = parse_duration(&v).map_err(|e| bad("--grace-period", e))?;
        }
        if let Some(v) = pick(flags.worker_id, "SHOTFLEET_WORKER_ID") {
            config.worker_id = v;
        }
        if let Some(v) = flags.state_dir.or_else(|| var("SHOTFLEET_STATE_DIR").map(PathBuf::from)) {
            config.state_dir = v;
        }
        if config.worker_id.is_empty() {
            let host = env.get("HOSTNAME").cloned().unwrap_or_else(hostname);
            config.worker_id = match config.device {
                DeviceKind::Cpu => format!("{host}/cpu"),
                DeviceKind::Cuda => format!("{host}/gpu{}", config.gpu),
            };
        }
        Ok(config)
    }

    /// Checks what can be checked without connecting anywhere.
    ///
    /// # Errors
    /// [`ConfigError`] naming the setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.model.as_os_str().is_empty() {
            return Err(bad("model (SHOTFLEET_MODEL, --model)", "no model folder given"));
        }
        if !self.model.is_dir() {
            return Err(bad("model (SHOTFLEET_MODEL, --model)", format!("{} is not a folder", self.model.display())));
        }
        if self.classes.is_empty() {
            return Err(bad("classes", "serve at least one class"));
        }
        if self.concurrency == 0 || self.concurrency > 64 {
            return Err(bad("concurrency", format!("{} is outside 1..=64", self.concurrency)));
        }
        // A render thread keeps its session; with fewer sessions than threads, two renders may
        // share one while another sits idle.
        if let UnetSessions::Count(n) = self.unet_sessions
            && n != 1
            && n != self.concurrency
        {
            return Err(bad(
                "unet_sessions",
                format!(
                    "{n} is neither 1 (the render slots take turns on one session), `concurrency` ({}, a session per slot) nor \"auto\"",
                    self.concurrency
                ),
            ));
        }
        if self.batch_jobs == 0 || self.batch_jobs > 64 {
            return Err(bad("batch_jobs", format!("{} is outside 1..=64", self.batch_jobs)));
        }
        if let Some(n) = self.lookahead
            && n > 256
        {
            return Err(bad("lookahead", format!("{n} is outside 0..=256")));
        }
        // Each graph's session starts this many threads at load (four graphs, and more with
        // `concurrency`): a slip of a few zeros exhausts the host's memory before any job.
        if let Some(n) = self.intra_threads
            && !(1..=256).contains(&n)
        {
            return Err(bad("intra_threads", format!("{n} is outside 1..=256 (omit it for one thread per core)")));
        }
        if self.affinity_passes > 64 {
            return Err(bad("affinity_passes", format!("{} is outside 0..=64", self.affinity_passes)));
        }
        // An idle worker polls its queues this often: at 0 it spins a core against the server.
        if self.idle_poll < Duration::from_millis(10) || self.idle_poll > Duration::from_secs(60) {
            return Err(bad("idle_poll", format!("{:?} is outside 10ms..=60s", self.idle_poll)));
        }
        if self.job_time_limit < Duration::from_secs(1) {
            return Err(bad("job_time_limit", "must be at least 1s"));
        }
        if self.worker_id.contains(['\n', '\r']) || self.worker_id.len() > 200 {
            return Err(bad("worker_id", "must be one line of at most 200 bytes"));
        }
        match (self.device, &self.budget.simulate) {
            (DeviceKind::Cpu, None) => {
                return Err(bad(
                    "budget.simulate",
                    "a CPU worker needs an explicit simulated GPU, e.g. `[budget.simulate] total_mib = 4096`; \
                     it is never assumed",
                ));
            }
            (DeviceKind::Cuda, Some(_)) => {
                return Err(bad("budget.simulate", "a CUDA worker measures its card through NVML; remove [budget.simulate]"));
            }
            _ => {}
        }
        if self.device == DeviceKind::Cpu && self.cuda != CudaConfig::default() {
            return Err(bad("cuda", "these options are for `device = \"cuda\"`; remove the [cuda.*] tables from a CPU worker's config"));
        }
        if self.cuda.vae.graph {
            return Err(bad(
                "cuda.vae.graph",
                "CUDA graphs are for the UNet (`[cuda.unet] graph`), which runs once per step at a fixed shape; the VAE runs once per render",
            ));
        }
        if self.device == DeviceKind::Cpu && self.faults.arena_limit_mib.is_some() {
            return Err(bad("faults.arena_limit_mib", "caps the CUDA arena; a CPU worker caps its arena with `cpu_arena_max_mib`"));
        }
        if self.cuda.unet.graph && self.concurrency > 1 {
            return Err(bad(
                "cuda.unet.graph",
                "needs `concurrency = 1`: a CUDA graph is captured while the UNet runs, and another render's allocations on the GPU at that moment break the capture",
            ));
        }
        if cfg!(not(feature = "cuda")) && self.device == DeviceKind::Cuda {
            return Err(bad("device", "this binary was built without the `cuda` feature; rebuild with --features cuda"));
        }
        self.budget.validate().map_err(|e| bad("budget", e.to_string()))?;
        self.limits.check().map_err(|(field, message)| bad(&format!("limits.{field}"), message))?;
        for (i, &[width, height, images]) in self.calibration.shapes.iter().enumerate() {
            if let Some(problem) = self.limits.shape_problem(width, height, images) {
                return Err(bad(&format!("calibration.shapes[{i}]"), format!("[{width}, {height}, {images}]: {problem}")));
            }
        }
        let mut sizes: Vec<(u32, u32)> = self.calibration.shapes.iter().map(|&[w, h, _]| (w, h)).collect();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.len() < 2 {
            return Err(bad(
                "calibration.shapes",
                "give at least two shapes of different sizes (within [limits]: the default shapes outside them are left out)",
            ));
        }
        if self.attempts.max_failures == 0 {
            return Err(bad("attempts.max_failures", "must be at least 1"));
        }
        if self.attempts.backoff > self.attempts.max_backoff {
            let (backoff, max) = (self.attempts.backoff, self.attempts.max_backoff);
            return Err(bad("attempts.backoff", format!("{backoff:?} is above max_backoff ({max:?}): the first wait would already be cut to it")));
        }
        if self.calibration.steps == 0 {
            return Err(bad("calibration.steps", "must be at least 1"));
        }
        self.lora.validate().map_err(|(setting, message)| bad(setting, message))?;
        self.nats.addresses().map_err(|e| bad("nats.server (NATS_URL, --server)", e.to_string()))?;
        Ok(())
    }

    /// Serving needs a store set on purpose: images never go to a folder nobody chose.
    /// (`--check-budget` renders without one.)
    ///
    /// # Errors
    /// [`ConfigError`] when no store is configured.
    pub fn require_store(&self) -> Result<(), ConfigError> {
        if self.store.url.trim().is_empty() {
            return Err(bad(
                "store.url (SHOTFLEET_STORE, --store)",
                "no store for the images; set one, e.g. `[store] url = \"s3://renders/shotfleet\"` or \
                 SHOTFLEET_STORE=file:///var/lib/shotfleet/images",
            ));
        }
        self.store.location().map_err(|e| bad("store.url (SHOTFLEET_STORE, --store)", e.to_string()))?;
        Ok(())
    }

    /// Jobs fetched ahead of the free slots while the queue is deep (`lookahead`, its default
    /// when unset).
    pub fn lookahead(&self) -> usize {
        self.lookahead.unwrap_or(if self.batch_jobs > 1 { 3 * self.batch_jobs } else { 0 })
    }

    /// The GPU index as the pipeline and probe see it: `None` on the CPU.
    pub fn gpu_index(&self) -> Option<u32> {
        (self.device == DeviceKind::Cuda).then_some(self.gpu)
    }

    /// The listen address for metrics and health.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.telemetry.listen
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "worker".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_encoders_leave_only_small_cards_unless_told() {
        const GIB: u64 = 1024 * 1024 * 1024;
        let auto = TextEncoderPlace::Auto;
        // A 12 GiB card leaves 10.3 GiB of room (0.9 of it, less the reserve); 24 GiB, 21.1.
        assert!(auto.on_cpu(DeviceKind::Cuda, 10 * GIB));
        assert!(!auto.on_cpu(DeviceKind::Cuda, 21 * GIB));
        assert!(!auto.on_cpu(DeviceKind::Cpu, GIB), "on a CPU worker everything is on the CPU already");
        assert!(TextEncoderPlace::Cpu.on_cpu(DeviceKind::Cuda, 100 * GIB));
        assert!(!TextEncoderPlace::Device.on_cpu(DeviceKind::Cuda, GIB));
        let parsed: WorkerConfig = toml::from_str("text_encoders = \"cpu\"").unwrap();
        assert_eq!(parsed.text_encoders, TextEncoderPlace::Cpu);
        assert!(toml::from_str::<WorkerConfig>("text_encoders = \"gpu\"").is_err());
    }

    #[test]
    fn unet_sessions_go_one_per_slot_only_on_a_roomy_card_unless_told() {
        const GIB: u64 = 1024 * 1024 * 1024;
        let auto = UnetSessions::Auto;
        // An 80 GiB card leaves ~65 GiB of room, a 48 GiB one ~38.
        assert_eq!(auto.count(DeviceKind::Cuda, 2, 65 * GIB), 2);
        assert_eq!(auto.count(DeviceKind::Cuda, 3, 65 * GIB), 3);
        assert_eq!(auto.count(DeviceKind::Cuda, 2, 38 * GIB), 1);
        assert_eq!(auto.count(DeviceKind::Cpu, 2, 65 * GIB), 1, "a CPU worker keeps one");
        assert_eq!(UnetSessions::Count(1).count(DeviceKind::Cuda, 2, 65 * GIB), 1);
        assert_eq!(UnetSessions::Count(2).count(DeviceKind::Cuda, 2, GIB), 2, "told: as told");
        let parsed = |text: &str| toml::from_str::<WorkerConfig>(text).map(|c| c.unet_sessions);
        assert_eq!(parsed("").unwrap(), UnetSessions::Auto);
        assert_eq!(parsed("unet_sessions = \"auto\"").unwrap(), UnetSessions::Auto);
        assert_eq!(parsed("unet_sessions = 2").unwrap(), UnetSessions::Count(2));
    }
}
