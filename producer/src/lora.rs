//! The LoRA library from the producer's side: `shotfleet lora push` checks a file and uploads it
//! with its sidecar, `shotfleet lora list` shows what is there. The layout and the checks are
//! `shotfleet_schema::lora`'s, the same the workers read with.
//!
//! The library is a folder of the image store (`<store url>/<prefix>`, `_loras` by default): a
//! local folder (`file:///...`) or S3 (`s3://bucket/prefix`; endpoint, region and credentials
//! from the usual `AWS_*` environment, `AWS_ALLOW_HTTP=true` for a plain-HTTP endpoint).

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use shotfleet_schema::lora::library::{self, LoraEntry};
use shotfleet_schema::lora::{FileLimits, LoraFile, LoraFileError};
use url::Url;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LibraryError {
    #[error("--name `{name}`: {reason}")]
    BadName { name: String, reason: String },

    #[error("{path}: {source}")]
    Refused { path: String, source: LoraFileError },

    #[error("store `{url}`: {reason}")]
    Url { url: String, reason: String },

    #[error(
        "a different LoRA named `{name}` is already in the library (sha256 {sha8}…); jobs naming it would change look: pass --replace to replace it, or push under a new name (e.g. `{name}.v2`)"
    )]
    Exists { name: String, sha8: String },

    /// A storage call failed; `retryable` says whether running the command again may work.
    #[error("{op} {key} at {location} failed ({}): {source}", if *retryable { "retryable: the store did not answer as it should, run the command again" } else { "permanent: check the bucket, credentials and permissions" })]
    Store { op: &'static str, key: String, location: String, retryable: bool, source: Box<object_store::Error> },
}

impl LibraryError {
    /// The user's input is at fault (the file, the name, the url): exit code 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(self, LibraryError::BadName { .. } | LibraryError::Refused { .. } | LibraryError::Url { .. } | LibraryError::Exists { .. })
    }
}

/// Whether trying again may help: no answer, a timeout, a 5xx (object_store reports those as
/// `Generic`); refusals, missing buckets and bad requests need a person.
fn retryable(error: &object_store::Error) -> bool {
    matches!(error, object_store::Error::Generic { .. })
}

/// The library in object storage.
pub struct Library {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    location: String,
}

/// What `push` did.
#[derive(Debug, Clone, PartialEq)]
pub enum Pushed {
    /// Uploaded (`replaced`: over another LoRA of that name).
    Uploaded { entry: LoraEntry, replaced: bool },
    /// The same bytes were there already: nothing written.
    Unchanged { entry: LoraEntry },
}

/// One entry of the library, or a sidecar that could not be read.
#[derive(Debug, Clone, PartialEq)]
pub enum Listed {
    Entry(LoraEntry),
    Unreadable { key: String, detail: String },
}

