//! The worker as operators run it: a real `shotfleet-consumer` process with the tiny model on the
//! CPU, a real nats-server, a local store folder.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{subject, Priority, ShotJob};
use shotfleet_testkit::NatsServer;
use shotfleet_tests::*;

fn topology(ack_wait_s: u64, max_deliver: i64) -> Topology {
    Topology { ack_wait: Duration::from_secs(ack_wait_s), max_deliver, ..Topology::default() }
}

#[tokio::test]
async fn renders_stores_reports_and_acks() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let worker = Worker::start(&server.url(), WorkerSpec::new("w1", store.path()));

    // b1's prompt is longer than the text encoders read.
    let long = ShotJob { prompt: "a lighthouse keeper at dawn ".repeat(20), ..job("b1", "beta", (64, 128), 3, 1) };
    let shots = vec![
        shot(Priority::P0, job("a1", "acme", (64, 64), 4, 1)),
        shot(Priority::P1, job("a2", "acme", (128, 96), 4, 2)),
        shot(Priority::P2, long),
    ];
    submit(&js, &shots).await;
    // As Python's json.dumps writes a job built with floats and Nones, and with two fields no
    // job has: `lora` (for `loras`) and one of the client's own.
    let python = br#"{"v": 1, "job_id": "a3", "project": "acme", "shot_id": "shot-a3", "prompt": "a red kite", "negative_prompt": null,
        "width": 64.0, "height": 64.0, "steps": 3.0, "guidance": 5.0, "seed": 7, "images": null, "loras": null, "floor": null,
        "lora": [{"name": "kai", "weight": 0.8}], "client_ref": "row 12"}"#;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "acme/a3");
    js.publish_with_headers("shots.p1.xs.acme", headers, python.as_slice().into()).await.unwrap().await.unwrap();
    let shots = [shots, vec![shot(Priority::P1, job("a3", "acme", (64, 64), 3, 1))]].concat();
    let outcomes = outcomes(&js, &shots, Duration::from_secs(120)).await;
    for result in results(&outcomes) {
        check_store(store.path(), &result);
        assert_eq!(result.worker, "w1");
        assert_eq!(result.device, "simulated (cpu)");
        let expected = shots.iter().find(|s| s.job.job_id == result.job_id).unwrap();
        assert_eq!(result.images.len() as u32, expected.job.images);
        for image in &result.images {
            assert_eq!((image.width, image.height), (expected.job.width, expected.job.height));
            assert!(image.key.starts_with(&format!("{}/{}/shot-{}-{}-", result.project, result.job_id, result.job_id, image.index)), "{}", image.key);
        }
    }
    // Acked: nothing left in the work queue.
    let mut stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while stream.info().await.unwrap().state.messages > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stream.info().await.unwrap().state.messages, 0, "every job acked");
    let metrics = worker.metrics();
    assert!(metrics.contains("shotfleet_jobs_total{outcome=\"done\",priority=\"p0\",class=\"xs\"} 1"), "{metrics}");
    assert!(metrics.contains("shotfleet_render_seconds"), "{metrics}");
    assert!(metrics.contains("shotfleet_estimate_error_ratio"), "{metrics}");
    let log = worker.plain_log();
    let cut: Vec<&str> = log.lines().filter(|l| l.contains("the end of the prompt is left out")).collect();
    assert!(cut.len() == 1 && cut[0].contains("job=b1"), "one warning, for b1: {cut:?}");
    // And its result says so, for the person who wrote the prompt.
    for result in results(&outcomes) {
        let cut_note = result.notes.iter().any(|n| n.starts_with("prompt cut at the text encoders' 77 tokens: its last "));
        assert_eq!(cut_note, result.job_id == "b1", "{}: {:?}", result.job_id, result.notes);
        // The fields no job has are named, the misspelt one with the field it is near.
        let ignored = "ignored, not fields of a job (contract v1): `client_ref`, `lora` (did you mean `loras`?)";
        assert_eq!(result.notes.iter().any(|n| n == ignored), result.job_id == "a3", "{}: {:?}", result.job_id, result.notes);
    }
}

