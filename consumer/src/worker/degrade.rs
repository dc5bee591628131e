//! The degrade ladder's outer rungs: when the job cannot fit on this worker even one image at a
//! time with a tiled VAE, it is re-published one rung down, so a card with room for the smaller
//! job (or this one, later) renders it.
//!
//! A rung first lowers the resolution into the next smaller memory class (aspect kept, sides
//! multiples of 64; within `xs`, three quarters of each side), then, once the sides are at the
//! floor, the steps (three quarters, at least the floor's). The job's `floor` bounds both; a job
//! without one is bounded by the worker's `[degrade]` settings. Below the floor the job fails
//! with reason `oom`.

use serde::Deserialize;
use shotfleet_schema::{Degrade, MemoryClass, Original, ShotJob};

/// `[degrade]`: the ladder's lower end for jobs that name no floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DegradeConfig {
    pub min_side: u32,
    pub min_steps: u32,
}

impl Default for DegradeConfig {
    fn default() -> Self {
        Self { min_side: 512, min_steps: 12 }
    }
}

/// The job one rung down, or `None` when the floor is reached.
pub fn next_rung(job: &ShotJob, ladder: &DegradeConfig) -> Option<ShotJob> {
    let (min_side, min_steps) = match job.floor {
        Some(floor) => (floor.min_side, floor.min_steps),
        None => (ladder.min_side.min(job.width.min(job.height)), ladder.min_steps.min(job.steps)),
    };
    let (width, height, steps) = match smaller_size(job.width, job.height, min_side) {
        Some((w, h)) => (w, h, job.steps),
        None => {
            let steps = (job.steps * 3 / 4).max(min_steps);
            if steps >= job.steps {
                return None;
            }
            (job.width, job.height, steps)
        }
    };
    let from = job.degrade.map_or(Original { width: job.width, height: job.height, steps: job.steps }, |d| d.from);
    let level = job.degrade.map_or(1, |d| d.level + 1);
    Some(ShotJob { width, height, steps, degrade: Some(Degrade { level, from }), ..job.clone() })
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
        let ladder = DegradeConfig { min_side: 256, min_steps: 10 };
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
    fn then_steps_then_nothing_below_the_floor() {
        let mut j = job(512, 512, 40);
        j.floor = Some(Floor { min_side: 512, min_steps: 25 });
        let ladder = DegradeConfig::default();
        let fewer = next_rung(&j, &ladder).unwrap();
        assert_eq!((fewer.width, fewer.steps), (512, 30));
        let fewer = next_rung(&fewer, &ladder).unwrap();
        assert_eq!(fewer.steps, 25);
        assert!(next_rung(&fewer, &ladder).is_none(), "floor reached");
    }
}
