//! What a worker says while it holds a job, and what it says about itself: plain NATS messages
//! (no stream keeps them), JSON, for any language to follow.
//!
//! | subject | payload | when |
//! | --- | --- | --- |
//! | `shots.progress.<project>.<job_id>` | [`ShotProgress`] | the job is taken, every few UNet steps (a few a second at most), given back to the queue, settled |
//! | `shots.workers.ping` (request) | none | a client asks every live worker for its [`WorkerState`] (the reply) |

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::class::MemoryClass;

/// One event of a job in a worker's hands, on `shots.progress.<project>.<job_id>`.
///
/// Events are best effort: a client that misses one sees the next; the job's outcome on
/// `shots.done.<project>.<job_id>` is what settles it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "ShotProgress", description = "A shotfleet progress event, contract version 1.")]
pub struct ShotProgress {
    /// Contract version; 1.
    pub v: u32,
    pub project: String,
    pub job_id: String,
    pub shot_id: String,
    pub event: ProgressEvent,
    /// The worker holding the job (`host/gpuN` style).
    pub worker: String,
    /// The UNet step just finished (1-based) of the current sub-batch; 0 before the first.
    #[serde(default)]
    pub step: u32,
    /// Steps per sub-batch.
    #[serde(default)]
    pub steps: u32,
    /// Images of the job in the sub-batch being denoised (a job's images are denoised in
    /// sub-batches as large as the card holds).
    #[serde(default)]
    pub batch: u32,
    /// Images of the job finished (decoded) so far.
    #[serde(default)]
    pub images_done: u32,
    /// Images the job asks for.
    pub images: u32,
    /// Milliseconds since the worker took the job.
    #[serde(default)]
    pub elapsed_ms: u64,
    /// The job's degrade rung (0: as submitted).
    #[serde(default)]
    pub degrade_level: u32,
    /// Why the job went back to the queue (`queued`), for a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The worker's card when the event was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuMemory>,
    /// When the event was sent, milliseconds since the Unix epoch.
    pub at_ms: u64,
}

impl ShotProgress {
    /// Its job's [`key`](crate::job::key), `<project>/<job_id>`.
    pub fn key(&self) -> String {
        crate::job::key(&self.project, &self.job_id)
    }
}

/// What happened to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProgressEvent {
    /// A worker took the job and starts rendering it.
    Taken,
    /// A UNet step finished.
    Step,
    /// The job went back to the queue (given back for room, a first out-of-memory, a failed
    /// attempt that will be retried, or re-published one rung down); `detail` says why.
    Queued,
    /// The worker let go of the job: its outcome is on `shots.done.<project>.<job_id>`.
    Settled,
}

/// A card's memory, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuMemory {
    /// In use on the card, every process.
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// This worker's budget for renders (after the models and the reserve).
    #[serde(default)]
    pub budget_bytes: u64,
}

/// A worker's answer to `shots.workers.ping`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "WorkerState", description = "A shotfleet worker's state, contract version 1.")]
pub struct WorkerState {
    /// Contract version; 1.
    pub v: u32,
    pub worker: String,
    /// The GPU's name as the driver reports it.
    pub device: String,
    /// The memory classes this worker is configured to serve (`xs`, `s`, `m`, `l`, `xl`).
    #[schemars(with = "Vec<String>")]
    pub serves: Vec<MemoryClass>,
    /// The classes of `serves` whose largest one-image job fits its budget when idle: jobs of a
    /// class no live worker admits wait forever. While `starting`: the classes it admitted when
    /// it last served, for at most its `[degrade] restart_grace` from its start (none where its
    /// last start never became ready).
    #[schemars(with = "Vec<String>")]
    pub admits: Vec<MemoryClass>,
    pub gpu: GpuMemory,
    /// Jobs it holds now: fetched and not settled (waiting for a render slot, rendering, or
    /// committing). 0: idle.
    pub in_flight: u32,
    /// Whether it is taking jobs (false while it starts, drains or stopped fetching).
    pub taking_jobs: bool,
    /// Whether it is loading its models and calibrating. Other workers leave the jobs of the
    /// classes it `admits` to it meanwhile, rather than sending them down the degrade ladder as
    /// held by nobody: a restart on a card can outlast `[degrade] handoff`. Absent: false.
    #[serde(default)]
    pub starting: bool,
    /// When it answered, milliseconds since the Unix epoch.
    pub at_ms: u64,
}

/// Where a job's progress events are published: `shots.progress.<project>.<job_id>`.
pub fn subject(project: &str, job_id: &str) -> String {
    format!("{}.progress.{project}.{job_id}", crate::subject::ROOT)
}

/// Every progress event of a project: `shots.progress.<project>.*`.
pub fn project_subjects(project: &str) -> String {
    format!("{}.progress.{project}.*", crate::subject::ROOT)
}

/// Where clients ask every worker for its [`WorkerState`].
pub const PING_SUBJECT: &str = "shots.workers.ping";
