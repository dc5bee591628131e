//! What the box knows of each GPU's worker: its process, its exits and restarts, and its own
//! `/readyz` (read every second while it runs). Shown on the box's `/readyz` and `/status` and as
//! the box's metrics.
//!
//! | metric | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `shotfleet_box_worker_running` | gauge | `gpu` | 1 while the GPU's worker process runs |
//! | `shotfleet_box_worker_ready` | gauge | `gpu` | 1 while its `/readyz` says ready (it takes jobs) |
//! | `shotfleet_box_worker_left_stopped` | gauge | `gpu` | 1 once it exited in a way a restart cannot mend (exit 2 or 78): a person must act |
//! | `shotfleet_box_worker_restarts_total` | counter | `gpu`, `reason` | restarts, by the exit before them: `driver_fault`, `leak_guard`, `store_unusable`, `start_failed`, `stopped`, `crashed`, `killed` |
//!
//! Alert on `shotfleet_box_worker_left_stopped == 1` and on
//! `increase(shotfleet_box_worker_restarts_total{reason="driver_fault"}[1h]) > 2` (a card that keeps faulting).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use metrics::{counter, gauge};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::plan::BoxPlan;
use super::policy::{Decision, Exit};

/// How often a running worker's `/readyz` is read.
const POLL_EVERY: Duration = Duration::from_secs(1);
/// A worker that does not answer within this is counted not ready for now.
const POLL_TIMEOUT: Duration = Duration::from_secs(2);

/// Where a GPU's worker is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Its process runs (whether it is ready says `ready`).
    Running,
    /// It exited and is started again after a delay.
    Restarting,
    /// It exited in a way a restart cannot mend; it stays stopped.
    LeftStopped,
    /// The box is stopping: it was asked to finish (SIGTERM) or has.
    Stopping,
}

/// One GPU's worker, as `/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct GpuStatus {
    /// `gpuN`.
    pub gpu: String,
    pub worker_id: String,
    /// The card's name and memory, MiB.
    pub card: String,
    pub total_mib: u64,
    /// The worker's metrics and health address.
    pub metrics: SocketAddr,
    pub phase: Phase,
    pub pid: Option<u32>,
    /// Whether its `/readyz` said ready at the last look.
    pub ready: bool,
    /// The first line of its `/readyz` (`ready`, `not ready: loading models and calibrating`).
    pub readiness: String,
    /// The lines after it: which classes it serves, and why not the others.
    pub classes: Vec<String>,
    pub restarts: u32,
    /// `exit 75 (driver fault)`.
    pub last_exit: Option<String>,
    /// What the worker said last of why it stopped: its exit message, else its last error line.
    pub last_error: Option<String>,
    /// Seconds until the next start, while restarting.
    pub restart_in_s: Option<f64>,
    /// Why it is left stopped.
    pub left_stopped: Option<String>,
    #[serde(skip)]
    restart_at: Option<Instant>,
}

impl GpuStatus {
    /// A worker not started yet.
    fn new(gpu: String, worker_id: String, card: String, total_mib: u64, metrics: SocketAddr) -> Self {
        Self {
            gpu,
            worker_id,
            card,
            total_mib,
            metrics,
            phase: Phase::Running,
            pid: None,
            ready: false,
            readiness: "not started".into(),
            classes: Vec::new(),
            restarts: 0,
            last_exit: None,
            last_error: None,
            restart_in_s: None,
            left_stopped: None,
            restart_at: None,
        }
    }

    /// One line of the box's `/readyz`.
    fn line(&self) -> String {
        let head = format!("{} {} ({}, {} MiB, {})", self.gpu, self.worker_id, self.card, self.total_mib, self.metrics);
        let exit = || {
            let error = self.last_error.as_deref().map(|e| format!(": {e}")).unwrap_or_default();
            format!("after {}{error}", self.last_exit.as_deref().unwrap_or("an exit"))
        };
        let state = match self.phase {
            Phase::Running => self.readiness.clone(),
            Phase::Restarting => format!("restarting in {:.0}s (restart {}) {}", self.restart_in_s.unwrap_or(0.0), self.restarts, exit()),
            Phase::LeftStopped => format!("stopped, not restarted ({}) {}", self.left_stopped.as_deref().unwrap_or(""), exit()),
            Phase::Stopping => "stopping".to_owned(),
        };
        format!("{head}: {state}")
    }
}

/// Every GPU's worker. Cheap to clone; clones share one table.
#[derive(Debug, Clone)]
pub struct BoxStatus {
    gpus: Arc<Mutex<Vec<GpuStatus>>>,
}

impl BoxStatus {
    pub fn new(plan: &BoxPlan) -> Self {
        let gpus = plan
            .workers
            .iter()
            .map(|worker| {
                let (card, config) = (&worker.card, &worker.config);
                GpuStatus::new(card.label(), config.worker_id.clone(), card.name.clone(), card.total_mib, config.telemetry.listen)
            })
            .collect();
        Self { gpus: Arc::new(Mutex::new(gpus)) }
    }

