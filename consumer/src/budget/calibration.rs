//! Calibration that never kills a worker: each probe render is planned against the room it
//! would have before it runs, and one that runs out of memory anyway is the card's ceiling.
//!
//! The worker's start-up renders the configured probe shapes in order (smallest first) and asks
//! [`Calibration::plan`] before each one, with the room it has at that moment:
//!
//! - the probe is **skipped** when what the budget would plan for it (its predicted need plus
//!   `safety`, as admission plans a job) is over the room: predicted by a fit of the probes
//!   measured so far, or, with fewer than two, bounded below by the peak of a measured probe
//!   it fits within (a probe needs at least what a smaller one did);
//! - it is **skipped** too when a shape it fits within already ran out of memory;
//! - otherwise it runs: its peak is **measured**, or it **ran out of memory** with that room,
//!   which the estimate keeps as a ceiling ([`Estimate::ran_out`]): this shape and every larger
//!   one need more than that room, so admission never lets them in.
//!
//! [`Calibration::estimate`] then fits what was measured. A calibration that measured fewer
//! than every probe is not worth storing as the card's fingerprint: the next start, perhaps on
//! an emptier card, tries them all again ([`Calibration::complete`]).

use super::estimate::{Estimate, EstimateError, Sample, Shape};

/// What became of one probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Rendered; its peak above the models, bytes.
    Measured { peak: u64 },
    /// Not rendered: the budget would plan `planned` bytes for it, over the `room`.
    OverRoom { planned: u64, room: u64 },
    /// Not rendered: `ceiling`, which fits within it, ran out of memory.
    OverCeiling { ceiling: Shape },
    /// Rendered and ran out of memory with `room` bytes of room: the card's ceiling.
    OutOfMemory { room: u64 },
}

impl ProbeOutcome {
    /// A short lowercase name for logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Measured { .. } => "measured",
            Self::OverRoom { .. } => "over_room",
            Self::OverCeiling { .. } => "over_ceiling",
            Self::OutOfMemory { .. } => "out_of_memory",
        }
    }
}

/// One probe shape and what became of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeRecord {
    pub shape: Shape,
    pub outcome: ProbeOutcome,
}

/// Calibration could not give an estimate.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CalibrationError {
    /// Not one probe could be rendered: the card cannot hold the smallest of them beside the
    /// models.
    #[error("no probe render fits this card: {}", describe(.probes))]
    NothingMeasured { probes: Vec<ProbeRecord> },
    #[error(transparent)]
    Estimate(#[from] EstimateError),
}

/// The probes of one calibration, in the order they were planned.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    safety: f64,
    probes: Vec<ProbeRecord>,
}

impl Calibration {
    /// A calibration whose plans add `safety` (`[budget] safety`) to predicted needs, as
    /// admission does.
    pub fn new(safety: f64) -> Self {
        Self { safety, probes: Vec::new() }
    }

    /// Whether to render `shape` now, with `room` bytes of room beside the models. A skip is
    /// recorded here, with why; a `None` asks the caller to render and report back through
    /// [`measured`](Self::measured) or [`ran_out`](Self::ran_out).
    pub fn plan(&mut self, shape: Shape, room: u64) -> Option<ProbeOutcome> {
        let ceiling = self.probes.iter().find(|p| matches!(p.outcome, ProbeOutcome::OutOfMemory { .. }) && p.shape.fits_within(&shape));
        let skip = match (ceiling, self.predicted(shape)) {
            (Some(ceiling), _) => Some(ProbeOutcome::OverCeiling { ceiling: ceiling.shape }),
            // No room at all: nothing renders in it, whatever it is.
            (None, need) if room == 0 => Some(ProbeOutcome::OverRoom { planned: self.planned(need.unwrap_or(0)), room }),
            (None, Some(need)) => {
                let planned = self.planned(need);
                (planned > room).then_some(ProbeOutcome::OverRoom { planned, room })
            }
            (None, None) => None,
        };
        if let Some(outcome) = skip {
            self.probes.push(ProbeRecord { shape, outcome });
        }
        skip
    }

    /// What admission would plan for a need of `need` bytes.
    fn planned(&self, need: u64) -> u64 {
        (need as f64 * (1.0 + self.safety)).ceil() as u64
    }

    /// `shape` rendered with a peak of `peak` bytes above the models.
    pub fn measured(&mut self, shape: Shape, peak: u64) {
        self.probes.push(ProbeRecord { shape, outcome: ProbeOutcome::Measured { peak } });
    }

    /// `shape` ran out of memory with `room` bytes of room: the card's ceiling for it.
    pub fn ran_out(&mut self, shape: Shape, room: u64) {
        self.probes.push(ProbeRecord { shape, outcome: ProbeOutcome::OutOfMemory { room } });
    }

