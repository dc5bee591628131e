//! The `shotfleet` command against real nats-server processes.

use std::path::{Path, PathBuf};

use async_nats::jetstream;
use async_nats::HeaderMap;
use futures::StreamExt;
use shotfleet_schema::encoding;
use shotfleet_schema::{failure, subject, ResultStatus, ShotJob};
use shotfleet_testkit::nats::{NatsServer, ServerBinary, ServerOptions};

mod support;
use support::{publish_outcome, shotfleet, text};

fn demo_storyboard() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/demo/storyboard.jsonl")
}


async fn jobs_in_stream(server: &NatsServer) -> u64 {
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    let mut stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    stream.info().await.unwrap().state.messages
}

#[tokio::test]
async fn setup_is_idempotent_on_every_server_version() {
    for binary in ServerBinary::available() {
        let server = NatsServer::start_with(ServerOptions { binary, ..Default::default() });
        let first = shotfleet(&server.url(), &["setup"]).await;
        assert!(first.status.success(), "{binary:?}: {}", text(&first));
        assert!(text(&first).contains("22 created"), "{binary:?}: {}", text(&first));
        let again = shotfleet(&server.url(), &["setup"]).await;
        assert!(text(&again).contains("0 created, 0 updated, 22 already as wanted"), "{}", text(&again));

        // One filter per consumer: check the server kept exactly the filter we set (2.9.10
        // drops `filter_subjects`, which would leave a consumer unfiltered).
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client);
        let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
        let info = stream.consumer_info("render-p0-m").await.unwrap();
        assert_eq!(info.config.filter_subject, "shots.p0.m.*", "{binary:?}");
    }
}