#[tokio::test]
async fn auto_and_wrong_class_jobs_are_routed_then_rendered() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let _worker = Worker::start(&server.url(), WorkerSpec::new("router", store.path()));

    // One job on `auto`, one on the wrong class (a 64x64 job on `s`), both as a foreign client
    // would publish them.
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut sequences = Vec::new();
    for (subject_name, j) in [
        ("shots.p1.auto.acme", job("r-auto", "acme", (64, 64), 2, 1)),
        ("shots.p1.s.acme", job("r-wrong", "acme", (64, 64), 2, 1)),
    ] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", j.job_id.as_str());
        let ack = js.publish_with_headers(subject_name, headers, serde_json::to_vec(&j).unwrap().into()).await.unwrap().await.unwrap();
        sequences.push(ack.sequence);
    }
    drop(client);
    let shots = vec![shot(Priority::P1, job("r-auto", "acme", (64, 64), 2, 1)), shot(Priority::P1, job("r-wrong", "acme", (64, 64), 2, 1))];
    let outcomes = outcomes(&js, &shots, Duration::from_secs(60)).await;
    assert_eq!(results(&outcomes).len(), 2);
    // The routed copies carry `<project>/<job>:route:<the original's sequence>` ids: publishing
    // one again is a duplicate.
    let id = format!("acme/r-auto:route:{}", sequences[0]);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.as_str());
    let ack = js.publish_with_headers("shots.p1.xs.acme", headers, "{}".into()).await.unwrap().await.unwrap();
    assert!(ack.duplicate, "the worker published the routed copy with Msg-Id {id}");
}

#[tokio::test]
async fn p2_is_served_within_its_bound_while_p0_keeps_arriving() {
    p2_within_its_bound_under_p0("").await;
}

/// The same with batching and the reserve (worker/reserve.rs): the p2 job (of a size no p0 job
/// has) waits among p0 jobs fetched ahead, and still leads within its bound.
#[tokio::test]
async fn p2_is_served_within_its_bound_while_p0_keeps_arriving_also_through_the_reserve() {
    p2_within_its_bound_under_p0("batch_jobs = 4\nlookahead = 8").await;
}

/// A worker (`top`: its extra top-level keys) busy with a stream of p0 jobs; a p2 job arrives
/// meanwhile and must be done within its bound (3 s) plus slack, after p0 jobs that came later.
async fn p2_within_its_bound_under_p0(top: &str) {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("prio", store.path());
    spec.p1_max_wait = "3s";
    spec.p2_max_wait = "3s";
    spec.top = top.to_owned();
    let _worker = Worker::start(&server.url(), spec);

    // A p0 stream that never runs dry during the test; once the worker is busy with it, a p2
    // job arrives.
    let js_feed = js.clone();
    let feeder = tokio::spawn(async move {
        let mut n = 0;
        loop {
            let batch: Vec<_> = (0..4).map(|i| shot(Priority::P0, job(&format!("hi-{n}-{i}"), "acme", (256, 256), 8, 1))).collect();
            submit(&js_feed, &batch).await;
            n += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    submit(&js, &[shot(Priority::P2, job("low", "acme", (64, 64), 2, 1))]).await;
    let started = Instant::now();
    let low = outcomes(&js, &[shot(Priority::P2, job("low", "acme", (64, 64), 2, 1))], Duration::from_secs(60)).await;
    let waited = started.elapsed();
    feeder.abort();
    let result = results(&low).remove(0);
    // The bound (3 s, counted from when p2 was last served or found empty, which can be before
    // this job arrived) plus one p0 render in progress and polling slack.
    assert!(waited < Duration::from_secs(15), "p2 waited {waited:?}");
    // p0 went first meanwhile: p0 jobs finished while the p2 job waited in the queue.
    let queued_at = result.finished_at_ms - result.timing.render_ms - result.timing.upload_ms - result.timing.queue_ms;
    let stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    let mut p0_meanwhile = 0;
    let mut seq = 1;
    while let Ok(message) = stream.get_raw_message(seq).await {
        let r: shotfleet_schema::ShotResult = serde_json::from_slice(&message.payload).unwrap();
        if r.job_id.starts_with("hi-") && r.finished_at_ms > queued_at && r.finished_at_ms < result.finished_at_ms {
            p0_meanwhile += 1;
        }
        seq += 1;
    }
    assert!(p0_meanwhile >= 2, "p0 jobs served while p2 waited: {p0_meanwhile} (p2 queued {} ms)", result.timing.queue_ms);
}

#[tokio::test]
async fn a_render_longer_than_ack_wait_is_not_redelivered() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &topology(2, 5)).await;
    let store = tempfile::tempdir().unwrap();
    let _worker = Worker::start(&server.url(), WorkerSpec::new("long", store.path()));
    // Large enough to take several ack_waits on the CPU.
    let long = shot(Priority::P1, job("long-1", "acme", (512, 512), 60, 1));
    submit(&js, std::slice::from_ref(&long)).await;
    let outcomes = outcomes(&js, &[long], Duration::from_secs(240)).await;
    let result = results(&outcomes).remove(0);
    assert!(result.timing.render_ms > 4_000, "the render took {} ms: longer than two ack_waits", result.timing.render_ms);
    assert_eq!(result.attempt, 1, "progress acks kept the job from being redelivered");
}

#[tokio::test]
async fn the_time_limit_stops_a_render_and_it_fails_on_the_last_delivery() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &topology(30, 2)).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("limited", store.path());
    spec.time_limit = "1s";
    let worker = Worker::start(&server.url(), spec);
    let slow = shot(Priority::P1, job("slow-1", "acme", (512, 512), 120, 1));
    submit(&js, std::slice::from_ref(&slow)).await;
    let outcomes = outcomes(&js, &[slow], Duration::from_secs(120)).await;
    match &outcomes["slow-1"] {
        shotfleet_producer::wait::Outcome::Failed { reason, detail, attempts } => {
            // Two failed attempts, fewer than `max_failures`, but the consumer delivers it no
            // more: the worker fails it itself, saying why.
            assert_eq!(reason, "attempts");
            assert!(detail.contains("time limit"), "{detail}");
            assert_eq!(attempts, "2");
        }
        other => panic!("expected a failed record: {other:?}\n{}", worker.log()),
    }
}

