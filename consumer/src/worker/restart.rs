//! What a restarting worker keeps of its place in the fleet while it loads and calibrates.
//!
//! Every worker sends a job down the degrade ladder when no live worker admits its class and it
//! has waited `[degrade] handoff` (unserved.rs). A worker restarting (a deploy, a driver fault, a
//! crash) answers pings at once but admits nothing until its models are loaded and its budget
//! calibrated, which on a card can take longer than the handoff: its classes' jobs would then be
//! degraded by a smaller card while the roomy one was seconds from taking them.
//!
//! So a worker that becomes ready writes the classes it admits to its state folder, and on its
//! next start it takes that record and answers pings with those classes, marked `starting`, for
//! at most `[degrade] restart_grace`. Taking stamps the record with the time of that first take,
//! and the grace counts from the stamp: a start that fails on something passing (the store or
//! NATS away for a moment) keeps the rest of its grace for the start after it, while a series of
//! starts that never becomes ready (a broken card, a model that no longer loads, a crash loop)
//! holds no class for longer than one grace in all. Becoming ready writes a fresh record.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use shotfleet_schema::MemoryClass;
use shotfleet_schema::progress::{GpuMemory, WorkerState};
use tracing::{info, warn};

use crate::worker::commit::now_ms;

/// The record of one worker id's last ready start, in its state folder.
pub struct LastServed {
    path: PathBuf,
    worker_id: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Record {
    worker: String,
    admits: Vec<MemoryClass>,
    at_ms: u64,
    /// When a start first took this record: the grace counts from here (absent until taken).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    taken_at_ms: Option<u64>,
}

/// What a start holds from the record of the last ready one: the classes, and how long ago the
/// first start since then took them (its grace counts from there).
#[derive(Debug, Default, PartialEq)]
pub struct Held {
    pub classes: Vec<MemoryClass>,
    pub taken_ago: Duration,
}

impl LastServed {
    /// `worker_id`'s record in `state_dir` (a digest of the id names the file: ids hold slashes).
    pub fn new(state_dir: &Path, worker_id: &str) -> Self {
        let digest = hex::encode(Sha256::digest(worker_id.as_bytes()));
        Self { path: state_dir.join(format!("last-served-{}.json", &digest[..16])), worker_id: worker_id.to_owned() }
    }

    /// The classes the last ready start admitted that this start still serves, and how long ago a
    /// start first took them; stamps the record with this take when it is the first. Nothing when
    /// there is no record, it is unreadable (then removed) or another worker's.
    pub fn take(&self, serves: &[MemoryClass]) -> Held {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Held::default(),
            Err(e) => {
                warn!(path = %self.path.display(), error = %e, "cannot read the record of the last start; holding no class while starting");
                return Held::default();
            }
        };
        let mut record = match serde_json::from_str::<Record>(&text) {
            Ok(record) if record.worker == self.worker_id => record,
            Ok(_) => return Held::default(),
            Err(e) => {
                warn!(path = %self.path.display(), error = %e, "the record of the last start is not readable; holding no class while starting");
                let _ = std::fs::remove_file(&self.path);
                return Held::default();
            }
        };
        let now = now_ms();
        let taken_at = match record.taken_at_ms {
            Some(at) if at <= now => at,
            // Unstamped, or stamped ahead of this clock (it stepped back): stamped now, or every
            // start until the clock passes the stamp would begin a fresh grace.
            _ => {
                record.taken_at_ms = Some(now);
                if let Err(e) = self.write(&record) {
                    // Unstamped, every start would begin a fresh grace: a crash loop would hold its
                    // classes for good.
                    warn!(path = %self.path.display(), error = %e, "cannot stamp the record of the last start; holding no class while starting");
                    return Held::default();
                }
                now
            }
        };
        let classes = record.admits.into_iter().filter(|c| serves.contains(c)).collect();
        Held { classes, taken_ago: Duration::from_millis(now - taken_at) }
    }

    /// Writes what this worker admits: once it is ready, and again as it stops (an out-of-memory
    /// may have taken a class from it since). A failure is logged: the next start then holds no
    /// class while it starts, as before this record existed. Records not written for
    /// [`STALE_AFTER`] go: on a shared state folder every worker id that ever served leaves one
    /// (a Kubernetes pod's id is its name).
    pub fn record(&self, admits: &[MemoryClass]) {
        if let Some(dir) = self.path.parent() {
            remove_stale(dir);
        }
        let record = Record { worker: self.worker_id.clone(), admits: admits.to_vec(), at_ms: now_ms(), taken_at_ms: None };
        if let Err(e) = self.write(&record) {
            warn!(path = %self.path.display(), error = %e, "cannot write the record of this start; a restart will hold no class while starting");
        }
    }

    /// Replaces the record whole (a rename: a reader never sees half of one).
    fn write(&self, record: &Record) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(record).expect("records serialize"))?;
        std::fs::rename(&tmp, &self.path)
    }
}

/// How old a record of another start may grow before a worker writing its own removes it.
pub const STALE_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

/// Removes the records in `dir` last written over [`STALE_AFTER`] ago.
fn remove_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let stale = entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE_AFTER));
        if stale && name.to_string_lossy().starts_with("last-served-") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A worker's answer to pings while it starts.
pub struct Starting {
    worker: String,
    serves: Vec<MemoryClass>,
    holds: Vec<MemoryClass>,
    started: Instant,
    grace: Duration,
}

