//! The leak guard: memory that creeps up while the worker is idle, or plain age, rebuilds the
//! ONNX Runtime sessions; if the creep survives a rebuild, it is not ours to fix in-process, and
//! the worker exits with `EXIT_RESTART` so its supervisor starts a fresh one.
//!
//! Checked only when no job is in flight (so a rebuild never waits for, or interrupts, a render),
//! at most every `check_every`, after shrinking the arenas: what is left above the baseline
//! (taken the same way at start), less the LoRA sets the pool keeps on the device, is memory
//! nothing should be holding.

use std::sync::Arc;

use tracing::{info, warn};

use crate::budget::MIB;
use crate::telemetry;
use crate::worker::{Shared, WorkerError};

pub struct LeakGuard {
    /// Idle usage after a shrink when the worker became ready: the models.
    baseline: u64,
    jobs: u64,
    last_check: std::time::Instant,
    /// The last rebuild was for growth: growth again means a restart.
    rebuilt_for_growth: bool,
}

impl LeakGuard {
    pub async fn new(shared: &Arc<Shared>) -> Self {
        let baseline = idle_usage(shared).await.unwrap_or(0);
        Self { baseline, jobs: 0, last_check: std::time::Instant::now(), rebuilt_for_growth: false }
    }

    pub fn job_started(&mut self) {
        self.jobs += 1;
    }

    /// Called while idle. Rebuilds when due.
    ///
    /// # Errors
    /// [`WorkerError::Restart`] when a rebuild did not help or failed.
    pub async fn check(&mut self, shared: &Arc<Shared>) -> Result<(), WorkerError> {
        let config = shared.config.leak_guard;
        let aged = config.rebuild_after_jobs > 0 && self.jobs >= config.rebuild_after_jobs;
        if !aged && (config.max_idle_growth_mib == 0 || self.last_check.elapsed() < config.check_every) {
            return Ok(());
        }
        self.last_check = std::time::Instant::now();
        let Some(used) = idle_usage(shared).await else { return Ok(()) };
        let growth = used.saturating_sub(self.baseline);
        let creeping = config.max_idle_growth_mib > 0 && growth > config.max_idle_growth_mib * MIB;
        if !creeping && !aged {
            return Ok(());
        }
        if creeping && self.rebuilt_for_growth {
            return Err(WorkerError::Restart(format!(
                "idle memory is {} MiB above the baseline even after rebuilding the sessions",
                growth / MIB
            )));
        }
        warn!(growth_mib = growth / MIB, jobs = self.jobs, reason = if creeping { "idle memory growth" } else { "job count" }, "rebuilding the sessions");
        rebuild(shared).await?;
        telemetry::session_rebuilt();
        self.jobs = 0;
        let after = idle_usage(shared).await.map_or(0, |u| u.saturating_sub(self.baseline));
        info!(growth_after_mib = after / MIB, "sessions rebuilt");
        self.rebuilt_for_growth = config.max_idle_growth_mib > 0 && after > config.max_idle_growth_mib * MIB;
        if self.rebuilt_for_growth {
            return Err(WorkerError::Restart(format!(
                "idle memory is {} MiB above the baseline even after rebuilding the sessions",
                after / MIB
            )));
        }
        Ok(())
    }
}

/// This process's usage (else the card's) once the arenas gave back what they could, less the
/// LoRA pool's sets on the device (they are the budget's line, not a leak).
async fn idle_usage(shared: &Arc<Shared>) -> Option<u64> {
    super::shrink_arenas(shared).await;
    let used = shared.probe.snapshot().ok().map(|s| s.own_used.unwrap_or(s.used))?;
    Some(used.saturating_sub(shared.loras.device_bytes()))
}

/// Drops the sessions and loads them again (no job holds the pipeline while idle).
async fn rebuild(shared: &Arc<Shared>) -> Result<(), WorkerError> {
    let restart = |detail: String| WorkerError::Restart(format!("rebuilding the sessions failed: {detail}"));
    // The sets' device memory belongs to the sessions about to go; their host copies stay.
    shared.loras.before_reload();
    let current = shared.take_pipeline().ok_or_else(|| restart("the models are in use".into()))?;
    let reloaded = tokio::task::spawn_blocking(move || current.reload())
        .await
        .map_err(|e| restart(e.to_string()))?
        .map_err(|e| restart(e.to_string()))?;
    shared.put_pipeline(reloaded);
    Ok(())
}
