//! The worker's local copies of LoRA files, by sha256: checked on every read, written
//! atomically, bounded in size (least recently used first out).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use shotfleet_schema::lora::library::sha256_hex;

const SUFFIX: &str = ".safetensors";
const PARTIAL: &str = ".partial";

/// A folder of `<sha256>.safetensors` files.
#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
}

impl DiskCache {
    /// Opens (creates) `dir`, removing what an interrupted write left there, and checks that a
    /// file can be written in it: a folder this process may read but not write would else fail
    /// every LoRA job, as the job's fault, after the worker said it was ready.
    ///
    /// # Errors
    /// When the folder cannot be created, read or written.
    pub fn open(dir: &Path, max_bytes: u64) -> std::io::Result<DiskCache> {
        fs::create_dir_all(dir)?;
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            if path.to_string_lossy().ends_with(PARTIAL) {
                let _ = fs::remove_file(&path);
            }
        }
        // Not named as a partial write: another worker's start-up on a shared cache removes
        // those, and could remove this one between its write and its removal.
        let probe = dir.join(format!(".write-check-{}", std::process::id()));
        fs::write(&probe, b"shotfleet")?;
        match fs::remove_file(&probe) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        Ok(DiskCache { dir: dir.to_path_buf(), max_bytes })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}{SUFFIX}"))
    }

    /// The file with this sha256, if the cache holds it intact (a copy that no longer matches
    /// its name is removed). A hit counts as a use for eviction.
    ///
    /// # Errors
    /// Reading the folder or file failed for another reason than its absence.
    pub fn get(&self, sha256: &str) -> std::io::Result<Option<Vec<u8>>> {
        let path = self.path(sha256);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if sha256_hex(&bytes) != sha256 {
            tracing::warn!(path = %path.display(), "cached LoRA file does not match its sha256; removed");
            let _ = fs::remove_file(&path);
            return Ok(None);
        }
        let _ = fs::File::options().append(true).open(&path).and_then(|f| f.set_modified(SystemTime::now()));
        Ok(Some(bytes))
    }

    /// Stores `bytes` (whose sha256 the caller checked) under its sha256: written to a partial
    /// file, synced, then renamed, so a reader sees a whole file or none. Then removes the least
    /// recently used other files until the cache is within its size.
    ///
    /// # Errors
    /// Writing failed (disk full, permissions).
    pub fn put(&self, sha256: &str, bytes: &[u8]) -> std::io::Result<()> {
        let path = self.path(sha256);
        let partial = self.dir.join(format!("{sha256}.{}{PARTIAL}", std::process::id()));
        let mut file = fs::File::create(&partial)?;
        let written = file.write_all(bytes).and_then(|()| file.sync_all());
        drop(file);
        if let Err(e) = written.and_then(|()| fs::rename(&partial, &path)) {
            let _ = fs::remove_file(&partial);
            return Err(e);
        }
        self.trim(&path)
    }

    /// Bytes of the files held.
    ///
    /// # Errors
    /// Reading the folder failed.
    pub fn bytes(&self) -> std::io::Result<u64> {
        Ok(self.files()?.iter().map(|(_, len, _)| len).sum())
    }

    fn files(&self) -> std::io::Result<Vec<(PathBuf, u64, SystemTime)>> {
        let mut files = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            let path = entry.path();
            if !path.to_string_lossy().ends_with(SUFFIX) {
                continue;
            }
            let meta = entry.metadata()?;
            files.push((path, meta.len(), meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)));
        }
        Ok(files)
    }

    fn trim(&self, keep: &Path) -> std::io::Result<()> {
        let mut files = self.files()?;
        files.sort_by_key(|(_, _, used)| *used);
        let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
        for (path, len, _) in files {
            if total <= self.max_bytes {
                break;
            }
            if path != keep && fs::remove_file(&path).is_ok() {
                total -= len;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_that_cannot_be_written_is_refused_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&dir.path().join("loras"), 1 << 20).unwrap();
        assert_eq!(fs::read_dir(cache.dir()).unwrap().count(), 0, "the check leaves nothing behind");
        // A folder that exists and reads, but takes no file, even for root.
        assert!(DiskCache::open(Path::new("/proc/self"), 1 << 20).is_err());
    }
}