impl Library {
    /// The library at `<store_url>/<prefix>`; `env` gives the S3 settings (`AWS_*`).
    ///
    /// # Errors
    /// [`LibraryError::Url`] for a url that names no store, or settings object_store refuses.
    pub fn open<K: AsRef<str>, V: Into<String>>(
        store_url: &str,
        prefix: &str,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Library, LibraryError> {
        let bad = |reason: String| LibraryError::Url { url: store_url.into(), reason };
        let url = Url::parse(store_url).map_err(|e| bad(format!("{e}; expected file:///folder or s3://bucket/prefix")))?;
        let prefix = prefix.trim_matches('/');
        let (store, base): (Arc<dyn ObjectStore>, &str) = match url.scheme() {
            "file" => {
                let root = url.to_file_path().map_err(|()| bad("is not an absolute local path".into()))?;
                shotfleet_schema::store::make_folder(&root).map_err(|e| bad(format!("the folder: {e}")))?;
                (Arc::new(LocalFileSystem::new_with_prefix(&root).map_err(|e| bad(e.to_string()))?), "")
            }
            "s3" => {
                let bucket = url.host_str().filter(|b| !b.is_empty()).ok_or_else(|| bad("names no bucket".into()))?;
                let mut builder = AmazonS3Builder::new().with_bucket_name(bucket);
                for (key, value) in env {
                    if key.as_ref().starts_with("AWS_")
                        && let Ok(config_key) = key.as_ref().to_ascii_lowercase().parse()
                    {
                        builder = builder.with_config(config_key, value);
                    }
                }
                (Arc::new(builder.build().map_err(|e| bad(e.to_string()))?), url.path().trim_matches('/'))
            }
            other => return Err(bad(format!("unknown scheme `{other}`; expected file:///folder or s3://bucket/prefix"))),
        };
        let joined = [base, prefix].iter().filter(|p| !p.is_empty()).copied().collect::<Vec<_>>().join("/");
        let location = format!("{}/{}", store_url.trim_end_matches('/'), prefix);
        Ok(Library { store, prefix: ObjectPath::from(joined), location })
    }

    /// Where the library is, for messages.
    pub fn location(&self) -> &str {
        &self.location
    }

    fn key(&self, relative: &str) -> ObjectPath {
        self.prefix.clone().join(relative)
    }

    fn failed(&self, op: &'static str, key: &ObjectPath) -> impl FnOnce(object_store::Error) -> LibraryError + '_ {
        let key = key.to_string();
        move |source| LibraryError::Store { op, key, location: self.location.clone(), retryable: retryable(&source), source: Box::new(source) }
    }

    /// Checks `bytes` as a LoRA file (safetensors only, within `limits`, an SDXL LoRA) and uploads
    /// it as `name`: the file first, the sidecar last (the sidecar is what makes it visible).
    /// `path` labels the file in errors.
    ///
    /// # Errors
    /// [`LibraryError::Refused`] with the file's problem; [`LibraryError::Exists`] when another
    /// LoRA has the name and `replace` is off; [`LibraryError::Store`].
    pub async fn push(&self, name: &str, path: &str, bytes: &[u8], limits: &FileLimits, replace: bool, now_unix: u64) -> Result<Pushed, LibraryError> {
        library::check_name(name).map_err(|reason| LibraryError::BadName { name: name.into(), reason })?;
        let file = LoraFile::parse(bytes, limits).map_err(|source| LibraryError::Refused { path: path.into(), source })?;
        let entry = LoraEntry::describe(name, bytes, &file, now_unix);
        let replaced = match self.entry(name).await? {
            Some(there) if there.sha256 == entry.sha256 => return Ok(Pushed::Unchanged { entry: there }),
            Some(there) if !replace => return Err(LibraryError::Exists { name: name.into(), sha8: there.sha256[..8].into() }),
            Some(_) => true,
            None => false,
        };
        let file_key = self.key(&library::file_key(name));
        self.store.put(&file_key, bytes.to_vec().into()).await.map_err(self.failed("put", &file_key))?;
        let sidecar_key = self.key(&library::sidecar_key(name));
        let sidecar = serde_json::to_vec_pretty(&entry).expect("an entry serializes");
        self.store.put(&sidecar_key, sidecar.into()).await.map_err(self.failed("put", &sidecar_key))?;
        Ok(Pushed::Uploaded { entry, replaced })
    }

    /// The sidecar of `name`, if the library has it.
    ///
    /// # Errors
    /// [`LibraryError::Store`].
    pub async fn entry(&self, name: &str) -> Result<Option<LoraEntry>, LibraryError> {
        let key = self.key(&library::sidecar_key(name));
        match self.store.get(&key).await {
            Ok(got) => {
                let bytes = got.bytes().await.map_err(self.failed("get", &key))?;
                Ok(serde_json::from_slice(&bytes).ok())
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.failed("get", &key)(e)),
        }
    }

    /// Every entry, sorted by name.
    ///
    /// # Errors
    /// [`LibraryError::Store`].
    pub async fn list(&self) -> Result<Vec<Listed>, LibraryError> {
        let objects: Vec<_> = self.store.list(Some(&self.prefix)).try_collect().await.map_err(self.failed("list", &self.prefix))?;
        let mut listed = Vec::new();
        for object in objects {
            let Some(name) = object.location.filename().and_then(library::name_of_sidecar) else { continue };
            let key = object.location.clone();
            let bytes = self.store.get(&key).await.map_err(self.failed("get", &key))?.bytes().await.map_err(self.failed("get", &key))?;
            listed.push(match serde_json::from_slice::<LoraEntry>(&bytes) {
                Ok(entry) if entry.name == name => Listed::Entry(entry),
                Ok(entry) => Listed::Unreadable { key: key.to_string(), detail: format!("it names `{}`", entry.name) },
                Err(e) => Listed::Unreadable { key: key.to_string(), detail: e.to_string() },
            });
        }
        listed.sort_by(|a, b| sort_key(a).cmp(sort_key(b)));
        Ok(listed)
    }
}

fn sort_key(listed: &Listed) -> &str {
    match listed {
        Listed::Entry(e) => &e.name,
        Listed::Unreadable { key, .. } => key,
    }
}
