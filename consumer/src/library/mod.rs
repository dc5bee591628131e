//! The LoRA library as a worker sees it: LoRA files by name from object storage (the layout in
//! `shotfleet_schema::lora::library`, written by `shotfleet lora push`), through a bounded local
//! disk cache, checked against their sidecar's sha256 and read as LoRA files. Knows nothing of
//! NATS or the pipeline: the worker turns what it fetches into
//! [`Adapter`](crate::pipeline::lora::Adapter)s.
//!
//! - `cache.rs`: [`DiskCache`], the local copies by sha256.

mod cache;

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;
use shotfleet_schema::lora::library::{self, LoraEntry};
use shotfleet_schema::lora::{FileLimits, LoraFile, LoraFileError};

pub use cache::DiskCache;

use crate::store::{Store, StoreConfig, StoreError, StoreErrorKind};

/// Where the library is (`prefix`, under the store's url: `s3://renders/shotfleet/_loras`) and
/// how much of it a worker keeps on disk. A worker's `[lora]` section
/// ([`LoraConfig`](crate::worker::lora::LoraConfig)) makes it, the cache under its state dir
/// unless told otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LibraryConfig {
    /// The library's folder under the image store's url (`shotfleet lora push --prefix`).
    pub prefix: String,
    /// The local copies of LoRA files.
    pub cache_dir: PathBuf,
    pub cache_max_mib: u64,
    /// Larger LoRA files are refused (`shotfleet lora push` refuses them too).
    pub max_file_mib: u64,
}

impl Default for LibraryConfig {
    fn default() -> Self {
        Self {
            prefix: library::DEFAULT_PREFIX.into(),
            cache_dir: PathBuf::from("/tmp/shotfleet/loras"),
            cache_max_mib: 20 * 1024,
            max_file_mib: shotfleet_schema::lora::DEFAULT_MAX_BYTES >> 20,
        }
    }
}

/// What a caller should do about a [`LibraryError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibraryErrorKind {
    /// The job names a LoRA that cannot be used (unknown, refused, corrupt in the library):
    /// invalid, a failed record; no retry helps until someone pushes it (again).
    InvalidJob,
    /// The store or the local disk failed for now: try again later (nak with a delay).
    Retry,
    /// The store refuses this worker (credentials, permissions, settings): an operator must act.
    Operator,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LibraryError {
    #[error("LoRA name `{name}`: {reason}")]
    BadName { name: String, reason: String },

    #[error("no LoRA named `{name}` in the library at {location}: push it with `shotfleet lora push FILE --name {name} --store STORE` (the workers' image store)")]
    Unknown { name: String, location: String },

    #[error("LoRA `{name}`: its sidecar in the library is unreadable ({detail}): push it again")]
    Sidecar { name: String, detail: String },

    #[error("LoRA `{name}`: the library's file does not match its sidecar ({detail}); a truncated or replaced upload: push it again")]
    Corrupt { name: String, detail: String },

    #[error("LoRA `{name}`: {source}")]
    File { name: String, source: LoraFileError },

    #[error("LoRA `{name}`: the library at {location} failed ({}): {source}", kind_word(source))]
    Store { name: String, location: String, source: Box<StoreError> },

    #[error("LoRA cache {path}: {source}")]
    Cache { path: PathBuf, source: std::io::Error },
}

fn kind_word(e: &StoreError) -> &'static str {
    match e.kind() {
        StoreErrorKind::Transient => "retryable",
        _ => "permanent until an operator acts",
    }
}

impl LibraryError {
    pub fn kind(&self) -> LibraryErrorKind {
        match self {
            LibraryError::BadName { .. }
            | LibraryError::Unknown { .. }
            | LibraryError::Sidecar { .. }
            | LibraryError::Corrupt { .. }
            | LibraryError::File { .. } => LibraryErrorKind::InvalidJob,
            LibraryError::Store { source, .. } => match source.kind() {
                StoreErrorKind::Transient => LibraryErrorKind::Retry,
                StoreErrorKind::InvalidKey | StoreErrorKind::NotFound => LibraryErrorKind::InvalidJob,
                _ => LibraryErrorKind::Operator,
            },
            LibraryError::Cache { .. } => LibraryErrorKind::Retry,
        }
    }
}

/// A LoRA fetched and read.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub entry: LoraEntry,
    pub file: Arc<LoraFile>,
    /// Whether the local cache had it.
    pub from_cache: bool,
}

/// The LoRA library: a store under the library's prefix, and the local cache.
#[derive(Debug, Clone)]
pub struct LoraLibrary {
    store: Store,
    cache: DiskCache,
    limits: FileLimits,
}

