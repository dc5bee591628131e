//! Every job settles exactly once: one outcome or one failed record, no image outliving its job,
//! under hostile payloads, late workers, crashes on the last delivery, rolling restarts, slow
//! stores and a store that goes away. (A crash after upload on a job's last delivery is in
//! failures.rs, with the rescue that sweeps it.)

use std::time::{Duration, Instant};

use async_nats::jetstream;
use shotfleet_producer::wait::Outcome;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{Priority, ResultStatus, failure, subject};
use shotfleet_testkit::{NatsServer, S3Server, ServerBinary, ServerOptions, TcpProxy};
use shotfleet_tests::*;

/// Every record in `SHOTS_FAILED`, as (headers, payload).
async fn failed_records(js: &jetstream::Context) -> Vec<(async_nats::HeaderMap, bytes::Bytes)> {
    let mut stream = js.get_stream(subject::FAILED_STREAM).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut records = Vec::new();
    for seq in 1..=last {
        if let Ok(message) = stream.get_raw_message(seq).await {
            records.push((message.headers, message.payload));
        }
    }
    records
}

async fn wait_for_records(js: &jetstream::Context, count: usize, timeout: Duration) -> Vec<(async_nats::HeaderMap, bytes::Bytes)> {
    let deadline = Instant::now() + timeout;
    loop {
        let records = failed_records(js).await;
        if records.len() >= count {
            return records;
        }
        assert!(Instant::now() < deadline, "{} failed record(s) after {timeout:?}, wanted {count}", records.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn header(headers: &async_nats::HeaderMap, name: &str) -> Option<String> {
    headers.get(name).map(|v| v.as_str().to_owned())
}

/// A job whose id holds a CR LF: it decodes (JSON escapes) but no header may carry it.
fn hostile_payload(n: u32) -> String {
    format!(
        r#"{{"v":1,"job_id":"evil-{n}\r\nNats-Msg-Id: x","project":"acme","shot_id":"s","prompt":"p","width":64,"height":64,"steps":2,"guidance":5.0,"seed":1}}"#
    )
}

#[tokio::test]
async fn a_job_id_with_a_line_break_ends_as_one_invalid_record_and_the_worker_lives() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut worker = Worker::start(&server.url(), WorkerSpec::new("steady", store.path()));
    js.publish("shots.p1.xs.acme", hostile_payload(1).into()).await.unwrap().await.unwrap();

    let records = wait_for_records(&js, 1, Duration::from_secs(30)).await;
    let (headers, payload) = &records[0];
    assert_eq!(header(headers, failure::REASON).as_deref(), Some("invalid"));
    assert_eq!(header(headers, failure::JOB_ID), None, "an id no header can hold is not named");
    let detail = header(headers, failure::DETAIL).unwrap();
    assert!(detail.contains("job_id") && !detail.contains('\r'), "{detail}");
    assert_eq!(&payload[..], hostile_payload(1).as_bytes(), "the raw id stays in the payload");

    // The worker is alive and serves the next job.
    let next = shot(Priority::P1, job("after-1", "acme", (64, 64), 2, 1));
    submit(&js, std::slice::from_ref(&next)).await;
    results(&outcomes(&js, &[next], Duration::from_secs(60)).await);
    assert!(worker.running());
    assert!(!worker.log().contains("panicked"), "{}", worker.log());
    wait_settled(&js, Duration::from_secs(10)).await;
    assert_eq!(failed_records(&js).await.len(), 1, "one record, not one per delivery");

    // `replay --job` finds it by the id it was sent with, and skips it: it would fail again.
    let filter = shotfleet_producer::replay::Filter { jobs: vec!["evil-1\r\nNats-Msg-Id: x".into()], ..Default::default() };
    let mut seen = Vec::new();
    let summary = shotfleet_producer::replay::replay(&js, &filter, false, |record, outcome| seen.push((record.job_name(), format!("{outcome:?}"))))
        .await
        .unwrap();
    assert_eq!(summary.matched, 1, "{seen:?}");
    assert_eq!(seen[0].0, r#""evil-1  Nats-Msg-Id: x" (no valid id)"#);
    assert!(seen[0].1.contains("Skipped") && seen[0].1.contains("a replay would fail the same way"), "{seen:?}");
    assert_eq!(failed_records(&js).await.len(), 1, "kept");
}

#[tokio::test]
async fn the_rescue_records_hostile_jobs_that_died_on_their_last_delivery_and_survives() {
    let server = NatsServer::start();
    // Long enough for the worker below to be listening before the deliveries run out (the
    // server emits the advisory when it would redeliver).
    let topology = Topology { max_deliver: 1, ack_wait: Duration::from_secs(10), ..Topology::default() };
    let js = jetstream_with(&server.url(), &topology).await;
    for n in 1..=2 {
        js.publish("shots.p1.xs.acme", hostile_payload(n).into()).await.unwrap().await.unwrap();
    }
    // Someone takes both and never answers: their one delivery is used up.
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream.get_consumer("render-p1-xs").await.unwrap();
    let mut taken = consumer.fetch().max_messages(2).messages().await.unwrap();
    let mut held = Vec::new();
    while let Some(message) = futures::StreamExt::next(&mut taken).await {
        held.push(message.unwrap());
    }
    assert_eq!(held.len(), 2);

    // A running worker hears both advisories; its rescue records both, one after the other.
    let store = tempfile::tempdir().unwrap();
    let mut worker = Worker::start(&server.url(), WorkerSpec::new("rescuer", store.path()));
    let records = wait_for_records(&js, 2, Duration::from_secs(60)).await;
    for (headers, _) in &records {
        assert_eq!(header(headers, failure::REASON).as_deref(), Some("max_deliveries"));
        assert_eq!(header(headers, failure::JOB_ID), None);
    }
    wait_settled(&js, Duration::from_secs(10)).await;
    assert!(worker.running(), "{}", worker.log());
    assert!(!worker.log().contains("panicked"), "{}", worker.log());
}

#[tokio::test]
async fn the_first_outcome_stands_after_the_duplicate_window_on_every_server() {
    for binary in ServerBinary::available() {
        let server = NatsServer::start_with(ServerOptions { binary, ..Default::default() });
        // A one-second window: the late worker publishes long after the server forgot the
        // first result's message id.
        let topology = Topology { duplicate_window: Duration::from_secs(1), ack_wait: Duration::from_secs(3), ..Topology::default() };
        let js = jetstream_with(&server.url(), &topology).await;
        let store = tempfile::tempdir().unwrap();
        let mut slow = WorkerSpec::new("late", store.path());
        // Until the other worker committed, then 2 s more: past the window.
        slow.extra = "[faults]\nstall_before_publish = \"2s\"\nstall_until_committed = true\nmark_images = true\n".into();
        let slow = Worker::start(&server.url(), slow);
        let j = shot(Priority::P1, job("late-1", "acme", (64, 64), 2, 2));
        submit(&js, std::slice::from_ref(&j)).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !slow.log().contains("stalling before publish") {
            assert!(Instant::now() < deadline, "{}", slow.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut first = WorkerSpec::new("first", store.path());
        first.extra = "[faults]\nmark_images = true\n".into();
        let _first = Worker::start(&server.url(), first);
        let result = results(&outcomes(&js, std::slice::from_ref(&j), Duration::from_secs(60)).await).remove(0);
        assert_eq!(result.worker, "first", "{binary:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !slow.log().contains("another outcome was committed first") {
            assert!(Instant::now() < deadline, "{binary:?}: the late worker took the commit:\n{}", slow.log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        wait_settled(&js, Duration::from_secs(20)).await;
        check_store(store.path(), &result);
        let results_stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
        let last = results_stream.direct_get_last_for_subject(subject::result("acme", "late-1")).await.unwrap();
        let stored: shotfleet_schema::ShotResult = serde_json::from_slice(&last.payload).unwrap();
        assert_eq!(stored.worker, "first", "{binary:?}: one outcome on the subject");
    }
}

#[tokio::test]
async fn a_result_publish_that_fails_on_the_last_attempt_leaves_no_image() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    // Results may be 900 bytes at most: a four-image result is refused by the server, every
    // time; a failure outcome (no images, a bounded detail) fits.
    let mut results_stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    let mut config = results_stream.info().await.unwrap().config.clone();
    config.max_message_size = 900;
    js.update_stream(&config).await.unwrap();
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("refused", store.path());
    spec.extra = "[attempts]\nmax_failures = 2\nbackoff = \"100ms\"\n".into();
    let _worker = Worker::start(&server.url(), spec);
    let j = shot(Priority::P1, job("refused-1", "acme", (64, 64), 2, 4));
    submit(&js, std::slice::from_ref(&j)).await;
    match &outcomes(&js, &[j], Duration::from_secs(60)).await["refused-1"] {
        Outcome::Failed { reason, .. } => assert_eq!(reason, "attempts"),
        other => panic!("expected a failure: {other:?}"),
    }
    wait_settled(&js, Duration::from_secs(20)).await;
    let left = std::fs::read_dir(store.path().join("acme/refused-1")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "the uploads of a failed job are swept");
    let records = failed_records(&js).await;
    assert_eq!(records.len(), 1);
    assert_eq!(header(&records[0].0, failure::ATTEMPTS).as_deref(), Some("2"));
}

#[tokio::test]
async fn rolling_restarts_during_long_renders_fail_no_job() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // Long renders on the CPU: each takes seconds, so every stop catches one in flight.
    let shots: Vec<_> = (0..4).map(|i| shot(Priority::P1, job(&format!("long-{i}"), "acme", (256, 256), 40, 1))).collect();
    submit(&js, &shots).await;
    let mut restarts = 0;
    for round in 0..6 {
        let mut spec = WorkerSpec::new(&format!("rolling-{round}"), store.path());
        spec.grace = "200ms";
        let mut worker = Worker::start(&server.url(), spec);
        // On a loaded machine the rounds are slow enough for renders to end between stops, so
        // the jobs may all have settled before the sixth round: the rolling ends there.
        let caught = in_flight_or_settled(&js, "render-p1-xs").await;
        if caught {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert_eq!(worker.terminate(Duration::from_secs(30)), Some(0), "{}", worker.log());
        restarts += 1;
        if !caught {
            break;
        }
    }
    assert!(restarts >= 2, "the jobs settled before a second worker took one: renders too short to test restarts");
    let _last = Worker::start(&server.url(), WorkerSpec::new("steady", store.path()));
    let done = outcomes(&js, &shots, Duration::from_secs(240)).await;
    let rendered = results(&done);
    assert_eq!(rendered.len(), shots.len(), "every job has one result, none failed");
    assert!(failed_records(&js).await.is_empty());
    wait_settled(&js, Duration::from_secs(20)).await;
    for result in &rendered {
        check_store(store.path(), result);
    }
}

#[tokio::test]
async fn a_job_that_fails_every_attempt_lands_in_the_failed_stream_with_its_count() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("strict-clock", store.path());
    // A time limit no render of this job meets: each attempt is a real failure (the time limit
    // stops the graph in progress).
    spec.time_limit = "1s";
    spec.extra = "[attempts]\nmax_failures = 3\nbackoff = \"100ms\"\n".into();
    let _worker = Worker::start(&server.url(), spec);
    let j = shot(Priority::P1, job("slow-1", "acme", (512, 512), 60, 2));
    submit(&js, std::slice::from_ref(&j)).await;
    match &outcomes(&js, &[j], Duration::from_secs(120)).await["slow-1"] {
        Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "attempts");
            assert!(detail.contains("time limit"), "{detail}");
        }
        other => panic!("expected a failure: {other:?}"),
    }
    let records = failed_records(&js).await;
    assert_eq!(records.len(), 1);
    assert_eq!(header(&records[0].0, failure::ATTEMPTS).as_deref(), Some("3"));
    assert_eq!(header(&records[0].0, failure::JOB_ID).as_deref(), Some("slow-1"));
}

#[tokio::test]
async fn a_held_job_is_kept_alive_through_a_slow_upload() {
    let server = NatsServer::start();
    let topology = Topology { ack_wait: Duration::from_secs(2), ..Topology::default() };
    let js = jetstream_with(&server.url(), &topology).await;
    let s3 = S3Server::start();
    s3.create_bucket("renders");
    let proxy = TcpProxy::start(&s3.endpoint());
    let scratch = tempfile::tempdir().unwrap();
    let worker = Worker::start(&server.url(), WorkerSpec::new("patient", scratch.path()).on_s3(&proxy.endpoint(), 60_000));
    // Noise PNGs of 512x512 are hundreds of KiB: at 64 KiB/s the upload outlasts ack_wait.
    proxy.throttle(Some(64 * 1024));
    let j = shot(Priority::P1, job("slow-store-1", "acme", (512, 512), 2, 2));
    submit(&js, std::slice::from_ref(&j)).await;
    let result = results(&outcomes(&js, &[j], Duration::from_secs(120)).await).remove(0);
    assert!(result.timing.upload_ms > 4000, "the upload outlasted ack_wait twice: {} ms", result.timing.upload_ms);
    assert_eq!(result.attempt, 1, "never redelivered:\n{}", worker.log());
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let info = stream.consumer_info("render-p1-s").await.unwrap();
    assert_eq!(info.num_redelivered, 0);
}

#[tokio::test]
async fn a_deleted_bucket_stops_the_worker_and_fails_no_job() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let s3 = S3Server::start();
    s3.create_bucket("renders");
    let scratch = tempfile::tempdir().unwrap();
    let spec = |id: &str| WorkerSpec::new(id, scratch.path()).on_s3(&s3.endpoint(), 2000);
    let mut worker = Worker::start(&server.url(), spec("orphaned"));
    s3.delete_all_buckets();
    let j = shot(Priority::P1, job("no-bucket-1", "acme", (64, 64), 2, 1));
    submit(&js, std::slice::from_ref(&j)).await;
    let status = worker.wait_exit(Duration::from_secs(60)).expect("the worker stops");
    assert_eq!(status.code(), Some(77), "EXIT_STORE:\n{}", worker.log());
    assert!(worker.log().contains("object store"), "{}", worker.log());
    assert!(failed_records(&js).await.is_empty(), "no job pays for the store");

    // The job waits for a healthy worker.
    s3.create_bucket("renders");
    let _healthy = Worker::start(&server.url(), spec("healthy"));
    let result = results(&outcomes(&js, &[j], Duration::from_secs(60)).await).remove(0);
    assert_eq!(result.worker, "healthy");
    assert_eq!(result.status, ResultStatus::Done);
}

#[tokio::test]
async fn a_store_folder_that_a_file_replaced_stops_the_worker_and_fails_no_job() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let scratch = tempfile::tempdir().unwrap();
    let store = scratch.path().join("images");
    let mut worker = Worker::start(&server.url(), WorkerSpec::new("displaced", &store));
    std::fs::remove_dir_all(&store).unwrap();
    std::fs::write(&store, b"not a folder").unwrap();
    let j = shot(Priority::P1, job("no-folder-1", "acme", (64, 64), 2, 1));
    submit(&js, std::slice::from_ref(&j)).await;
    // "Not a directory" is no failure a retry mends: not eight retries and a failed attempt for
    // every job, but the worker's stop, its jobs given back.
    let status = worker.wait_exit(Duration::from_secs(30)).expect("the worker stops");
    assert_eq!(status.code(), Some(77), "EXIT_STORE:\n{}", worker.log());
    assert!(failed_records(&js).await.is_empty(), "no job pays for the store");
}

#[tokio::test]
async fn a_store_that_refuses_one_jobs_keys_fails_that_job_and_serves_the_next() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("one-refused", store.path());
    spec.extra = "[attempts]\nmax_failures = 2\nbackoff = \"100ms\"\n".into();
    let mut worker = Worker::start(&server.url(), spec);
    // A file where the job's folder goes: the store refuses this job's keys, not the store's.
    std::fs::create_dir_all(store.path().join("acme")).unwrap();
    std::fs::write(store.path().join("acme").join("refused-1"), b"in the way").unwrap();
    let refused = shot(Priority::P1, job("refused-1", "acme", (64, 64), 2, 1));
    let next = shot(Priority::P1, job("after-refused-1", "acme", (64, 64), 2, 1));
    submit(&js, &[refused.clone(), next.clone()]).await;
    let ended = outcomes(&js, &[refused, next], Duration::from_secs(60)).await;
    match &ended["refused-1"] {
        Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "attempts", "{detail}");
            assert!(detail.contains("the store refuses this job's keys and takes others"), "{detail}");
        }
        other => panic!("expected the job to fail: {other:?}"),
    }
    assert!(matches!(&ended["after-refused-1"], Outcome::Done(_)), "{:?}", ended["after-refused-1"]);
    assert!(worker.running(), "one job's keys do not stop the worker:\n{}", worker.log());
}

