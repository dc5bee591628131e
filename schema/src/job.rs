//! The shot job: what a producer asks a worker to render.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::class::MemoryClass;
use crate::wire;

/// One storyboard shot to render: a prompt and its parameters, and how many images of it.
///
/// The priority is not a field: it is the subject's (`shots.<prio>.<class>.<project>`), so that a
/// worker can choose what to fetch without opening payloads. Unknown fields are ignored, so a
/// newer producer can add optional fields without breaking older workers; a worker names them
/// in the result's notes, so that a misspelt field (`lora`) is not dropped unsaid. Numbers and
/// `null`s are read as `wire` says: `128.0` is 128, `images: null` is one image. The bounds below say
/// "by default": a worker enforces its own `[limits]`, and refuses a job outside them as
/// `invalid` with the field named.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "ShotJob", description = "A shotfleet render job, contract version 1.")]
pub struct ShotJob {
    /// Contract version; must be 1.
    #[schemars(range(min = 1, max = 1))]
    #[serde(deserialize_with = "wire::whole")]
    pub v: u32,
    /// Unique per job; the deduplication key (`Nats-Msg-Id`). Letters, digits, `_` and `-`.
    #[schemars(length(min = 1, max = 96), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub job_id: String,
    /// The project (account, series) the shot belongs to; part of subjects and object keys.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub project: String,
    /// The shot's id inside its storyboard; part of the image object keys.
    #[schemars(length(min = 1, max = 96), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub shot_id: String,
    /// What to render. Non-empty; at most 8 KiB of UTF-8 by default.
    #[schemars(length(min = 1))]
    pub prompt: String,
    /// What to steer away from. Absent or empty means SDXL's zero negative embedding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    /// Image width in pixels: a positive multiple of 8 (the model may ask for 16 or 64), in
    /// 64..=2048 by default; width x height x images x steps at most 1,000 million by default.
    #[schemars(range(min = 8))]
    #[serde(deserialize_with = "wire::whole")]
    pub width: u32,
    /// Image height in pixels: as `width`.
    #[schemars(range(min = 8))]
    #[serde(deserialize_with = "wire::whole")]
    pub height: u32,
    /// Denoising steps, 1..=150 by default.
    #[schemars(range(min = 1))]
    #[serde(deserialize_with = "wire::whole")]
    pub steps: u32,
    /// Classifier-free guidance scale (finite), 0..=30 by default.
    #[serde(deserialize_with = "wire::float32")]
    pub guidance: f32,
    /// Seed of image 0; image `i` uses the noise of (`seed`, `i`), however the images are batched.
    /// Sent as an integer: a float from 2^53 on is refused, since it no longer holds every
    /// integer (`1e19` is valid JSON Schema `integer` but not a seed a worker takes).
    #[serde(deserialize_with = "wire::whole")]
    pub seed: u64,
    /// How many images of this shot to render, 1..=8 by default; absent or `null` is 1.
    #[serde(default = "one", deserialize_with = "wire::images")]
    #[schemars(with = "Option<u32>", range(min = 1))]
    pub images: u32,
    /// LoRA adapters to apply, by name, with their weights; each name at most once; at most 8
    /// by default. Absent, `null` or empty is none.
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "wire::null_as_default")]
    #[schemars(with = "Option<Vec<Lora>>")]
    pub loras: Vec<Lora>,
    /// The least a degraded render may fall to; absent means the job must not be degraded
    /// below the ladder's own lower end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floor: Option<Floor>,
    /// Set by a worker that re-published this job one rung down the degrade ladder; producers
    /// omit it (a job whose record is not a worker's is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degrade: Option<Degrade>,
}

/// A job's fields on the wire, as [`ShotJob`] names them (a test holds the two together): what
/// a worker tells from the fields a payload has that it ignores.
pub const FIELDS: [&str; 15] = [
    "v", "job_id", "project", "shot_id", "prompt", "negative_prompt", "width", "height", "steps", "guidance", "seed", "images",
    "loras", "floor", "degrade",
];

/// A LoRA entry's fields (`loras[i]`), as [`Lora`] names them.
pub const LORA_FIELDS: [&str; 2] = ["name", "weight"];
/// The floor's fields, as [`Floor`] names them.
pub const FLOOR_FIELDS: [&str; 2] = ["min_side", "min_steps"];

/// A field of a job that the contract does not know: ignored by a worker (a newer producer's
/// optional field), refused by `shotfleet submit` (a storyboard's misspelt field).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownField {
    /// `lora`, `loras[0].strength`, `floor.min_step`.
    pub path: String,
    /// Where it was found: `None` at the top, `Some("loras")` in a LoRA entry, `Some("floor")`.
    pub within: Option<&'static str>,
    /// The known field it is a typo or two away from, if any ([`crate::names::nearest`]).
    pub near: Option<&'static str>,
}

