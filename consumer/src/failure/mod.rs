//! What a failure means for the job and the worker: every error of a render (or of NVML) comes
//! down to one [`ErrorKind`], and the kind decides ack, nak, degrade, fail or stop.
//!
//! | kind | examples | what the worker does |
//! | --- | --- | --- |
//! | [`Invalid`](ErrorKind::Invalid) | size not a multiple of 8, a prompt the tokenizer refuses, an input shape the model refuses | publish to `shots.failed.<prio>.<project>` with its headers, then `term`; never retried |
//! | [`Oom`](ErrorKind::Oom) | ORT's BFC arena full, `CUDA failure 2: out of memory`, cuBLAS/cuDNN allocation failures, cuDNN refusing a too-large tensor | shrink the arena (rebuild sessions if they are poisoned); first time nak with a short delay (a roomier worker may take it at full quality) and correct the estimate; again: the degrade ladder (smaller UNet batches, tiled VAE, in place; then republish one rung down) |
//! | [`Transient`](ErrorKind::Transient) | upload or publish error, a model output the pipeline cannot use, anything unrecognised | nak with backoff; after `max_deliver`, the failed stream |
//! | [`DriverFault`](ErrorKind::DriverFault) | illegal address, launch failure, uncorrectable ECC, "GPU has fallen off the bus", CUDA 999, NVML `GpuLost` | stop fetching, nak in-flight jobs at once, record the fault, exit with [`EXIT_DRIVER_FAULT`] so the supervisor restarts the worker; a job present at repeated faults goes to the failed stream with reason `driver` |
//! | [`Timeout`](ErrorKind::Timeout) | the job's time limit stopped the render (`RunOptions::terminate`) | as transient |
//!
//! A CUDA context that saw a driver fault is unusable for the life of the process (CUDA's
//! "sticky" errors), so nothing short of a new process recovers: hence the exit.
//!
//! The classifiers read ONNX Runtime's text because that is all ONNX Runtime gives: a CUDA
//! failure inside a kernel reaches the caller as status FAIL with the CUDA (or cuBLAS, cuDNN)
//! message embedded. See [`classify`] for the texts matched and where each comes from.

pub mod classify;

pub use classify::{classify_nvml, classify_render, classify_text};

/// What a failure means; see the module's table for what the worker does with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The job itself cannot be rendered; retrying cannot help.
    Invalid,
    /// Not enough memory for this job at this size on this worker now.
    Oom,
    /// Might work on a retry (here or elsewhere).
    Transient,
    /// The GPU or its driver is broken for this process.
    DriverFault,
    /// The job ran past its time limit.
    Timeout,
}

impl ErrorKind {
    /// A short lowercase name for logs, metrics labels and the `Shotfleet-Reason` header
    /// (`driver` as DESIGN.md names it).
    pub fn reason(self) -> &'static str {
        match self {
            ErrorKind::Invalid => "invalid",
            ErrorKind::Oom => "oom",
            ErrorKind::Transient => "transient",
            ErrorKind::DriverFault => "driver",
            ErrorKind::Timeout => "timeout",
        }
    }

    /// Whether the job may be delivered again (nak) rather than failed at once.
    pub fn is_retryable(self) -> bool {
        !matches!(self, ErrorKind::Invalid)
    }

    /// Whether the process must stop taking work and exit with [`EXIT_DRIVER_FAULT`].
    pub fn stops_the_worker(self) -> bool {
        self == ErrorKind::DriverFault
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.reason())
    }
}

/// Exit status after a driver fault: the GPU context is gone, restart the worker (and count
/// the restarts: a card that keeps faulting needs a person). 75 is `EX_TEMPFAIL` in
/// `sysexits.h`; systemd: `RestartForceExitStatus=75`.
pub const EXIT_DRIVER_FAULT: i32 = 75;

/// Exit status of a planned restart (suspected leak, or the configured number of jobs
/// reached, in-flight work finished first): not a failure, restart at once.
pub const EXIT_RESTART: i32 = 76;

/// Exit status for a configuration or model folder the worker cannot start with: restarting
/// will not help until a person fixes it. 78 is `EX_CONFIG`; systemd:
/// `RestartPreventExitStatus=78`.
pub const EXIT_CONFIG: i32 = 78;