impl LoraLibrary {
    /// Opens the library at `<store.url>/<config.prefix>` with the store's other settings, and
    /// the cache folder. No I/O on the store.
    ///
    /// # Errors
    /// The store's settings ([`StoreError`]), or the cache folder cannot be made.
    pub fn open<K, V>(store: &StoreConfig, config: &LibraryConfig, env: impl IntoIterator<Item = (K, V)>) -> Result<LoraLibrary, LibraryError>
    where
        K: AsRef<str>,
        V: Into<String>,
    {
        let url = format!("{}/{}", store.url.trim_end_matches('/'), config.prefix.trim_matches('/'));
        let store_config = StoreConfig { url: url.clone(), ..store.clone() };
        let store = Store::open(&store_config, env).map_err(|source| LibraryError::Store { name: String::new(), location: url, source: Box::new(source) })?;
        let cache = DiskCache::open(&config.cache_dir, config.cache_max_mib << 20)
            .map_err(|source| LibraryError::Cache { path: config.cache_dir.clone(), source })?;
        Ok(LoraLibrary { store, cache, limits: FileLimits { max_bytes: config.max_file_mib << 20 } })
    }

    /// Where the library is, for messages.
    pub fn location(&self) -> &str {
        self.store.location()
    }

    /// The sidecar of `name`: its sha256 identifies the set a job asks for before any file is
    /// fetched.
    ///
    /// # Errors
    /// [`LibraryError::Unknown`] when the library has no such LoRA; see [`LibraryError::kind`].
    pub async fn entry(&self, name: &str) -> Result<LoraEntry, LibraryError> {
        library::check_name(name).map_err(|reason| LibraryError::BadName { name: name.into(), reason })?;
        let bytes = self.get(name, &library::sidecar_key(name)).await?;
        let entry: LoraEntry =
            serde_json::from_slice(&bytes).map_err(|e| LibraryError::Sidecar { name: name.into(), detail: e.to_string() })?;
        if entry.name != name {
            return Err(LibraryError::Sidecar { name: name.into(), detail: format!("it names `{}`", entry.name) });
        }
        Ok(entry)
    }

    /// The LoRA `name`: from the cache when it holds the sidecar's sha256, else from the store
    /// (checked against the sidecar, then cached), read as a LoRA file.
    ///
    /// # Errors
    /// See [`LibraryError::kind`]: unknown, corrupt or refused LoRAs make the job invalid; a
    /// store outage is retryable.
    pub async fn fetch(&self, name: &str) -> Result<Fetched, LibraryError> {
        let mut entry = self.entry(name).await?;
        let cached = self.blocking({
            let (cache, sha) = (self.cache.clone(), entry.sha256.clone());
            move || cache.get(&sha)
        });
        let (bytes, from_cache) = match cached.await? {
            Some(bytes) => (bytes, true),
            None => {
                let mut bytes = self.get(name, &library::file_key(name)).await?;
                if let Err(detail) = matches(&entry, &bytes) {
                    // A push may have replaced the LoRA between the two reads: read both again.
                    entry = self.entry(name).await?;
                    bytes = self.get(name, &library::file_key(name)).await?;
                    matches(&entry, &bytes).map_err(|_| LibraryError::Corrupt { name: name.into(), detail })?;
                }
                let (cache, sha, copy) = (self.cache.clone(), entry.sha256.clone(), bytes.clone());
                self.blocking(move || cache.put(&sha, &copy)).await?;
                (bytes, false)
            }
        };
        let limits = self.limits;
        let file = tokio::task::spawn_blocking(move || LoraFile::parse(&bytes, &limits))
            .await
            .expect("parsing does not panic")
            .map_err(|source| LibraryError::File { name: name.into(), source })?;
        Ok(Fetched { entry, file: Arc::new(file), from_cache })
    }

    async fn get(&self, name: &str, relative: &str) -> Result<Vec<u8>, LibraryError> {
        match self.store.get(&self.store.key_under_prefix(relative)).await {
            Ok(bytes) => Ok(bytes.to_vec()),
            Err(e) if e.kind() == StoreErrorKind::NotFound => {
                Err(LibraryError::Unknown { name: name.into(), location: self.store.location().into() })
            }
            Err(source) => Err(LibraryError::Store { name: name.into(), location: self.store.location().into(), source: Box::new(source) }),
        }
    }

    /// Runs cache I/O (reading, hashing, writing hundreds of MB) off the async threads.
    async fn blocking<T: Send + 'static>(&self, work: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> Result<T, LibraryError> {
        let path = self.cache.dir().to_path_buf();
        tokio::task::spawn_blocking(work).await.expect("cache I/O does not panic").map_err(|source| LibraryError::Cache { path, source })
    }

    /// The local cache.
    pub fn cache(&self) -> &DiskCache {
        &self.cache
    }
}

/// Whether `bytes` are the file `entry` describes; what differs otherwise.
fn matches(entry: &LoraEntry, bytes: &[u8]) -> Result<(), String> {
    if bytes.len() as u64 != entry.bytes {
        return Err(format!("{} bytes, the sidecar says {}", bytes.len(), entry.bytes));
    }
    let sha = library::sha256_hex(bytes);
    if sha != entry.sha256 {
        return Err(format!("sha256 {sha}, the sidecar says {}", entry.sha256));
    }
    Ok(())
}
