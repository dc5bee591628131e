//! The commit protocol under crashes and races: afterwards every image a result names exists
//! with its sha256 and no other object stays under the job.

use std::time::Duration;

use shotfleet_schema::nats::Topology;
use shotfleet_schema::Priority;
use shotfleet_testkit::{NatsServer, S3Server};
use shotfleet_tests::*;

fn short_ack_wait() -> Topology {
    Topology { ack_wait: Duration::from_secs(3), ..Topology::default() }
}

#[tokio::test]
async fn a_worker_killed_after_upload_leaves_one_result_and_no_strays() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &short_ack_wait()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("doomed", store.path());
    spec.extra = "[faults]\ncrash_at = \"after_upload\"\nmark_images = true\n".into();
    let mut doomed = Worker::start(&server.url(), spec);
    let j = shot(Priority::P1, job("crash-1", "acme", (64, 64), 3, 2));
    submit(&js, std::slice::from_ref(&j)).await;
    let status = doomed.wait_exit(Duration::from_secs(60)).expect("the worker dies at the crash point");
    assert_eq!(status.code(), Some(137), "{}", doomed.log());
    // Its images are in the store, without a result.
    let job_dir = store.path().join("acme/crash-1");
    assert_eq!(std::fs::read_dir(&job_dir).unwrap().count(), 2, "the dead worker uploaded two images");

    // A healthy worker (rendering different bytes, as another GPU model would) takes the
    // redelivery, commits, and sweeps the dead worker's images.
    let mut spec = WorkerSpec::new("heir", store.path());
    spec.extra = "[faults]\nmark_images = true\n".into();
    let _heir = Worker::start(&server.url(), spec);
    let done = outcomes(&js, &[j], Duration::from_secs(60)).await;
    let result = results(&done).remove(0);
    assert_eq!(result.worker, "heir");
    assert!(result.attempt >= 2);
    wait_settled(&js, Duration::from_secs(20)).await;
    check_store(store.path(), &result);
    assert_eq!(std::fs::read_dir(&job_dir).unwrap().count(), 2);
}

#[tokio::test]
async fn a_worker_killed_after_publishing_is_acked_by_the_next_without_rendering() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &short_ack_wait()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("doomed", store.path());
    spec.extra = "[faults]\ncrash_at = \"after_publish\"\n".into();
    let mut doomed = Worker::start(&server.url(), spec);
    let j = shot(Priority::P1, job("crash-2", "acme", (64, 64), 3, 1));
    submit(&js, std::slice::from_ref(&j)).await;
    assert_eq!(doomed.wait_exit(Duration::from_secs(60)).and_then(|s| s.code()), Some(137));
    let heir = Worker::start(&server.url(), WorkerSpec::new("heir", store.path()));
    let done = outcomes(&js, std::slice::from_ref(&j), Duration::from_secs(30)).await;
    let result = results(&done).remove(0);
    assert_eq!(result.worker, "doomed", "the committed result stands");
    wait_settled(&js, Duration::from_secs(20)).await;
    check_store(store.path(), &result);
    // The redelivery is acked without a render.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !heir.metrics().contains("outcome=\"duplicate_skip\"") {
        assert!(std::time::Instant::now() < deadline, "the heir never saw the redelivery:\n{}", heir.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!heir.metrics().contains("shotfleet_render_seconds_count"), "no render happened");
}

#[tokio::test]
async fn two_workers_rendering_one_job_leave_one_result_and_only_its_images() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &short_ack_wait()).await;
    let store = tempfile::tempdir().unwrap();
    // The first stalls before publishing, without progress acks, until the second has
    // committed: the server redelivers the job to the second, which commits first. Both render
    // different bytes.
    let mut slow = WorkerSpec::new("slow", store.path());
    slow.extra = "[faults]\nstall_before_publish = \"100ms\"\nstall_until_committed = true\nmark_images = true\n".into();
    let slow = Worker::start(&server.url(), slow);
    let j = shot(Priority::P1, job("race-1", "acme", (64, 64), 3, 2));
    submit(&js, std::slice::from_ref(&j)).await;
    // Let the slow one fetch it first.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !slow.log().contains("stalling before publish") {
        assert!(std::time::Instant::now() < deadline, "{}", slow.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut fast = WorkerSpec::new("fast", store.path());
    fast.extra = "[faults]\nmark_images = true\n".into();
    let _fast = Worker::start(&server.url(), fast);
    let done = outcomes(&js, std::slice::from_ref(&j), Duration::from_secs(60)).await;
    let result = results(&done).remove(0);
    assert_eq!(result.worker, "fast");
    // Wait for the slow one to lose the race and clean up after itself.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !slow.log().contains("another outcome was committed first") {
        assert!(std::time::Instant::now() < deadline, "{}", slow.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_settled(&js, Duration::from_secs(20)).await;
    check_store(store.path(), &result);
    let files = std::fs::read_dir(store.path().join("acme/race-1")).unwrap().count();
    assert_eq!(files, 2, "only the committed result's two images remain");
}

#[tokio::test]
async fn images_go_to_s3_with_the_same_protocol() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let s3 = S3Server::start();
    s3.create_bucket("renders");
    let scratch = tempfile::tempdir().unwrap();
    let _worker = Worker::start(&server.url(), WorkerSpec::new("s3-worker", scratch.path()).on_s3(&s3.endpoint(), 5000));
    let j = shot(Priority::P0, job("s3-1", "acme", (64, 64), 2, 2));
    submit(&js, std::slice::from_ref(&j)).await;
    let result = results(&outcomes(&js, &[j], Duration::from_secs(60)).await).remove(0);
    assert_eq!(result.images.len(), 2);
    let config = shotfleet_consumer::store::StoreConfig {
        url: "s3://renders/shotfleet".into(),
        endpoint: Some(s3.endpoint()),
        allow_http: true,
        ..Default::default()
    };
    let client = shotfleet_consumer::store::Store::open(&config, S3Server::credentials()).unwrap();
    for image in &result.images {
        assert!(image.key.starts_with("shotfleet/acme/s3-1/"), "{}", image.key);
        let body = client.get(&image.key).await.unwrap();
        use sha2::Digest;
        assert_eq!(hex::encode(sha2::Sha256::digest(&body)), image.sha256);
    }
    let listed = client.list_job("acme", "s3-1").await.unwrap();
    assert_eq!(listed.len(), 2, "nothing else under the job: {listed:?}");
}

#[tokio::test]
async fn a_stray_message_on_a_jobs_result_subject_does_not_wedge_it() {
    // On a server without the shipped roles any client may publish on a result subject; a
    // message there that is no outcome settles nothing, and the job's outcome claims over it.
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let stray = shotfleet_schema::subject::result("acme", "stray-1");
    js.publish(stray, r#"{"job_id": "stray-1", "prompt": "not an outcome"}"#.into()).await.unwrap().await.unwrap();
    let worker = Worker::start(&server.url(), WorkerSpec::new("w", store.path()));
    let j = shot(Priority::P1, job("stray-1", "acme", (64, 64), 2, 1));
    submit(&js, std::slice::from_ref(&j)).await;
    let result = results(&outcomes(&js, std::slice::from_ref(&j), Duration::from_secs(60)).await).remove(0);
    assert_eq!(result.worker, "w");
    assert!(worker.log().contains("settling the job over a message that is no outcome"), "{}", worker.log());
    check_store(store.path(), &result);
}
