//! The store's behaviour, written once and run against both backends (object_store's conformance
//! style): a local folder (`store_local::*`) and S3 on a real moto server (`store_s3::*`).

mod store_support;

use std::collections::HashSet;

use shotfleet_consumer::store::{Store, StoreErrorKind};
use store_support::png;

/// Generates one test per body for each backend. A body gets the store and the key prefix its
/// keys start with (`""` or `"shotfleet/v1/"`).
macro_rules! conformance {
    ($($body:ident),* $(,)?) => {
        mod store_local {
            $(
                #[tokio::test]
                async fn $body() {
                    let (store, _dir) = crate::store_support::local_store();
                    crate::$body(&store, "").await;
                }
            )*
        }
        mod store_s3 {
            $(
                #[tokio::test]
                async fn $body() {
                    let (store, _server) = crate::store_support::s3_store("shotfleet/v1");
                    crate::$body(&store, "shotfleet/v1/").await;
                }
            )*
        }
    };
}

conformance!(
    put_image_stores_under_a_content_addressed_key,
    list_job_lists_that_job_only,
    sweep_job_deletes_everything_not_kept,
    delete_ignores_missing_keys_and_refuses_foreign_ones,
    unsafe_ids_are_refused,
    get_of_a_missing_key_is_not_found,
    startup_check_passes,
);

async fn put_image_stores_under_a_content_addressed_key(store: &Store, prefix: &str) {
    let bytes = png("first");
    let stored = store.put_image("acme", "job-1", "shot_7", 3, bytes.clone()).await.unwrap();
    let sha = hex_sha256(&bytes);
    assert_eq!(stored.key, format!("{prefix}acme/job-1/shot_7-3-{}.png", &sha[..8]));
    assert_eq!(stored.sha256, sha);
    assert_eq!(stored.bytes, bytes.len() as u64);
    assert_eq!(store.get(&stored.key).await.unwrap(), bytes);

    // Equal bytes, equal key: a retried upload overwrites itself.
    let again = store.put_image("acme", "job-1", "shot_7", 3, bytes.clone()).await.unwrap();
    assert_eq!(again, stored);
    // A different render of the same image gets its own key; the first is untouched.
    let other = store.put_image("acme", "job-1", "shot_7", 3, png("second")).await.unwrap();
    assert_ne!(other.key, stored.key);
    assert_eq!(store.get(&stored.key).await.unwrap(), bytes);
}

async fn list_job_lists_that_job_only(store: &Store, _prefix: &str) {
    assert_eq!(store.list_job("acme", "job-1").await.unwrap(), Vec::<String>::new(), "nothing stored yet");
    let a = store.put_image("acme", "job-1", "s", 1, png("a")).await.unwrap();
    let b = store.put_image("acme", "job-1", "s", 0, png("b")).await.unwrap();
    // Neighbours that a string prefix match would confuse with job-1.
    store.put_image("acme", "job-10", "s", 0, png("c")).await.unwrap();
    store.put_image("acme2", "job-1", "s", 0, png("d")).await.unwrap();

    let mut expected = vec![a.key, b.key];
    expected.sort();
    assert_eq!(store.list_job("acme", "job-1").await.unwrap(), expected);
}

async fn sweep_job_deletes_everything_not_kept(store: &Store, _prefix: &str) {
    // Two attempts of one job rendered different bytes; the second committed.
    let first: Vec<_> = futures::future::try_join_all(
        (0..2).map(|i| store.put_image("acme", "job-1", "s", i, png(&format!("attempt-1-{i}")))),
    )
    .await
    .unwrap();
    let second: Vec<_> = futures::future::try_join_all(
        (0..2).map(|i| store.put_image("acme", "job-1", "s", i, png(&format!("attempt-2-{i}")))),
    )
    .await
    .unwrap();
    let neighbour = store.put_image("acme", "job-2", "s", 0, png("attempt-1-0")).await.unwrap();

    let keep: HashSet<String> = second.iter().map(|s| s.key.clone()).collect();
    assert_eq!(store.sweep_job("acme", "job-1", &keep).await.unwrap(), 2);
    let mut kept: Vec<String> = keep.iter().cloned().collect();
    kept.sort();
    assert_eq!(store.list_job("acme", "job-1").await.unwrap(), kept);
    for gone in &first {
        assert_eq!(store.get(&gone.key).await.unwrap_err().kind(), StoreErrorKind::NotFound);
    }
    assert_eq!(store.sweep_job("acme", "job-1", &keep).await.unwrap(), 0, "a second sweep finds nothing");

    // Before a re-render: clear the folder.
    assert_eq!(store.sweep_job("acme", "job-1", &HashSet::new()).await.unwrap(), 2);
    assert!(store.list_job("acme", "job-1").await.unwrap().is_empty());
    assert_eq!(store.sweep_job("acme", "job-1", &HashSet::new()).await.unwrap(), 0);
    assert_eq!(store.list_job("acme", "job-2").await.unwrap(), vec![neighbour.key], "other jobs untouched");
}

async fn delete_ignores_missing_keys_and_refuses_foreign_ones(store: &Store, prefix: &str) {
    let stored = store.put_image("acme", "job-1", "s", 0, png("x")).await.unwrap();
    let missing = format!("{prefix}acme/job-1/s-9-00000000.png");
    store.delete(&[stored.key.clone(), missing.clone()]).await.unwrap();
    assert!(store.list_job("acme", "job-1").await.unwrap().is_empty());
    store.delete(&[missing]).await.unwrap();

    for bad in ["../elsewhere/x.png", "acme/../../x.png", ""] {
        let err = store.delete(&[bad]).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::InvalidKey, "{bad:?}: {err}");
    }
    if !prefix.is_empty() {
        let err = store.delete(&["someone-else/acme/job-1/s-0-00000000.png"]).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::InvalidKey, "{err}");
        assert!(err.to_string().contains("is not an object under"), "{err}");
    }
}

async fn unsafe_ids_are_refused(store: &Store, _prefix: &str) {
    let put = store.put_image("..", "job-1", "s", 0, png("x")).await.unwrap_err();
    assert_eq!(put.kind(), StoreErrorKind::InvalidKey);
    assert!(put.to_string().contains("project"), "{put}");
    let put = store.put_image("acme", "job-1", "a/b", 0, png("x")).await.unwrap_err();
    assert!(put.to_string().contains("shot_id"), "{put}");
    let list = store.list_job("acme", "job\n1").await.unwrap_err();
    assert_eq!(list.kind(), StoreErrorKind::InvalidKey);
    let sweep = store.sweep_job("acme", "../job-1", &HashSet::new()).await.unwrap_err();
    assert_eq!(sweep.kind(), StoreErrorKind::InvalidKey);
}

async fn get_of_a_missing_key_is_not_found(store: &Store, prefix: &str) {
    let err = store.get(&format!("{prefix}acme/job-1/s-0-00000000.png")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::NotFound, "{err}");
}

async fn startup_check_passes(store: &Store, _prefix: &str) {
    store.check().await.unwrap();
    store.check().await.unwrap();
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}
