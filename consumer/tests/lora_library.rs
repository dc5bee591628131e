//! The LoRA library from a worker's side, on a local folder and on moto's S3: fetched once, then
//! from the disk cache (checked by sha256); unknown, deleted, corrupt and refused LoRAs make the
//! job invalid with a detail a person can act on; a store outage is retryable.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::{ObjectStore, ObjectStoreExt};
use object_store::path::Path as ObjectPath;
use shotfleet_consumer::library::{LibraryConfig, LibraryError, LibraryErrorKind, LoraLibrary};
use shotfleet_consumer::store::{RetryConfig, StoreConfig};
use shotfleet_schema::lora::library::{self, LoraEntry};
use shotfleet_schema::lora::{FileLimits, LoraFile};
use shotfleet_testkit::S3Server;

const BUCKET: &str = "renders";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/lora").join(name)).unwrap()
}

fn quick_retry() -> RetryConfig {
    RetryConfig { max_attempts: 3, initial_backoff_ms: 20, max_backoff_ms: 50, max_elapsed_ms: 2_000 }
}

/// A library (worker side) and a raw object store on the same place, to play `shotfleet lora push`.
struct Setup {
    library: LoraLibrary,
    raw: Arc<dyn ObjectStore>,
    /// The library's prefix inside `raw`.
    prefix: String,
    cache: PathBuf,
    _dir: tempfile::TempDir,
}

impl Setup {
    fn local(cache_max_mib: u64) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        std::fs::create_dir_all(&root).unwrap();
        let store = StoreConfig { url: format!("file://{}", root.display()), retry: quick_retry(), ..StoreConfig::default() };
        let raw: Arc<dyn ObjectStore> = Arc::new(object_store::local::LocalFileSystem::new_with_prefix(&root).unwrap());
        Self::with(store, Vec::new(), raw, String::new(), dir, cache_max_mib)
    }

    fn s3(server: &S3Server) -> Setup {
        server.create_bucket(BUCKET);
        let store = StoreConfig { url: format!("s3://{BUCKET}/shotfleet"), allow_http: true, retry: quick_retry(), ..StoreConfig::default() };
        let mut env: Vec<(String, String)> = S3Server::credentials().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        env.push(("AWS_ENDPOINT_URL".into(), server.endpoint()));
        let raw: Arc<dyn ObjectStore> = Arc::new(
            object_store::aws::AmazonS3Builder::new()
                .with_bucket_name(BUCKET)
                .with_endpoint(server.endpoint())
                .with_allow_http(true)
                .with_access_key_id(S3Server::credentials()[0].1)
                .with_secret_access_key(S3Server::credentials()[1].1)
                .with_region("us-east-1")
                .build()
                .unwrap(),
        );
        Self::with(store, env, raw, "shotfleet".into(), tempfile::tempdir().unwrap(), 1024)
    }

    fn with(store: StoreConfig, env: Vec<(String, String)>, raw: Arc<dyn ObjectStore>, base: String, dir: tempfile::TempDir, cache_max_mib: u64) -> Setup {
        let cache = dir.path().join("cache");
        let config = LibraryConfig { cache_dir: cache.clone(), cache_max_mib, ..LibraryConfig::default() };
        let library = LoraLibrary::open(&store, &config, env).unwrap();
        let prefix = if base.is_empty() { config.prefix.clone() } else { format!("{base}/{}", config.prefix) };
        Setup { library, raw, prefix, cache, _dir: dir }
    }

    fn key(&self, relative: &str) -> ObjectPath {
        ObjectPath::from(format!("{}/{relative}", self.prefix))
    }

    /// What `shotfleet lora push` leaves: the file, then its sidecar.
    async fn push(&self, name: &str, bytes: &[u8]) -> LoraEntry {
        let file = LoraFile::parse(bytes, &FileLimits::default()).unwrap();
        let entry = LoraEntry::describe(name, bytes, &file, 1);
        self.put(&library::file_key(name), bytes.to_vec()).await;
        self.put(&library::sidecar_key(name), serde_json::to_vec(&entry).unwrap()).await;
        entry
    }

    async fn put(&self, relative: &str, bytes: Vec<u8>) {
        self.raw.put(&self.key(relative), bytes.into()).await.unwrap();
    }

    async fn delete(&self, relative: &str) {
        self.raw.delete(&self.key(relative)).await.unwrap();
    }
}

fn expect_invalid(err: LibraryError, says: &[&str]) {
    assert_eq!(err.kind(), LibraryErrorKind::InvalidJob, "{err}");
    for text in says {
        assert!(err.to_string().contains(text), "{err}");
    }
}

