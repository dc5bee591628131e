//! `[store]` settings, and turning them (plus the environment) into an object store.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ClientConfigKey, ClientOptions, ObjectStore};
use serde::Deserialize;
use url::Url;

use super::StoreError;
use super::retry::RetryConfig;

/// Where images go.
///
/// ```toml
/// [store]
/// url = "s3://renders/shotfleet"      # or "file:///var/lib/shotfleet/images"
/// endpoint = "http://minio:9000"      # S3-compatible servers; else AWS_ENDPOINT_URL, else AWS
/// allow_http = true                   # plain HTTP endpoints only when set
/// [store.retry]
/// max_attempts = 8
/// ```
///
/// Credentials and region come from the environment as for any AWS tool (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, web identity, container
/// credentials, instance metadata), never from this file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `file:///absolute/folder` (created if missing inside a folder that exists) or
    /// `s3://bucket/optional/prefix`. Required.
    pub url: String,
    /// S3 endpoint for S3-compatible servers, path-style (`http://host:port`). Overrides
    /// `AWS_ENDPOINT_URL`; unset with neither means AWS itself.
    pub endpoint: Option<String>,
    /// S3 region; overrides `AWS_REGION` / `AWS_DEFAULT_REGION` (default `us-east-1`).
    pub region: Option<String>,
    /// Allow an `http://` endpoint (`AWS_ALLOW_HTTP=true` also does). Off, so credentials do not
    /// cross a network in the clear by accident.
    pub allow_http: bool,
    /// Longest wait for a connection to the endpoint.
    pub connect_timeout_ms: u64,
    /// Longest single request, body included (an upload of one PNG).
    pub request_timeout_ms: u64,
    /// Retries of transient failures, per call.
    pub retry: RetryConfig,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            // No default: a worker refuses to serve without one (`WorkerConfig::require_store`).
            url: String::new(),
            endpoint: None,
            region: None,
            allow_http: false,
            connect_timeout_ms: 5_000,
            request_timeout_ms: 30_000,
            retry: RetryConfig::default(),
        }
    }
}

/// Where a store's URL points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local folder (`file:///...`).
    Folder(PathBuf),
    /// A bucket and the key prefix inside it (`s3://bucket/prefix`).
    Bucket { bucket: String, prefix: Path },
}

/// A `file://` store's folder as it was opened: the same folder, not only one at the same path,
/// must be there at each put. A share's mount point stays behind when the share is unmounted,
/// an empty folder on the local disk; its device and inode tell it from the share's root.
#[derive(Debug, Clone)]
pub(crate) struct LocalRoot {
    pub path: PathBuf,
    identity: (u64, u64),
}

impl LocalRoot {
    fn of(path: PathBuf) -> std::io::Result<Self> {
        let identity = Self::identity_of(&path)?;
        Ok(Self { path, identity })
    }

    fn identity_of(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path)?;
        Ok((meta.dev(), meta.ino()))
    }

    /// Why the folder is not the one opened, if it is not.
    pub fn gone(&self) -> Option<std::io::Error> {
        let why = match Self::identity_of(&self.path) {
            Ok(identity) if identity == self.identity => return None,
            Ok(_) => "the store folder is another folder than at start (a share unmounted, or the folder replaced)",
            Err(_) => "the store folder is gone (unmounted, moved or deleted?)",
        };
        Some(std::io::Error::new(std::io::ErrorKind::NotFound, format!("{why}; nothing is written in its place")))
    }
}

/// A store ready to use: the client, the key prefix inside it, and a description for messages.
pub(crate) struct Opened {
    pub inner: Arc<dyn ObjectStore>,
    pub prefix: Path,
    /// `file:///folder` or `s3://bucket/prefix at endpoint`: for logs and errors, no secrets.
    pub location: String,
    /// URL of the prefix, to which a key relative to it is appended: `s3://bucket` or `file:///folder`.
    pub url_base: String,
    /// Whether puts may set a Content-Type (the local filesystem rejects attributes).
    pub attributes: bool,
    /// A local store's folder, which must still be there at each put.
    pub local_root: Option<LocalRoot>,
}

impl StoreConfig {
    /// Checks the settings and builds the client. No I/O but creating a local folder; see
    /// [`Store::check`](super::Store::check) for the start-up probe.
    pub(crate) fn open<K, V>(&self, env: impl IntoIterator<Item = (K, V)>) -> Result<Opened, StoreError>
    where
        K: AsRef<str>,
        V: Into<String>,
    {
        match self.location()? {
            Location::Folder(root) => self.open_local(root),
            Location::Bucket { bucket, prefix } => self.open_s3(&bucket, prefix, env),
        }
    }