/// Four 256x256 jobs queued before a one-slot worker with `batch_jobs` starts, uploads of
/// seconds (a noise PNG through S3 at 64 KiB/s), renders of a fraction: the lines naming a
/// render's end (`ended_by`) that the worker logged before its first commit.
async fn renders_before_the_first_commit(batch_jobs: u32, ended_by: &str) -> usize {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let s3 = S3Server::start();
    s3.create_bucket("renders");
    let proxy = TcpProxy::start(&s3.endpoint());
    let shots: Vec<_> = (1..=4).map(|i| shot(Priority::P1, job(&format!("overlap-{i}"), "acme", (256, 256), 2, 1))).collect();
    submit(&js, &shots).await;
    let scratch = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("overlapping", scratch.path()).on_s3(&proxy.endpoint(), 60_000);
    spec.top = format!("batch_jobs = {batch_jobs}");
    proxy.throttle(Some(64 * 1024));
    let worker = Worker::start(&server.url(), spec);
    let done = results(&outcomes(&js, &shots, Duration::from_secs(120)).await);
    assert_eq!(done.len(), 4);
    let log = worker.log();
    let lines: Vec<&str> = log.lines().collect();
    let first_done = lines.iter().position(|l| l.contains("job done")).unwrap_or_else(|| panic!("{log}"));
    lines[..first_done].iter().filter(|l| l.contains(ended_by)).count()
}

