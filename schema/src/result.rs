//! The result of a rendered job: the commit point of its work.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::failure::FailureReason;
use crate::job::Degrade;

/// A job's outcome, published on `shots.done.<project>.<job_id>`: the commit point of its work.
///
/// Exactly one outcome settles each request for a job: a worker publishes it with
/// `Nats-Expected-Last-Subject-Sequence` set to the last outcome it saw on the subject (0 when
/// none), so a second, late outcome for the same request is refused by the server however long
/// after the first it comes. A rendered result (`done`, `degraded`) is final: the job is never
/// rendered again. A `failed` or `cancelled` outcome settles the job's messages up to the one its
/// `Shotfleet-Settles` header names; a message queued after that one (a replay, a fix, a
/// re-submission) is a new request.
///
/// Every image a result names exists in the object store with that sha256.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "ShotResult", description = "A shotfleet render result, contract version 1.")]
pub struct ShotResult {
    /// Contract version; 1.
    pub v: u32,
    pub job_id: String,
    pub project: String,
    pub shot_id: String,
    /// `done`; `degraded` when the job was rendered one or more rungs down its ladder; `failed`
    /// (see `failure`; the job's payload waits in `SHOTS_FAILED` for a replay); `cancelled`.
    pub status: ResultStatus,
    /// The stored images, in index order (none unless done or degraded).
    pub images: Vec<ImageRef>,
    /// Set when the job was degraded: the rung and the original size and steps.
    #[serde(default)]
    pub degrade: Option<Degrade>,
    /// The worker that rendered it (`host/gpuN` style, from its config).
    pub worker: String,
    /// The GPU's name as the driver reports it, or `cpu`.
    pub device: String,
    /// Delivery attempt that produced this result (1 for the first).
    pub attempt: u32,
    /// Where the time went.
    pub timing: Timing,
    /// When the result was published, milliseconds since the Unix epoch.
    pub finished_at_ms: u64,
    /// Why the job failed (status `failed`), or who cancelled it (status `cancelled`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    /// What a person should know of how it was rendered, such as a prompt cut at the text
    /// encoders' 77 tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl ShotResult {
    /// Whether the job's images were rendered (`done` or `degraded`): such a result is final.
    pub fn is_rendered(&self) -> bool {
        matches!(self.status, ResultStatus::Done | ResultStatus::Degraded)
    }

    /// Its job's [`key`](crate::job::key), `<project>/<job_id>`.
    pub fn key(&self) -> String {
        crate::job::key(&self.project, &self.job_id)
    }
}

/// Why a job ended without images.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Failure {
    /// The failed record's reason; absent for a cancelled job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<FailureReason>,
    /// What went wrong, or who cancelled it, for a person.
    pub detail: String,
    /// Attempts that failed (as the failed record's `Shotfleet-Attempts`); 0 for a cancelled
    /// job.
    #[serde(default)]
    pub attempts: u64,
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResultStatus {
    Done,
    Degraded,
    Failed,
    Cancelled,
}

/// One stored image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ImageRef {
    /// Object key: `<prefix>/<project>/<job_id>/<shot_id>-<index>-<sha8>.png`.
    pub key: String,
    /// Image index inside the job, from 0.
    pub index: u32,
    /// The seed this image was rendered from: the job's seed; noise is per (seed, index).
    pub seed: u64,
    pub width: u32,
    pub height: u32,
    /// PNG size in bytes.
    pub bytes: u64,
    /// Lowercase hex SHA-256 of the PNG.
    pub sha256: String,
}

/// Milliseconds spent in each phase of a job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Timing {
    /// From the job's publish (the stream's timestamp; a worker's copy, routed or one rung down
    /// its ladder, counts from its original's) until a render slot took it.
    pub queue_ms: u64,
    /// The render: text encoders, UNet steps and VAE decodes, until the images' pixels are out.
    pub render_ms: u64,
    /// The images' PNG encoding and their upload (the next job renders meanwhile).
    pub upload_ms: u64,
}
