//! The per-render memory need: `need = a + b x latent pixels x images x 2`.
//!
//! `a` is what a render holds whatever its size (text encoder outputs, scheduler state, kernel
//! workspaces); `b` is what each latent pixel of the UNet batch costs (activations, attention).
//! The batch is doubled because classifier-free guidance runs negative and positive together.
//! Both are fitted by least squares to measured peaks: a few probe renders at start, then every
//! observed render, on a bounded window so the fit follows the card and the model as they are.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Distinct shapes whose highest peak is remembered as a floor; more than a fleet renders.
const MAX_FLOORS: usize = 256;

/// One UNet batch: `images` images of `width x height` pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape {
    pub width: u32,
    pub height: u32,
    pub images: u32,
}

impl Shape {
    pub const fn new(width: u32, height: u32, images: u32) -> Self {
        Self { width, height, images }
    }

    /// The latent's pixels: the VAE downsamples by 8 on each side.
    pub fn latent_pixels(&self) -> u64 {
        u64::from(self.width / 8) * u64::from(self.height / 8)
    }

    /// The model's variable: latent pixels of the whole guidance batch.
    pub fn units(&self) -> f64 {
        (self.latent_pixels() * u64::from(self.images) * 2) as f64
    }

    /// Needs no more memory than `other`: no more latent pixels and no more images. A peak
    /// seen at `self` is a lower bound for `other`.
    fn fits_within(&self, other: &Shape) -> bool {
        self.latent_pixels() <= other.latent_pixels() && self.images <= other.images
    }
}

/// A measured peak: the most memory one render added above where it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    pub shape: Shape,
    pub peak_bytes: u64,
}

/// Calibration could not give a usable model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EstimateError {
    #[error("calibration needs peaks at 2 or more shapes of different size; got {distinct}")]
    NotEnoughShapes { distinct: usize },
    /// Usually the arena kept memory from an earlier render, so the probe saw no growth.
    #[error(
        "calibration peaks do not grow with size ({peaks:?} bytes); shrink the arena before each probe render, or probe from the smallest shape up"
    )]
    NoGrowth { peaks: Vec<u64> },
}

/// The fitted need model and what it learned from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// `a`, bytes.
    fixed_bytes: f64,
    /// `b`, bytes per unit.
    bytes_per_unit: f64,
    /// The probe renders; always part of the fit, so a window of one shape cannot tilt it.
    calibration: Vec<Sample>,
    recent: VecDeque<Sample>,
    /// The highest peak seen per shape, oldest first.
    floors: Vec<Sample>,
}

impl Estimate {
    /// Fits the model to probe renders.
    ///
    /// # Errors
    ///
    /// Fewer than two distinct sizes, or peaks that do not grow with size.
    pub fn calibrate(samples: &[Sample]) -> Result<Self, EstimateError> {
        let (fixed_bytes, bytes_per_unit) = fit(samples).ok_or_else(|| {
            let mut units: Vec<f64> = samples.iter().map(|s| s.shape.units()).collect();
            units.sort_by(f64::total_cmp);
            units.dedup();
            EstimateError::NotEnoughShapes { distinct: units.len() }
        })?;
        if bytes_per_unit <= 0.0 {
            return Err(EstimateError::NoGrowth { peaks: samples.iter().map(|s| s.peak_bytes).collect() });
        }
        let mut estimate = Self {
            fixed_bytes,
            bytes_per_unit,
            calibration: samples.to_vec(),
            recent: VecDeque::new(),
            floors: Vec::new(),
        };
        for sample in samples {
            estimate.raise_floor(sample.shape, sample.peak_bytes);
        }
        Ok(estimate)
    }

    /// The bytes a render of `shape` needs, before any safety margin: the fitted model, and
    /// never less than a peak seen at this shape or a smaller one.
    pub fn need(&self, shape: Shape) -> u64 {
        let modelled = (self.fixed_bytes + self.bytes_per_unit * shape.units()).ceil() as u64;
        let floor = self.floors.iter().filter(|f| f.shape.fits_within(&shape)).map(|f| f.peak_bytes).max();
        modelled.max(floor.unwrap_or(0))
    }

    /// Learns from a render's observed peak and returns how far off the need was,
    /// `(observed - predicted) / predicted`: positive means it was underestimated.
    /// `window` is how many recent observations the fit keeps.
    pub fn observe(&mut self, sample: Sample, window: usize) -> f64 {
        let predicted = self.need(sample.shape).max(1) as f64;
        let error = (sample.peak_bytes as f64 - predicted) / predicted;
        self.recent.push_back(sample);
        while self.recent.len() > window {
            self.recent.pop_front();
        }
        self.raise_floor(sample.shape, sample.peak_bytes);
        if let Some((fixed, per_unit)) = fit(self.calibration.iter().chain(&self.recent)) {
            self.fixed_bytes = fixed;
            self.bytes_per_unit = per_unit;
        }
        error
    }

    /// Records that `shape` needs at least `bytes` (a render of it ran out of memory with that
    /// much planned), for this shape and every larger one.
    pub fn raise_floor(&mut self, shape: Shape, bytes: u64) {
        if let Some(floor) = self.floors.iter_mut().find(|f| f.shape == shape) {
            floor.peak_bytes = floor.peak_bytes.max(bytes);
            return;
        }
        if self.floors.len() == MAX_FLOORS {
            self.floors.remove(0);
        }
        self.floors.push(Sample { shape, peak_bytes: bytes });
    }

