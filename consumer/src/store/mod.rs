//! Where rendered images go: a local folder or an S3-compatible bucket.
//!
//! Keys are content-addressed, `<prefix>/<project>/<job_id>/<shot_id>-<index>-<sha8>.png` (see
//! [`key`]), so a retried or repeated upload of the same bytes lands on the same key and two
//! different renders of one image never overwrite each other. That is what lets the worker treat
//! the published result as the commit point (DESIGN.md, "Ack after upload"): upload, publish, and
//! then [`Store::sweep_job`] whatever other attempts left under the job's folder.
//!
//! - `config.rs`: the `[store]` settings, URL parsing, building the client from them and the
//!   environment.
//! - [`key`]: key building and the checks on every part of it.
//! - `retry.rs`: bounded exponential backoff, the one retry layer.
//! - `error.rs`: [`StoreError`] and its [`StoreErrorKind`], which decides nak, fail or stop.

mod config;
mod error;
pub mod key;
mod retry;

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{Attribute, Attributes, ObjectStore, ObjectStoreExt, PutOptions, PutPayload};
use tracing::info;

pub use config::{Location, StoreConfig};
pub use error::{Op, StoreError, StoreErrorKind};
pub use retry::RetryConfig;

use config::Opened;
use retry::retrying;

/// Folder (under the prefix) of the start-up probe objects; never a project name in practice, and
/// each probe deletes only its own random key.
const PROBE_FOLDER: &str = "_shotfleet_probe";

/// One uploaded image, as a result names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredImage {
    /// Object key, prefix included: `<prefix>/<project>/<job_id>/<shot_id>-<index>-<sha8>.png`.
    pub key: String,
    /// PNG size in bytes.
    pub bytes: u64,
    /// Lowercase hex SHA-256 of the PNG.
    pub sha256: String,
}

/// A handle on the image store; cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    prefix: Path,
    location: Arc<str>,
    url_base: Arc<str>,
    attributes: bool,
    retry: RetryConfig,
    /// The folder of a `file://` store.
    local_root: Option<config::LocalRoot>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("location", &self.location).finish_non_exhaustive()
    }
}

impl Store {
    /// Builds the store from `config` and the process environment `env` (pass `std::env::vars()`;
    /// tests pass their own), without touching it except to create a local folder.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Permanent`]: an unknown URL scheme, a relative path, no bucket, a bad
    /// endpoint, plain HTTP without `allow_http`, a folder that cannot be created, a credential
    /// pair set by half.
    pub fn open<K, V>(config: &StoreConfig, env: impl IntoIterator<Item = (K, V)>) -> Result<Self, StoreError>
    where
        K: AsRef<str>,
        V: Into<String>,
    {
        let Opened { inner, prefix, location, url_base, attributes, local_root } = config.open(env)?;
        Ok(Self {
            inner,
            prefix,
            location: location.into(),
            url_base: url_base.into(),
            attributes,
            local_root,
            retry: config.retry.clone(),
        })
    }

    /// [`open`](Self::open), then [`check`](Self::check): what a worker calls at start.
    ///
    /// # Errors
    ///
    /// As both.
    pub async fn connect<K, V>(config: &StoreConfig, env: impl IntoIterator<Item = (K, V)>) -> Result<Self, StoreError>
    where
        K: AsRef<str>,
        V: Into<String>,
    {
        let store = Self::open(config, env)?;
        store.check().await?;
        info!(store = %store.location, "store ready");
        Ok(store)
    }

    /// The start-up check: writes a small probe object, reads it back and deletes it, so a wrong
    /// endpoint, bucket or credential shows before the first job rather than after a render.
    ///
    /// # Errors
    ///
    /// [`StoreError::Probe`] naming the step that failed (write, read back, delete), with a hint
    /// for the usual causes; its kind is the failed call's.
    pub async fn check(&self) -> Result<(), StoreError> {
        let token = hex::encode(rand::random::<[u8; 8]>());
        let path = self.prefix.clone().join(PROBE_FOLDER).join(format!("{token}.txt").as_str());
        let body = Bytes::from(format!("shotfleet start-up probe {token}\n"));
        let probe = |step, source: StoreError| StoreError::Probe {
            location: self.location.to_string(),
            step,
            hint: error::probe_hint(&source),
            source: Box::new(source),
        };
        self.put_path(&path, body.clone()).await.map_err(|e| probe("write", e))?;
        let read = self.get_path(&path).await.map_err(|e| probe("read back", e))?;
        if read != body {
            return Err(StoreError::ProbeMismatch { location: self.location.to_string(), key: path.to_string() });
        }
        self.delete_paths(std::slice::from_ref(&path)).await.map_err(|e| probe("delete", e))
    }

    /// Where this store is, for messages: `file:///folder` or `s3://bucket/prefix at endpoint`.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// A key as a URL a person can follow: `s3://bucket/<key>` or `file:///folder/<key>`.
    pub fn url(&self, key: &str) -> String {
        format!("{}/{key}", self.url_base)
    }