    /// `n` GPUs with made-up names and ports, for the supervisor's own tests.
    #[cfg(test)]
    pub(crate) fn for_tests(n: usize) -> Self {
        let gpu = |i: usize| {
            GpuStatus::new(format!("gpu{i}"), format!("test/gpu{i}"), "simulated".into(), 1024, SocketAddr::from(([127, 0, 0, 1], 1)))
        };
        Self { gpus: Arc::new(Mutex::new((0..n).map(gpu).collect())) }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<GpuStatus>> {
        // Every update below leaves a consistent row; a panic elsewhere cannot tear one.
        self.gpus.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Worker `i`'s process started.
    pub fn started(&self, i: usize, pid: Option<u32>) {
        let mut gpus = self.lock();
        let gpu = &mut gpus[i];
        gpu.phase = Phase::Running;
        gpu.pid = pid;
        gpu.ready = false;
        gpu.readiness = "starting".into();
        gpu.restart_at = None;
        gauge!("shotfleet_box_worker_running", "gpu" => gpu.gpu.clone()).set(1.0);
        gauge!("shotfleet_box_worker_ready", "gpu" => gpu.gpu.clone()).set(0.0);
    }

    /// Worker `i` exited with `exit` (its last log line `last_error`), and what follows.
    pub fn exited(&self, i: usize, exit: Exit, last_error: Option<String>, decision: Option<Decision>) {
        let mut gpus = self.lock();
        let gpu = &mut gpus[i];
        gpu.pid = None;
        gpu.ready = false;
        gpu.last_exit = Some(exit.to_string());
        gpu.last_error = last_error;
        let name = gpu.gpu.clone();
        gauge!("shotfleet_box_worker_running", "gpu" => name.clone()).set(0.0);
        gauge!("shotfleet_box_worker_ready", "gpu" => name.clone()).set(0.0);
        match decision {
            Some(Decision::Restart { after }) => {
                gpu.phase = Phase::Restarting;
                gpu.restart_at = Some(Instant::now() + after);
                gpu.restarts += 1;
                counter!("shotfleet_box_worker_restarts_total", "gpu" => name, "reason" => exit.reason()).increment(1);
            }
            Some(Decision::LeaveStopped { why }) => {
                gpu.phase = Phase::LeftStopped;
                gpu.left_stopped = Some(why.to_owned());
                gauge!("shotfleet_box_worker_left_stopped", "gpu" => name).set(1.0);
            }
            None => gpu.phase = Phase::Stopping,
        }
    }

    /// The box is stopping; worker `i` was asked to finish.
    pub fn stopping(&self, i: usize) {
        let mut gpus = self.lock();
        gpus[i].phase = Phase::Stopping;
        gpus[i].ready = false;
    }

    fn set_readiness(&self, i: usize, pid: Option<u32>, ready: bool, body: &str) {
        let mut gpus = self.lock();
        let gpu = &mut gpus[i];
        // An answer about a process that has since exited is stale.
        if gpu.phase != Phase::Running || gpu.pid != pid {
            return;
        }
        let mut lines = body.lines();
        gpu.ready = ready;
        gpu.readiness = lines.next().unwrap_or(if ready { "ready" } else { "not ready" }).to_owned();
        gpu.classes = lines.map(str::to_owned).collect();
        gauge!("shotfleet_box_worker_ready", "gpu" => gpu.gpu.clone()).set(if ready { 1.0 } else { 0.0 });
    }

    /// Every GPU's row, with the time left before each restart.
    pub fn snapshot(&self) -> Vec<GpuStatus> {
        let now = Instant::now();
        self.lock()
            .iter()
            .map(|gpu| GpuStatus { restart_in_s: gpu.restart_at.map(|at| at.saturating_duration_since(now).as_secs_f64()), ..gpu.clone() })
            .collect()
    }

    /// The box's readiness: ready while at least one worker takes jobs (a box with one card
    /// down still serves; the rest of the answer says which). Then one line per GPU, its
    /// classes indented under it.
    pub fn readyz(&self) -> (bool, String) {
        let gpus = self.snapshot();
        let ready = gpus.iter().filter(|gpu| gpu.ready).count();
        let first = match ready {
            0 => format!("not ready: none of the {} workers takes jobs", gpus.len()),
            n => format!("ready: {n} of {} workers take jobs", gpus.len()),
        };
        let mut text = first;
        for gpu in &gpus {
            text.push('\n');
            text.push_str(&gpu.line());
            for class in &gpu.classes {
                text.push_str("\n  ");
                text.push_str(class);
            }
        }
        text.push('\n');
        (ready > 0, text)
    }
}

/// Reads each running worker's `/readyz` every [`POLL_EVERY`] until `stop`.
pub async fn poll_readiness(status: BoxStatus, stop: CancellationToken) {
    let client = reqwest::Client::builder().timeout(POLL_TIMEOUT).build().expect("an HTTP client without TLS builds");
    let mut every = tokio::time::interval(POLL_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        let running: Vec<(usize, Option<u32>, SocketAddr)> =
            status.snapshot().iter().enumerate().filter(|(_, gpu)| gpu.phase == Phase::Running).map(|(i, gpu)| (i, gpu.pid, gpu.metrics)).collect();
        for (i, pid, addr) in running {
            let (ready, body) = match client.get(format!("http://{}/readyz", reachable(addr))).send().await {
                Ok(response) => (response.status().is_success(), response.text().await.unwrap_or_default()),
                Err(e) if e.is_connect() => (false, "starting: its health port is not open yet".to_owned()),
                Err(e) => (false, format!("not answering on its health port: {e}")),
            };
            status.set_readiness(i, pid, ready, &body);
        }
    }
}

/// A worker listening on every interface is reached on loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() { SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port()) } else { addr }
}
