//! The result of a rendered job: the commit point of its work.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::job::Degrade;

/// Published on `shots.done.<project>.<job_id>` with `Nats-Msg-Id = <job_id>:done` once every
/// image is stored. Every image it names exists in the object store with that sha256.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "ShotResult", description = "A shotfleet render result, contract version 1.")]
pub struct ShotResult {
    /// Contract version; 1.
    pub v: u32,
    pub job_id: String,
    pub project: String,
    pub shot_id: String,
    /// `done`, or `degraded` when the job was rendered one or more rungs down its ladder.
    pub status: ResultStatus,
    /// The stored images, in index order.
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
}

/// Whether a result is at the requested quality.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResultStatus {
    Done,
    Degraded,
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
    /// From publish (the stream's timestamp) to the worker's fetch.
    pub queue_ms: u64,
    pub render_ms: u64,
    pub upload_ms: u64,
}
