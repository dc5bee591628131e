//! `shotfleet-consumer --check-budget`: does the budget's memory model hold on this card?
//!
//! Loads and calibrates as a worker starts, then renders each listed shape from arenas shrunk
//! back to the models and compares its peak with what the budget predicts for it; renders it a
//! second time from shrunk arenas, which tells a first render's extra memory (ONNX Runtime
//! planning a new shape's tensors, cuDNN choosing its algorithms) from what the shape always
//! needs; and once more without
//! shrinking, to time a render of a known shape. No NATS, no store: an operator runs it on a new
//! card, model or runtime before the worker serves.

use shotfleet_schema::Limits;

use crate::budget::{MIB, Shape};
use crate::config::WorkerConfig;
use crate::worker::WorkerError;
use crate::worker::startup;

/// One checked shape.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CheckedShape {
    pub width: u32,
    pub height: u32,
    pub images: u32,
    /// The estimate's need, before the safety margin.
    pub predicted_mib: f64,
    /// What admission reserves: the need plus `[budget] safety`.
    pub planned_mib: f64,
    /// The render's need: its peak above the floor, what the process keeps outside its arenas
    /// once they are shrunk after it (the kernels this render loaded included in the floor).
    pub observed_mib: f64,
    /// `(observed - predicted) / predicted`: above 0 the estimate ran low.
    pub error: f64,
    /// The need of a second render from shrunk arenas, the shape now known to every graph. Under
    /// `observed_mib` where a shape's first render costs extra (on the H200 1152x896 x 2 by
    /// 2.4-3.4 GiB before its size was probed, new sizes such as 1216x832 by 0.55-0.6 GiB); the
    /// same where it does not (most shapes checked there).
    pub observed_again_mib: f64,
    /// The first render of the shape, from shrunk arenas (cuDNN's algorithm search included).
    pub first_ms: f64,
    /// A third render of the shape, right after the second and without shrinking: what a job
    /// of it costs once the shape is known.
    pub again_ms: f64,
    /// That third render's VAE decode alone, which `[cuda.vae]` and `[budget] vae_keeps_arena`
    /// change.
    pub again_vae_ms: f64,
    /// Each graph's arena after the first render, MiB reserved, its weights included (ONNX
    /// Runtime's `TotalAllocated`; every arena starts that render shrunk). Their growth over the
    /// arenas right after loading, short of `observed_mib`, is memory outside the arenas. The
    /// VAE's has given its regions back after each decode unless `[budget] vae_keeps_arena`, so
    /// it shows the weights alone. Graphs whose arena gives no counters are left out.
    pub arenas_mib: std::collections::BTreeMap<String, f64>,
}

/// Parses `512x512x1,1536x1536x4`: width x height x images, each size a multiple of 8 (the
/// VAE's factor) within the job limits.
///
/// # Errors
/// A message naming the item that is not a shape.
pub fn parse_shapes(text: &str, limits: &Limits) -> Result<Vec<Shape>, String> {
    let shapes: Vec<Shape> = text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            let bad = |why: &str| format!("`{item}` {why}; write WIDTHxHEIGHTxIMAGES, e.g. 1024x1024x2");
            let parts: Vec<u32> = item.split('x').map(|p| p.trim().parse::<u32>()).collect::<Result<_, _>>().map_err(|_| bad("is not a shape"))?;
            let [width, height, images] = parts[..] else { return Err(bad("is not three numbers")) };
            match limits.shape_problem(width, height, images) {
                Some(problem) => Err(bad(&format!("is not a job's shape ({problem})"))),
                None => Ok(Shape::new(width, height, images)),
            }
        })
        .collect::<Result<_, _>>()?;
    if shapes.is_empty() {
        return Err("no shapes given; write e.g. 512x512x1,1024x1024x2".into());
    }
    Ok(shapes)
}

