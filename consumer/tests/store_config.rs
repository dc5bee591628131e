//! `[store]` settings: what is refused at start, and how it is said. No server needed.

use shotfleet_consumer::store::{Store, StoreConfig, StoreError, StoreErrorKind};

fn open(url: &str) -> Result<Store, StoreError> {
    open_with(StoreConfig { url: url.into(), ..StoreConfig::default() }, &[])
}

fn open_with(config: StoreConfig, env: &[(&str, &str)]) -> Result<Store, StoreError> {
    Store::open(&config, env.iter().map(|(k, v)| (*k, *v)))
}

fn refused(result: Result<Store, StoreError>) -> String {
    let err = result.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Permanent, "{err}");
    err.to_string()
}

#[test]
fn store_config_refuses_an_unknown_scheme() {
    let message = refused(open("gs://bucket/prefix"));
    assert!(message.contains("unknown scheme `gs`"), "{message}");
    assert!(message.contains("file:///folder or s3://bucket/prefix"), "{message}");
}

#[test]
fn store_config_refuses_relative_paths() {
    for url in ["images", "./images", "file://images/x", "file:images"] {
        let message = refused(open(url));
        assert!(message.contains(url), "{message}");
    }
    assert!(refused(open("file://images/x")).contains("absolute path"));
}

#[test]
fn store_config_refuses_an_empty_bucket() {
    for url in ["s3:///prefix", "s3://"] {
        let message = refused(open(url));
        assert!(message.contains("names no bucket"), "{url}: {message}");
    }
}

#[test]
fn store_config_creates_a_missing_local_folder_only_inside_one_that_exists() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("images");
    let store = open(&format!("file://{}", folder.display())).unwrap();
    assert!(folder.is_dir());
    assert_eq!(store.location(), format!("file://{}", folder.display()));
    assert_eq!(store.url("p/j/s-0-01234567.png"), format!("file://{}/p/j/s-0-01234567.png", folder.display()));
    // A slip in the path (or a share not mounted) is refused, not made on the local disk.
    let deep = dir.path().join("a/b/images");
    let message = refused(open(&format!("file://{}", deep.display())));
    assert!(message.contains("a/b/images") && message.contains("does not exist") && message.contains("create it first"), "{message}");
    assert!(!dir.path().join("a").exists());
}

#[tokio::test]
async fn a_local_store_whose_folder_went_away_refuses_to_write_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("images");
    let store = open(&format!("file://{}", folder.display())).unwrap();
    store.check().await.unwrap();
    std::fs::rename(&folder, dir.path().join("moved")).unwrap();
    let err = store.check().await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Permanent, "{err}");
    assert!(err.to_string().contains("the store folder is gone"), "{err}");
    assert!(!folder.exists(), "nothing made in its place");
    // An empty folder at the same path (a share's mount point, the share unmounted) is not it.
    std::fs::create_dir(&folder).unwrap();
    let err = store.check().await.unwrap_err();
    assert!(err.to_string().contains("another folder than at start"), "{err}");
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0, "nothing written there");
}

#[test]
fn store_config_names_a_folder_it_cannot_create() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-folder");
    std::fs::write(&file, b"x").unwrap();
    let message = refused(open(&format!("file://{}/images", file.display())));
    assert!(message.contains("not-a-folder/images"), "{message}");
}

#[test]
fn store_config_wants_allow_http_for_a_plain_endpoint() {
    let s3 = |allow_http| StoreConfig { url: "s3://b/p".into(), allow_http, ..StoreConfig::default() };
    let env = [("AWS_ENDPOINT_URL", "http://127.0.0.1:9")];
    let message = refused(open_with(s3(false), &env));
    assert!(message.contains("allow_http"), "{message}");
    open_with(s3(true), &env).unwrap();
    open_with(s3(false), &[env[0], ("AWS_ALLOW_HTTP", "true")]).unwrap();
    // The file's endpoint wins over the environment's.
    let config = StoreConfig { endpoint: Some("https://s3.example.test".into()), ..s3(false) };
    let store = open_with(config, &env).unwrap();
    assert_eq!(store.location(), "s3://b/p at https://s3.example.test/");
}

#[test]
fn store_config_never_shows_secrets() {
    let secret = "wJalrXUtnFEMI-very-secret";
    let env = [
        ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
        ("AWS_SECRET_ACCESS_KEY", secret),
        ("AWS_ENDPOINT_URL", "http://user:hunter2@127.0.0.1:9"),
    ];
    let config = StoreConfig { url: "s3://b/p".into(), ..StoreConfig::default() };
    let message = refused(open_with(config.clone(), &env));
    assert!(!message.contains("hunter2") && !message.contains(secret), "{message}");

    let store = open_with(StoreConfig { allow_http: true, ..config }, &env).unwrap();
    let shown = format!("{store:?} {}", store.location());
    assert!(!shown.contains("hunter2") && !shown.contains(secret), "{shown}");
}

#[test]
fn store_config_refuses_half_a_credential_pair() {
    let config = StoreConfig { url: "s3://b/p".into(), ..StoreConfig::default() };
    let message = refused(open_with(config, &[("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")]));
    assert!(message.contains("s3://b/p"), "{message}");
}

#[test]
fn store_config_refuses_unusable_retries() {
    let mut config = StoreConfig::default();
    config.retry.max_attempts = 0;
    assert!(refused(open_with(config, &[])).contains("retry.max_attempts"));
}

#[test]
fn store_config_reads_toml_and_refuses_unknown_keys() {
    let config: StoreConfig = toml::from_str(
        r#"
        url = "s3://renders/shotfleet"
        endpoint = "http://minio:9000"
        allow_http = true
        [retry]
        max_attempts = 3
        "#,
    )
    .unwrap();
    assert_eq!(config.endpoint.as_deref(), Some("http://minio:9000"));
    assert_eq!(config.retry.max_attempts, 3);
    assert_eq!(config.retry.max_elapsed_ms, StoreConfig::default().retry.max_elapsed_ms);

    let err = toml::from_str::<StoreConfig>("url = \"s3://b\"\nendpont = \"http://x\"").unwrap_err();
    assert!(err.to_string().contains("endpont"), "{err}");
}

#[test]
fn store_config_has_no_default_location() {
    let message = refused(open_with(StoreConfig::default(), &[]));
    assert!(message.contains("no store configured"), "{message}");
}

#[test]
fn store_config_hides_credentials_written_into_the_url() {
    let message = refused(open("s3://AKIDEXAMPLE:hunter2@renders/p"));
    assert!(!message.contains("hunter2") && !message.contains("AKIDEXAMPLE"), "{message}");
    assert!(message.contains("s3://***@renders/p") && message.contains("AWS_SECRET_ACCESS_KEY"), "{message}");
    let message = refused(open("s3://AKIDEXAMPLE:hunter2@/p"));
    assert!(!message.contains("hunter2"), "{message}");
    let message = refused(open("ftp://user:hunter2@host/p"));
    assert!(!message.contains("hunter2"), "{message}");
}