    /// Reads the URL and the retry settings without touching anything: what a worker's
    /// configuration check runs, so that a mistyped URL is a configuration error (exit 2),
    /// not a failed start that a supervisor retries.
    ///
    /// # Errors
    /// [`StoreError::Url`] or the retry settings' error, saying what to write instead.
    pub fn location(&self) -> Result<Location, StoreError> {
        self.retry.validate()?;
        let url_error = |reason: &str| StoreError::Url { url: redact_url(&self.url), reason: reason.into() };
        if self.url.trim().is_empty() {
            return Err(url_error("no store configured; expected file:///folder or s3://bucket/prefix"));
        }
        let url = Url::parse(&self.url)
            .map_err(|e| url_error(&format!("{e}; expected file:///folder or s3://bucket/prefix")))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(url_error(
                "holds credentials; take them out and give them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
            ));
        }
        match url.scheme() {
            "file" => {
                if url.host_str().is_some_and(|h| !h.is_empty()) || !self.url.starts_with("file:///") {
                    return Err(url_error("a local folder needs an absolute path: file:///var/lib/shotfleet/images"));
                }
                url.to_file_path().map(Location::Folder).map_err(|()| url_error("is not a local path"))
            }
            "s3" => {
                let bucket = url.host_str().unwrap_or_default();
                if bucket.is_empty() {
                    return Err(url_error("names no bucket; expected s3://bucket/prefix"));
                }
                let prefix = Path::parse(url.path())
                    .map_err(|e| url_error(&format!("prefix is not a valid key prefix: {e}")))?;
                Ok(Location::Bucket { bucket: bucket.to_owned(), prefix })
            }
            other => {
                Err(url_error(&format!("unknown scheme `{other}`; expected file:///folder or s3://bucket/prefix")))
            }
        }
    }

    fn open_local(&self, root: PathBuf) -> Result<Opened, StoreError> {
        let display = root.display().to_string();
        shotfleet_schema::store::make_folder(&root).map_err(|source| StoreError::Folder { path: display.clone(), source })?;
        let location = format!("file://{display}");
        let fs = LocalFileSystem::new_with_prefix(&root)
            .map_err(|source| StoreError::Build { location: location.clone(), source })?
            // A result names images as committed: they must survive a power cut once put returns.
            .with_fsync(true)
            // Sweeping a job's leftovers should not leave its empty folder behind.
            .with_automatic_cleanup(true);
        let local_root = LocalRoot::of(root).map_err(|source| StoreError::Folder { path: display.clone(), source })?;
        Ok(Opened { inner: Arc::new(fs), prefix: Path::ROOT, url_base: location.clone(), location, attributes: false, local_root: Some(local_root) })
    }

    fn open_s3<K, V>(
        &self,
        bucket: &str,
        prefix: Path,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Opened, StoreError>
    where
        K: AsRef<str>,
        V: Into<String>,
    {
        let client = ClientOptions::new()
            .with_connect_timeout(Duration::from_millis(self.connect_timeout_ms))
            .with_timeout(Duration::from_millis(self.request_timeout_ms));
        // The retries live in `retry.rs`; a second layer here would multiply attempts and time.
        let no_retry = object_store::RetryConfig { max_retries: 0, ..Default::default() };
        let mut builder = AmazonS3Builder::new().with_client_options(client).with_retry(no_retry);
        // As AmazonS3Builder::from_env, but from the environment handed in (tests pass their own).
        for (key, value) in env {
            let key = key.as_ref();
            if key.starts_with("AWS_")
                && let Ok(config_key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>()
            {
                builder = builder.with_config(config_key, value);
            }
        }
        if let Some(endpoint) = &self.endpoint {
            // AWS_ENDPOINT_URL_S3 would win over a plain endpoint inside object_store; the file wins here.
            builder = builder.with_endpoint(endpoint).with_config(AmazonS3ConfigKey::S3Endpoint, endpoint);
        }
        if let Some(region) = &self.region {
            builder = builder.with_region(region);
        }
        if self.allow_http {
            builder = builder.with_allow_http(true);
        }
        let endpoint = builder
            .get_config_value(&AmazonS3ConfigKey::S3Endpoint)
            .or_else(|| builder.get_config_value(&AmazonS3ConfigKey::Endpoint));
        let endpoint = endpoint.as_deref().map(check_endpoint).transpose()?;
        let http_allowed = builder
            .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
            .is_some_and(|v| v == "true");
        if let Some(endpoint) = &endpoint
            && endpoint.scheme() == "http"
            && !http_allowed
        {
            return Err(StoreError::Config {
                key: "allow_http",
                reason: format!(
                    "endpoint {endpoint} is plain HTTP; set allow_http = true (or AWS_ALLOW_HTTP=true) if that is intended"
                ),
            });
        }
        let url_base = format!("s3://{bucket}");
        let mut location = if prefix.is_root() { url_base.clone() } else { format!("{url_base}/{prefix}") };
        if let Some(endpoint) = &endpoint {
            location = format!("{location} at {endpoint}");
        }
        let s3 = builder
            .with_bucket_name(bucket)
            .build()
            .map_err(|source| StoreError::Build { location: location.clone(), source })?;
        Ok(Opened { inner: Arc::new(s3), prefix, location, url_base, attributes: true, local_root: None })
    }
}

/// A store URL as it may be shown: a `user:password@` part (credentials belong in the
/// environment, but someone may write them there) becomes `***@`.
fn redact_url(url: &str) -> String {
    match Url::parse(url) {
        Ok(mut parsed) if !parsed.username().is_empty() || parsed.password().is_some() => {
            let _ = parsed.set_password(None);
            let _ = parsed.set_username("***");
            parsed.to_string()
        }
        Ok(_) => url.to_owned(),
        // Unparsable: shown as written (it is what to fix) unless it may hold a secret.
        Err(_) if url.contains('@') => "(unparsable; not shown, it may hold a password)".into(),
        Err(_) => url.to_owned(),
    }
}

/// Parses an endpoint and drops any user:password part, so it can be shown.
fn check_endpoint(endpoint: &str) -> Result<Url, StoreError> {
    let mut url = Url::parse(endpoint)
        .map_err(|e| StoreError::Config { key: "endpoint", reason: format!("{e}; expected http(s)://host:port") })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(StoreError::Config {
            key: "endpoint",
            reason: format!("scheme `{}` is not http or https", url.scheme()),
        });
    }
    let _ = url.set_username("");
    let _ = url.set_password(None);
    Ok(url)
}
