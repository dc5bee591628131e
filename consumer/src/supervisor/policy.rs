//! What a worker's exit means for it: restart it (after how long), or leave it stopped.
//!
//! | exit | meaning (`failure/mod.rs`) | the supervisor |
//! | --- | --- | --- |
//! | 2 | bad configuration, or a model folder that is wrong | leaves it stopped: a person must fix the config or the folder |
//! | 78 | the card holds none of the worker's classes | leaves it stopped: the card, its share or `classes` must change |
//! | 76 | the leak guard asks for a restart | restarts at once; again after a quick exit, with backoff |
//! | 75 | driver fault | restarts with backoff (a card that keeps faulting is retried every `max_restart_backoff`) |
//! | 3 | a start-up step failed that may pass (NATS, the store unreachable, the GPU) | restarts with backoff: a server coming back helps |
//! | 77 | the object store refused for good, at start or while serving | restarts after `store_backoff` at least: the store is the box's, not the card's |
//! | 0, others, a signal | stopped by someone else, a crash, the OOM killer | restarts with backoff: the box keeps one worker per card |
//!
//! Backoff: `restart_backoff` doubled for each quick exit before this one (up to
//! `max_restart_backoff`); a worker that ran `stable_after` starts afresh.

use std::fmt;
use std::process::ExitStatus;
use std::time::Duration;

use crate::failure::{EXIT_CONFIG, EXIT_DRIVER_FAULT, EXIT_NOTHING_FITS, EXIT_RESTART, EXIT_START, EXIT_STORE};

use super::config::SupervisorConfig;

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    /// Killed by this signal (SIGKILL from the OOM killer, SIGSEGV, ...).
    Signal(i32),
}

impl From<ExitStatus> for Exit {
    fn from(status: ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => Self::Code(code),
            (None, Some(signal)) => Self::Signal(signal),
            // Neither is only possible for a stopped process, which `wait` does not report.
            (None, None) => Self::Code(-1),
        }
    }
}

impl Exit {
    /// A lowercase name for logs and the restart metric's `reason` label.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Code(0) => "stopped",
            Self::Code(EXIT_CONFIG) => "bad_config",
            Self::Code(EXIT_START) => "start_failed",
            Self::Code(EXIT_DRIVER_FAULT) => "driver_fault",
            Self::Code(EXIT_RESTART) => "leak_guard",
            Self::Code(EXIT_STORE) => "store_unusable",
            Self::Code(EXIT_NOTHING_FITS) => "nothing_fits",
            Self::Code(_) => "crashed",
            Self::Signal(_) => "killed",
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Code(code) => write!(f, "exit {code} ({})", self.reason().replace('_', " ")),
            Self::Signal(signal) => write!(f, "killed by signal {signal}"),
        }
    }
}

/// What to do after an exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Restart { after: Duration },
    /// Restarting cannot help; the reason is for `/readyz` and the log.
    LeaveStopped { why: &'static str },
}

/// The restart rules with the box's delays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    pub backoff: Duration,
    pub max_backoff: Duration,
    pub store_backoff: Duration,
    pub stable_after: Duration,
}

impl From<&SupervisorConfig> for RestartPolicy {
    fn from(config: &SupervisorConfig) -> Self {
        Self {
            backoff: config.restart_backoff,
            max_backoff: config.max_restart_backoff,
            store_backoff: config.store_backoff,
            stable_after: config.stable_after,
        }
    }
}

impl RestartPolicy {
    /// The decision after `exit`, the worker's `quick_exits`-th quick exit in a row before this
    /// one (0: it had run `stable_after`, or this is its first exit).
    pub fn decide(&self, exit: Exit, quick_exits: u32) -> Decision {
        match exit {
            Exit::Code(EXIT_CONFIG) => Decision::LeaveStopped { why: "bad configuration: fix it, then restart the box" },
            Exit::Code(EXIT_NOTHING_FITS) => Decision::LeaveStopped {
                why: "the card holds none of the worker's classes: a larger card or `max_mib`, fewer other processes on it, or other `classes`",
            },
            // A planned restart, not a failure: at once, unless it keeps asking.
            Exit::Code(EXIT_RESTART) if quick_exits == 0 => Decision::Restart { after: Duration::ZERO },
            Exit::Code(EXIT_STORE) => Decision::Restart { after: self.backoff(quick_exits).max(self.store_backoff) },
            _ => Decision::Restart { after: self.backoff(quick_exits) },
        }
    }

    /// `backoff` doubled `quick_exits` times, at most `max_backoff`.
    fn backoff(&self, quick_exits: u32) -> Duration {
        let factor = 1u32.checked_shl(quick_exits.min(31)).unwrap_or(u32::MAX);
        self.backoff.saturating_mul(factor).min(self.max_backoff)
    }

    /// Whether a worker that ran `ran` exited quickly (its backoff keeps growing).
    pub fn quick(&self, ran: Duration) -> bool {
        ran < self.stable_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RestartPolicy {
        RestartPolicy::from(&SupervisorConfig::default())
    }

    fn after(decision: Decision) -> Duration {
        match decision {
            Decision::Restart { after } => after,
            Decision::LeaveStopped { why } => panic!("left stopped: {why}"),
        }
    }

    #[test]
    fn bad_configuration_and_a_card_that_holds_nothing_are_never_restarted() {
        for code in [EXIT_CONFIG, EXIT_NOTHING_FITS] {
            assert!(matches!(policy().decide(Exit::Code(code), 0), Decision::LeaveStopped { .. }), "{code}");
        }
    }

    #[test]
    fn driver_faults_start_failures_and_crashes_back_off_doubling_to_the_cap() {
        let policy = policy();
        for exit in [Exit::Code(EXIT_DRIVER_FAULT), Exit::Code(EXIT_START), Exit::Code(0), Exit::Code(1), Exit::Signal(9)] {
            let delays: Vec<u64> = (0..12).map(|n| after(policy.decide(exit, n)).as_secs()).collect();
            assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300], "{exit}");
        }
        assert_eq!(after(policy.decide(Exit::Code(EXIT_DRIVER_FAULT), u32::MAX)), Duration::from_secs(300));
    }

    #[test]
    fn the_leak_guard_restarts_at_once_unless_it_keeps_asking() {
        let policy = policy();
        assert_eq!(after(policy.decide(Exit::Code(EXIT_RESTART), 0)), Duration::ZERO);
        assert_eq!(after(policy.decide(Exit::Code(EXIT_RESTART), 1)), Duration::from_secs(2));
    }

    #[test]
    fn an_unusable_store_waits_long() {
        let policy = policy();
        assert_eq!(after(policy.decide(Exit::Code(EXIT_STORE), 0)), Duration::from_secs(300));
        let short = RestartPolicy { store_backoff: Duration::from_secs(30), ..policy };
        assert_eq!(after(short.decide(Exit::Code(EXIT_STORE), 6)), Duration::from_secs(64));
    }

    #[test]
    fn exits_read_as_the_worker_meant_them() {
        assert_eq!(Exit::Code(EXIT_DRIVER_FAULT).to_string(), "exit 75 (driver fault)");
        assert_eq!(Exit::Code(EXIT_NOTHING_FITS).to_string(), "exit 78 (nothing fits)");
        assert_eq!(Exit::Signal(9).to_string(), "killed by signal 9");
        assert!(policy().quick(Duration::from_secs(599)));
        assert!(!policy().quick(Duration::from_secs(600)));
    }
}