    /// Every probe, in order, with what became of it.
    pub fn probes(&self) -> &[ProbeRecord] {
        &self.probes
    }

    /// Whether every probe was measured: only then is the estimate the card's own, fit to
    /// store as its fingerprint.
    pub fn complete(&self) -> bool {
        self.probes.iter().all(|p| matches!(p.outcome, ProbeOutcome::Measured { .. }))
    }

    /// The smallest shape that ran out of memory and fits within `shape`, if any: why a render
    /// of `shape` is past this card's ceiling.
    pub fn ceiling_under(&self, shape: Shape) -> Option<Shape> {
        self.probes
            .iter()
            .filter(|p| matches!(p.outcome, ProbeOutcome::OutOfMemory { .. }) && p.shape.fits_within(&shape))
            .map(|p| p.shape)
            .min_by_key(|s| s.units() as u64)
    }

    /// The estimate from the measured probes (one measured probe gives
    /// [`Estimate::from_one`]), with every out-of-memory probe as a ceiling.
    ///
    /// # Errors
    ///
    /// Nothing was measured, or the peaks do not make an estimate ([`EstimateError`]).
    pub fn estimate(&self) -> Result<Estimate, CalibrationError> {
        let samples = self.samples();
        let mut estimate = match samples.as_slice() {
            [] => return Err(CalibrationError::NothingMeasured { probes: self.probes.clone() }),
            [one] => Estimate::from_one(*one),
            // Probes of one shape (repeated in the config) or of several.
            [first, rest @ ..] if rest.iter().all(|s| s.shape == first.shape) => Estimate::from_one(*first),
            many => Estimate::calibrate(many)?,
        };
        for probe in &self.probes {
            if let ProbeOutcome::OutOfMemory { room } = probe.outcome {
                estimate.ran_out(probe.shape, room);
            }
        }
        Ok(estimate)
    }

    fn samples(&self) -> Vec<Sample> {
        self.probes
            .iter()
            .filter_map(|p| match p.outcome {
                ProbeOutcome::Measured { peak } => Some(Sample { shape: p.shape, peak_bytes: peak }),
                _ => None,
            })
            .collect()
    }

    /// The need of `shape` as the probes so far predict it: a fit once two shapes were
    /// measured, else the peak of a measured shape it fits within (a lower bound), else
    /// nothing to go on.
    fn predicted(&self, shape: Shape) -> Option<u64> {
        let samples = self.samples();
        if let Ok(fitted) = Estimate::calibrate(&samples) {
            return Some(fitted.need(shape));
        }
        samples.iter().filter(|s| s.shape.fits_within(&shape)).map(|s| s.peak_bytes).max()
    }
}

