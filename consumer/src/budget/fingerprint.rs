//! Calibrated estimates on disk, so a restart skips the probe renders.
//!
//! An estimate holds for one card model, one model and one ONNX Runtime version: any change in
//! those changes the memory a render takes. Each key has its own file in the state directory, so
//! workers of different cards can share it and a card swapped back finds its old fingerprint.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::warn;

use super::estimate::Estimate;

/// Bumped when [`Estimate`]'s stored form or what it measures changes; other versions are
/// recalibrated. 2: four terms, probes from shrunk arenas. 3: five terms, size offsets. 4: needs
/// above the floor (what the process keeps outside its arenas), not above the models. 5: each
/// probe measured on its shape's second render (worker/calibrate.rs). 6: under `[budget]
/// cold_renders`, probes give the UNet's arena back before the decode, as the jobs do. 7: every
/// run thread is warmed while loading, so no probe pays a thread's first graph run; the batch
/// terms are fitted within sizes and a size's offset is carried from its own image counts.
const FORMAT: u32 = 7;

/// What an estimate is valid for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FingerprintKey {
    /// The card's name as the probe reports it (`NVIDIA H200`).
    pub device: String,
    /// The model: its folder name, or better a digest of its graphs.
    pub model: String,
    /// ONNX Runtime's version (`1.31.1`).
    pub runtime: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Fingerprint {
    format: u32,
    key: FingerprintKey,
    estimate: Estimate,
}

/// The state directory could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("fingerprint {path}: {source}")]
pub struct FingerprintError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Fingerprints in one directory, one JSON file per key.
#[derive(Debug, Clone)]
pub struct FingerprintStore {
    dir: PathBuf,
}

impl FingerprintStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Where `key`'s fingerprint lives: a digest of the key, since names hold spaces and slashes.
    pub fn path(&self, key: &FingerprintKey) -> PathBuf {
        let mut digest = Sha256::new();
        for part in [&key.device, &key.model, &key.runtime] {
            digest.update(part.as_bytes());
            digest.update([0]);
        }
        self.dir.join(format!("fingerprint-{}.json", &hex::encode(digest.finalize())[..16]))
    }

    /// The estimate stored for `key`, or `None` when there is none to trust: no file, another
    /// key in it, an older format, or unreadable JSON (all of which calibration mends).
    ///
    /// # Errors
    ///
    /// The file exists but cannot be read (permissions, I/O).
    pub fn load(&self, key: &FingerprintKey) -> Result<Option<Estimate>, FingerprintError> {
        let path = self.path(key);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(FingerprintError { path, source }),
        };
        match serde_json::from_str::<Fingerprint>(&text) {
            Ok(stored) if stored.format == FORMAT && stored.key == *key => Ok(Some(stored.estimate)),
            Ok(stored) => {
                warn!(path = %path.display(), format = stored.format, "fingerprint is for another key or format; recalibrating");
                Ok(None)
            }
            Err(err) => {
                warn!(path = %path.display(), error = %err, "fingerprint is unreadable; recalibrating");
                Ok(None)
            }
        }
    }

    /// Stores `estimate` for `key`, replacing the file whole (written aside, then renamed), so a
    /// crash or a second worker never leaves half a file.
    ///
    /// # Errors
    ///
    /// The directory cannot be created or written.
    pub fn save(&self, key: &FingerprintKey, estimate: &Estimate) -> Result<PathBuf, FingerprintError> {
        let path = self.path(key);
        let io = |source| FingerprintError { path: path.clone(), source };
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let stored = Fingerprint { format: FORMAT, key: key.clone(), estimate: estimate.clone() };
        let json = serde_json::to_vec_pretty(&stored).expect("an estimate always serializes");
        let aside = aside_path(&path);
        std::fs::write(&aside, json).map_err(io)?;
        std::fs::rename(&aside, &path).map_err(io)?;
        Ok(path)
    }
}

/// A temporary name beside `path`, unique per writer so two workers do not share one, also on a
/// folder shared by pods whose processes all run as PID 1 (deploy/k8s).
fn aside_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}-{:016x}.tmp", std::process::id(), rand::random::<u64>()));
    path.with_file_name(name)
}