impl Starting {
    /// `held` (from [`LastServed::take`]) for what is left of `grace` since it was first taken.
    pub fn new(worker: &str, serves: &[MemoryClass], held: Held, grace: Duration) -> Self {
        let names = held.classes.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(",");
        let left = grace.saturating_sub(held.taken_ago);
        if !held.classes.is_empty() && !left.is_zero() {
            info!(classes = %names, grace_s = left.as_secs_f64(), "restarting: the fleet leaves the classes this worker admitted to it while it starts");
        } else if !held.classes.is_empty() && !grace.is_zero() {
            info!(classes = %names, "starting: no classes held meanwhile (the starts since this worker last became ready used up its grace)");
        } else if !grace.is_zero() {
            info!("starting: no classes held meanwhile (no record of a start that became ready, under this worker_id and state_dir)");
        }
        Self { worker: worker.to_owned(), serves: serves.to_vec(), holds: held.classes, started: Instant::now(), grace: left }
    }

    /// What a ping hears: no job taken, and the classes held while the grace lasts.
    pub fn state(&self) -> WorkerState {
        WorkerState {
            v: shotfleet_schema::VERSION,
            worker: self.worker.clone(),
            device: "(starting)".into(),
            serves: self.serves.clone(),
            admits: if self.started.elapsed() < self.grace { self.holds.clone() } else { Vec::new() },
            gpu: GpuMemory::default(),
            in_flight: 0,
            taking_jobs: false,
            starting: true,
            at_ms: now_ms(),
        }
    }
}

#[cfg(test)]
mod tests {
    use MemoryClass::{L, M, S, Xl};

    use super::*;

    #[test]
    fn a_start_holds_what_the_last_ready_start_admitted_for_one_grace_in_all() {
        let dir = tempfile::tempdir().unwrap();
        let last = LastServed::new(dir.path(), "host/gpu0");
        assert_eq!(last.take(&[S, M, L]), Held::default(), "no record yet");
        last.record(&[S, M, L]);
        // Classes no longer served are not held.
        let first = last.take(&[S, M]);
        assert_eq!(first.classes, [S, M]);
        assert!(first.taken_ago < Duration::from_secs(5));
        // A start that failed before it became ready: the next holds the same classes, its grace
        // counted from the first take (here stamped ten minutes back).
        let mut record: Record = serde_json::from_slice(&std::fs::read(&last.path).unwrap()).unwrap();
        record.taken_at_ms = Some(now_ms() - 600_000);
        last.write(&record).unwrap();
        let again = last.take(&[S, M, L]);
        assert_eq!(again.classes, [S, M, L]);
        assert!(again.taken_ago >= Duration::from_secs(600));
        let state = Starting::new("host/gpu0", &[S, M, L], again, Duration::from_secs(300)).state();
        assert!(state.starting && state.admits.is_empty(), "a grace of 5 min used up ten minutes ago");
        // A stamp ahead of the clock (it stepped back) is stamped again now, not trusted.
        record.taken_at_ms = Some(now_ms() + 3_600_000);
        last.write(&record).unwrap();
        assert!(last.take(&[S]).taken_ago < Duration::from_secs(5));
        let restamped: Record = serde_json::from_slice(&std::fs::read(&last.path).unwrap()).unwrap();
        assert!(restamped.taken_at_ms.unwrap() <= now_ms());
        // Becoming ready writes a fresh record: the next start holds for a whole grace again.
        last.record(&[M]);
        let fresh = last.take(&[S, M, L]);
        assert_eq!(fresh.classes, [M]);
        assert!(fresh.taken_ago < Duration::from_secs(5));
    }

    #[test]
    fn another_workers_record_or_a_broken_one_holds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        LastServed::new(dir.path(), "a").record(&[M]);
        let a = LastServed::new(dir.path(), "a");
        let b = LastServed::new(dir.path(), "b");
        assert_eq!(b.take(&[M]), Held::default(), "b has its own file");
        b.write(&Record { worker: "a".into(), admits: vec![M], at_ms: 0, taken_at_ms: None }).unwrap();
        assert_eq!(b.take(&[M]), Held::default(), "a record naming another worker");
        std::fs::write(&a.path, b"{ not json").unwrap();
        assert_eq!(a.take(&[M]), Held::default());
        assert!(!a.path.exists(), "a broken record is removed");
    }

    #[test]
    fn records_nobody_took_for_a_week_go_when_another_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let old = LastServed::new(dir.path(), "pod-gone");
        old.record(&[M]);
        let week_ago = std::time::SystemTime::now() - STALE_AFTER - Duration::from_secs(60);
        std::fs::File::options().write(true).open(&old.path).unwrap().set_modified(week_ago).unwrap();
        let recent = LastServed::new(dir.path(), "pod-recent");
        recent.record(&[M]);
        let unrelated = dir.path().join("fingerprint-0123.json");
        std::fs::write(&unrelated, b"{}").unwrap();
        std::fs::File::options().write(true).open(&unrelated).unwrap().set_modified(week_ago).unwrap();
        LastServed::new(dir.path(), "pod-new").record(&[S]);
        assert!(!old.path.exists(), "a record a week old goes");
        assert!(recent.path.exists() && unrelated.exists(), "a recent record and other files stay");
    }

    #[test]
    fn a_starting_worker_holds_its_classes_for_the_grace_only() {
        let held = || Held { classes: vec![S, M], taken_ago: Duration::ZERO };
        let holding = Starting::new("w", &[S, M, Xl], held(), Duration::from_secs(60)).state();
        assert!(holding.starting && !holding.taking_jobs);
        assert_eq!(holding.admits, [S, M]);
        assert_eq!(holding.serves, [S, M, Xl]);
        let over = Starting::new("w", &[S, M], held(), Duration::ZERO).state();
        assert!(over.starting && over.admits.is_empty());
    }
}
