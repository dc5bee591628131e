//! S3 behaviour a local folder cannot show: the endpoint going away, and the start-up check's
//! reports. Against a real moto server.

mod store_support;

use std::time::{Duration, Instant};

use shotfleet_consumer::store::{RetryConfig, Store, StoreError, StoreErrorKind};
use shotfleet_testkit::{S3Server, TcpProxy};
use store_support::{create_bucket, png, s3_config, s3_store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_s3_put_rides_out_an_endpoint_restart() {
    // Through a proxy, so the endpoint comes back only once the restarted moto has its bucket
    // again: a put landing between the two would rightly fail for good (no such bucket).
    let mut server = S3Server::start();
    create_bucket(&server);
    let mut proxy = TcpProxy::start(&server.endpoint());
    let (config, mut env) = s3_config(&server, "shotfleet");
    env.retain(|(k, _)| k != "AWS_ENDPOINT_URL");
    env.push(("AWS_ENDPOINT_URL".into(), proxy.endpoint()));
    let store = Store::open(&config, env).unwrap();
    proxy.down();
    server.stop();
    let put = tokio::spawn({
        let store = store.clone();
        async move { store.put_image("acme", "job-1", "s", 0, png("survivor")).await }
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!put.is_finished(), "the put should still be retrying: {:?}", put.await);

    // moto comes back empty: the bucket has to be made again, as an operator would.
    tokio::task::block_in_place(|| {
        server.start_again();
        create_bucket(&server);
        proxy.up();
    });
    let stored = tokio::time::timeout(Duration::from_secs(20), put).await.unwrap().unwrap().unwrap();
    assert_eq!(store.get(&stored.key).await.unwrap(), png("survivor"));
}

#[tokio::test]
async fn store_s3_put_fails_transient_and_says_why_when_the_endpoint_stays_down() {
    let mut server = S3Server::start();
    create_bucket(&server);
    let (mut config, env) = s3_config(&server, "shotfleet");
    config.retry = RetryConfig { max_attempts: 4, initial_backoff_ms: 20, max_backoff_ms: 100, max_elapsed_ms: 5_000 };
    let store = Store::open(&config, env).unwrap();
    server.stop();

    let started = Instant::now();
    let err = store.put_image("acme", "job-1", "s", 0, png("lost")).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!(err.kind(), StoreErrorKind::Transient);
    let message = err.to_string();
    assert!(message.starts_with("put shotfleet/acme/job-1/s-0-"), "{message}");
    assert!(message.contains("after 4 attempt(s)"), "{message}");
}

#[tokio::test]
async fn store_s3_check_names_an_unreachable_endpoint() {
    let mut server = S3Server::start();
    let (mut config, env) = s3_config(&server, "shotfleet");
    config.retry = RetryConfig { max_attempts: 2, initial_backoff_ms: 10, max_backoff_ms: 10, max_elapsed_ms: 1_000 };
    server.stop();

    let err = Store::connect(&config, env).await.unwrap_err();
    assert!(matches!(err, StoreError::Probe { step: "write", .. }), "{err:?}");
    assert_eq!(err.kind(), StoreErrorKind::Transient);
    let message = err.to_string();
    assert!(message.contains(&format!("s3://renders/shotfleet at {}", server.endpoint())), "{message}");
    assert!(message.contains("is the endpoint up"), "{message}");
}

#[tokio::test]
async fn store_s3_check_names_a_missing_bucket() {
    let server = S3Server::start();
    let (mut config, env) = s3_config(&server, "shotfleet");
    config.retry = RetryConfig { max_attempts: 2, initial_backoff_ms: 10, max_backoff_ms: 10, max_elapsed_ms: 1_000 };

    let err = Store::connect(&config, env).await.unwrap_err();
    assert!(err.to_string().contains("does the bucket exist?"), "{err}");
    assert_eq!(err.kind(), StoreErrorKind::Permanent, "no job can fix a missing bucket");
}

#[tokio::test]
async fn store_s3_check_removes_its_probe() {
    let (store, server) = s3_store("shotfleet");
    store.check().await.unwrap();
    // The probe lives under <prefix>/_shotfleet_probe/: seen from the bucket's root, that folder
    // reads as project "shotfleet", job "_shotfleet_probe".
    let (mut root_config, env) = s3_config(&server, "");
    root_config.url = "s3://renders".into();
    let root = Store::open(&root_config, env).unwrap();
    assert_eq!(root.list_job("shotfleet", "_shotfleet_probe").await.unwrap(), Vec::<String>::new());
}
