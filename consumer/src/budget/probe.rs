//! What the budget asks of a GPU: a memory snapshot, and the peak usage of a render.
//!
//! Two implementations: [`NvmlProbe`](super::NvmlProbe) for real cards and
//! [`SimulatedGpu`](super::SimulatedGpu), an explicit simulation for CPU runs and tests.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use nvml_wrapper::error::NvmlError;

/// One reading of the card.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSnapshot {
    /// What the card calls itself (`NVIDIA H200`, `simulated (cpu)`); part of the fingerprint key.
    pub device: String,
    pub total: u64,
    /// Used by every process on the card, this one included.
    pub used: u64,
    pub free: u64,
    /// This process's own usage, where the driver reports it. NVML's per-process accounting
    /// fails inside containers whose PIDs the driver does not see; the budget is then
    /// conservative (see [`Budget`](super::Budget)).
    pub own_used: Option<u64>,
    /// Fraction of the last sample period a kernel ran, `0..=1`.
    pub utilization: Option<f64>,
    pub temperature_c: Option<u32>,
}

impl GpuSnapshot {
    /// Used memory as a fraction of the card: what the water levels compare.
    pub fn used_fraction(&self) -> f64 {
        if self.total == 0 { 1.0 } else { self.used as f64 / self.total as f64 }
    }

    /// The memory this process holds now that it did not hold at `before`: take `before` ahead of
    /// loading the models and call this on a snapshot taken after, to get the resident size.
    /// Own usage is exact where the driver reports it (CUDA context included); otherwise the
    /// card's growth between the two snapshots stands in for it.
    pub fn resident_since(&self, before: &GpuSnapshot) -> u64 {
        self.own_used.unwrap_or_else(|| self.used.saturating_sub(before.used))
    }
}

/// A GPU the budget can read. Shared between the async loop and the render thread.
pub trait GpuProbe: Send + Sync {
    /// Reads the card now.
    ///
    /// # Errors
    ///
    /// The driver's own error, unaltered: a lost GPU must reach the worker as what it is.
    fn snapshot(&self) -> Result<GpuSnapshot, ProbeError>;

    /// Starts a peak measurement and returns the usage it starts from. The measurement is of
    /// this process where the probe can tell it apart (else of the card), and is process-wide:
    /// one at a time, around one render.
    ///
    /// # Errors
    ///
    /// The usage could not be read.
    fn start_peak(&self) -> Result<u64, ProbeError>;

    /// The highest usage since [`start_peak`](Self::start_peak), in the same terms as its
    /// return value; ends the measurement.
    ///
    /// # Errors
    ///
    /// [`ProbeError::PeakNotStarted`] without a `start_peak`, or the usage could not be read.
    fn peak_since_start(&self) -> Result<u64, ProbeError>;

    /// Whether this probe's usage falls when ONNX Runtime's arenas give their regions back, so
    /// that what it reads right after a shrink is what the process keeps outside the arenas
    /// (see [`PeakMeter::note_floor`]). A card's driver memory does (the arena frees it); the
    /// CPU simulation's resident size does not (the C allocator keeps freed pages for reuse).
    fn frees_on_shrink(&self) -> bool {
        true
    }
}

/// A GPU could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// No NVML on this machine (no driver, no library, no permission).
    #[error(
        "NVML unavailable: {source}; use `device = \"cpu\"` with an explicit `[budget.simulate]` section for CPU runs"
    )]
    NvmlUnavailable {
        #[source]
        source: NvmlError,
    },

    #[error("NVML has no GPU {index}: {source}")]
    NoDevice {
        index: u32,
        #[source]
        source: NvmlError,
    },

    /// A query on an opened GPU failed: `GpuLost`, `ResetRequired` and `Unknown` here are driver
    /// faults for the worker to act on.
    #[error("NVML {call} on GPU {index}: {source}")]
    Nvml {
        call: &'static str,
        index: u32,
        #[source]
        source: NvmlError,
    },

    /// `CUDA_VISIBLE_DEVICES` makes CUDA's device `ordinal` no card NVML can read.
    #[error("CUDA device {ordinal}: {detail}")]
    NotVisible { ordinal: u32, detail: String },

    /// The simulation could not read this process's memory.
    #[error("{path}: {detail}")]
    Proc { path: &'static str, detail: String },

    #[error("peak_since_start called without start_peak")]
    PeakNotStarted,

    /// A CPU run has no card to read; the simulation must be asked for, never implied.
    #[error("`device = \"cpu\"` needs a `[budget.simulate]` section, e.g. `simulate = {{ total_mib = 4096 }}`")]
    SimulationRequired,

    /// A simulation on a GPU run would plan against a card that is not there.
    #[error("`[budget.simulate]` is for CPU runs; remove it to budget GPU {index} through NVML")]
    SimulationOnGpu { index: u32 },
}

