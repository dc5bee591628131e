//! Store errors, and the one decision callers make from them: their [`StoreErrorKind`].

use std::time::Duration;

use object_store::client::{HttpError, HttpErrorKind};

/// What a caller should do about a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// Another try later may work: storage unreachable, timed out, throttled, 5xx, disk full.
    /// The store has already retried within its budget; the worker counts a failed attempt and
    /// naks the job with a backoff.
    Transient,
    /// Retrying cannot help until an operator acts: a bad URL or setting, credentials refused,
    /// permission denied, the bucket gone. At start the worker refuses to run; at run time it
    /// gives its jobs back (they are fine) and stops with `EXIT_STORE`.
    Permanent,
    /// An input (project, job or shot id, or a key handed back) cannot make a safe key. The job is
    /// invalid and goes to the failed stream.
    InvalidKey,
    /// The object does not exist (only [`Store::get`](super::Store::get) reports this).
    NotFound,
}

/// Which storage call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::Display)]
#[strum(serialize_all = "lowercase")]
pub enum Op {
    Put,
    Get,
    List,
    Delete,
}

/// A store failure. Messages name the setting, key or location involved; none carries a secret
/// (credentials never enter [`StoreConfig`](super::StoreConfig), and the environment is not echoed).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The `url` setting cannot name a store.
    #[error("store url `{url}`: {reason}")]
    Url { url: String, reason: String },

    /// Another setting is unusable.
    #[error("store setting `{key}`: {reason}")]
    Config { key: &'static str, reason: String },

    /// The local folder could not be created or opened.
    #[error("store folder {path}: {source}")]
    Folder { path: String, source: std::io::Error },

    /// object_store refused the configuration (for example a half-set credential pair).
    #[error("cannot set up the store {location}: {source}")]
    Build { location: String, source: object_store::Error },

    /// The start-up check could not write, read back or delete its probe object.
    #[error("start-up check of {location} failed: could not {step} the probe object ({hint}): {source}")]
    Probe { location: String, step: &'static str, hint: &'static str, source: Box<StoreError> },

    /// The probe object read back differs from what was written.
    #[error("start-up check of {location} failed: the probe object {key} read back different bytes")]
    ProbeMismatch { location: String, key: String },

    /// An input that goes into a key is unsafe.
    #[error("key part `{field}` = \"{value}\" {reason}")]
    InvalidKeyPart { field: &'static str, value: String, reason: &'static str },

    /// A key handed to [`Store::get`](super::Store::get) or [`Store::delete`](super::Store::delete)
    /// is malformed or lies outside this store's prefix.
    #[error("key `{key}` {reason}")]
    InvalidKey { key: String, reason: String },

    /// A storage call failed, after retries when it was transient.
    #[error("{op} {target} failed after {attempts} attempt(s) in {elapsed:.1?}: {source}")]
    Operation {
        op: Op,
        target: String,
        attempts: u32,
        elapsed: Duration,
        kind: StoreErrorKind,
        source: object_store::Error,
    },
}

impl StoreError {
    /// What the caller should do; see [`StoreErrorKind`].
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            Self::Url { .. } | Self::Config { .. } | Self::Folder { .. } | Self::Build { .. } => {
                StoreErrorKind::Permanent
            }
            Self::ProbeMismatch { .. } => StoreErrorKind::Permanent,
            Self::Probe { source, .. } => source.kind(),
            Self::InvalidKeyPart { .. } | Self::InvalidKey { .. } => StoreErrorKind::InvalidKey,
            Self::Operation { kind, .. } => *kind,
        }
    }
}

