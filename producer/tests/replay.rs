//! `shotfleet replay` against real nats-server processes: failed records written as a worker
//! writes them, replayed back to the jobs stream.

use std::process::Output;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{Degrade, Original, Priority, ResultStatus, ShotJob, failure, subject};
use shotfleet_testkit::nats::{NatsServer, ServerBinary, ServerOptions};

mod support;
use support::{publish_outcome, shotfleet, text};


/// The table rows (stdout lines) whose action column is `action`.
fn rows(output: &Output, action: &str) -> Vec<String> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with(&format!("{action} ")))
        .map(str::to_owned)
        .collect()
}

/// A server with the topology, and a JetStream context on it.
async fn topology(binary: ServerBinary) -> (NatsServer, jetstream::Context) {
    let server = NatsServer::start_with(ServerOptions { binary, ..Default::default() });
    let out = shotfleet(&server.url(), &["setup"]).await;
    assert!(out.status.success(), "{binary:?}: {}", text(&out));
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    (server, js)
}

/// A job payload as a producer sent it.
fn job_payload(job_id: &str, project: &str, content_type: ContentType) -> Vec<u8> {
    let json = format!(
        r#"{{"v":1,"job_id":"{job_id}","project":"{project}","shot_id":"s1","prompt":"a paper boat","width":512,"height":512,"steps":20,"guidance":5.0,"seed":7}}"#
    );
    match content_type {
        ContentType::Json => json.into_bytes(),
        other => encoding::encode(other, &encoding::decode_job(Some("application/json"), json.as_bytes()).unwrap()),
    }
}

/// One failed record, as `consumer/src/worker/failed.rs` writes it.
struct Record<'a> {
    job_id: Option<&'a str>,
    project: &'a str,
    priority: Priority,
    reason: &'a str,
    /// `None`: the header is missing.
    original_subject: Option<&'a str>,
    content_type: Option<ContentType>,
    payload: Vec<u8>,
    /// The job's sequence in SHOTS when it failed (names the record's Msg-Id).
    job_seq: u64,
}

impl<'a> Record<'a> {
    fn job(job_id: &'a str, project: &'a str, reason: &'a str) -> Self {
        Self {
            job_id: Some(job_id),
            project,
            priority: Priority::P1,
            reason,
            original_subject: None,
            content_type: Some(ContentType::Json),
            payload: job_payload(job_id, project, ContentType::Json),
            job_seq: 1,
        }
    }
}

/// Publishes the record to `shots.failed.<prio>.<project>`; returns its sequence in SHOTS_FAILED.
async fn publish_failed(js: &jetstream::Context, record: Record<'_>) -> u64 {
    let default_subject = format!("shots.{}.s.{}", record.priority, record.project);
    let mut headers = HeaderMap::new();
    if let Some(ct) = record.content_type {
        headers.insert(failure::CONTENT_TYPE, ct.as_str());
    }
    headers.insert(failure::REASON, record.reason);
    headers.insert(failure::DETAIL, format!("{} happened", record.reason).as_str());
    match record.original_subject {
        Some("") => {}
        Some(s) => headers.insert(failure::ORIGINAL_SUBJECT, s),
        None => headers.insert(failure::ORIGINAL_SUBJECT, default_subject.as_str()),
    }
    headers.insert(failure::ATTEMPTS, "3");
    headers.insert(failure::WORKER, "gpu-test-0");
    let id = match record.job_id {
        Some(job_id) => {
            headers.insert(failure::JOB_ID, job_id);
            subject::msg_id::failed(job_id, record.job_seq)
        }
        None => format!("seq-{}:failed", record.job_seq),
    };
    headers.insert("Nats-Msg-Id", id.as_str());
    let ack = js
        .publish_with_headers(subject::failed(record.priority, record.project), headers, record.payload.into())
        .await
        .unwrap()
        .await
        .unwrap();
    ack.sequence
}

