//! What a failure means for the job and the worker: every error of a job's steps comes down to
//! one [`ErrorKind`], and `worker::settle` turns the kind into ack, nak, term with a failed
//! record, degrade, or stopping the worker.
//!
//! | kind | examples | what the worker does |
//! | --- | --- | --- |
//! | [`Invalid`](ErrorKind::Invalid) | size not a multiple of 8, a prompt the tokenizer refuses, an input shape the model refuses | failed record (reason `invalid`), then `term`; never retried |
//! | [`Oom`](ErrorKind::Oom) | ORT's BFC arena full, `CUDA failure 2: out of memory`, cuBLAS/cuDNN allocation failures | while rendering: shrink, learn, give back on the job's first out-of-memory (a roomier worker may take it), then smaller UNet batches and a tiled VAE in place; what reaches `settle` is out of memory one image at a time: re-publish one rung down, or fail `oom` below the floor |
//! | [`Transient`](ErrorKind::Transient) | upload or publish error, a model output the pipeline cannot use, anything unrecognised | a failed attempt: nak with backoff; at `max_failures`, failed record (reason `attempts`) |
//! | [`Timeout`](ErrorKind::Timeout) | the job's time limit stopped the render (`RunOptions::terminate`) | as transient |
//! | [`GiveBack`](ErrorKind::GiveBack) | no room now, the worker stopping, a first out-of-memory | nak after the delay; not a failed attempt |
//! | [`DriverFault`](ErrorKind::DriverFault) | illegal address, launch failure, uncorrectable ECC, "GPU has fallen off the bus", CUDA 999, NVML `GpuLost` | nak at once (failed record `driver` when present at repeated faults), stop fetching, exit with [`EXIT_DRIVER_FAULT`] |
//! | [`StoreUnusable`](ErrorKind::StoreUnusable) | credentials refused, permission denied, the bucket gone | when the store's start-up probe fails too: nak at once (not a failed attempt: the job is fine), stop fetching, not ready, exit with [`EXIT_STORE`]; when it passes, the refusal is of the job's keys: a failed attempt |
//! | [`LibraryUnusable`](ErrorKind::LibraryUnusable) | the LoRA library's store refuses (credentials, permissions) | as a store that refuses everything: nak at once, stop, exit with [`EXIT_STORE`] |
//!
//! A CUDA context that saw a driver fault is unusable for the life of the process (CUDA's
//! "sticky" errors), so nothing short of a new process recovers: hence the exit.
//!
//! The classifiers read ONNX Runtime's text because that is all ONNX Runtime gives: a CUDA
//! failure inside a kernel reaches the caller as status FAIL with the CUDA (or cuBLAS, cuDNN)
//! message embedded. See [`classify`] for the texts matched and where each comes from.

pub mod classify;

use std::time::Duration;

pub use classify::{classify_nvml, classify_render, classify_text};

/// What a failure means; see the module's table for what the worker does with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The job itself cannot be rendered; retrying cannot help.
    Invalid,
    /// Not enough memory for this job at this size on this worker now.
    Oom,
    /// Might work on a retry (here or elsewhere); counts as a failed attempt.
    Transient,
    /// The job ran past its time limit; counts as a failed attempt.
    Timeout,
    /// Nothing failed: the job is handed back, to be delivered again after `after`.
    GiveBack { after: Duration },
    /// The GPU or its driver is broken for this process.
    DriverFault,
    /// The object store refuses every job (credentials, permissions, a missing bucket).
    StoreUnusable,
    /// The LoRA library refuses (its store's credentials or permissions): the operator's to
    /// fix, never the job's.
    LibraryUnusable,
}

impl ErrorKind {
    /// A short lowercase name for logs and metrics labels.
    pub fn reason(self) -> &'static str {
        match self {
            ErrorKind::Invalid => "invalid",
            ErrorKind::Oom => "oom",
            ErrorKind::Transient => "transient",
            ErrorKind::Timeout => "timeout",
            ErrorKind::GiveBack { .. } => "give_back",
            ErrorKind::DriverFault => "driver",
            ErrorKind::StoreUnusable => "store_unusable",
            ErrorKind::LibraryUnusable => "library_unusable",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.reason())
    }
}

/// Why one step of a job did not complete; its [`ErrorKind`] decides how the job ends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct JobError {
    pub kind: ErrorKind,
    /// For a person: what happened, naming the step.
    pub detail: String,
}

impl JobError {
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> Self {
        Self { kind, detail: detail.into() }
    }

    pub fn invalid(detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, detail)
    }

    pub fn transient(detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Transient, detail)
    }

    pub fn give_back(after: Duration, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::GiveBack { after }, detail)
    }

    /// A store error as a job error: permanent refusals stop the worker, an unsafe key makes
    /// the job invalid, the rest is worth another attempt.
    pub fn store(step: &str, error: &crate::store::StoreError) -> Self {
        use crate::store::StoreErrorKind;
        let kind = match error.kind() {
            StoreErrorKind::Permanent => ErrorKind::StoreUnusable,
            StoreErrorKind::InvalidKey => ErrorKind::Invalid,
            _ => ErrorKind::Transient,
        };
        Self::new(kind, format!("{step}: {error}"))
    }
}

/// How a failed start-up step reads: "cannot {step}: {detail}", or `detail` alone where it
/// already says so ("cannot connect to NATS at ...": the step is not said twice).
pub(crate) fn cannot(step: &str, detail: &str) -> String {
    if detail.starts_with(&format!("cannot {step}")) { detail.to_owned() } else { format!("cannot {step}: {detail}") }
}

/// Exit status for a configuration the worker cannot start with (clap's usage errors exit 2
/// too): restarting will not help until a person fixes it. systemd:
/// `RestartPreventExitStatus=2`.
pub const EXIT_CONFIG: i32 = 2;

/// Exit status when a start-up step failed that may pass (NATS, the store unreachable,
/// calibration): the supervisor may retry with backoff. A model folder that is wrong exits with
/// [`EXIT_CONFIG`], a store that refuses for good with [`EXIT_STORE`].
pub const EXIT_START: i32 = 3;

/// Exit status after a driver fault: the GPU context is gone, restart the worker (and count
/// the restarts: a card that keeps faulting needs a person). 75 is `EX_TEMPFAIL` in
/// `sysexits.h`; systemd: `RestartForceExitStatus=75`.
pub const EXIT_DRIVER_FAULT: i32 = 75;

/// Exit status of a planned restart (suspected leak, or the configured number of jobs
/// reached, in-flight work finished first): not a failure, restart at once.
pub const EXIT_RESTART: i32 = 76;

/// Exit status when the card holds none of the classes the worker may serve (not even its
/// smallest probe): a restart will not help until the card, its share (`max_mib`), the other
/// processes on it or `classes` change. 78 is `EX_CONFIG` in `sysexits.h`; systemd:
/// `RestartPreventExitStatus=2 78`.
pub const EXIT_NOTHING_FITS: i32 = 78;

/// Exit status when the object store refused for good, at start or while serving (credentials revoked,
/// permission denied, the bucket deleted): the worker gave its jobs back; restarting helps
/// only once an operator fixed the store. 77 is `EX_NOPERM` in `sysexits.h`.
pub const EXIT_STORE: i32 = 77;