/// A job gives its render slot back when its render ends: the next job renders while it
/// encodes and uploads its images.
#[tokio::test]
async fn the_next_render_starts_while_a_rendered_job_uploads() {
    assert!(renders_before_the_first_commit(1, "observed peak").await >= 2, "the second render ended before the first commit");
}

/// The same for jobs rendered together (two at a time): the next group renders while the
/// first one's images encode and upload.
#[tokio::test]
async fn the_next_group_renders_while_a_rendered_group_uploads() {
    assert_eq!(renders_before_the_first_commit(2, "rendered a group").await, 2, "both groups rendered before the first commit");
}

/// Each outcome on a job's result subject, oldest first.
async fn outcomes_of(js: &jetstream::Context, project: &str, job_id: &str) -> Vec<shotfleet_schema::ShotResult> {
    let mut stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut found = Vec::new();
    for seq in 1..=last {
        if let Ok(message) = stream.get_raw_message(seq).await
            && message.subject.as_str() == subject::result(project, job_id)
        {
            found.push(serde_json::from_slice(&message.payload).unwrap());
        }
    }
    found
}

async fn wait_for_outcomes(js: &jetstream::Context, project: &str, job_id: &str, count: usize) -> Vec<shotfleet_schema::ShotResult> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = outcomes_of(js, project, job_id).await;
        if found.len() >= count {
            return found;
        }
        assert!(Instant::now() < deadline, "{job_id}: {} outcome(s), wanted {count}: {found:?}", found.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Publishes `job` as JSON with `fields` changed, under its own message id.
async fn publish_raw(js: &jetstream::Context, subject: &str, job: &shotfleet_schema::ShotJob, fields: serde_json::Value, msg_id: &str) {
    let mut payload = serde_json::to_value(job).unwrap();
    payload.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    js.publish_with_headers(subject.to_owned(), headers, serde_json::to_vec(&payload).unwrap().into()).await.unwrap().await.unwrap();
}

/// A fix sent while the broken request still waited (both queued before any worker runs): the
/// failure settles the broken message only (its `Shotfleet-Settles`), and the fix renders.
#[tokio::test]
async fn a_fix_queued_behind_its_broken_request_renders_after_the_failure() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let broken = job("fx-1", "acme", (64, 64), 2, 1);
    publish_raw(&js, "shots.p1.xs.acme", &broken, serde_json::json!({"steps": 0}), "acme/fx-1").await;
    publish_raw(&js, "shots.p1.xs.acme", &broken, serde_json::json!({}), "acme/fx-1:2").await;
    let _worker = Worker::start(&server.url(), WorkerSpec::new("fixes", store.path()));
    let found = wait_for_outcomes(&js, "acme", "fx-1", 2).await;
    assert_eq!((found[0].status, found[1].status), (ResultStatus::Failed, ResultStatus::Done), "{found:?}");
}