#[tokio::test]
async fn an_incompatible_stream_is_reported_not_clobbered() {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    // Someone made SHOTS by hand with limits retention and a short duplicate window.
    js.create_stream(jetstream::stream::Config {
        name: subject::JOBS_STREAM.into(),
        subjects: subject::jobs_stream_subjects(),
        duplicate_window: std::time::Duration::from_secs(60),
        ..Default::default()
    })
    .await
    .unwrap();
    let out = shotfleet(&server.url(), &["setup"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let message = text(&out);
    assert!(message.contains("stream SHOTS exists with a different configuration"), "{message}");
    assert!(message.contains("retention is Limits, wanted WorkQueue"), "{message}");
    assert!(message.contains("duplicate_window is 60s, wanted 1200s"), "{message}");
    let mut stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().config.retention,
        jetstream::stream::RetentionPolicy::Limits,
        "left as it was"
    );
}

#[tokio::test]
async fn setup_update_changes_what_the_server_allows() {
    let server = NatsServer::start();
    assert!(shotfleet(&server.url(), &["setup"]).await.status.success());
    let out = shotfleet(&server.url(), &["setup", "--failed-max-age", "2d"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("max_age is 2592000s, wanted 172800s"), "{}", text(&out));
    let out = shotfleet(&server.url(), &["setup", "--failed-max-age", "2d", "--update"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("updated   stream SHOTS_FAILED"), "{}", text(&out));
}

#[tokio::test]
async fn the_queue_takes_only_the_subjects_its_consumers_read() {
    let server = NatsServer::start();
    // Before setup no stream takes a job: submit says what to run.
    let board = demo_storyboard();
    let out = shotfleet(&server.url(), &["submit", board.to_str().unwrap()]).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("no stream takes subject `shots.p"), "{}", text(&out));
    assert!(text(&out).contains("run `shotfleet setup`"), "{}", text(&out));
    // After it, a class no consumer reads is refused by the server instead of stored forever.
    assert!(shotfleet(&server.url(), &["setup"]).await.status.success());
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    let refused = js.publish("shots.p0.bogus.acme", "{}".into()).await.unwrap().await;
    assert!(refused.is_err(), "a bogus class is not stored: {refused:?}");
    let mut stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.subjects.len(), 18, "{:?}", config.subjects);
    assert_eq!(config.max_age, std::time::Duration::from_secs(7 * 24 * 3600));
    assert_eq!(config.max_bytes, 1 << 30);
    assert_eq!(config.discard, jetstream::stream::DiscardPolicy::New);
}

#[tokio::test]
async fn resubmitting_inside_the_duplicate_window_queues_nothing_twice() {
    for binary in ServerBinary::available() {
        let server = NatsServer::start_with(ServerOptions { binary, ..Default::default() });
        shotfleet(&server.url(), &["setup"]).await;
        let board = demo_storyboard();
        let first = shotfleet(&server.url(), &["submit", board.to_str().unwrap()]).await;
        assert!(first.status.success(), "{}", text(&first));
        assert!(text(&first).contains("queued 9 job(s)"), "{}", text(&first));
        let second = shotfleet(&server.url(), &["submit", board.to_str().unwrap(), "--json"]).await;
        assert!(text(&second).contains("queued 0 job(s)"), "{}", text(&second));
        assert!(text(&second).contains("9 already in the stream inside its duplicate window"), "{}", text(&second));
        assert!(text(&second).contains("9 without an outcome yet: still queued or rendering"), "{}", text(&second));
        assert_eq!(jobs_in_stream(&server).await, 9, "{binary:?}");
    }
}

#[tokio::test]
async fn jobs_land_on_their_priority_and_class_subjects_with_msg_ids() {
    let server = NatsServer::start();
    shotfleet(&server.url(), &["setup"]).await;
    let board = demo_storyboard();
    assert!(shotfleet(&server.url(), &["submit", board.to_str().unwrap()]).await.status.success());
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let message = stream.get_last_raw_message_by_subject("shots.p0.xs.moth").await.unwrap();
    let headers = message.headers;
    assert_eq!(headers.get("Nats-Msg-Id").unwrap().as_str(), "moth/moth-ep03-s01");
    assert_eq!(headers.get("Content-Type").unwrap().as_str(), "application/msgpack");
    let job = encoding::parse_job(Some("application/msgpack"), &message.payload, &Default::default()).unwrap();
    assert_eq!(job.shot_id, "s01");
}

#[tokio::test]
async fn a_job_id_is_one_job_per_project() {
    let server = NatsServer::start();
    shotfleet(&server.url(), &["setup"]).await;
    let dir = tempfile::tempdir().unwrap();
    let line = |project: &str| format!(r#"{{"v":1,"job_id":"ep1-s1","project":"{project}","shot_id":"s1","prompt":"a boat","width":512,"height":512,"steps":4,"guidance":5,"seed":1}}"#);
    for (project, queued) in [("acme", "queued 1 job(s)"), ("tide", "queued 1 job(s)"), ("acme", "queued 0 job(s)")] {
        let file = dir.path().join(format!("{project}.jsonl"));
        std::fs::write(&file, line(project) + "\n").unwrap();
        let out = shotfleet(&server.url(), &["submit", file.to_str().unwrap()]).await;
        assert!(text(&out).contains(queued), "{project}: {}", text(&out));
    }
    // The same id in two projects is two jobs; the same job again is a duplicate.
    assert_eq!(jobs_in_stream(&server).await, 2);
}

#[tokio::test]
async fn a_file_with_bad_lines_publishes_nothing_unless_told() {
    let server = NatsServer::start();
    shotfleet(&server.url(), &["setup"]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("board.csv");
    std::fs::write(
        &file,
        "job_id,project,shot_id,prompt,width,height,steps,guidance,seed,priority\n\
         ok-1,acme,s1,a cat,512,512,20,5,1,p1\n\
         bad-1,acme,s2,a dog,513,512,20,5,2,p1\n\
         bad-2,ac/me,s3,a cow,512,512,20,5,3,p1\n\
         ok-2,acme,s4,a fox,512,512,20,5,4,p2\n",
    )
    .unwrap();
    let out = shotfleet(&server.url(), &["submit", file.to_str().unwrap()]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let message = text(&out);
    assert!(message.contains("line 3: field `width`: 513 must be a positive multiple of 8"), "{message}");
    assert!(message.contains("line 4: field `project`"), "{message}");
    assert!(message.contains("nothing was published"), "{message}");
    assert_eq!(jobs_in_stream(&server).await, 0);

    let out = shotfleet(&server.url(), &["submit", file.to_str().unwrap(), "--skip-invalid"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("queued 2 job(s)"), "{}", text(&out));
    assert_eq!(jobs_in_stream(&server).await, 2);
}

#[tokio::test]
async fn connection_errors_name_what_failed() {
    let out = shotfleet("nats://127.0.0.1:1", &["status"]).await;
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out).contains("cannot connect to NATS at nats://127.0.0.1:1"), "{}", text(&out));

    let server = NatsServer::start_with(ServerOptions {
        extra_config: "authorization { user: render, password: s3cret }\n".into(),
        ..Default::default()
    });
    let out = shotfleet(&server.url(), &["status", "--user", "render", "--password", "wrong"]).await;
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out).contains("authorization violation"), "{}", text(&out));
    assert!(!text(&out).contains("wrong"), "the password must not be echoed: {}", text(&out));
    let out = shotfleet(&server.url(), &["setup", "--user", "render", "--password", "s3cret"]).await;
    assert!(out.status.success(), "{}", text(&out));

    let out = shotfleet(&server.url(), &["status", "--creds", "/nonexistent.creds"]).await;
    assert!(text(&out).contains("cannot read NATS credentials file /nonexistent.creds"), "{}", text(&out));
}

/// Plays the worker's part on the wire: takes every job from the stream and publishes a result
/// (or, for one job, a failed record) exactly as a worker does.
async fn answer_jobs(url: String, fail_job: &'static str) {
    let client = async_nats::connect(url).await.unwrap();
    let js = jetstream::new(client);
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let mut pulled = Vec::new();
    while pulled.len() < 9 {
        for config in shotfleet_schema::nats::Topology::default().consumers() {
            let consumer: jetstream::consumer::PullConsumer =
                stream.get_consumer(config.durable_name.as_deref().unwrap()).await.unwrap();
            let mut batch = consumer
                .fetch()
                .max_messages(20)
                .expires(std::time::Duration::from_millis(100))
                .messages()
                .await
                .unwrap();
            while let Some(message) = batch.next().await {
                pulled.push(message.unwrap());
            }
        }
    }
    for message in pulled {
        let ct = message.headers.as_ref().and_then(|h| h.get("Content-Type")).map(|v| v.as_str().to_owned());
        let job: ShotJob = encoding::decode_job(ct.as_deref(), &message.payload).unwrap();
        let parsed = subject::parse_job(&message.subject).unwrap();
        if job.job_id == fail_job {
            let mut headers = HeaderMap::new();
            headers.insert(failure::REASON, "oom");
            headers.insert(failure::DETAIL, "below the floor");
            headers.insert(failure::ATTEMPTS, "3");
            headers.insert(failure::JOB_ID, job.job_id.as_str());
            js.publish_with_headers(subject::failed(parsed.priority, &job.project), headers, message.payload.clone())
                .await
                .unwrap()
                .await
                .unwrap();
        } else {
            publish_outcome(&js, &job.project, &job.job_id, &job.shot_id, "test", ResultStatus::Done).await;
        }
        message.ack().await.unwrap();
    }
}

#[tokio::test]
async fn submit_wait_reports_every_job_and_fails_when_one_failed() {
    let server = NatsServer::start();
    shotfleet(&server.url(), &["setup"]).await;
    let worker = tokio::spawn(answer_jobs(server.url(), "moth-ep03-s02"));
    let board = demo_storyboard();
    let out = shotfleet(&server.url(), &["submit", board.to_str().unwrap(), "--wait", "--timeout", "60s"]).await;
    worker.await.unwrap();
    let message = text(&out);
    assert_eq!(out.status.code(), Some(1), "{message}");
    assert!(message.contains("8 done, 0 degraded, 1 failed"), "{message}");
    assert!(message.contains("oom: below the floor"), "{message}");

    // Submitting again inside the window: nothing is queued, and the outcomes are still known.
    let out = shotfleet(&server.url(), &["submit", board.to_str().unwrap(), "--wait", "--timeout", "30s"]).await;
    assert!(text(&out).contains("8 done, 0 degraded, 1 failed"), "{}", text(&out));
}

#[tokio::test]
async fn status_shows_pending_per_priority_and_class() {
    let server = NatsServer::start();
    shotfleet(&server.url(), &["setup"]).await;
    let board = demo_storyboard();
    shotfleet(&server.url(), &["submit", board.to_str().unwrap()]).await;
    let out = shotfleet(&server.url(), &["status"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let table = text(&out);
    let row = |name: &str| table.lines().find(|l| l.starts_with(name)).unwrap_or_default().to_owned();
    // p0: two 64x64 shots, both class xs.
    assert!(row("render-p0-xs ").split_whitespace().nth(1) == Some("2"), "{table}");
    assert!(row("render-p1-xs ").split_whitespace().nth(1) == Some("4"), "{table}");
    assert!(table.contains("failed: 0"), "{table}");
}

#[tokio::test]
async fn a_reader_that_leaves_ends_the_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let server = NatsServer::start();
    shotfleet(&server.url(), &["setup"]).await;
    // `shotfleet submit board | head -1`, with a reader that left before the first line.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_shotfleet"))
        .args(["submit", demo_storyboard().to_str().unwrap()])
        .env("NATS_URL", server.url())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(13), "ended by SIGPIPE, as `head` expects: {:?} {stderr}", out.status);
    assert_eq!(jobs_in_stream(&server).await, 9, "the jobs were queued before the output");
}

#[tokio::test]
async fn a_wait_of_nothing_is_refused_before_anything_is_sent() {
    let board = demo_storyboard();
    let board = board.to_str().unwrap();
    let out = shotfleet("nats://127.0.0.1:1", &["submit", board, "--wait", "--timeout", "0s"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("a wait of 0 gives up at once"), "{}", text(&out));
    let out = shotfleet("nats://127.0.0.1:1", &["submit", board, "--timeout", "5m"]).await;
    assert_eq!(out.status.code(), Some(2), "--timeout without --wait: {}", text(&out));
    assert!(text(&out).contains("--wait"), "{}", text(&out));
}