/// `512x512x1 out of memory with 1800 MiB of room, ...`: the probes for an error message.
fn describe(probes: &[ProbeRecord]) -> String {
    if probes.iter().all(|p| matches!(p.outcome, ProbeOutcome::OverRoom { room: 0, .. })) {
        return format!("no room at all beside the models for any of the {} probes", probes.len());
    }
    let mib = |bytes: u64| bytes / super::MIB;
    probes
        .iter()
        .map(|p| {
            let shape = format!("{}x{}x{}", p.shape.width, p.shape.height, p.shape.images);
            match p.outcome {
                ProbeOutcome::Measured { peak } => format!("{shape} peaked at {} MiB", mib(peak)),
                ProbeOutcome::OverRoom { room: 0, .. } => format!("{shape} not rendered: no room beside the models"),
                ProbeOutcome::OverRoom { planned, room } => format!("{shape} not rendered: {} MiB planned, {} MiB of room", mib(planned), mib(room)),
                ProbeOutcome::OverCeiling { ceiling } => {
                    format!("{shape} is larger than {}x{}x{}, which ran out of memory", ceiling.width, ceiling.height, ceiling.images)
                }
                ProbeOutcome::OutOfMemory { room } => format!("{shape} ran out of memory with {} MiB of room", mib(room)),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MIB;

    /// Peaks of a known model: 100 MiB fixed and 16 KiB per unit (512x512x1 is 228 MiB).
    fn peak(shape: Shape) -> u64 {
        100 * MIB + 16_384 * shape.units() as u64
    }

    fn square(side: u32, images: u32) -> Shape {
        Shape::new(side, side, images)
    }

    #[test]
    fn probes_run_until_the_fit_says_the_next_is_over_the_room() {
        let mut calibration = Calibration::new(0.10);
        let room = 600 * MIB;
        for shape in [square(256, 1), square(512, 1)] {
            assert_eq!(calibration.plan(shape, room), None, "nothing predicts {shape:?} over the room");
            calibration.measured(shape, peak(shape));
        }
        // 768x768 x 1 needs 388 MiB (427 planned): it runs. 1024x1024 x 1 needs 612: skipped.
        assert_eq!(calibration.plan(square(768, 1), room), None);
        calibration.measured(square(768, 1), peak(square(768, 1)));
        let skipped = calibration.plan(square(1024, 1), room).expect("over the room");
        let planned = (peak(square(1024, 1)) as f64 * 1.1).ceil() as u64;
        assert!(matches!(skipped, ProbeOutcome::OverRoom { planned: p, room: r } if p.abs_diff(planned) < 8 && r == room), "{skipped:?}");
        assert!(!calibration.complete());
        let estimate = calibration.estimate().unwrap();
        assert!(estimate.need(square(1024, 2)).abs_diff(peak(square(1024, 2))) < 8, "the fit extrapolates");
        assert_eq!(calibration.probes().len(), 4);
    }

    #[test]
    fn with_one_probe_measured_only_its_peak_bounds_a_larger_one() {
        let mut calibration = Calibration::new(0.10);
        calibration.measured(square(512, 1), 500 * MIB);
        // No fit yet: a larger probe is skipped only when the smaller one's peak alone, plus
        // the safety margin, is over the room.
        assert_eq!(calibration.plan(square(768, 1), 550 * MIB), None);
        assert_eq!(
            calibration.plan(square(768, 1), 550 * MIB - 1),
            Some(ProbeOutcome::OverRoom { planned: 550 * MIB, room: 550 * MIB - 1 })
        );
        // A shape the probe does not fit within (a narrower one) has no bound at all.
        assert_eq!(calibration.plan(Shape::new(384, 384, 1), 1), None);
    }

    #[test]
    fn a_probe_that_ran_out_of_memory_is_the_ceiling_for_every_larger_shape() {
        let mut calibration = Calibration::new(0.10);
        let room = 3000 * MIB;
        calibration.measured(square(256, 1), peak(square(256, 1)));
        calibration.measured(square(512, 1), peak(square(512, 1)));
        // The fit says 768x768 fits, but an arena cap behind the budget's back says otherwise.
        assert_eq!(calibration.plan(square(768, 1), room), None);
        calibration.ran_out(square(768, 1), room);
        assert_eq!(calibration.plan(square(768, 4), room), Some(ProbeOutcome::OverCeiling { ceiling: square(768, 1) }));
        assert_eq!(calibration.plan(square(1024, 1), room), Some(ProbeOutcome::OverCeiling { ceiling: square(768, 1) }));
        // A shape narrower on one side is not larger: it is still planned on the fit.
        assert_eq!(calibration.plan(Shape::new(1024, 512, 1), room), None);
        assert_eq!(calibration.ceiling_under(square(1024, 2)), Some(square(768, 1)));
        assert_eq!(calibration.ceiling_under(square(512, 4)), None);

        let estimate = calibration.estimate().unwrap();
        for shape in [square(768, 1), square(768, 2), square(1024, 1)] {
            assert!(estimate.need(shape) > room, "{shape:?} is past the ceiling");
        }
        // What was measured keeps its need: the ceiling is no size offset.
        assert!(estimate.need(square(512, 1)).abs_diff(peak(square(512, 1))) < 8);
        assert!(estimate.need(Shape::new(1024, 512, 1)) < room);
    }

    #[test]
    fn one_measured_probe_still_gives_an_estimate_and_none_gives_a_reason() {
        let mut calibration = Calibration::new(0.10);
        calibration.measured(square(512, 1), 2400 * MIB);
        calibration.ran_out(square(768, 1), 3000 * MIB);
        let estimate = calibration.estimate().unwrap();
        assert_eq!(estimate.need(square(512, 1)), 2400 * MIB);
        assert!(estimate.need(square(512, 2)) >= 2 * 2400 * MIB - 1, "in proportion to the batch: errs high");

        let mut crowded = Calibration::new(0.10);
        assert_eq!(crowded.plan(square(512, 1), 0), Some(ProbeOutcome::OverRoom { planned: 0, room: 0 }), "no room, no render");
        assert!(crowded.plan(square(768, 1), 0).is_some());
        assert!(crowded.estimate().unwrap_err().to_string().ends_with("no room at all beside the models for any of the 2 probes"));

        let mut nothing = Calibration::new(0.10);
        nothing.ran_out(square(512, 1), 1800 * MIB);
        assert!(nothing.plan(square(768, 1), 1800 * MIB).is_some());
        let error = nothing.estimate().unwrap_err();
        assert!(matches!(error, CalibrationError::NothingMeasured { ref probes } if probes.len() == 2));
        let text = error.to_string();
        assert!(text.contains("512x512x1 ran out of memory with 1800 MiB of room"), "{text}");
        assert!(text.contains("768x768x1 is larger than 512x512x1"), "{text}");
    }
}