async fn count(js: &jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream).await.unwrap().info().await.unwrap().state.messages
}

#[tokio::test]
async fn a_dry_run_lists_every_record_and_changes_nothing() {
    for binary in ServerBinary::available() {
        let (server, js) = topology(binary).await;
        let a = publish_failed(&js, Record::job("ep1-s1", "acme", "oom")).await;
        let b = publish_failed(&js, Record { priority: Priority::P0, ..Record::job("ep1-s2", "acme", "driver") }).await;
        let c = publish_failed(&js, Record::job("moth-s3", "moth", "max_deliveries")).await;

        let out = shotfleet(&server.url(), &["replay", "--dry-run"]).await;
        assert!(out.status.success(), "{binary:?}: {}", text(&out));
        let listed = rows(&out, "would replay");
        assert_eq!(listed.len(), 3, "{binary:?}: {}", text(&out));
        for (row, seq, job, reason, subject) in [
            (&listed[0], a, "acme/ep1-s1", "oom", "shots.p1.s.acme"),
            (&listed[1], b, "acme/ep1-s2", "driver", "shots.p0.s.acme"),
            (&listed[2], c, "moth/moth-s3", "max_deliveries", "shots.p1.s.moth"),
        ] {
            let columns: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(columns[2..7], [seq.to_string().as_str(), job, reason, "3", subject][..], "{row}");
            assert!(columns[7].ends_with('s'), "an age in seconds: {row}");
            assert!(row.ends_with(&format!("{reason} happened")), "{row}");
        }
        assert!(text(&out).contains("dry run: 3 matching, would replay 3"), "{}", text(&out));
        assert!(text(&out).contains("nothing changed"), "{}", text(&out));
        assert_eq!(count(&js, subject::FAILED_STREAM).await, 3, "{binary:?}");
        assert_eq!(count(&js, subject::JOBS_STREAM).await, 0, "{binary:?}");
    }
}