impl ProbeError {
    /// What NVML said, for the worker to classify driver faults (`GpuLost`, `ResetRequired`,
    /// `Unknown`) without parsing text.
    pub fn nvml_error(&self) -> Option<&NvmlError> {
        match self {
            Self::NvmlUnavailable { source } | Self::NoDevice { source, .. } | Self::Nvml { source, .. } => {
                Some(source)
            }
            Self::NotVisible { .. } | Self::Proc { .. } | Self::PeakNotStarted | Self::SimulationRequired | Self::SimulationOnGpu { .. } => None,
        }
    }
}

/// The peak usage of one render, measured through a probe.
///
/// ```ignore
/// let window = PeakWindow::start(&*probe)?;
/// let images = pipeline.render(&request)?;
/// let peak = window.finish()?; // bytes the render added at its highest
/// ```
///
/// On a real card, measure with ONNX Runtime's arena shrunk (or each shape larger than the last):
/// memory an arena already holds is reused without showing up as growth.
#[must_use = "a peak window measures nothing until finished"]
pub struct PeakWindow<'a> {
    probe: &'a dyn GpuProbe,
    start: u64,
}

impl<'a> PeakWindow<'a> {
    /// # Errors
    ///
    /// The probe could not read the usage.
    pub fn start(probe: &'a dyn GpuProbe) -> Result<Self, ProbeError> {
        Ok(Self { start: probe.start_peak()?, probe })
    }

    /// The most the usage rose above where it started, bytes.
    ///
    /// # Errors
    ///
    /// The probe could not read the usage.
    pub fn finish(self) -> Result<u64, ProbeError> {
        Ok(self.probe.peak_since_start()?.saturating_sub(self.start))
    }
}

/// A thread that samples a usage every `interval` and keeps the highest, for probes whose
/// source has no high-water mark of its own (NVML).
pub(crate) struct PeakSampler {
    stop: mpsc::Sender<()>,
    handle: JoinHandle<u64>,
}

impl PeakSampler {
    /// Starts sampling; `first` is the usage at the start, so a render shorter than one
    /// interval still reports at least that. Samples that fail are skipped: the render itself
    /// reports a failing device.
    pub(crate) fn start<F>(interval: Duration, first: u64, mut sample: F) -> Self
    where
        F: FnMut() -> Option<u64> + Send + 'static,
    {
        let (stop, stopped) = mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("budget-peak".into())
            .spawn(move || {
                let mut peak = first;
                // A closed channel (the sender dropped) ends sampling as a stop does.
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    peak = peak.max(sample().unwrap_or(0));
                }
                // One last sample, so the end of the render is counted.
                peak.max(sample().unwrap_or(0))
            })
            .expect("spawning a thread fails only when the process is out of resources");
        Self { stop, handle }
    }

    /// Stops sampling and returns the highest usage seen.
    pub(crate) fn finish(self) -> u64 {
        // A send fails only if the thread already ended, which it does not on its own.
        let _ = self.stop.send(());
        // A panic in the sampler is a bug in a probe: let it surface where the peak is used.
        self.handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    #[test]
    fn the_sampler_keeps_the_highest_sample() {
        let usage = Arc::new(AtomicU64::new(100));
        let read = Arc::clone(&usage);
        let sampler = PeakSampler::start(Duration::from_millis(1), 50, move || Some(read.load(Ordering::Relaxed)));
        std::thread::sleep(Duration::from_millis(30));
        usage.store(10, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(sampler.finish(), 100);
        // A window shorter than one interval still reports its start and its end.
        let quick = PeakSampler::start(Duration::from_secs(60), 50, || Some(70));
        assert_eq!(quick.finish(), 70);
    }

    #[test]
    fn a_need_is_the_peak_above_the_floor_and_trusted_from_shrunk_arenas() {
        // 1.5 GiB outside the arenas (kernels loaded earlier), a 512x512 render adds 0.8.
        let small = Measured { peak: 2320, held_at_start: 1520 };
        assert_eq!(small.need_over(1520), (800, true));
        assert!(!small.need_over(0).1, "above the baseline alone, the held kernels look like a cache");
        // A cache above the floor: not the render's own.
        assert_eq!(Measured { peak: 4000, held_at_start: 3000 }.need_over(1520), (2480, false));
        // A floor read after the render, above its start (it loaded kernels): its peak above that.
        assert_eq!(Measured { peak: 9154, held_at_start: 802 }.need_over(1390), (7764, true));
    }

    #[test]
    fn a_render_is_cold_when_little_was_held_at_its_start() {
        let cold = |m: Measured| m.need_over(0).1;
        // Arenas shrunk back to the models: the peak is the render's own.
        assert!(cold(Measured { peak: 6660, held_at_start: 0 }));
        assert!(cold(Measured { peak: 6660, held_at_start: 300 }));
        // A larger job's cache still held: the peak says nothing about this shape.
        assert!(!cold(Measured { peak: 16726, held_at_start: 9000 }));
        assert!(!cold(Measured { peak: 0, held_at_start: 1 }));
        // A 5.44 GiB LoRA set on the device through a render is not the render's.
        let with_set = Measured { peak: 5570 + 6660, held_at_start: 5570 + 300 };
        assert!(!cold(with_set));
        assert_eq!(with_set.less_held(5570), Measured { peak: 6660, held_at_start: 300 });
        assert!(cold(with_set.less_held(5570)));
    }
}

/// Measures renders above a floor: what the process holds with its arenas shrunk.
///
/// A [`PeakWindow`] sees only growth, and an arena reuses what it already holds, so a render
/// that fits in memory cached by an earlier one looks free. A render that starts from arenas
/// shrunk back to nothing needs what it adds above the process's usage at that point, the
/// floor: the models and what the libraries keep outside the arenas once they have loaded
/// them, which grows as new kernels are first used (CUDA modules, cuDNN's runtime-compiled
/// kernels per shape; deploy/gpu/RESULTS.md has its size on an H200). A render that loads such
/// kernels leaves the floor higher, so the floor is read
/// again after it (`note_floor`, right after a shrink) and its need is its peak above that. The
/// floor starts at the post-load baseline; where the probe's usage does not fall on a shrink
/// ([`GpuProbe::frees_on_shrink`]) it stays there.
pub struct PeakMeter {
    probe: std::sync::Arc<dyn GpuProbe>,
    baseline: u64,
    /// Bytes above the baseline at the last reading with shrunk arenas.
    floor: std::sync::atomic::AtomicU64,
}

/// One measured render, bytes above the post-load baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// The highest usage during the render.
    pub peak: u64,
    /// What the arenas already held when it started.
    pub held_at_start: u64,
}