#[tokio::test]
async fn invalid_jobs_go_to_the_failed_stream_with_reasons() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let _worker = Worker::start(&server.url(), WorkerSpec::new("strict", store.path()));
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "garbage-1");
    js.publish_with_headers("shots.p0.xs.acme", headers, "{\"v\":1,\"job_id\":\"bad-1\",\"width\":\"wide\"}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let failed = js.get_stream(subject::FAILED_STREAM).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let record = loop {
        if let Ok(m) = failed.get_last_raw_message_by_subject("shots.failed.p0.acme").await {
            break m;
        }
        assert!(Instant::now() < deadline, "no failed record");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let header = |n: &str| record.headers.get(n).map(|v| v.as_str().to_owned()).unwrap_or_default();
    assert_eq!(header("Shotfleet-Reason"), "invalid");
    assert!(header("Shotfleet-Detail").contains("width"), "{}", header("Shotfleet-Detail"));
    assert_eq!(header("Shotfleet-Original-Subject"), "shots.p0.xs.acme");
    assert_eq!(header("Shotfleet-Attempts"), "1");
    assert_eq!(header("Shotfleet-Deliveries"), "1");
    assert_eq!(header("Shotfleet-Worker"), "strict");
    assert_eq!(&record.payload[..], b"{\"v\":1,\"job_id\":\"bad-1\",\"width\":\"wide\"}", "the original payload is kept");
    // The payload did not decode, but it names its job: the record and an outcome say so, so
    // that its producer hears why (`shotfleet replay --job bad-1` finds it).
    assert_eq!(header("Shotfleet-Job-Id"), "bad-1");
    let named = |id: &str| shot(Priority::P0, job(id, "acme", (64, 64), 2, 1));
    match &outcomes(&js, &[named("bad-1")], Duration::from_secs(30)).await["bad-1"] {
        shotfleet_producer::wait::Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "invalid");
            assert!(detail.contains("width"), "{detail}");
        }
        other => panic!("expected a failed outcome: {other:?}"),
    }
    // So does a job of another contract version, in MessagePack.
    let future = serde_json::json!({"v": 2, "job_id": "future-1", "project": "acme", "shot_id": "s1", "prompt": "a cat"});
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "acme/future-1");
    headers.insert("Content-Type", "application/msgpack");
    js.publish_with_headers("shots.p0.xs.acme", headers, shotfleet_schema::encoding::encode(shotfleet_schema::ContentType::MessagePack, &future).into()).await.unwrap().await.unwrap();
    match &outcomes(&js, &[named("future-1")], Duration::from_secs(30)).await["future-1"] {
        shotfleet_producer::wait::Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "invalid");
            assert!(detail.contains("version 2"), "{detail}");
        }
        other => panic!("expected a failed outcome: {other:?}"),
    }

    // Python's json.dumps of a NaN guidance: no JSON, but its producer still hears why.
    let python = br#"{"v": 1, "job_id": "nan-1", "project": "acme", "shot_id": "s1", "prompt": "a cat", "width": 64, "height": 64, "steps": 2, "guidance": NaN, "seed": 1}"#;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "acme/nan-1");
    js.publish_with_headers("shots.p0.xs.acme", headers, python.as_slice().into()).await.unwrap().await.unwrap();
    match &outcomes(&js, &[named("nan-1")], Duration::from_secs(30)).await["nan-1"] {
        shotfleet_producer::wait::Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "invalid");
            assert!(detail.contains("allow_nan=False"), "{detail}");
        }
        other => panic!("expected a failed outcome: {other:?}"),
    }

    // A LoRA the library does not have: never rendered without the style it asked for.
    let mut styled = job("styled-1", "acme", (64, 64), 2, 1);
    styled.loras = vec![shotfleet_schema::Lora { name: "ink-wash.v2".into(), weight: 0.8 }];
    let styled = shot(Priority::P1, styled);
    submit(&js, std::slice::from_ref(&styled)).await;
    match &outcomes(&js, &[styled], Duration::from_secs(30)).await["styled-1"] {
        shotfleet_producer::wait::Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "invalid");
            assert!(detail.contains("no LoRA named `ink-wash.v2`") && detail.contains("shotfleet lora push"), "{detail}");
        }
        other => panic!("expected a failed record: {other:?}"),
    }

    // A payload of project beta published under acme fails in acme, where it was published:
    // nothing of it reaches beta's outcomes.
    let stray = job("stray-1", "beta", (64, 64), 2, 1);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "acme/stray-1");
    js.publish_with_headers("shots.p1.xs.acme", headers, serde_json::to_vec(&stray).unwrap().into()).await.unwrap().await.unwrap();
    let as_acme = shot(Priority::P1, job("stray-1", "acme", (64, 64), 2, 1));
    match &outcomes(&js, &[as_acme], Duration::from_secs(30)).await["stray-1"] {
        shotfleet_producer::wait::Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "invalid");
            assert!(detail.contains("payload project `beta` was published under project `acme`"), "{detail}");
        }
        other => panic!("expected a failed record: {other:?}"),
    }
    let results = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    assert!(results.get_last_raw_message_by_subject("shots.done.beta.stray-1").await.is_err(), "nothing under beta");

    // A size this model cannot render, in a class no worker here holds: refused as invalid,
    // not routed and then degraded to a size it can render.
    let odd = shot(Priority::P2, job("odd-1", "acme", (1000, 1000), 2, 1));
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "acme/odd-1");
    js.publish_with_headers("shots.p2.xs.acme", headers, serde_json::to_vec(&odd.job).unwrap().into()).await.unwrap().await.unwrap();
    match &outcomes(&js, &[odd], Duration::from_secs(30)).await["odd-1"] {
        shotfleet_producer::wait::Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "invalid");
            assert!(detail.contains("multiples of 16") && detail.contains("992x992"), "{detail}");
        }
        other => panic!("expected a failed outcome: {other:?}"),
    }
}