/// Sorts an object_store error into a kind.
///
/// object_store maps the HTTP statuses it understands to variants (404, 403, 401, 409, 412) and
/// reports everything else as `Generic` without a public status: what arrives there is a transport
/// failure, a 5xx or 429 its client would itself retry, or a local I/O error. All of those are worth
/// another try within a bounded budget, except a local permission or read-only failure, or a
/// store folder that a file has taken the place of (no retry brings it back).
pub(crate) fn classify(op: Op, error: &object_store::Error) -> StoreErrorKind {
    use object_store::Error as E;
    match error {
        // A put or list can only 404 when the bucket is gone (start-up checked it existed): every
        // job would fail the same way, so no job should be charged for it. The worker gives its
        // jobs back and stops until an operator restores the bucket.
        E::NotFound { .. } if op != Op::Get => StoreErrorKind::Permanent,
        E::NotFound { .. } => StoreErrorKind::NotFound,
        E::Generic { .. } => match io_error_kind(error) {
            Some(
                std::io::ErrorKind::PermissionDenied
                | std::io::ErrorKind::ReadOnlyFilesystem
                | std::io::ErrorKind::NotADirectory,
            ) => {
                StoreErrorKind::Permanent
            }
            _ => StoreErrorKind::Transient,
        },
        _ => StoreErrorKind::Permanent,
    }
}

/// The kind of the first I/O error in `error`'s source chain (local filesystem failures).
fn io_error_kind(error: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut next = error.source();
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        next = e.source();
    }
    None
}

/// What an operator should look at first when the start-up probe failed with `error`.
pub(crate) fn probe_hint(error: &StoreError) -> &'static str {
    let StoreError::Operation { source, .. } = error else { return "see the cause" };
    match source {
        object_store::Error::NotFound { .. } => "does the bucket exist?",
        object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
            "check the credentials in the environment and the bucket's policy"
        }
        _ if is_unreachable(source) => "is the endpoint up, and is its address right?",
        _ => "see the cause",
    }
}

/// Whether `error` says the endpoint could not be reached at all (connection refused, DNS, TLS).
fn is_unreachable(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(http) = e.downcast_ref::<HttpError>() {
            return matches!(http.kind(), HttpErrorKind::Connect | HttpErrorKind::Timeout);
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> object_store::Error {
        // Shaped as LocalFileSystem reports it: Generic wrapping an error whose source is the io::Error.
        #[derive(Debug, thiserror::Error)]
        #[error("local")]
        struct Local(#[source] std::io::Error);
        object_store::Error::Generic { store: "LocalFileSystem", source: Box::new(Local(std::io::Error::from(kind))) }
    }

    #[test]
    fn local_permission_failures_are_permanent_others_transient() {
        assert_eq!(classify(Op::Put, &io(std::io::ErrorKind::PermissionDenied)), StoreErrorKind::Permanent);
        assert_eq!(classify(Op::Put, &io(std::io::ErrorKind::ReadOnlyFilesystem)), StoreErrorKind::Permanent);
        assert_eq!(classify(Op::Put, &io(std::io::ErrorKind::NotADirectory)), StoreErrorKind::Permanent);
        assert_eq!(classify(Op::Put, &io(std::io::ErrorKind::StorageFull)), StoreErrorKind::Transient);
    }

    #[test]
    fn denied_and_unauthenticated_are_permanent() {
        let denied = object_store::Error::PermissionDenied { path: "k".into(), source: "403".into() };
        let unauth = object_store::Error::Unauthenticated { path: "k".into(), source: "401".into() };
        assert_eq!(classify(Op::Put, &denied), StoreErrorKind::Permanent);
        assert_eq!(classify(Op::List, &unauth), StoreErrorKind::Permanent);
    }

    #[test]
    fn not_found_is_missing_object_for_get_and_missing_bucket_otherwise() {
        let nf = || object_store::Error::NotFound { path: "k".into(), source: "404".into() };
        assert_eq!(classify(Op::Get, &nf()), StoreErrorKind::NotFound);
        assert_eq!(classify(Op::Put, &nf()), StoreErrorKind::Permanent);
        assert_eq!(classify(Op::List, &nf()), StoreErrorKind::Permanent);
    }
}
