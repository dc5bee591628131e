//! Fault injection for tests: explicit configuration, off by default, loudly logged when on.
//!
//! The chaos and commit-protocol tests need a worker to die at an exact point (after upload,
//! after the result is published) or to produce bytes another worker would not (two GPU models
//! render the same job differently). Nothing here is ever chosen implicitly.

use std::time::Duration;

use serde::{Deserialize, Serialize};


/// Where a worker may be told to die, as SIGKILL would leave it: no ack, no cleanup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CrashPoint {
    /// Images uploaded, no result published.
    AfterUpload,
    /// Result published, message not acked.
    AfterPublish,
}

/// The `[faults]` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// Exit the process (code 137, as SIGKILL) at this point of the first job.
    pub crash_at: Option<CrashPoint>,
    /// Sleep this long between upload and publishing the result, without progress acks, so the
    /// server redelivers the job to another worker meanwhile.
    #[serde(default, with = "humantime_serde")]
    pub stall_before_publish: Option<Duration>,
    /// With `stall_before_publish`: first wait (at most two minutes) until another worker has
    /// committed the job, then the stall: a late publish however slowly the other one starts.
    pub stall_until_committed: bool,
    /// Add a text chunk naming this worker to every PNG, so two workers' renders of one job
    /// differ as renders on two GPU models do.
    pub mark_images: bool,
    /// Make the Nth render (1-based) fail with this real CUDA error text instead of rendering,
    /// e.g. `CUDA failure 999: unknown error`: the driver-fault path, without a broken GPU.
    pub driver_fault_on_render: Option<u32>,
    pub driver_fault_text: Option<String>,
    /// Leak this many MiB (allocated and touched, never freed) after every job: the leak guard's
    /// test signal.
    pub leak_mib_per_job: u64,
    /// Skip the render: every image is a fixed 1x1 PNG. Everything else of a job (admission,
    /// fetch, decode, upload, commit, sweep, ack) runs: the control plane's own cost, measured
    /// by `tests/benches/control_plane.rs`.
    pub noop_render: bool,
    /// Cap ONNX Runtime's CUDA arena (`gpu_mem_limit`, per session) at this many MiB without the
    /// budget knowing: a job the budget admits then runs out of device memory for real, which
    /// is how the out-of-memory path is rehearsed on a card too large to fill.
    pub arena_limit_mib: Option<u64>,
    /// Wait this long before loading the models: a start as long as a card's (models read from
    /// a slow disk, a cold calibration) with the tiny model, for the restart tests.
    #[serde(default, with = "humantime_serde")]
    pub slow_start: Option<Duration>,
}

impl FaultConfig {
    pub fn any(&self) -> bool {
        self.crash_at.is_some()
            || self.stall_before_publish.is_some()
            || self.stall_until_committed
            || self.mark_images
            || self.driver_fault_on_render.is_some()
            || self.leak_mib_per_job > 0
            || self.arena_limit_mib.is_some()
            || self.noop_render
            || self.slow_start.is_some()
    }

    /// The injected driver error for render number `n` (1-based), if any.
    pub fn driver_fault(&self, n: u32) -> Option<String> {
        (self.driver_fault_on_render == Some(n)).then(|| {
            self.driver_fault_text.clone().unwrap_or_else(|| {
                "CUDA failure 999: unknown error ; GPU=0 ; hostname=injected ; expr=cudaStreamSynchronize(stream);".into()
            })
        })
    }

    /// Leaks the configured amount, touching every page so it is resident.
    pub fn leak(&self) {
        if self.leak_mib_per_job > 0 {
            let bytes = vec![1u8; (self.leak_mib_per_job * 1024 * 1024) as usize];
            std::mem::forget(bytes);
        }
    }

    pub fn stall(&self) -> Option<Duration> {
        self.stall_before_publish
    }

    /// Dies here if told to.
    pub fn crash_point(&self, here: CrashPoint) {
        if self.crash_at == Some(here) {
            tracing::error!(point = ?here, "fault injection: exiting as if killed");
            std::process::exit(137);
        }
    }
}

/// Inserts a `tEXt` chunk (`keyword`, `text`) after the PNG's header chunk.
pub fn add_png_text(png: &[u8], keyword: &str, text: &str) -> Vec<u8> {
    // signature (8) + IHDR chunk (4 length + 4 type + 13 data + 4 crc)
    const AFTER_IHDR: usize = 8 + 25;
    let mut data = Vec::with_capacity(keyword.len() + 1 + text.len());
    data.extend_from_slice(keyword.as_bytes());
    data.push(0);
    data.extend_from_slice(text.as_bytes());
    let mut chunk = Vec::with_capacity(12 + data.len());
    chunk.extend_from_slice(&(data.len() as u32).to_be_bytes());
    chunk.extend_from_slice(b"tEXt");
    chunk.extend_from_slice(&data);
    let mut crc = crc32fast::Hasher::new();
    crc.update(b"tEXt");
    crc.update(&data);
    chunk.extend_from_slice(&crc.finalize().to_be_bytes());
    let mut out = png[..AFTER_IHDR].to_vec();
    out.extend_from_slice(&chunk);
    out.extend_from_slice(&png[AFTER_IHDR..]);
    out
}