#[tokio::test]
async fn only_classes_that_fit_the_budget_are_fetched() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("small", store.path());
    spec.classes = "[\"xs\", \"s\", \"m\"]";
    // A card with little room beyond the models: one xs image (512x512 at most: about 270 MiB
    // planned on the tiny model, mostly its VAE) fits, an m image (1024x1024: about 1 GiB) does not.
    spec.total_mib = 800;
    let worker = Worker::start(&server.url(), spec);
    let small = shot(Priority::P1, job("fits", "acme", (64, 64), 2, 1));
    let big = shot(Priority::P0, job("too-big", "acme", (1024, 1024), 2, 1));
    submit(&js, &[big.clone(), small.clone()]).await;
    let done = outcomes(&js, std::slice::from_ref(&small), Duration::from_secs(60)).await;
    assert_eq!(results(&done).len(), 1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream.get_consumer("render-p0-m").await.unwrap();
    let mut consumer = consumer;
    let info = consumer.info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (1, 0), "the m job was never fetched:\n{}", worker.log());
}

#[tokio::test]
async fn an_idle_worker_gives_back_its_arena_cache_for_a_class_that_does_not_fit() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("cache", store.path());
    // Room for a 768x768 render (about 1.1 GiB planned on the tiny model on the CPU) beside the
    // models, but not beside the arena cache such a render leaves: the room never counts a
    // process's idle cache as free. The leak guard's own idle shrink is ten minutes away, so
    // only the fetch loop's shrink can let the second job in soon.
    spec.total_mib = 2000;
    // The decoder keeps its regions between renders, as the UNet does: most of the cache this
    // test needs is the decoder's (by default it gives its arena back after every image).
    spec.budget = "vae_keeps_arena = true";
    spec.calibration = "[[128, 128, 1], [256, 256, 1], [512, 512, 1], [768, 768, 1]]";
    spec.extra = "[leak_guard]\ncheck_every = \"10m\"\n".into();
    let worker = Worker::start(&server.url(), spec);
    let first = shot(Priority::P1, job("cache-maker", "acme", (768, 768), 2, 1));
    submit(&js, std::slice::from_ref(&first)).await;
    assert_eq!(results(&outcomes(&js, &[first], Duration::from_secs(120)).await).len(), 1);

    let second = shot(Priority::P1, job("needs-room", "acme", (768, 768), 2, 1));
    let sent = Instant::now();
    submit(&js, std::slice::from_ref(&second)).await;
    assert_eq!(results(&outcomes(&js, &[second], Duration::from_secs(120)).await).len(), 1);
    assert!(sent.elapsed() < Duration::from_secs(100), "the second job waited {:?}", sent.elapsed());
    // The shrink that lets the second job in may come before it is even submitted (the worker
    // goes idle with a class shut as soon as the first is done), so look for it in the log's
    // order: after the first job's render, before the second's.
    // Lines, not offsets: the log's fields carry colour codes between a key and its value.
    let log = worker.log();
    let lines: Vec<&str> = log.lines().collect();
    let line_of = |message: &str, job: &str| {
        lines.iter().position(|l| l.contains(message) && l.contains(job)).unwrap_or_else(|| panic!("no `{message}` line of {job}:\n{log}"))
    };
    // From the first render's end (its slot is free then, before its upload and commit).
    let (first_done, second_rendered) = (line_of("observed peak", "cache-maker"), line_of("observed peak", "needs-room"));
    assert!(
        lines[first_done..second_rendered].iter().any(|l| l.contains("a class does not fit while idle")),
        "the second job got in without a shrink: the test's card is too roomy\n{log}"
    );
}

