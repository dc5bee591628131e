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
//! at most `[degrade] restart_grace`. Taking removes the record: a start that never becomes ready
//! (a broken card, a model that no longer loads) leaves nothing for the start after it, so a
//! worker crash-looping at start-up holds no class for longer than one grace.

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
}

impl LastServed {
    /// `worker_id`'s record in `state_dir` (a digest of the id names the file: ids hold slashes).
    pub fn new(state_dir: &Path, worker_id: &str) -> Self {
        let digest = hex::encode(Sha256::digest(worker_id.as_bytes()));
        Self { path: state_dir.join(format!("last-served-{}.json", &digest[..16])), worker_id: worker_id.to_owned() }
    }

    /// The classes the last ready start admitted that this start still serves, and removes the
    /// record. None when there is no record, it is unreadable or another worker's.
    pub fn take(&self, serves: &[MemoryClass]) -> Vec<MemoryClass> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                warn!(path = %self.path.display(), error = %e, "cannot read the record of the last start; holding no class while starting");
                return Vec::new();
            }
        };
        if let Err(e) = std::fs::remove_file(&self.path) {
            // Kept, it would let a start that never becomes ready hold classes on every restart.
            warn!(path = %self.path.display(), error = %e, "cannot remove the record of the last start; holding no class while starting");
            return Vec::new();
        }
        match serde_json::from_str::<Record>(&text) {
            Ok(record) if record.worker == self.worker_id => record.admits.into_iter().filter(|c| serves.contains(c)).collect(),
            Ok(_) => Vec::new(),
            Err(e) => {
                warn!(path = %self.path.display(), error = %e, "the record of the last start is not readable; holding no class while starting");
                Vec::new()
            }
        }
    }

    /// Writes what this worker admits: once it is ready, and again as it stops (an out-of-memory
    /// may have taken a class from it since). A failure is logged: the next start then holds no
    /// class while it starts, as before this record existed. Records nobody took for
    /// [`STALE_AFTER`] go: on a shared state folder every worker id that ever served leaves one
    /// (a Kubernetes pod's id is its name).
    pub fn record(&self, admits: &[MemoryClass]) {
        if let Some(dir) = self.path.parent() {
            remove_stale(dir);
        }
        let record = Record { worker: self.worker_id.clone(), admits: admits.to_vec(), at_ms: now_ms() };
        let write = || -> std::io::Result<()> {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = self.path.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_vec(&record).expect("records serialize"))?;
            std::fs::rename(&tmp, &self.path)
        };
        if let Err(e) = write() {
            warn!(path = %self.path.display(), error = %e, "cannot write the record of this start; a restart will hold no class while starting");
        }
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
    /// `holds` (from [`LastServed::take`]) for `grace` from now.
    pub fn new(worker: &str, serves: &[MemoryClass], holds: Vec<MemoryClass>, grace: Duration) -> Self {
        let names = holds.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(",");
        if !holds.is_empty() && !grace.is_zero() {
            info!(classes = %names, grace_s = grace.as_secs_f64(), "restarting: the fleet leaves the classes this worker admitted to it while it starts");
        } else if !grace.is_zero() {
            info!("starting: no classes held meanwhile (no record of a start that became ready, under this worker_id and state_dir)");
        }
        Self { worker: worker.to_owned(), serves: serves.to_vec(), holds, started: Instant::now(), grace }
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
    fn a_start_holds_what_the_last_ready_start_admitted_once() {
        let dir = tempfile::tempdir().unwrap();
        let last = LastServed::new(dir.path(), "host/gpu0");
        assert!(last.take(&[S, M, L]).is_empty(), "no record yet");
        last.record(&[S, M, L]);
        // Classes no longer served are not held.
        assert_eq!(last.take(&[S, M]), [S, M]);
        // Taken: a start that never becomes ready leaves nothing for the next.
        assert!(last.take(&[S, M, L]).is_empty());
    }

    #[test]
    fn another_workers_record_or_a_broken_one_holds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        LastServed::new(dir.path(), "a").record(&[M]);
        let a = LastServed::new(dir.path(), "a");
        let b = LastServed::new(dir.path(), "b");
        assert!(b.take(&[M]).is_empty(), "b has its own file");
        std::fs::write(&b.path, serde_json::to_vec(&Record { worker: "a".into(), admits: vec![M], at_ms: 0 }).unwrap()).unwrap();
        assert!(b.take(&[M]).is_empty(), "a record naming another worker");
        std::fs::write(&a.path, b"{ not json").unwrap();
        assert!(a.take(&[M]).is_empty());
        assert!(!a.path.exists(), "a broken record is removed too");
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
        let holding = Starting::new("w", &[S, M, Xl], vec![S, M], Duration::from_secs(60)).state();
        assert!(holding.starting && !holding.taking_jobs);
        assert_eq!(holding.admits, [S, M]);
        assert_eq!(holding.serves, [S, M, Xl]);
        let over = Starting::new("w", &[S, M], vec![S, M], Duration::ZERO).state();
        assert!(over.starting && over.admits.is_empty());
    }
}