    /// Uploads one PNG under its content-addressed key, retrying transient failures.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::InvalidKey`] when an id cannot be part of a key;
    /// [`StoreErrorKind::Transient`] when the retries ran out; [`StoreErrorKind::Permanent`] when
    /// the store refused (credentials, permissions).
    pub async fn put_image(
        &self,
        project: &str,
        job_id: &str,
        shot_id: &str,
        index: u32,
        png: impl Into<Bytes>,
    ) -> Result<StoredImage, StoreError> {
        let png = png.into();
        let digest = key::sha256(&png);
        let path = key::image_key(&self.prefix, project, job_id, shot_id, index, &digest)?;
        self.put_path(&path, png.clone()).await?;
        Ok(StoredImage { key: path.to_string(), bytes: png.len() as u64, sha256: hex::encode(digest) })
    }

    /// Every key under the job's folder, sorted.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::InvalidKey`] for unsafe ids; otherwise the listing's failure.
    pub async fn list_job(&self, project: &str, job_id: &str) -> Result<Vec<String>, StoreError> {
        let folder = key::job_prefix(&self.prefix, project, job_id)?;
        let mut keys: Vec<String> = self.list_paths(&folder).await?.iter().map(Path::to_string).collect();
        keys.sort();
        Ok(keys)
    }

    /// Deletes `keys`; keys already gone count as deleted.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::InvalidKey`] for a malformed key or one outside this store's prefix
    /// (nothing is deleted then); otherwise the deletion's failure.
    pub async fn delete<S: AsRef<str>>(&self, keys: &[S]) -> Result<(), StoreError> {
        let paths = keys.iter().map(|k| self.own_path(k.as_ref())).collect::<Result<Vec<_>, _>>()?;
        self.delete_paths(&paths).await
    }

    /// Deletes every object under the job's folder that `keep` does not name, and returns how many.
    /// After a result is committed this removes what other attempts of the job uploaded; with an
    /// empty `keep`, it clears the folder before a re-render.
    ///
    /// # Errors
    ///
    /// As [`list_job`](Self::list_job) and [`delete`](Self::delete).
    pub async fn sweep_job(&self, project: &str, job_id: &str, keep: &HashSet<String>) -> Result<usize, StoreError> {
        let folder = key::job_prefix(&self.prefix, project, job_id)?;
        let doomed: Vec<Path> =
            self.list_paths(&folder).await?.into_iter().filter(|p| !keep.contains(p.as_ref())).collect();
        if !doomed.is_empty() {
            self.delete_paths(&doomed).await?;
            info!(project, job = job_id, deleted = doomed.len(), "swept job leftovers");
        }
        Ok(doomed.len())
    }

    /// Reads one object (tests and verification; the worker never reads images back).
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::NotFound`] when it does not exist; [`StoreErrorKind::InvalidKey`] for a
    /// malformed key or one outside the prefix.
    pub async fn get(&self, key: &str) -> Result<Bytes, StoreError> {
        self.get_path(&self.own_path(key)?).await
    }

    /// The key of `relative` (one path part, e.g. a LoRA library file name) under this store's
    /// prefix, as [`get`](Self::get) takes it.
    pub fn key_under_prefix(&self, relative: &str) -> String {
        self.prefix.clone().join(relative).to_string()
    }

    /// Parses a key handed back by a caller and checks it lies under this store's prefix.
    fn own_path(&self, key: &str) -> Result<Path, StoreError> {
        let invalid = |reason: String| StoreError::InvalidKey { key: key.escape_debug().to_string(), reason };
        let path = Path::parse(key).map_err(|e| invalid(format!("is not a valid object key: {e}")))?;
        if path.is_root() || !path.prefix_matches(&self.prefix) || path.parts().any(|p| p.as_ref() == "..") {
            return Err(invalid(format!("is not an object under {}", self.location)));
        }
        Ok(path)
    }

    async fn put_path(&self, path: &Path, body: Bytes) -> Result<(), StoreError> {
        // The local store makes a key's folders as it writes: its own folder gone (a share
        // unmounted, the folder moved) would be made again on the local disk, unseen.
        if let Some(root) = &self.local_root
            && let Some(gone) = root.gone()
        {
            return Err(StoreError::Folder { path: root.path.display().to_string(), source: gone });
        }
        let mut options = PutOptions::default();
        if self.attributes {
            options.attributes = Attributes::from_iter([(Attribute::ContentType, "image/png")]);
        }
        retrying(&self.retry, Op::Put, path.as_ref(), || {
            self.inner.put_opts(path, PutPayload::from_bytes(body.clone()), options.clone())
        })
        .await
        .map(drop)
    }

    async fn get_path(&self, path: &Path) -> Result<Bytes, StoreError> {
        retrying(&self.retry, Op::Get, path.as_ref(), || async { self.inner.get(path).await?.bytes().await }).await
    }

    async fn list_paths(&self, folder: &Path) -> Result<Vec<Path>, StoreError> {
        retrying(&self.retry, Op::List, folder.as_ref(), || {
            self.inner.list(Some(folder)).map_ok(|meta| meta.location).try_collect()
        })
        .await
    }

    async fn delete_paths(&self, paths: &[Path]) -> Result<(), StoreError> {
        let target = match paths {
            [one] => one.to_string(),
            _ => format!("{} keys under {}", paths.len(), self.location),
        };
        retrying(&self.retry, Op::Delete, &target, || async {
            let stream = futures::stream::iter(paths.to_vec()).map(Ok).boxed();
            let mut results = self.inner.delete_stream(stream);
            while let Some(result) = results.next().await {
                match result {
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
        .await
    }
}