#[tokio::test]
async fn sigterm_finishes_in_flight_work_within_the_grace_period() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut worker = Worker::start(&server.url(), WorkerSpec::new("graceful", store.path()));
    let j = shot(Priority::P1, job("grace-1", "acme", (512, 512), 20, 1));
    submit(&js, std::slice::from_ref(&j)).await;
    // Wait until it is in flight, then ask the worker to stop.
    wait_in_flight(&js, "render-p1-xs").await;
    let code = worker.terminate(Duration::from_secs(30));
    assert_eq!(code, Some(0), "clean exit:\n{}", worker.log());
    let done = outcomes(&js, &[j], Duration::from_secs(5)).await;
    assert_eq!(results(&done).len(), 1, "the in-flight job finished before exit");
}

#[tokio::test]
async fn past_the_grace_period_in_flight_jobs_are_naked_for_others() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &topology(60, 5)).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("impatient", store.path());
    spec.grace = "1s";
    let mut first = Worker::start(&server.url(), spec);
    let j = shot(Priority::P1, job("handover-1", "acme", (512, 512), 60, 1));
    submit(&js, std::slice::from_ref(&j)).await;
    wait_in_flight(&js, "render-p1-xs").await;
    let stopped = Instant::now();
    assert_eq!(first.terminate(Duration::from_secs(30)), Some(0), "{}", first.log());
    assert!(stopped.elapsed() < Duration::from_secs(10), "stopped soon after the grace period");
    // Naked without delay: a second worker takes it long before ack_wait (60 s) would. Its
    // fetch is what is timed (`queue_ms`: publish to this delivery's fetch); the 60-step render
    // after it may take long on a loaded machine.
    let _second = Worker::start(&server.url(), WorkerSpec::new("successor", store.path()));
    let done = outcomes(&js, &[j], Duration::from_secs(150)).await;
    let result = results(&done).remove(0);
    assert_eq!(result.worker, "successor");
    assert_eq!(result.attempt, 2);
    assert!(result.timing.queue_ms < 50_000, "fetched {} ms after publishing: the nak was not immediate", result.timing.queue_ms);
}

