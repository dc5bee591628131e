//! Failed records: the headers that say why a job failed, and the reasons.
//!
//! A failed record is the job's original payload (byte for byte, with its `Content-Type`)
//! published to `shots.failed.<prio>.<project>`, so it can be replayed as it was sent.

use std::fmt;
use std::str::FromStr;

/// Why a job failed (`Shotfleet-Reason`).
pub const REASON: &str = "Shotfleet-Reason";
/// What exactly went wrong, for a person (`Shotfleet-Detail`), one line.
pub const DETAIL: &str = "Shotfleet-Detail";
/// The subject the job was taken from (`Shotfleet-Original-Subject`), where replay sends it.
pub const ORIGINAL_SUBJECT: &str = "Shotfleet-Original-Subject";
/// Deliveries the job had (`Shotfleet-Attempts`).
pub const ATTEMPTS: &str = "Shotfleet-Attempts";
/// The worker that gave up on it (`Shotfleet-Worker`).
pub const WORKER: &str = "Shotfleet-Worker";
/// The job's id, when the payload could be decoded (`Shotfleet-Job-Id`).
pub const JOB_ID: &str = "Shotfleet-Job-Id";
/// The payload's content type, as the producer sent it.
pub const CONTENT_TYPE: &str = "Content-Type";

/// Why a job ended in the failed stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureReason {
    /// The payload cannot be decoded or breaks the contract; never retried.
    Invalid,
    /// Out of memory below the job's floor.
    Oom,
    /// Failed on every delivery (upload, publish, timeout ...).
    MaxDeliveries,
    /// Present at repeated driver faults.
    Driver,
}

impl FailureReason {
    pub const ALL: [FailureReason; 4] = [Self::Invalid, Self::Oom, Self::MaxDeliveries, Self::Driver];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::Oom => "oom",
            Self::MaxDeliveries => "max_deliveries",
            Self::Driver => "driver",
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FailureReason {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| {
            format!("unknown failure reason `{s}`; expected invalid, oom, max_deliveries or driver")
        })
    }
}

/// Makes a detail text fit a header: one line, bounded, no control characters.
pub fn header_safe(detail: &str) -> String {
    const MAX: usize = 1000;
    let mut line: String =
        detail.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if line.len() > MAX {
        let mut cut = MAX;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
        line.push('…');
    }
    line
}