/// What the check found, after the rows: how close the estimate came, and what it was fitted on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CheckSummary {
    pub shapes: usize,
    pub max_abs_error: f64,
    pub within_10pct: usize,
    pub coefficients: crate::budget::Coefficients,
    /// The probe renders the estimate was fitted on.
    pub calibration: Vec<ProbePeak>,
    /// Each memory class: whether a worker with this config would serve it here, and why not.
    pub classes: Vec<String>,
}

/// One probe render's peak.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ProbePeak {
    pub width: u32,
    pub height: u32,
    pub images: u32,
    pub peak_mib: f64,
}

impl CheckSummary {
    pub fn of(checked: &[CheckedShape], estimate: &crate::budget::Estimate, classes: &crate::budget::ClassReport) -> Self {
        let mib = MIB as f64;
        Self {
            shapes: checked.len(),
            max_abs_error: checked.iter().map(|r| r.error.abs()).fold(0.0, f64::max),
            within_10pct: checked.iter().filter(|r| r.error.abs() <= 0.10).count(),
            coefficients: estimate.coefficients(),
            calibration: estimate
                .calibration()
                .iter()
                .map(|s| ProbePeak { width: s.shape.width, height: s.shape.height, images: s.shape.images, peak_mib: s.peak_bytes as f64 / mib })
                .collect(),
            classes: classes.holds.iter().map(ToString::to_string).collect(),
        }
    }
}

/// Starts as the worker would (load, calibrate, fitness render), then measures every shape.
///
/// # Errors
/// [`WorkerError::Start`] when start-up or a check render fails (out of memory included).
pub async fn check_budget(config: &WorkerConfig, shapes: &[Shape]) -> Result<(Vec<CheckedShape>, CheckSummary), WorkerError> {
    let ready = startup::prepare(config).await?;
    let runs = startup::ProbeRuns::of(config);
    let mut checked = Vec::with_capacity(shapes.len());
    for &shape in shapes {
        let steps = config.calibration.steps;
        let first = startup::measure(&ready.pipeline, &ready.meter, shape, steps, runs.with_cold(true)).await?;
        let arenas_mib = ready
            .pipeline
            .arena_stats()
            .into_iter()
            .filter_map(|(graph, stats)| Some((graph, stats?.total_allocated as f64 / MIB as f64)))
            .collect();
        let known = startup::measure(&ready.pipeline, &ready.meter, shape, steps, runs.with_cold(true)).await?;
        let again = startup::measure(&ready.pipeline, &ready.meter, shape, steps, runs.with_cold(false)).await?;
        let observed = first.peak as f64;
        let predicted = ready.budget.estimate().need(shape) as f64;
        let planned = ready.budget.planned(shape.width, shape.height, shape.images) as f64;
        let mib = MIB as f64;
        checked.push(CheckedShape {
            width: shape.width,
            height: shape.height,
            images: shape.images,
            predicted_mib: predicted / mib,
            planned_mib: planned / mib,
            observed_mib: observed / mib,
            error: (observed - predicted) / predicted.max(1.0),
            observed_again_mib: known.peak as f64 / mib,
            first_ms: first.timings.total().as_secs_f64() * 1e3,
            again_ms: again.timings.total().as_secs_f64() * 1e3,
            again_vae_ms: again.timings.vae.as_secs_f64() * 1e3,
            arenas_mib,
        });
    }
    let summary = CheckSummary::of(&checked, &ready.budget.estimate(), &ready.classes);
    Ok((checked, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_are_named() {
        let limits = Limits::default();
        assert_eq!(parse_shapes("512x512x1, 1152x896x3", &limits).unwrap(), vec![Shape::new(512, 512, 1), Shape::new(1152, 896, 3)]);
        for (text, says) in [("512x512", "three numbers"), ("512x500x1", "multiple of 8"), ("axbxc", "not a shape"), ("", "no shapes"), ("512x512x0", "images: 0 is outside 1..=8"), ("8x8x1", "width: 8 is outside 64..=2048")] {
            let err = parse_shapes(text, &limits).unwrap_err();
            assert!(err.contains(says), "{text:?}: {err}");
        }
    }
}