    /// `(a, b)`: bytes, and bytes per latent pixel of the guidance batch.
    pub fn coefficients(&self) -> (f64, f64) {
        (self.fixed_bytes, self.bytes_per_unit)
    }
}

/// Least squares of peak on units, clamped to what memory can do: neither part negative. `None`
/// when all samples have one size, where a slope cannot be told.
fn fit<'a>(samples: impl IntoIterator<Item = &'a Sample> + Clone) -> Option<(f64, f64)> {
    let points = || samples.clone().into_iter().map(|s| (s.shape.units(), s.peak_bytes as f64));
    let n = points().count() as f64;
    if n == 0.0 {
        return None;
    }
    let mean_x = points().map(|(x, _)| x).sum::<f64>() / n;
    let mean_y = points().map(|(_, y)| y).sum::<f64>() / n;
    let sxx: f64 = points().map(|(x, _)| (x - mean_x).powi(2)).sum();
    let sxy: f64 = points().map(|(x, y)| (x - mean_x) * (y - mean_y)).sum();
    if sxx <= f64::EPSILON * mean_x.powi(2) {
        return None;
    }
    let slope = sxy / sxx;
    if slope <= 0.0 {
        // Bigger renders cannot need less; read the data as a constant need.
        return Some((mean_y, 0.0));
    }
    let intercept = mean_y - slope * mean_x;
    if intercept < 0.0 {
        // A render cannot need negative memory at size zero: fit through the origin instead.
        let sxy0: f64 = points().map(|(x, y)| x * y).sum();
        let sxx0: f64 = points().map(|(x, _)| x * x).sum();
        return Some((0.0, sxy0 / sxx0));
    }
    Some((intercept, slope))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    /// Peaks from a known model: 300 MiB fixed, 4 KiB per unit.
    fn synthetic(shape: Shape) -> Sample {
        Sample { shape, peak_bytes: 300 * MIB + 4096 * shape.units() as u64 }
    }

    fn calibrated() -> Estimate {
        let shapes = [Shape::new(512, 512, 1), Shape::new(768, 768, 1), Shape::new(1024, 1024, 1)];
        Estimate::calibrate(&shapes.map(synthetic)).unwrap()
    }

    #[test]
    fn calibration_recovers_a_known_model() {
        let estimate = calibrated();
        let (a, b) = estimate.coefficients();
        assert!((a - (300 * MIB) as f64).abs() < 1.0, "a = {a}");
        assert!((b - 4096.0).abs() < 1e-6, "b = {b}");
        // Extrapolates to a batch it never saw.
        let batch = Shape::new(1024, 1024, 4);
        assert_eq!(estimate.need(batch), synthetic(batch).peak_bytes);
    }

    #[test]
    fn calibration_refuses_one_size_and_flat_peaks() {
        let one = [synthetic(Shape::new(512, 512, 1)), synthetic(Shape::new(512, 512, 1))];
        assert_eq!(Estimate::calibrate(&one), Err(EstimateError::NotEnoughShapes { distinct: 1 }));
        let flat = [Shape::new(512, 512, 1), Shape::new(1024, 1024, 1)].map(|shape| Sample { shape, peak_bytes: 0 });
        assert!(matches!(Estimate::calibrate(&flat), Err(EstimateError::NoGrowth { .. })));
    }

    #[test]
    fn fit_is_clamped_to_non_negative_parts() {
        // Peaks that extrapolate below zero at size zero: fitted through the origin.
        let steep = [(512, 100 * MIB), (1024, 500 * MIB)]
            .map(|(side, peak_bytes)| Sample { shape: Shape::new(side, side, 1), peak_bytes });
        let (a, b) = fit(&steep).unwrap();
        assert_eq!(a, 0.0);
        assert!(b > 0.0);
        // Peaks that fall with size: a constant need at their mean.
        let falling = [(512, 500 * MIB), (1024, 100 * MIB)]
            .map(|(side, peak_bytes)| Sample { shape: Shape::new(side, side, 1), peak_bytes });
        assert_eq!(fit(&falling), Some(((300 * MIB) as f64, 0.0)));
    }

    #[test]
    fn observations_report_their_error_and_move_the_fit() {
        let mut estimate = calibrated();
        let shape = Shape::new(1024, 1024, 2);
        let predicted = estimate.need(shape);
        let observed = predicted + predicted / 5;
        let error = estimate.observe(Sample { shape, peak_bytes: observed }, 8);
        assert!((error - 0.2).abs() < 1e-6, "error = {error}");
        // Never below what this shape was seen to need, whatever the fit says.
        assert!(estimate.need(shape) >= observed);
        // Larger shapes inherit the floor; the fit itself moved up.
        assert!(estimate.need(Shape::new(1024, 1024, 3)) >= observed);
        assert!(estimate.coefficients().1 > 4096.0 || estimate.coefficients().0 > (300 * MIB) as f64);
        // An overestimate is a negative error.
        let small = Shape::new(512, 512, 1);
        let under = estimate.observe(Sample { shape: small, peak_bytes: estimate.need(small) / 2 }, 8);
        assert!(under < 0.0);
    }

    #[test]
    fn the_window_bounds_what_is_remembered() {
        let mut estimate = calibrated();
        for i in 0..20 {
            estimate.observe(synthetic(Shape::new(512 + 64 * (i % 4), 512, 1)), 5);
        }
        assert_eq!(estimate.recent.len(), 5);
        for i in 0..(MAX_FLOORS as u32 + 10) {
            estimate.raise_floor(Shape::new(8 * (i + 1), 8, 1), 1);
        }
        assert_eq!(estimate.floors.len(), MAX_FLOORS);
    }
}
