//! Bounds a job must respect before a worker spends a GPU on it.
//!
//! Every problem is reported with the field's name and what would fix it; all problems of a job
//! are reported at once, so a person fixes a storyboard line in one go.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::VERSION;
use crate::job::ShotJob;

/// Configurable bounds. The defaults suit SDXL on 8 to 141 GB cards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Smallest allowed width or height, pixels.
    pub min_side: u32,
    /// Largest allowed width or height, pixels.
    pub max_side: u32,
    pub max_steps: u32,
    pub max_images: u32,
    pub min_guidance: f32,
    pub max_guidance: f32,
    /// Bytes of UTF-8, for the prompt and for the negative prompt each.
    pub max_prompt_bytes: usize,
    pub max_loras: usize,
    /// LoRA weights must lie in `-max_lora_weight..=max_lora_weight`.
    pub max_lora_weight: f32,
    /// The most work one job may ask for, in megapixel-steps (width x height x images x steps /
    /// 10^6): each bound alone allows jobs no card finishes inside a worker's time limit, and
    /// such a job would hold a card for the whole limit on every delivery.
    pub max_megapixel_steps: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            min_side: 64,
            max_side: 2048,
            max_steps: 150,
            max_images: 8,
            min_guidance: 0.0,
            max_guidance: 30.0,
            max_prompt_bytes: 8 * 1024,
            max_loras: 8,
            max_lora_weight: 4.0,
            // 1536x1536 x 4 images x 50 steps is 472; an H200 renders about 29 megapixel-steps
            // a second at 1024x1024, a 12 GB card several times fewer (BENCHMARKS.md).
            max_megapixel_steps: 1000,
        }
    }
}

impl Limits {
    /// Whether these bounds leave jobs to render: a worker's `[limits]` are checked at start,
    /// so that a slip (`max_steps = 0`, `max_side` below `min_side`) does not fail every job
    /// as `invalid`, which is never retried.
    ///
    /// # Errors
    /// The field and what is wrong with it.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.min_side < 8 || !self.min_side.is_multiple_of(8) {
            return Err(("min_side", format!("{} must be a positive multiple of 8", self.min_side)));
        }
        if self.max_side < self.min_side || self.max_side > 16_384 {
            return Err(("max_side", format!("{} must lie in min_side ({})..=16384", self.max_side, self.min_side)));
        }
        for (field, value) in [("max_steps", self.max_steps), ("max_images", self.max_images)] {
            if value == 0 {
                return Err((field, "must be at least 1".into()));
            }
        }
        if !self.min_guidance.is_finite() || !self.max_guidance.is_finite() || self.max_guidance < self.min_guidance {
            let (min, max) = (self.min_guidance, self.max_guidance);
            return Err(("max_guidance", format!("min_guidance {min} ..= max_guidance {max} must be finite and not empty")));
        }
        if self.max_prompt_bytes == 0 {
            return Err(("max_prompt_bytes", "must be at least 1".into()));
        }
        if !(self.max_lora_weight.is_finite() && self.max_lora_weight >= 0.0) {
            return Err(("max_lora_weight", format!("{} must be finite and not negative", self.max_lora_weight)));
        }
        // The cheapest job the other bounds allow must fit the cost bound.
        let cheapest = f64::from(self.min_side).powi(2) / 1e6;
        if f64::from(self.max_megapixel_steps) < cheapest {
            return Err((
                "max_megapixel_steps",
                format!(
                    "{} admits no job: one {}x{} image at one step is {cheapest:.2} megapixel-steps",
                    self.max_megapixel_steps, self.min_side, self.min_side
                ),
            ));
        }
        Ok(())
    }

    /// What is wrong with a render of `images` images of `width` x `height` under these bounds
    /// (a worker's calibration shapes are checked as a job's size would be), if anything.
    pub fn shape_problem(&self, width: u32, height: u32, images: u32) -> Option<String> {
        let mut check = Checker::default();
        check.side("width", width, self);
        check.side("height", height, self);
        check.range("images", images, 1, self.max_images);
        check.finish().err().map(|e| e.to_string())
    }
}

/// Longest id (job, project, shot, LoRA name), bytes.
pub const MAX_ID_BYTES: usize = 96;
/// Longest project name: it is a subject token and an object key part on every job.
pub const MAX_PROJECT_BYTES: usize = 64;

/// Most rungs a degraded copy may have taken: each rung at least nearly halves the pixels, so
/// from 16384² to 64² is under 20.
pub const MAX_DEGRADE_LEVEL: u32 = 32;

/// One thing wrong with one field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The field's path, e.g. `width` or `loras[2].name`.
    pub field: String,
    pub message: String,
}

/// Everything wrong with a job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationError {
    pub problems: Vec<Problem>,
}