#[tokio::test]
async fn fetched_once_then_from_the_checked_cache() {
    let setup = Setup::local(1024);
    let bytes = fixture("kohya_sgm.safetensors");
    let entry = setup.push("hero.v1", &bytes).await;
    let first = setup.library.fetch("hero.v1").await.unwrap();
    assert!(!first.from_cache);
    assert_eq!((first.entry.clone(), first.file.targets.len()), (entry.clone(), 237));
    let again = setup.library.fetch("hero.v1").await.unwrap();
    assert!(again.from_cache);
    assert_eq!(again.file, first.file);
    // A cached copy that rotted on disk is noticed and fetched again.
    let cached = setup.cache.join(format!("{}.safetensors", entry.sha256));
    std::fs::write(&cached, &bytes[..100]).unwrap();
    let healed = setup.library.fetch("hero.v1").await.unwrap();
    assert!(!healed.from_cache);
    assert_eq!(std::fs::read(&cached).unwrap(), bytes);
}

#[tokio::test]
async fn unknown_and_deleted_loras_make_the_job_invalid() {
    let setup = Setup::local(1024);
    expect_invalid(setup.library.fetch("nobody.v1").await.unwrap_err(), &["no LoRA named `nobody.v1`", "shotfleet lora push FILE --name nobody.v1"]);
    setup.push("gone.v1", &fixture("peft.safetensors")).await;
    setup.library.fetch("gone.v1").await.unwrap();
    // Deleted from the library while jobs still name it: the cache does not resurrect it.
    setup.delete(&library::sidecar_key("gone.v1")).await;
    setup.delete(&library::file_key("gone.v1")).await;
    expect_invalid(setup.library.fetch("gone.v1").await.unwrap_err(), &["no LoRA named `gone.v1`"]);
    expect_invalid(setup.library.fetch("../x").await.unwrap_err(), &["LoRA name `../x`"]);
}

#[tokio::test]
async fn a_truncated_or_refused_file_makes_the_job_invalid_saying_what_to_do() {
    let setup = Setup::local(1024);
    let bytes = fixture("kohya_sgm.safetensors");
    setup.push("cut.v1", &bytes).await;
    setup.put(&library::file_key("cut.v1"), bytes[..bytes.len() / 3].to_vec()).await;
    expect_invalid(setup.library.fetch("cut.v1").await.unwrap_err(), &["does not match its sidecar", "bytes, the sidecar says", "push it again"]);
    // A pickle that reached the library without `lora push`.
    let pickle = fixture("pickle.pt");
    let entry = LoraEntry { name: "sneaky.v1".into(), sha256: library::sha256_hex(&pickle), bytes: pickle.len() as u64, ..setup.push("sneaky.v1", &bytes).await };
    setup.put(&library::file_key("sneaky.v1"), pickle).await;
    setup.put(&library::sidecar_key("sneaky.v1"), serde_json::to_vec(&entry).unwrap()).await;
    expect_invalid(setup.library.fetch("sneaky.v1").await.unwrap_err(), &["pickle files can run code"]);
    setup.put(&library::sidecar_key("broken.v1"), b"{not json".to_vec()).await;
    expect_invalid(setup.library.fetch("broken.v1").await.unwrap_err(), &["sidecar in the library is unreadable"]);
}

#[tokio::test]
async fn the_cache_stays_within_its_size() {
    let setup = Setup::local(0); // nothing but the file just written stays
    setup.push("a.v1", &fixture("kohya_sgm.safetensors")).await;
    setup.push("b.v1", &fixture("peft.safetensors")).await;
    setup.library.fetch("a.v1").await.unwrap();
    setup.library.fetch("b.v1").await.unwrap();
    let files: Vec<_> = std::fs::read_dir(&setup.cache).unwrap().collect();
    assert_eq!(files.len(), 1, "only the latest file is kept");
    assert!(!setup.library.fetch("a.v1").await.unwrap().from_cache);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_s3_and_through_an_outage() {
    let mut server = S3Server::start();
    let setup = Setup::s3(&server);
    let entry = setup.push("ink-wash.v2", &fixture("peft.safetensors")).await;
    let fetched = setup.library.fetch("ink-wash.v2").await.unwrap();
    assert_eq!((fetched.entry, fetched.from_cache), (entry, false));
    assert!(setup.library.location().starts_with("s3://renders/shotfleet/_loras"), "{}", setup.library.location());
    tokio::task::block_in_place(|| server.stop());
    let err = setup.library.fetch("ink-wash.v2").await.unwrap_err();
    assert_eq!(err.kind(), LibraryErrorKind::Retry, "{err}");
    assert!(err.to_string().contains("retryable"), "{err}");
}