#[tokio::test]
async fn the_worker_runs_on_nats_server_2_9() {
    use shotfleet_testkit::nats::{ServerBinary, ServerOptions};
    if !ServerBinary::available().contains(&ServerBinary::Debian29) {
        eprintln!("Debian's nats-server 2.9 is not installed here; covered by 2.15.1 elsewhere");
        return;
    }
    let server = NatsServer::start_with(ServerOptions { binary: ServerBinary::Debian29, ..Default::default() });
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let _worker = Worker::start(&server.url(), WorkerSpec::new("old-server", store.path()));
    // A job on its class, one on `auto`, and one that fails validation (terminated: 2.9 takes
    // only a bare +TERM, which is all the worker sends).
    let shots = vec![shot(Priority::P0, job("old-1", "acme", (64, 64), 2, 2))];
    submit(&js, &shots).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "old-auto");
    let auto = job("old-auto", "acme", (64, 64), 2, 1);
    js.publish_with_headers("shots.p1.auto.acme", headers, serde_json::to_vec(&auto).unwrap().into()).await.unwrap().await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "old-bad");
    let mut bad = job("old-bad", "acme", (64, 64), 2, 1);
    bad.width = 63;
    js.publish_with_headers("shots.p1.xs.acme", headers, serde_json::to_vec(&bad).unwrap().into()).await.unwrap().await.unwrap();
    let all = vec![shots[0].clone(), shot(Priority::P1, auto), shot(Priority::P1, bad)];
    let done = outcomes(&js, &all, Duration::from_secs(60)).await;
    assert!(matches!(done["old-1"], shotfleet_producer::wait::Outcome::Done(_)));
    assert!(matches!(done["old-auto"], shotfleet_producer::wait::Outcome::Done(_)));
    assert!(matches!(&done["old-bad"], shotfleet_producer::wait::Outcome::Failed { reason, .. } if reason == "invalid"));
    for outcome in done.values() {
        if let shotfleet_producer::wait::Outcome::Done(result) = outcome {
            check_store(store.path(), result);
        }
    }
    wait_settled(&js, Duration::from_secs(10)).await;
}

#[tokio::test]
async fn compatible_jobs_share_unet_batches_and_render_the_same_images() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // Queued before the worker starts, so its first fetch takes them together.
    let batch: Vec<_> = (0..4).map(|i| shot(Priority::P1, job(&format!("grp-{i}"), "acme", (64, 96), 3, 1 + i % 2))).collect();
    let odd_one = shot(Priority::P1, job("grp-odd", "acme", (96, 64), 3, 1));
    submit(&js, &batch).await;
    submit(&js, std::slice::from_ref(&odd_one)).await;
    let mut spec = WorkerSpec::new("batcher", store.path());
    spec.top = "batch_jobs = 8".into();
    let batcher = Worker::start(&server.url(), spec);
    let mut all = batch.clone();
    all.push(odd_one);
    let grouped = results(&outcomes(&js, &all, Duration::from_secs(60)).await);
    assert!(batcher.log().contains("rendered a group"), "{}", batcher.log());
    drop(batcher);

    // The same shots rendered one job at a time give the same bytes.
    let _solo = Worker::start(&server.url(), WorkerSpec::new("solo", store.path()));
    let again: Vec<_> = batch
        .iter()
        .map(|s| {
            let mut j = s.job.clone();
            j.job_id = format!("{}-solo", j.job_id);
            shot(s.priority, j)
        })
        .collect();
    submit(&js, &again).await;
    let solo = results(&outcomes(&js, &again, Duration::from_secs(60)).await);
    for one in &solo {
        let twin = grouped.iter().find(|r| format!("{}-solo", r.job_id) == one.job_id).unwrap();
        let shas = |r: &shotfleet_schema::ShotResult| r.images.iter().map(|i| i.sha256.clone()).collect::<Vec<_>>();
        assert_eq!(shas(one), shas(twin), "{}", one.job_id);
    }
}

