//! `shotfleet-consumer --gpus all`: one worker process per GPU of the box, supervised.
//!
//! Each worker is this same program run as a single worker on one card, so a CUDA fault stays in
//! its process (CUDA's sticky errors end a process, not a card's neighbours). The supervisor:
//!
//! - plans the box ([`plan`]): the cards `--gpus` names ([`cards`]), and per card a worker with
//!   its own config file (`[supervisor.gpu.N]` merged in, [`config`]), id `<box>/gpuN`, state
//!   folder `<state_dir>/gpuN`, metrics port and, on CUDA, its one visible card; every worker's
//!   config is validated before any starts (exit 2 names the GPU and the setting);
//! - runs each worker ([`child`]) and restarts it as [`policy`] says: after a driver fault (75),
//!   a leak-guard restart (76), a failed start (3), an unusable store (77, long) or a crash, with
//!   backoff; never after bad configuration (2) or a card that holds nothing (78);
//! - reports each GPU's state ([`status`]) on one port ([`server`]): `/healthz`, `/readyz`
//!   (ready while any worker takes jobs), `/status` (JSON), `/metrics`;
//! - on SIGTERM, passes it to every worker and waits for each one's grace period and drain.
//!
//! The box ends by itself only when no GPU has a worker left (every one left stopped): with exit
//! 2 if any stopped for bad configuration, else 78.

pub mod cards;
pub mod child;
pub mod config;
pub mod plan;
pub mod policy;
pub mod server;
pub mod status;

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tracing::info;

pub use config::SupervisorConfig;
pub use plan::{BoxInputs, BoxPlan};

use crate::failure::{EXIT_CONFIG, EXIT_NOTHING_FITS, EXIT_START};
use child::{Ended, Supervised};
use policy::{Exit, RestartPolicy};
use status::BoxStatus;

/// Why the box could not start, or stopped by itself.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BoxError {
    /// A setting of the box, or of one GPU's worker (named): exit 2.
    #[error("configuration: {0}")]
    Config(String),
    /// A start-up step (listing the GPUs, writing the workers' files, the health port): exit 3.
    #[error("{}", crate::failure::cannot(step, detail))]
    Start { step: String, detail: String },
    /// Every GPU's worker stopped in a way a restart cannot mend.
    #[error("no GPU has a worker left: {detail}")]
    NoWorkerLeft { code: i32, detail: String },
}

impl BoxError {
    pub(crate) fn start(step: &str, e: impl std::fmt::Display) -> Self {
        Self::Start { step: step.to_owned(), detail: e.to_string() }
    }

    /// The supervisor's exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Config(_) => EXIT_CONFIG,
            Self::Start { .. } => EXIT_START,
            Self::NoWorkerLeft { code, .. } => *code,
        }
    }
}

/// Runs the box's workers until `shutdown` resolves, or until none is left.
///
/// # Errors
/// [`BoxError`]: a start-up step failed, or every worker stopped for good.
pub async fn run(plan: BoxPlan, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), BoxError> {
    plan.write()?;
    let stop = CancellationToken::new();
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop.cancel();
        });
    }
    let metrics = crate::telemetry::install().map_err(|e| BoxError::start("install metrics", e))?;
    let status = BoxStatus::new(&plan);
    let server_stop = CancellationToken::new();
    let (addr, server) = server::serve(plan.supervisor.listen, status.clone(), metrics, server_stop.clone()).await?;
    info!(%addr, workers = plan.workers.len(), "supervising one worker per GPU");
    let poller = tokio::spawn(status::poll_readiness(status.clone(), server_stop.clone()));
    let policy = RestartPolicy::from(&plan.supervisor);
    let tasks: Vec<_> = plan
        .workers
        .iter()
        .enumerate()
        .map(|(index, worker)| {
            let supervised = Supervised {
                index,
                label: worker.card.label(),
                command: worker.command.clone(),
                grace: worker.config.grace_period,
                drain: child::DRAIN_ALLOWANCE,
            };
            tokio::spawn(child::supervise(supervised, policy, status.clone(), stop.clone()))
        })
        .collect();
    let mut ended = Vec::with_capacity(tasks.len());
    for task in tasks {
        // A supervising task that panicked has dropped (and so killed) its worker.
        ended.push(task.await.unwrap_or(Ended::Stopped));
    }
    let asked = stop.is_cancelled();
    server_stop.cancel();
    let _ = poller.await;
    let _ = server.await;
    if asked {
        info!("every worker stopped");
        return Ok(());
    }
    let left: Vec<Exit> = ended.iter().filter_map(|e| match e { Ended::LeftStopped(exit) => Some(*exit), Ended::Stopped => None }).collect();
    let code = if left.contains(&Exit::Code(EXIT_CONFIG)) { EXIT_CONFIG } else { EXIT_NOTHING_FITS };
    let detail = status.snapshot().iter().map(|gpu| format!("{}: {} ({})", gpu.gpu, gpu.last_exit.as_deref().unwrap_or("-"), gpu.last_error.as_deref().unwrap_or("-"))).collect::<Vec<_>>().join("; ");
    Err(BoxError::NoWorkerLeft { code, detail })
}
