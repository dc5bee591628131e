//! Reading images back from the worker's store, with the same URL the workers take
//! (`SHOTFLEET_STORE`): `file:///folder` or `s3://bucket/prefix`. Read-only; a result's image
//! key is relative to the folder, or to the bucket (the prefix is part of the key).
//!
//! S3 settings come from the environment as for any AWS tool (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, ...), read by
//! object_store itself.

use std::sync::Arc;

use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use url::Url;

/// A read-only handle on the images.
#[derive(Clone)]
pub struct ImageStore {
    inner: Arc<dyn ObjectStore>,
}

impl std::fmt::Debug for ImageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore").finish_non_exhaustive()
    }
}

/// `url` with any user information of its authority (`s3://key:secret@bucket`) replaced by `***`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{}", &rest[authority_end..]),
        None => url.to_owned(),
    }
}

impl ImageStore {
    /// Opens the store at `url`, taking S3 settings from `env` (pass `std::env::vars()`).
    ///
    /// # Errors
    /// A message naming what to fix: the scheme, a relative folder, a missing bucket,
    /// credentials written into the URL.
    pub fn open(url: &str, env: impl IntoIterator<Item = (String, String)>) -> Result<Self, String> {
        let expected = "expected file:///folder or s3://bucket/prefix, the URL the workers write to (SHOTFLEET_STORE)";
        // Never echo what may be a secret written into the URL.
        let url = &redact(url);
        let parsed = Url::parse(url).map_err(|e| format!("store `{url}`: {e}; {expected}"))?;
        if url.contains("***@") {
            return Err("the store URL holds credentials: give them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)".into());
        }
        let inner: Arc<dyn ObjectStore> = match parsed.scheme() {
            "file" => {
                let folder = parsed
                    .to_file_path()
                    .ok()
                    .filter(|_| url.starts_with("file:///"))
                    .ok_or_else(|| format!("store `{url}` is not an absolute folder: file:///var/lib/shotfleet/images"))?;
                Arc::new(LocalFileSystem::new_with_prefix(&folder).map_err(|e| format!("store `{url}`: {e}"))?)
            }
            "s3" => {
                let bucket = parsed.host_str().filter(|b| !b.is_empty()).ok_or_else(|| format!("store `{url}` names no bucket; {expected}"))?;
                let mut builder = AmazonS3Builder::new().with_bucket_name(bucket);
                for (key, value) in env.into_iter().filter(|(k, _)| k.starts_with("AWS_")) {
                    let key = match key.as_str() {
                        "AWS_ALLOW_HTTP" => "allow_http".to_owned(),
                        other => other.to_ascii_lowercase(),
                    };
                    if let Ok(key) = key.parse() {
                        builder = builder.with_config(key, value);
                    }
                }
                Arc::new(builder.build().map_err(|e| format!("store `{url}`: {e}"))?)
            }
            other => return Err(format!("store `{url}`: unknown scheme `{other}`; {expected}")),
        };
        Ok(Self { inner })
    }

    /// The bytes of the object a result names.
    ///
    /// # Errors
    /// The store's answer, naming the key.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>, String> {
        let path = Path::parse(key).map_err(|e| format!("`{key}` is not an object key: {e}"))?;
        let object = self.inner.get(&path).await.map_err(|e| format!("cannot read {key}: {e}"))?;
        Ok(object.bytes().await.map_err(|e| format!("cannot read {key}: {e}"))?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_a_url_are_refused_and_never_shown() {
        let err = ImageStore::open("s3://key:secret@sheets/renders", Vec::new()).unwrap_err();
        assert!(err.contains("AWS_ACCESS_KEY_ID") && !err.contains("secret"), "{err}");
        assert_eq!(redact("file:///srv/a@b/images"), "file:///srv/a@b/images", "an @ in a folder is no user");
        assert!(ImageStore::open("ftp://host/x", Vec::new()).unwrap_err().contains("unknown scheme `ftp`"));
        assert!(ImageStore::open("file://relative/x", Vec::new()).unwrap_err().contains("absolute"));
    }
}