#[tokio::test]
async fn every_request_of_a_job_gets_its_own_outcome_an_invalid_resubmission_included() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let _worker = Worker::start(&server.url(), WorkerSpec::new("resubmit", store.path()));

    // Refused, then refused again for another reason: the second request has its own outcome
    // (its claim expects the first, not none, which the server would refuse).
    let first = job("rs-1", "acme", (64, 64), 2, 1);
    publish_raw(&js, "shots.p1.xs.acme", &first, serde_json::json!({"steps": 0}), "acme/rs-1").await;
    let found = wait_for_outcomes(&js, "acme", "rs-1", 1).await;
    assert!(found[0].failure.as_ref().unwrap().detail.contains("steps"), "{found:?}");
    publish_raw(&js, "shots.p1.xs.acme", &first, serde_json::json!({"width": 100}), "acme/rs-1:b").await;
    let found = wait_for_outcomes(&js, "acme", "rs-1", 2).await;
    assert!(found[1].failure.as_ref().unwrap().detail.contains("width"), "{found:?}");
    // A later failure keeps the earlier record: an earlier payload may be the one to replay.
    let records_of = |records: Vec<(async_nats::HeaderMap, bytes::Bytes)>, job: &str| -> Vec<String> {
        let named = |headers: &async_nats::HeaderMap| header(headers, failure::JOB_ID).as_deref() == Some(job);
        records.iter().filter(|(headers, _)| named(headers)).filter_map(|(headers, _)| header(headers, failure::DETAIL)).collect()
    };
    let kept = records_of(failed_records(&js).await, "rs-1");
    assert!(kept.len() == 2 && kept[0].contains("steps") && kept[1].contains("width"), "{kept:?}");
    // Fixed, it renders: a failure settles only what was published before it, and the
    // render withdraws both failures' records (`status` counted them, waiting for a replay).
    publish_raw(&js, "shots.p1.xs.acme", &first, serde_json::json!({}), "acme/rs-1:c").await;
    let found = wait_for_outcomes(&js, "acme", "rs-1", 3).await;
    assert_eq!(found[2].status, ResultStatus::Done, "{found:?}");
    let kept = records_of(failed_records(&js).await, "rs-1");
    assert!(kept.is_empty(), "{kept:?}");
    // Once done, a copy is settled by the result, not rendered nor failed.
    publish_raw(&js, "shots.p1.xs.acme", &first, serde_json::json!({"steps": 0}), "acme/rs-1:d").await;
    wait_settled(&js, Duration::from_secs(20)).await;
    assert_eq!(outcomes_of(&js, "acme", "rs-1").await.len(), 3);

    // Cancelled while queued (a class nobody here serves), then re-submitted invalid: its
    // failure follows the cancellation, with its failed record.
    let second = job("rs-2", "acme", (1600, 1600), 1, 1);
    submit(&js, &[shot(Priority::P1, second.clone())]).await;
    let answer = js.client().request("shots.cancel.acme.rs-2", "{}".into()).await.unwrap();
    assert!(String::from_utf8_lossy(&answer.payload).contains("\"cancelled\""), "{answer:?}");
    let records_before = failed_records(&js).await.len();
    publish_raw(&js, "shots.p1.xs.acme", &job("rs-2", "acme", (64, 64), 2, 1), serde_json::json!({"steps": 0}), "acme/rs-2:b").await;
    let found = wait_for_outcomes(&js, "acme", "rs-2", 2).await;
    assert_eq!((found[0].status, found[1].status), (ResultStatus::Cancelled, ResultStatus::Failed), "{found:?}");
    wait_for_records(&js, records_before + 1, Duration::from_secs(10)).await;
}