impl ValidationError {
    /// The first offending field, for one-line reports.
    pub fn first_field(&self) -> &str {
        self.problems.first().map_or("", |p| p.field.as_str())
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, problem) in self.problems.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}: {}", problem.field, problem.message)?;
        }
        Ok(())
    }
}

impl ShotJob {
    /// The work the job asks for: width x height x images x steps, in millions.
    pub fn megapixel_steps(&self) -> f64 {
        f64::from(self.width) * f64::from(self.height) * f64::from(self.images) * f64::from(self.steps) / 1e6
    }

    /// The job's `degrade` where a worker could have written it (a rung lowers the size and keeps
    /// the steps; see `validate`), else `None`: what a replay may restore the original from.
    pub fn worker_degrade(&self) -> Option<crate::Degrade> {
        let degrade = self.degrade?;
        let mut check = Checker::default();
        check.degrade(degrade, self);
        check.finish().is_ok().then_some(degrade)
    }

    /// Checks the job against `limits`.
    ///
    /// # Errors
    /// A [`ValidationError`] listing every field that is out of bounds.
    pub fn validate(&self, limits: &Limits) -> Result<(), ValidationError> {
        let mut check = Checker::default();
        if self.v != VERSION {
            check.fail("v", format!("contract version {} is not supported; use {VERSION}", self.v));
        }
        check.id("job_id", &self.job_id, MAX_ID_BYTES, IdKind::Plain);
        check.id("project", &self.project, MAX_PROJECT_BYTES, IdKind::Plain);
        check.id("shot_id", &self.shot_id, MAX_ID_BYTES, IdKind::Plain);
        check.prompt("prompt", &self.prompt, limits.max_prompt_bytes, true);
        if let Some(negative) = &self.negative_prompt {
            check.prompt("negative_prompt", negative, limits.max_prompt_bytes, false);
        }
        check.side("width", self.width, limits);
        check.side("height", self.height, limits);
        check.range("steps", self.steps, 1, limits.max_steps);
        check.range("images", self.images, 1, limits.max_images);
        check.finite_range("guidance", self.guidance, limits.min_guidance, limits.max_guidance);
        let cost = self.megapixel_steps();
        if cost > f64::from(limits.max_megapixel_steps) {
            check.fail(
                "steps",
                format!(
                    "{}x{} x {} image(s) x {} steps is {cost:.0} megapixel-steps; at most {} are allowed per job: \
                     split the images over several jobs, or use fewer steps or a smaller size",
                    self.width, self.height, self.images, self.steps, limits.max_megapixel_steps
                ),
            );
        }
        if self.loras.len() > limits.max_loras {
            check.fail(
                "loras",
                format!("{} LoRAs given; at most {} are allowed", self.loras.len(), limits.max_loras),
            );
        }
        for (i, lora) in self.loras.iter().enumerate() {
            check.id(&format!("loras[{i}].name"), &lora.name, MAX_ID_BYTES, IdKind::FileName);
            let max = limits.max_lora_weight;
            check.finite_range(&format!("loras[{i}].weight"), lora.weight, -max, max);
            // Two entries of one LoRA would be applied as the sum of their weights: almost
            // always a slip in the producer (a character listed by two rules), so say so.
            if let Some(first) = self.loras[..i].iter().position(|earlier| earlier.name == lora.name) {
                check.fail(
                    &format!("loras[{i}].name"),
                    format!("`{}` is listed twice (also loras[{first}]); list each LoRA once, with the weight wanted", lora.name),
                );
            }
        }
        if let Some(floor) = self.floor {
            let short_side = self.width.min(self.height);
            if floor.min_side == 0 || floor.min_side % 8 != 0 || floor.min_side > short_side {
                check.fail(
                    "floor.min_side",
                    format!(
                        "{} must be a positive multiple of 8 no larger than the shorter side ({short_side})",
                        floor.min_side
                    ),
                );
            }
            if floor.min_steps > self.steps {
                check.fail(
                    "floor.min_steps",
                    format!("{} must not be above steps ({}); 0 or absent leaves it unset", floor.min_steps, self.steps),
                );
            }
        }
        if let Some(degrade) = self.degrade {
            check.degrade(degrade, self);
        }
        check.finish()
    }
}

/// What is wrong with `value` as a plain id (job, project, shot: letters, digits, `_` and `-`,
/// at most `max_bytes`), if anything. Ids become subject tokens, header values, message ids and
/// object key parts: nothing else may reach those.
pub fn id_problem(value: &str, max_bytes: usize) -> Option<String> {
    IdKind::Plain.problem(value, max_bytes)
}

/// What is wrong with `name` as a file-like id (a LoRA name), `None` when it is fine.
pub fn file_name_problem(name: &str) -> Option<String> {
    IdKind::FileName.problem(name, MAX_ID_BYTES)
}

