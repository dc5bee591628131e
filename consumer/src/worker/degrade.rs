//! The degrade ladder's outer rung: when the job cannot fit on this worker even one image at a
//! time with a tiled VAE, it is re-published one rung down, so a card with room for the smaller
//! job (or this one, later) renders it.
//!
//! A rung lowers the resolution into the next smaller memory class (aspect kept, sides
//! multiples of 64; within `xs`, three quarters of each side). Steps are never lowered: peak
//! memory does not depend on them (the budget's model has no steps term), so fewer steps would
//! cost an out-of-memory cycle and lose quality for nothing. The job's `floor.min_side` bounds
//! the rung; a job without a floor is bounded by the worker's `[degrade] min_side`. Below the
//! floor the job fails with reason `oom`.

use std::time::Duration;

use serde::Deserialize;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::subject::{self, SubjectClass};
use shotfleet_schema::{Degrade, MemoryClass, Original, ShotJob};

use crate::failure::JobError;
use crate::worker::Shared;
use crate::worker::delivery::{Delivery, QUEUED_SINCE_HEADER};

/// `[degrade]`: the ladder's lower end for jobs that name no floor, and how long a job that ran
/// out of memory is offered to the fleet at full size before it is degraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DegradeConfig {
    /// The shorter side never falls below this many pixels (nor below the job's own).
    pub min_side: u32,
    /// From a job's first out-of-memory in the fleet, how long workers that cannot hold it
    /// give it back (so a roomier card renders it at full size) before one degrades it.
    #[serde(with = "humantime_serde")]
    pub handoff: Duration,
    /// How long a restarting worker, while it loads and calibrates, keeps the classes it admitted
    /// when it last served: the fleet leaves their jobs to it meanwhile instead of degrading them
    /// as held by nobody (worker/restart.rs). 0 turns it off.
    #[serde(with = "humantime_serde")]
    pub restart_grace: Duration,
}

impl Default for DegradeConfig {
    fn default() -> Self {
        Self { min_side: 512, handoff: Duration::from_secs(30), restart_grace: Duration::from_secs(300) }
    }
}

/// The job one rung down, or `None` when the floor is reached.
pub fn next_rung(job: &ShotJob, ladder: &DegradeConfig) -> Option<ShotJob> {
    let min_side = match job.floor {
        Some(floor) => floor.min_side,
        None => ladder.min_side.min(job.width.min(job.height)),
    };
    let (width, height) = smaller_size(job.width, job.height, min_side)?;
    let from = job.degrade.map_or(Original { width: job.width, height: job.height, steps: job.steps }, |d| d.from);
    let level = job.degrade.map_or(1, |d| d.level + 1);
    Some(ShotJob { width, height, degrade: Some(Degrade { level, from }), ..job.clone() })
}

/// Publishes `smaller` (from [`next_rung`]) to its class subject at the original's priority,
/// with `Nats-Msg-Id <project>/<job>:deg:<level>:<the original's stream sequence>`, and waits
/// for the server to store it.
///
/// # Errors
/// A transient [`JobError`]: the original must be kept.
pub async fn republish(shared: &Shared, delivery: &Delivery, smaller: &ShotJob) -> Result<(), JobError> {
    let level = smaller.degrade.map_or(1, |d| d.level);
    let target = subject::job(delivery.origin.priority, SubjectClass::Class(smaller.class()), &smaller.project);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(encoding::HEADER, ContentType::MessagePack.as_str());
    headers.insert("Nats-Msg-Id", subject::msg_id::degrade(&smaller.project, &smaller.job_id, level, delivery.stream_sequence).as_str());
    headers.insert(QUEUED_SINCE_HEADER, delivery.queued_since_header().as_str());
    let payload = encoding::encode(ContentType::MessagePack, smaller);
    let stored = match shared.js.publish_with_headers(target.clone(), headers, payload.into()).await {
        Ok(ack) => ack.await.map(drop).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    stored.map_err(|e| JobError::transient(format!("cannot re-publish the job one rung down to {target}: {e}")))?;
    tracing::info!(job = %smaller.job_id, level, width = smaller.width, height = smaller.height, to = %target, "re-published one rung down");
    Ok(())
}

/// Both sides scaled by one factor into the next smaller class, rounded down to multiples of 64,
/// the shorter side not below `min_side`.
fn smaller_size(width: u32, height: u32, min_side: u32) -> Option<(u32, u32)> {
    let pixels = f64::from(width) * f64::from(height);
    let class = MemoryClass::of_size(width, height);
    let target = MemoryClass::ALL
        .iter()
        .rev()
        .find(|c| **c < class)
        .and_then(|c| c.max_pixels())
        .map_or(pixels * 0.5625, |max| (max as f64).min(pixels * 0.5625));
    let scale = (target / pixels).sqrt();
    let down = |side: u32| ((f64::from(side) * scale) as u32 / 64 * 64).max(64);
    let (w, h) = (down(width), down(height));
    ((w, h) != (width, height) && w.min(h) >= min_side).then_some((w, h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use shotfleet_schema::Floor;

    fn job(width: u32, height: u32, steps: u32) -> ShotJob {
        serde_json::from_value(serde_json::json!({
            "v": 1, "job_id": "j", "project": "p", "shot_id": "s", "prompt": "x",
            "width": width, "height": height, "steps": steps, "guidance": 5.0, "seed": 1
        }))
        .unwrap()
    }

    #[test]
    fn resolution_drops_one_class_keeping_the_aspect() {
        let ladder = DegradeConfig { min_side: 256, ..DegradeConfig::default() };
        let j = job(1536, 1536, 30);
        let down = next_rung(&j, &ladder).unwrap();
        assert_eq!((down.width, down.height, down.steps), (1024, 1024, 30));
        assert_eq!(down.class(), MemoryClass::M);
        assert_eq!(down.degrade, Some(Degrade { level: 1, from: Original { width: 1536, height: 1536, steps: 30 } }));
        let wide = next_rung(&job(1344, 768, 30), &ladder).unwrap();
        assert_eq!((wide.width, wide.height), (960, 576));
        assert_eq!(wide.class(), MemoryClass::S);
        assert!(wide.width.is_multiple_of(64) && wide.height.is_multiple_of(64));
        let again = next_rung(&down, &ladder).unwrap();
        assert_eq!(again.degrade.unwrap().level, 2);
        assert_eq!(again.degrade.unwrap().from.width, 1536, "from keeps the original");
    }

    #[test]
    fn steps_are_never_lowered_and_the_floor_ends_the_ladder() {
        let mut j = job(768, 768, 40);
        j.floor = Some(Floor { min_side: 512, min_steps: 25 });
        let ladder = DegradeConfig::default();
        let down = next_rung(&j, &ladder).unwrap();
        assert_eq!((down.width, down.height, down.steps), (512, 512, 40));
        assert!(next_rung(&down, &ladder).is_none(), "512 is the floor: fewer steps would not lower the peak");
        let mut small = job(512, 512, 40);
        small.floor = None;
        assert!(next_rung(&small, &ladder).is_none(), "no rung at the worker's own floor either");
    }
}
