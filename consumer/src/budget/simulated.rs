//! A configured stand-in for a GPU, for CPU runs and tests.
//!
//! Its memory is real where it can be: "used" is this process's resident memory (Linux
//! `VmRSS`) plus what other processes are configured to hold, and a render's peak is the
//! kernel's high-water mark (`VmHWM`, reset through `/proc/self/clear_refs`). So a CPU render of
//! the tiny model exercises the same budget arithmetic, calibration and learning as a card.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::config::{MIB, SimulateConfig};
use super::lock;
use super::probe::{GpuProbe, GpuSnapshot, PeakSampler, ProbeError};

const STATUS: &str = "/proc/self/status";
const CLEAR_REFS: &str = "/proc/self/clear_refs";
/// Sampling interval of the fallback where the high-water mark cannot be reset.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// The device name of every simulation; fingerprints made on it never match a real card.
pub const SIMULATED_DEVICE: &str = "simulated (cpu)";

/// A simulated GPU. Tests keep an `Arc` of it to change [`set_others_used`](Self::set_others_used)
/// while the budget holds it as a [`GpuProbe`].
pub struct SimulatedGpu {
    total: u64,
    others_used: AtomicU64,
    peak: Mutex<Option<Peak>>,
}

/// How the running peak measurement is read back.
enum Peak {
    /// The kernel keeps the mark; `VmHWM` is read at the end.
    HighWaterMark,
    /// `clear_refs` was refused (some sandboxes forbid it): a thread samples `VmRSS` instead,
    /// which can miss a spike shorter than its interval.
    Sampled(PeakSampler),
}

impl SimulatedGpu {
    /// # Errors
    ///
    /// [`ProbeError::Proc`] where this process's memory cannot be read (not Linux).
    pub fn new(config: &SimulateConfig) -> Result<Self, ProbeError> {
        resident_bytes()?;
        Ok(Self {
            total: config.total_mib * MIB,
            others_used: AtomicU64::new(config.others_used_mib * MIB),
            peak: Mutex::new(None),
        })
    }

    /// Pretends other processes now hold `bytes` of the card.
    pub fn set_others_used(&self, bytes: u64) {
        self.others_used.store(bytes, Ordering::Relaxed);
    }

    pub fn others_used(&self) -> u64 {
        self.others_used.load(Ordering::Relaxed)
    }
}

impl GpuProbe for SimulatedGpu {
    fn snapshot(&self) -> Result<GpuSnapshot, ProbeError> {
        let own = resident_bytes()?;
        let used = own + self.others_used();
        Ok(GpuSnapshot {
            device: SIMULATED_DEVICE.to_owned(),
            total: self.total,
            used,
            free: self.total.saturating_sub(used),
            own_used: Some(own),
            utilization: None,
            temperature_c: None,
        })
    }

    fn start_peak(&self) -> Result<u64, ProbeError> {
        let mut peak = lock(&self.peak);
        if let Some(Peak::Sampled(old)) = peak.take() {
            old.finish();
        }
        // Writing 5 resets the high-water mark to the current resident size (proc(5)).
        let mode = match std::fs::write(CLEAR_REFS, "5") {
            Ok(()) => Peak::HighWaterMark,
            Err(_) => {
                let first = resident_bytes()?;
                Peak::Sampled(PeakSampler::start(SAMPLE_EVERY, first, || resident_bytes().ok()))
            }
        };
        let start = resident_bytes()?;
        *peak = Some(mode);
        Ok(start)
    }

    fn peak_since_start(&self) -> Result<u64, ProbeError> {
        match lock(&self.peak).take() {
            None => Err(ProbeError::PeakNotStarted),
            Some(Peak::HighWaterMark) => status_bytes("VmHWM"),
            Some(Peak::Sampled(sampler)) => Ok(sampler.finish()),
        }
    }

    /// The resident size keeps the pages a shrunk CPU arena freed (the C allocator holds them
    /// for reuse), so it says nothing of what the process keeps outside its arenas.
    fn frees_on_shrink(&self) -> bool {
        false
    }
}

/// This process's resident memory, bytes.
fn resident_bytes() -> Result<u64, ProbeError> {
    status_bytes("VmRSS")
}

/// A `kB` line of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> Result<u64, ProbeError> {
    let text = std::fs::read_to_string(STATUS)
        .map_err(|err| ProbeError::Proc { path: STATUS, detail: format!("cannot read: {err}") })?;
    parse_status_kib(&text, field)
        .map(|kib| kib * 1024)
        .ok_or_else(|| ProbeError::Proc { path: STATUS, detail: format!("no `{field}: N kB` line") })
}

fn parse_status_kib(status: &str, field: &str) -> Option<u64> {
    let line = status.lines().find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))?;
    line.trim().strip_suffix("kB")?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_parse_in_kib() {
        let status = "Name:\tx\nVmHWM:\t  218328 kB\nVmRSS:\t   13524 kB\n";
        assert_eq!(parse_status_kib(status, "VmRSS"), Some(13524));
        assert_eq!(parse_status_kib(status, "VmHWM"), Some(218_328));
        assert_eq!(parse_status_kib(status, "VmSwap"), None);
        assert_eq!(parse_status_kib("VmRSSx:\t1 kB", "VmRSS"), None);
    }
}