impl Measured {
    /// The render's own need above `floor` (bytes above the baseline, from
    /// [`PeakMeter::floor`]), and whether it can be trusted: the render started from (nearly)
    /// shrunk arenas, what it held above the floor then under 1/20 of the need. One that
    /// started beside a larger job's cache reads that cache too.
    pub fn need_over(&self, floor: u64) -> (u64, bool) {
        let need = self.peak.saturating_sub(floor);
        (need, self.held_at_start.saturating_sub(floor).saturating_mul(20) <= need)
    }

    /// The measurement without `bytes` that something else held on the device through the
    /// whole render (the LoRA pool's sets): the render's own.
    pub fn less_held(self, bytes: u64) -> Measured {
        Measured { peak: self.peak.saturating_sub(bytes), held_at_start: self.held_at_start.saturating_sub(bytes) }
    }
}

impl PeakMeter {
    /// Takes the baseline now: call it right after the models load, before any render.
    ///
    /// # Errors
    ///
    /// The probe could not read the usage.
    pub fn new(probe: std::sync::Arc<dyn GpuProbe>) -> Result<Self, ProbeError> {
        let baseline = probe.start_peak()?;
        probe.peak_since_start()?;
        Ok(Self { probe, baseline, floor: std::sync::atomic::AtomicU64::new(0) })
    }

    /// The floor renders are measured from, bytes above the post-load baseline.
    pub fn floor(&self) -> u64 {
        self.floor.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads the process right after its arenas were shrunk: that usage is the new floor
    /// (returned, bytes above the baseline). Call it only with every arena shrunk and nothing
    /// rendering.
    ///
    /// # Errors
    ///
    /// The usage could not be read.
    pub fn note_floor(&self) -> Result<u64, ProbeError> {
        if !self.probe.frees_on_shrink() {
            return Ok(self.floor());
        }
        let now = self.probe.start_peak()?;
        self.probe.peak_since_start()?;
        let floor = now.saturating_sub(self.baseline);
        self.floor.store(floor, std::sync::atomic::Ordering::Relaxed);
        Ok(floor)
    }

    /// Runs `work` once and returns its output with its measurement, or why the peak could not
    /// be read (the work runs either way). One measurement at a time per process (the probe's
    /// high-water mark is process-wide).
    pub fn measure<T>(&self, work: impl FnOnce() -> T) -> (T, Result<Measured, ProbeError>) {
        let started = self.probe.start_peak();
        let output = work();
        let measured = started.and_then(|start| {
            let peak = self.probe.peak_since_start()?;
            Ok(Measured { peak: peak.saturating_sub(self.baseline), held_at_start: start.saturating_sub(self.baseline) })
        });
        (output, measured)
    }
}
