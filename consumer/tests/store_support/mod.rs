//! Shared by the store tests: the two backends, made the same way, and a bucket on moto.

#![allow(dead_code)] // each test binary uses a different part


use shotfleet_consumer::store::{RetryConfig, Store, StoreConfig};
use shotfleet_testkit::S3Server;

pub const BUCKET: &str = "renders";

/// Retries quick enough for tests, long enough to ride out a moto restart (~1-3 s).
pub fn test_retry() -> RetryConfig {
    RetryConfig { max_attempts: 40, initial_backoff_ms: 50, max_backoff_ms: 500, max_elapsed_ms: 15_000 }
}

/// A local store in a fresh temporary folder (kept alive by the returned guard).
pub fn local_store() -> (Store, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        url: format!("file://{}/images", dir.path().display()),
        retry: test_retry(),
        ..StoreConfig::default()
    };
    let store = Store::open(&config, no_env()).unwrap();
    (store, dir)
}

/// The settings and environment for `s3://renders/<prefix>` on `server`.
pub fn s3_config(server: &S3Server, prefix: &str) -> (StoreConfig, Vec<(String, String)>) {
    let config = StoreConfig {
        url: format!("s3://{BUCKET}/{prefix}"),
        allow_http: true,
        retry: test_retry(),
        ..StoreConfig::default()
    };
    let mut env: Vec<(String, String)> =
        S3Server::credentials().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    env.push(("AWS_ENDPOINT_URL".into(), server.endpoint()));
    (config, env)
}

/// A moto server with the bucket created, and a store on it under `prefix`.
pub fn s3_store(prefix: &str) -> (Store, S3Server) {
    let server = S3Server::start();
    create_bucket(&server);
    let (config, env) = s3_config(&server, prefix);
    (Store::open(&config, env).unwrap(), server)
}

pub fn no_env() -> Vec<(String, String)> {
    Vec::new()
}

/// Creates the test bucket.
pub fn create_bucket(server: &S3Server) {
    server.create_bucket(BUCKET);
}

/// Bytes that stand in for a PNG: the store never parses them.
pub fn png(tag: &str) -> Vec<u8> {
    let mut bytes = b"\x89PNG\r\n\x1a\n".to_vec();
    bytes.extend_from_slice(tag.as_bytes());
    bytes
}