#[derive(Clone, Copy)]
enum IdKind {
    /// Letters, digits, `_`, `-`: safe in subjects, message ids and object keys.
    Plain,
    /// As plain, plus `.` (but never `..` nor a leading dot): names files such as LoRAs.
    FileName,
}

impl IdKind {
    fn problem(self, value: &str, max_bytes: usize) -> Option<String> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || (matches!(self, Self::FileName) && c == '.');
        let charset = match self {
            Self::Plain => "ASCII letters (a-z, A-Z), digits, `_` and `-`",
            Self::FileName => "ASCII letters (a-z, A-Z), digits, `_`, `-` and `.`",
        };
        if value.is_empty() {
            Some("must not be empty".into())
        } else if value.len() > max_bytes {
            Some(format!("is {} bytes long; at most {max_bytes} are allowed", value.len()))
        } else if let Some(bad) = value.chars().find(|c| !allowed(*c)) {
            Some(format!("contains {bad:?}; only {charset} are allowed"))
        } else if value.contains("..") || value.starts_with('.') {
            Some("must not contain `..` or start with `.`".into())
        } else {
            None
        }
    }
}

#[derive(Default)]
struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn fail(&mut self, field: &str, message: String) {
        self.problems.push(Problem { field: field.to_owned(), message });
    }

    fn finish(self) -> Result<(), ValidationError> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(ValidationError { problems: self.problems })
        }
    }

    fn id(&mut self, field: &str, value: &str, max_bytes: usize, kind: IdKind) {
        if let Some(problem) = kind.problem(value, max_bytes) {
            self.fail(field, problem);
        }
    }

    /// A degraded copy is written by a worker ([`crate::Degrade`]): a rung lowers the size and
    /// keeps the steps, so a copy whose record says otherwise was not made by one (a producer
    /// sets no `degrade`), and its rung count must leave room for the next.
    fn degrade(&mut self, degrade: crate::Degrade, job: &ShotJob) {
        if !(1..=MAX_DEGRADE_LEVEL).contains(&degrade.level) {
            self.fail(
                "degrade.level",
                format!("{} must lie in 1..={MAX_DEGRADE_LEVEL}; degrade is set by workers: a producer omits it", degrade.level),
            );
        }
        let from = degrade.from;
        let pixels = |w: u32, h: u32| u64::from(w) * u64::from(h);
        if pixels(from.width, from.height) <= pixels(job.width, job.height) || from.steps != job.steps {
            self.fail(
                "degrade.from",
                format!(
                    "{}x{} at {} steps is not a larger original of this {}x{} job at {} steps; \
                     degrade is set by workers: a producer omits it",
                    from.width, from.height, from.steps, job.width, job.height, job.steps
                ),
            );
        }
    }

    fn prompt(&mut self, field: &str, value: &str, max_bytes: usize, required: bool) {
        if required && value.trim().is_empty() {
            self.fail(field, "must not be empty".into());
        }
        if value.len() > max_bytes {
            self.fail(field, format!("is {} bytes long; at most {max_bytes} are allowed", value.len()));
        }
        if value.contains('\0') {
            self.fail(field, "contains a NUL character".into());
        }
    }

    fn side(&mut self, field: &str, value: u32, limits: &Limits) {
        if !value.is_multiple_of(8) || value == 0 {
            // The nearest multiple of 64 within the limits: SDXL's sizes are, and every model's
            // side multiple (8 times its UNet's, 16 or 32) divides it, where a multiple of 8 may
            // be refused. Limits with no multiple of 64 between them get the nearest bound.
            let (low, high) = (limits.min_side.div_ceil(64) * 64, limits.max_side / 64 * 64);
            let nearest = value.saturating_add(32) / 64 * 64;
            // max then min, never clamp: bounds in the wrong order must not panic a worker.
            let nearest = if low <= high { nearest.max(low).min(high) } else { nearest.max(limits.min_side).min(limits.max_side) };
            self.fail(field, format!("{value} must be a positive multiple of 8 (e.g. {nearest})"));
        } else if value < limits.min_side || value > limits.max_side {
            self.fail(
                field,
                format!("{value} is outside {}..={} pixels", limits.min_side, limits.max_side),
            );
        }
    }

    fn range(&mut self, field: &str, value: u32, min: u32, max: u32) {
        if value < min || value > max {
            self.fail(field, format!("{value} is outside {min}..={max}"));
        }
    }

    fn finite_range(&mut self, field: &str, value: f32, min: f32, max: f32) {
        if !value.is_finite() {
            self.fail(field, format!("{value} is not a finite number"));
        } else if value < min || value > max {
            self.fail(field, format!("{value} is outside {min}..={max}"));
        }
    }
}
