//! The LoRA library: LoRAs by name in object storage, each file beside a metadata sidecar.
//!
//! Under the library's prefix, a LoRA named `ink-wash.v2` is two objects:
//! `ink-wash.v2.safetensors` (the file as pushed) and `ink-wash.v2.json` (a [`LoraEntry`]).
//! `shotfleet lora push` writes the file first and the sidecar last, so a listed entry has its
//! file; a worker checks the file it fetched against the sidecar's size and sha256.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{Arch, Format, LoraFile, Part};

/// The library's folder under the image store's url, unless configured otherwise; the leading
/// `_` keeps it apart from project folders.
pub const DEFAULT_PREFIX: &str = "_loras";

/// The file's key under the library prefix.
pub fn file_key(name: &str) -> String {
    format!("{name}.safetensors")
}

/// The sidecar's key under the library prefix.
pub fn sidecar_key(name: &str) -> String {
    format!("{name}.json")
}

/// The LoRA name a sidecar key belongs to (`None` for other objects).
pub fn name_of_sidecar(key: &str) -> Option<&str> {
    key.strip_suffix(".json").filter(|n| check_name(n).is_ok())
}

/// A LoRA's name, as jobs give it: what a job's `loras[].name` may be.
///
/// # Errors
/// What is wrong with it, for a person to fix.
pub fn check_name(name: &str) -> Result<(), String> {
    crate::validate::file_name_problem(name).map_or(Ok(()), Err)
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The sidecar: what a library entry holds, so workers and people need not open the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraEntry {
    pub name: String,
    /// Of the file's bytes, lowercase hex.
    pub sha256: String,
    pub bytes: u64,
    pub format: Format,
    pub arch: Arch,
    /// The largest rank of any target.
    pub rank: usize,
    /// Adapted modules in all.
    pub targets: usize,
    /// Adapted modules per part.
    pub parts: BTreeMap<Part, usize>,
    /// When it was pushed, seconds since the Unix epoch.
    pub pushed_unix: u64,
}

impl LoraEntry {
    /// The entry for `bytes`, read as `file`.
    pub fn describe(name: &str, bytes: &[u8], file: &LoraFile, pushed_unix: u64) -> LoraEntry {
        let parts = Part::ALL.iter().map(|&p| (p, file.count(p))).filter(|&(_, n)| n > 0).collect();
        LoraEntry {
            name: name.to_owned(),
            sha256: sha256_hex(bytes),
            bytes: bytes.len() as u64,
            format: file.format,
            arch: Arch::Sdxl,
            rank: file.rank(),
            targets: file.targets.len(),
            parts,
            pushed_unix,
        }
    }
}