/// What a supervisor does after an exit follows its code: a broken model folder is left
/// stopped (2) like a bad config, a store that refuses for good waits out the store backoff
/// (77) as it does when it refuses while serving; neither is "start failed" (3), which a
/// supervisor restarts within seconds.
#[tokio::test]
async fn start_up_failures_that_no_restart_mends_exit_with_their_own_codes() {
    let server = NatsServer::start();
    let _js = jetstream_with(&server.url(), &Topology::default()).await;
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("model");
    shotfleet_testkit::paths::copy_dir(&tiny_model(), &model);
    std::fs::remove_file(model.join("unet/model.onnx")).unwrap();
    let mut spec = WorkerSpec::new("no-unet", &scratch.path().join("images"));
    spec.env = vec![("SHOTFLEET_MODEL".into(), model.display().to_string())];
    let mut worker = Worker::spawn(&server.url(), spec);
    let status = worker.wait_exit(Duration::from_secs(60)).expect("the worker exits");
    assert_eq!(status.code(), Some(2), "{}", worker.log());
    assert!(worker.log().contains("unet/model.onnx: missing") && worker.log().contains("fix the model folder"), "{}", worker.log());

    let file = scratch.path().join("a-file");
    std::fs::write(&file, b"not a folder").unwrap();
    let mut worker = Worker::spawn(&server.url(), WorkerSpec::new("store-is-a-file", &file.join("images")));
    let status = worker.wait_exit(Duration::from_secs(60)).expect("the worker exits");
    assert_eq!(status.code(), Some(77), "{}", worker.log());
}

#[tokio::test]
async fn a_second_worker_under_a_live_workers_id_says_so() {
    let server = NatsServer::start();
    let _js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let _first = Worker::start(&server.url(), WorkerSpec::new("twin", store.path()));
    let second = Worker::start(&server.url(), WorkerSpec::new("twin", store.path()));
    assert!(second.log().contains("another live worker answers under this worker_id"), "{}", second.log());
    let third = Worker::start(&server.url(), WorkerSpec::new("other", store.path()));
    assert!(!third.log().contains("another live worker answers"), "{}", third.log());
}

/// Through a stop: `/healthz` and `/metrics` serve through the drain, `/readyz` says draining,
/// and a second SIGTERM gives the job back at once rather than after the grace period; the job
/// renders on the next worker, once.
#[tokio::test]
async fn a_draining_worker_stays_observable_and_a_second_signal_hurries_it() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("drain", store.path());
    spec.grace = "60s";
    let mut worker = Worker::start(&server.url(), spec);
    let long = shot(Priority::P1, job("drain-long", "acme", (128, 128), 150, 4));
    submit(&js, std::slice::from_ref(&long)).await;
    wait_in_flight(&js, "render-p1-xs").await;
    worker.signal("TERM");
    let port = worker.metrics_port;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !worker.log().contains("stopping: finishing in-flight jobs") {
        assert!(Instant::now() < deadline, "{}", worker.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let get = |path: &str| shotfleet_testkit::process::http_get(port, path).map(|(code, _)| code);
    assert_eq!((get("/healthz"), get("/metrics"), get("/readyz")), (Some(200), Some(200), Some(503)), "{}", worker.log());
    let signalled = Instant::now();
    worker.signal("TERM");
    let status = worker.wait_exit(Duration::from_secs(20)).expect("the worker exits on the second signal");
    assert!(status.success() && signalled.elapsed() < Duration::from_secs(15), "{:?} after {:?}", status, signalled.elapsed());
    assert!(worker.log().contains("signalled again"), "{}", worker.log());
    let _next = Worker::start(&server.url(), WorkerSpec::new("after-drain", store.path()));
    assert!(matches!(&outcomes(&js, &[long], Duration::from_secs(120)).await["drain-long"], shotfleet_producer::wait::Outcome::Done(_)));
}

/// A worker cut off from NATS is not ready, and ready again once the server is back.
#[tokio::test]
async fn readiness_follows_the_nats_connection() {
    let mut server = NatsServer::start();
    let _js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let worker = Worker::start(&server.url(), WorkerSpec::new("cut-off", store.path()));
    let readyz = || shotfleet_testkit::process::http_get(worker.metrics_port, "/readyz");
    let until = |want: u16, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = readyz();
            if got.as_ref().is_some_and(|(code, _)| *code == want) {
                return got.unwrap().1;
            }
            assert!(Instant::now() < deadline, "{what}: /readyz says {got:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    server.stop();
    let body = until(503, "with the server stopped");
    assert!(body.contains("disconnected from NATS"), "{body}");
    server.restart();
    until(200, "with the server back");
}