/// The fields of a job, as a JSON object, that the contract does not know: at the top (`top`
/// lists the known ones: [`FIELDS`], or a storyboard line's), and inside `loras[i]` and `floor`,
/// where a misspelt `min_steps` or an added `strength` is as silently dropped.
pub fn unknown_fields(job: &serde_json::Map<String, serde_json::Value>, top: &[&'static str]) -> Vec<UnknownField> {
    let unknown_in = |object: &serde_json::Map<String, serde_json::Value>, within: &'static str, known: &'static [&'static str], prefix: &str| {
        let unknown = object.keys().filter(|name| !known.contains(&name.as_str()));
        unknown
            .map(|name| UnknownField { path: format!("{prefix}.{name}"), within: Some(within), near: crate::names::nearest(name, known) })
            .collect::<Vec<_>>()
    };
    let mut unknown = Vec::new();
    for (name, value) in job {
        match (name.as_str(), value) {
            (name, _) if !top.contains(&name) => {
                unknown.push(UnknownField { path: name.to_owned(), within: None, near: crate::names::nearest(name, top) });
            }
            ("loras", serde_json::Value::Array(loras)) => {
                for (i, lora) in loras.iter().enumerate() {
                    if let serde_json::Value::Object(lora) = lora {
                        unknown.extend(unknown_in(lora, "loras", &LORA_FIELDS, &format!("loras[{i}]")));
                    }
                }
            }
            ("floor", serde_json::Value::Object(floor)) => unknown.extend(unknown_in(floor, "floor", &FLOOR_FIELDS, "floor")),
            _ => {}
        }
    }
    unknown
}

fn one() -> u32 {
    1
}

/// A LoRA adapter by name and weight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Lora {
    /// Letters, digits, `_`, `-` and `.`; no path separators, no `..`.
    #[schemars(length(min = 1, max = 96), regex(pattern = r"^[A-Za-z0-9_.-]+$"))]
    pub name: String,
    /// Strength, finite, in -4..=4 by default.
    #[serde(deserialize_with = "wire::float32")]
    pub weight: f32,
}

/// The lowest quality a producer accepts when a job is degraded after running out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Floor {
    /// The shorter image side may not fall below this many pixels.
    #[serde(deserialize_with = "wire::whole")]
    pub min_side: u32,
    /// Accepted and kept for producers that set it, but no rung lowers steps: fewer steps do
    /// not lower peak memory. 0 or absent: unset.
    #[serde(default, deserialize_with = "wire::whole")]
    pub min_steps: u32,
}

/// How far down the degrade ladder a job has been sent, and what it was before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Degrade {
    /// Rungs taken: 1 for the first re-publish.
    #[schemars(range(min = 1, max = crate::validate::MAX_DEGRADE_LEVEL))]
    pub level: u32,
    /// The job's size and steps as the producer sent them.
    pub from: Original,
}

/// A job's size and steps before any degrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Original {
    pub width: u32,
    pub height: u32,
    pub steps: u32,
}

/// A job's name across projects, `<project>/<job_id>`: ids are unique within a project (and
/// hold no `/`), so two projects' jobs of one id are two jobs.
pub fn key(project: &str, job_id: &str) -> String {
    format!("{project}/{job_id}")
}

/// The ids a result names its job by. A payload that does not decode as a whole may still
/// give them ([`crate::encoding::read_ids`]), so that its producer hears why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobIds {
    pub job_id: String,
    pub project: String,
    /// Empty when a payload that did not decode had none to read.
    pub shot_id: String,
}

impl ShotJob {
    /// The ids its result names it by.
    pub fn ids(&self) -> JobIds {
        JobIds { job_id: self.job_id.clone(), project: self.project.clone(), shot_id: self.shot_id.clone() }
    }

    /// This job's [`key`].
    pub fn key(&self) -> String {
        key(&self.project, &self.job_id)
    }

    /// The memory class of one image of this job, which picks its subject.
    pub fn class(&self) -> MemoryClass {
        MemoryClass::of_size(self.width, self.height)
    }

    /// The negative prompt, `None` when absent or empty.
    pub fn negative(&self) -> Option<&str> {
        self.negative_prompt.as_deref().filter(|n| !n.is_empty())
    }

    /// The LoRA set the job names: names with their weights' bits, sorted, LoRAs at weight 0 left
    /// out (they change nothing; none left is the base model). Jobs with equal sets render with
    /// the same weights, as long as the library holds the same files under those names.
    pub fn lora_set(&self) -> Vec<(String, u32)> {
        let mut set: Vec<(String, u32)> =
            self.loras.iter().filter(|l| l.weight != 0.0).map(|l| (l.name.clone(), l.weight.to_bits())).collect();
        set.sort();
        set
    }
}