#[tokio::test]
async fn filters_select_by_reason_project_job_and_time() {
    let (server, js) = topology(ServerBinary::Current).await;
    publish_failed(&js, Record::job("early-oom", "acme", "oom")).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let between = std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%S.%NZ"]).output().unwrap();
    let between = String::from_utf8(between.stdout).unwrap().trim().to_owned();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    publish_failed(&js, Record::job("late-driver", "acme", "driver")).await;
    publish_failed(&js, Record::job("late-invalid", "moth", "invalid")).await;

    let listed = |args: &'static [&'static str], extra: Option<String>| {
        let url = server.url();
        async move {
            let mut all: Vec<&str> = vec!["replay", "--dry-run"];
            all.extend(args);
            if let Some(extra) = &extra {
                all.push(extra);
            }
            let out = shotfleet(&url, &all).await;
            assert!(out.status.success(), "{all:?}: {}", text(&out));
            rows(&out, "would replay").iter().map(|r| r.split_whitespace().nth(3).unwrap().to_owned()).collect::<Vec<_>>()
        }
    };
    assert_eq!(listed(&["--reason", "oom"], None).await, ["acme/early-oom"]);
    assert_eq!(listed(&["--reason", "oom", "--reason", "invalid"], None).await, ["acme/early-oom", "moth/late-invalid"]);
    assert_eq!(listed(&["--project", "acme"], None).await, ["acme/early-oom", "acme/late-driver"]);
    assert_eq!(listed(&["--project", "acme", "--project", "moth"], None).await.len(), 3);
    assert_eq!(listed(&["--project", "acme", "--reason", "driver"], None).await, ["acme/late-driver"]);
    assert_eq!(listed(&["--job", "late-invalid"], None).await, ["moth/late-invalid"]);
    assert_eq!(listed(&["--job", "moth/late-invalid"], None).await, ["moth/late-invalid"], "by key, as the table names it");
    assert!(listed(&["--job", "acme/late-invalid"], None).await.is_empty(), "another project's key");
    assert_eq!(listed(&["--since", "1h"], None).await.len(), 3);
    assert!(listed(&["--until", "1h"], None).await.is_empty());
    assert_eq!(listed(&["--until"], Some(between.clone())).await, ["acme/early-oom"]);
    assert_eq!(listed(&["--since"], Some(between.clone())).await, ["acme/late-driver", "moth/late-invalid"]);

    let out = shotfleet(&server.url(), &["replay", "--reason", "stale"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("expected invalid, oom, attempts, max_deliveries or driver"), "{}", text(&out));
    let out = shotfleet(&server.url(), &["replay", "--since", "yesterday"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    // A window that ends before it begins is refused, not an empty match.
    let out = shotfleet(&server.url(), &["replay", "--since", "1m", "--until", "2h"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--since is later than --until"), "{}", text(&out));
    assert_eq!(count(&js, subject::FAILED_STREAM).await, 3);
}

#[tokio::test]
async fn a_replay_puts_the_original_payload_back_and_deletes_the_failed_copy() {
    for binary in ServerBinary::available() {
        let (server, js) = topology(binary).await;
        let json = Record { original_subject: Some("shots.p1.m.acme"), ..Record::job("ep1-s1", "acme", "oom") };
        let json_payload = json.payload.clone();
        let json_seq = publish_failed(&js, json).await;
        let msgpack_payload = job_payload("ep1-s2", "acme", ContentType::MessagePack);
        let msgpack_seq = publish_failed(
            &js,
            Record {
                priority: Priority::P0,
                original_subject: Some("shots.p0.auto.acme"),
                content_type: Some(ContentType::MessagePack),
                payload: msgpack_payload.clone(),
                ..Record::job("ep1-s2", "acme", "driver")
            },
        )
        .await;

        let out = shotfleet(&server.url(), &["replay"]).await;
        assert!(out.status.success(), "{binary:?}: {}", text(&out));
        assert_eq!(rows(&out, "replayed").len(), 2, "{}", text(&out));
        assert!(text(&out).contains("replayed 2, duplicates 0"), "{}", text(&out));

        let jobs = js.get_stream(subject::JOBS_STREAM).await.unwrap();
        for (subject, payload, content_type, msg_id) in [
            ("shots.p1.m.acme", &json_payload, "application/json", format!("ep1-s1:replay:{json_seq}")),
            ("shots.p0.auto.acme", &msgpack_payload, "application/msgpack", format!("ep1-s2:replay:{msgpack_seq}")),
        ] {
            let message = jobs.get_last_raw_message_by_subject(subject).await.unwrap();
            assert_eq!(&message.payload[..], &payload[..], "{binary:?}: byte for byte");
            assert_eq!(message.headers.get("Content-Type").unwrap().as_str(), content_type);
            assert_eq!(message.headers.get("Nats-Msg-Id").unwrap().as_str(), msg_id);
        }
        assert_eq!(count(&js, subject::FAILED_STREAM).await, 0, "{binary:?}");
        assert_eq!(count(&js, subject::JOBS_STREAM).await, 2, "{binary:?}");

        // Again: nothing left to do.
        let out = shotfleet(&server.url(), &["replay"]).await;
        assert!(out.status.success(), "{}", text(&out));
        assert!(text(&out).contains("replayed 0, duplicates 0, skipped 0, could not replay 0"), "{}", text(&out));
        assert_eq!(count(&js, subject::JOBS_STREAM).await, 2, "{binary:?}");
    }
}

#[tokio::test]
async fn a_job_that_failed_degraded_goes_back_at_its_requested_size() {
    let (server, js) = topology(ServerBinary::Current).await;
    // A 1216x832, 30-step job the ladder lowered twice before it failed (a driver crash).
    let mut job = encoding::decode_job(None, &job_payload("ep2-s4", "acme", ContentType::Json)).unwrap();
    let original = Original { width: 1216, height: 832, steps: 30 };
    job = ShotJob { width: 640, height: 448, steps: 30, degrade: Some(Degrade { level: 2, from: original }), ..job };
    let failed_subject = subject::job(Priority::P0, shotfleet_schema::SubjectClass::Class(job.class()), "acme");
    let seq = publish_failed(
        &js,
        Record {
            priority: Priority::P0,
            original_subject: Some(&failed_subject),
            content_type: Some(ContentType::MessagePack),
            payload: encoding::encode(ContentType::MessagePack, &job),
            ..Record::job("ep2-s4", "acme", "driver")
        },
    )
    .await;
    let requested_class = shotfleet_schema::MemoryClass::of_size(1216, 832);
    let requested_subject = format!("shots.p0.{}.acme", requested_class.as_str());
    assert_ne!(requested_subject, failed_subject, "the test needs two classes");
    let said = format!("seq {seq} (job acme/ep2-s4): sent at its requested 1216x832, 30 steps (it failed 2 rung(s) down its ladder, at 640x448), to {requested_subject}");

    let out = shotfleet(&server.url(), &["replay", "--dry-run"]).await;
    let would = said.replace("sent at", "would be sent at");
    assert!(out.status.success() && text(&out).contains(&would), "the dry run says so: {}", text(&out));

    let out = shotfleet(&server.url(), &["replay"]).await;
    assert!(out.status.success() && text(&out).contains(&said), "{}", text(&out));
    let jobs = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let message = jobs.get_last_raw_message_by_subject(&requested_subject).await.unwrap();
    assert_eq!(message.headers.get("Content-Type").unwrap().as_str(), "application/msgpack", "in its own encoding");
    assert_eq!(message.headers.get("Nats-Msg-Id").unwrap().as_str(), format!("ep2-s4:replay:{seq}"));
    let sent = encoding::decode_job(Some("application/msgpack"), &message.payload).unwrap();
    assert_eq!((sent.width, sent.height, sent.steps, sent.degrade), (1216, 832, 30, None));
    assert_eq!((sent.prompt, sent.seed), (job.prompt, job.seed), "the rest as it was");
    assert_eq!(count(&js, subject::JOBS_STREAM).await, 1);
    assert_eq!(count(&js, subject::FAILED_STREAM).await, 0);
}

#[tokio::test]
async fn a_job_rendered_since_it_failed_is_not_replayed_and_its_record_goes() {
    let (server, js) = topology(ServerBinary::Current).await;
    publish_failed(&js, Record::job("ep1-s1", "acme", "driver")).await;
    publish_failed(&js, Record::job("ep1-s2", "acme", "driver")).await;
    // ep1-s1 was rendered since (re-submitted with --again, or replayed by another operator).
    publish_outcome(&js, "acme", "ep1-s1", "s1", "gpu-7", ResultStatus::Done).await;

    let out = shotfleet(&server.url(), &["replay", "--dry-run"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("would replay 1, would skip 0, cannot replay 0, already rendered 1; nothing changed"), "{}", text(&out));
    assert!(text(&out).contains("the record would be deleted"), "{}", text(&out));
    assert_eq!(count(&js, subject::FAILED_STREAM).await, 2);

    let out = shotfleet(&server.url(), &["replay"]).await;
    assert!(out.status.success(), "nothing went wrong: {}", text(&out));
    assert_eq!(rows(&out, "rendered").len(), 1, "{}", text(&out));
    assert!(rows(&out, "rendered")[0].contains("acme/ep1-s1"), "{}", text(&out));
    let said = text(&out);
    assert!(said.contains("already rendered (done, ") && said.contains("s ago, by gpu-7): a replay would render nothing; the record is deleted"), "{said}");
    assert!(said.contains("replayed 1, duplicates 0, skipped 0, could not replay 0, already rendered 1 (records deleted)"), "{said}");
    assert_eq!(count(&js, subject::JOBS_STREAM).await, 1, "only the job still to render");
    assert_eq!(count(&js, subject::FAILED_STREAM).await, 0, "the rendered job's record is deleted, as a worker deletes it");
}

#[tokio::test]
async fn a_job_cancelled_after_it_failed_is_skipped_and_one_failed_again_is_replayed() {
    let (server, js) = topology(ServerBinary::Current).await;
    publish_failed(&js, Record::job("ep1-s1", "acme", "driver")).await;
    publish_failed(&js, Record::job("ep1-s2", "acme", "driver")).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    // ep1-s1 was sent again (`submit --again`) and then cancelled by its owner; ep1-s2's last
    // outcome is its own failure.
    publish_outcome(&js, "acme", "ep1-s1", "s1", "", ResultStatus::Cancelled).await;
    publish_outcome(&js, "acme", "ep1-s2", "s1", "gpu-7", ResultStatus::Failed).await;

    let out = shotfleet(&server.url(), &["replay"]).await;
    assert!(out.status.success(), "a skip is not a problem: {}", text(&out));
    assert_eq!(rows(&out, "skipped").len(), 1, "{}", text(&out));
    assert_eq!(rows(&out, "replayed").len(), 1, "{}", text(&out));
    assert!(rows(&out, "replayed")[0].contains("acme/ep1-s2"), "{}", text(&out));
    let said = text(&out);
    assert!(said.contains("(job acme/ep1-s1): cancelled ") && said.contains("after it failed (by its owner): `shotfleet submit --again` renders it anew"), "{said}");
    assert_eq!(count(&js, subject::FAILED_STREAM).await, 1, "the cancelled job's record is kept");
}

#[tokio::test]
async fn a_degrade_no_worker_wrote_is_not_restored() {
    let (server, js) = topology(ServerBinary::Current).await;
    // A producer's own `degrade` (refused as invalid): its `from` is smaller than the job.
    let mut job = encoding::decode_job(None, &job_payload("ep2-s5", "acme", ContentType::Json)).unwrap();
    job = ShotJob { width: 1024, height: 1024, degrade: Some(Degrade { level: 1, from: Original { width: 512, height: 512, steps: 20 } }), ..job };
    let payload = encoding::encode(ContentType::Json, &job);
    publish_failed(&js, Record { original_subject: Some("shots.p1.m.acme"), payload: payload.clone(), ..Record::job("ep2-s5", "acme", "invalid") }).await;
    let out = shotfleet(&server.url(), &["replay"]).await;
    assert!(out.status.success() && !text(&out).contains("sent at"), "{}", text(&out));
    let jobs = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let message = jobs.get_last_raw_message_by_subject("shots.p1.m.acme").await.unwrap();
    assert_eq!(&message.payload[..], &payload[..], "as it was: the worker names why, again");
}

#[tokio::test]
async fn an_interrupted_replay_completes_without_queueing_twice() {
    for binary in ServerBinary::available() {
        let (server, js) = topology(binary).await;
        let record = Record::job("ep1-s1", "acme", "max_deliveries");
        let payload = record.payload.clone();
        let seq = publish_failed(&js, record).await;
        // The tool published the replay and died before deleting the failed copy.
        let mut headers = HeaderMap::new();
        headers.insert("Content-Type", "application/json");
        headers.insert("Nats-Msg-Id", subject::msg_id::replay("ep1-s1", seq).as_str());
        js.publish_with_headers("shots.p1.s.acme", headers, payload.into()).await.unwrap().await.unwrap();

        let out = shotfleet(&server.url(), &["replay"]).await;
        assert!(out.status.success(), "{binary:?}: {}", text(&out));
        assert_eq!(rows(&out, "duplicate").len(), 1, "{}", text(&out));
        assert!(text(&out).contains("replayed 0, duplicates 1"), "{}", text(&out));
        assert_eq!(count(&js, subject::JOBS_STREAM).await, 1, "{binary:?}: queued once");
        assert_eq!(count(&js, subject::FAILED_STREAM).await, 0, "{binary:?}");
    }
}

#[tokio::test]
async fn a_job_that_fails_again_is_replayed_again() {
    let (server, js) = topology(ServerBinary::Current).await;
    publish_failed(&js, Record::job("ep1-s1", "acme", "oom")).await;
    assert!(shotfleet(&server.url(), &["replay"]).await.status.success());
    // A worker took the replayed job (sequence 1 in SHOTS) and it failed again.
    publish_failed(&js, Record { job_seq: 2, ..Record::job("ep1-s1", "acme", "oom") }).await;
    let out = shotfleet(&server.url(), &["replay"]).await;
    assert!(text(&out).contains("replayed 1, duplicates 0"), "a new record is a new Msg-Id: {}", text(&out));
    assert_eq!(count(&js, subject::JOBS_STREAM).await, 2);
}

#[tokio::test]
async fn a_record_with_a_bad_original_subject_is_kept_and_reported() {
    for binary in ServerBinary::available() {
        let (server, js) = topology(binary).await;
        let missing = publish_failed(&js, Record { original_subject: Some(""), ..Record::job("no-subject", "acme", "oom") }).await;
        let wrong =
            publish_failed(&js, Record { original_subject: Some("shots.failed.p1.acme"), ..Record::job("wrong", "acme", "oom") })
                .await;
        publish_failed(&js, Record::job("fine", "acme", "oom")).await;

        let dry = shotfleet(&server.url(), &["replay", "--dry-run"]).await;
        assert_eq!(dry.status.code(), Some(1), "{}", text(&dry));
        assert!(text(&dry).contains("would replay 1, would skip 0, cannot replay 2"), "{}", text(&dry));

        let out = shotfleet(&server.url(), &["replay"]).await;
        assert_eq!(out.status.code(), Some(1), "{binary:?}: {}", text(&out));
        let message = text(&out);
        assert!(
            message.contains(&format!("seq {missing} (job acme/no-subject): no Shotfleet-Original-Subject header")),
            "{message}"
        );
        assert!(
            message.contains(&format!("seq {wrong} (job acme/wrong): Shotfleet-Original-Subject is not a job subject")),
            "{message}"
        );
        assert!(message.contains("replayed 1, duplicates 0, skipped 0, could not replay 2"), "{message}");
        assert_eq!(rows(&out, "kept").len(), 2, "{message}");
        assert_eq!(count(&js, subject::FAILED_STREAM).await, 2, "{binary:?}: both kept");
        assert_eq!(count(&js, subject::JOBS_STREAM).await, 1, "{binary:?}");
    }
}

#[tokio::test]
async fn records_without_a_job_id_are_replayed_only_when_their_reason_is_asked_for() {
    let (server, js) = topology(ServerBinary::Current).await;
    let seq = publish_failed(
        &js,
        Record {
            job_id: None,
            content_type: None,
            payload: b"\xc1 not a job".to_vec(),
            job_seq: 41,
            ..Record::job("-", "acme", "invalid")
        },
    )
    .await;

    let out = shotfleet(&server.url(), &["replay"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("no job id (undecodable payload); pass --reason invalid"), "{}", text(&out));
    assert!(text(&out).contains("replayed 0, duplicates 0, skipped 1"), "{}", text(&out));
    assert_eq!(count(&js, subject::FAILED_STREAM).await, 1);

    let out = shotfleet(&server.url(), &["replay", "--reason", "invalid"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("replayed 1"), "{}", text(&out));
    let jobs = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let message = jobs.get_last_raw_message_by_subject("shots.p1.s.acme").await.unwrap();
    assert_eq!(&message.payload[..], b"\xc1 not a job");
    assert!(message.headers.get("Content-Type").is_none(), "no Content-Type was sent, none is added");
    assert_eq!(message.headers.get("Nats-Msg-Id").unwrap().as_str(), format!("seq-{seq}:replay:{seq}"));
    assert_eq!(count(&js, subject::FAILED_STREAM).await, 0);
}
