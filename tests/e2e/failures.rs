//! When things break: real out-of-memory errors (a capped ONNX Runtime arena on the CPU) down
//! the degrade ladder, driver faults, jobs that died on their last delivery, the leak guard.

use std::time::{Duration, Instant};

use futures::StreamExt;
use shotfleet_producer::wait::Outcome;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{subject, Floor, Priority, ResultStatus};
use shotfleet_testkit::NatsServer;
use shotfleet_tests::*;

/// A worker whose ONNX Runtime arena is capped at `mib`: it runs out of memory for real, as a
/// small card would. Its probe renders stay small enough to fit. A job it cannot hold is offered
/// to the rest of the fleet for 2 s before it is degraded.
fn capped(id: &str, store: &std::path::Path, classes: &'static str, mib: u64) -> WorkerSpec {
    let mut spec = WorkerSpec::new(id, store);
    spec.classes = classes;
    spec.extra = "[degrade]\nhandoff = \"2s\"\n".into();
    spec.top = format!("cpu_arena_max_mib = {mib}");
    spec.calibration = "[[64, 64, 1], [128, 128, 1], [192, 192, 1]]";
    spec
}

/// One worker alone, capped below a 1024² render, with a long handoff: each out-of-memory raises
/// its estimate until the class no longer fits its room, and it stops fetching the class with
/// the job still queued there. Its watch of the classes nobody admits, its own included, sends
/// the job down; then the ladder renders it.
#[tokio::test]
async fn a_lone_worker_that_stops_admitting_a_class_degrades_its_jobs() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = capped("lone-card", store.path(), "[\"xs\", \"s\", \"m\"]", 200);
    // Five or so out-of-memory cycles (about 1.4 s each here) carry the estimate past the room;
    // the handoff must not end first, or the worker degrades the job itself.
    spec.extra = "[degrade]\nhandoff = \"30s\"\n".into();
    let lone = Worker::start(&server.url(), spec);
    let mut j = job("lone-1", "acme", (1024, 1024), 2, 1);
    j.floor = Some(Floor { min_side: 256, min_steps: 2 });
    let s = shot(Priority::P1, j);
    submit(&js, std::slice::from_ref(&s)).await;
    let result = results(&outcomes(&js, &[s], Duration::from_secs(180)).await).remove(0);
    assert_eq!(result.status, ResultStatus::Degraded, "{}", lone.log());
    assert!(result.images[0].width < 1024, "{result:?}");
    let log = lone.plain_log();
    let watched = log.lines().find(|l| l.contains("no live worker holds this class: one rung down without rendering"));
    assert!(watched.is_some_and(|l| l.contains("class=m")), "the watch sent it down, not the worker's own handoff:\n{log}");
}

/// A job that failed after the ladder lowered it is replayed at the size it was asked for: the
/// failed record holds the 768x768 copy it failed as, and a roomier card renders it whole.
#[tokio::test]
async fn a_replayed_job_that_failed_degraded_renders_at_its_requested_size() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut small = Worker::start(&server.url(), capped("small-card", store.path(), "[\"s\", \"m\"]", 200));
    let mut j = job("replay-deg-1", "acme", (1024, 1024), 2, 1);
    // One rung down (768x768) and no further: the capped card fails it there.
    j.floor = Some(Floor { min_side: 768, min_steps: 2 });
    let s = shot(Priority::P1, j);
    submit(&js, std::slice::from_ref(&s)).await;
    match outcomes(&js, std::slice::from_ref(&s), Duration::from_secs(120)).await.remove("replay-deg-1") {
        Some(Outcome::Failed { reason, .. }) => assert_eq!(reason, "oom", "{}", small.log()),
        other => panic!("expected a failure below the floor, got {other:?}\n{}", small.log()),
    }
    assert!(small.log().contains("re-published one rung down"), "{}", small.log());
    small.terminate(Duration::from_secs(20));

    let mut roomy = WorkerSpec::new("roomy-card", store.path());
    roomy.classes = "[\"s\", \"m\"]";
    // A card that plans a 1024x1024 image within its room (a 4 GiB one does not serve m).
    roomy.total_mib = 16384;
    let roomy = Worker::start(&server.url(), roomy);
    let filter = shotfleet_producer::replay::Filter { jobs: vec!["replay-deg-1".into()], ..Default::default() };
    let mut restored = Vec::new();
    let summary = shotfleet_producer::replay::replay(&js, &filter, false, |_, outcome| {
        if let shotfleet_producer::replay::Outcome::Replayed { restored: Some(r), subject, .. } = outcome {
            restored.push((*r, subject.clone()));
        }
    })
    .await
    .unwrap();
    assert_eq!(summary.replayed, 1, "{summary:?}");
    let (r, to) = restored.pop().expect("the replay says it restored the job");
    assert_eq!((r.level, r.failed_width, r.failed_height), (1, 768, 768));
    assert_eq!((r.original.width, r.original.height, r.original.steps), (1024, 1024, 2));
    assert_eq!(to, "shots.p1.m.acme", "to the requested size's class");

    // The failure stays the last outcome until the replay's result lands.
    let results_stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let result = loop {
        let last = shotfleet_schema::nats::outcome::last(&results_stream, "acme", "replay-deg-1").await.unwrap();
        if let Some(last) = last.filter(|o| o.result.is_rendered()) {
            break last.result;
        }
        assert!(Instant::now() < deadline, "{}", roomy.log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!((result.status, result.worker.as_str()), (ResultStatus::Done, "roomy-card"), "{}", roomy.plain_log());
    assert_eq!(result.degrade, None, "rendered as asked");
    assert_eq!((result.images[0].width, result.images[0].height), (1024, 1024));
    check_store(store.path(), &result);
}

#[tokio::test]
async fn out_of_memory_goes_down_the_ladder_to_a_smaller_worker() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // A serves s and m but its 200 MiB arena cannot hold a 768x768 UNet; B serves only xs.
    let big = capped("big-card", store.path(), "[\"s\", \"m\"]", 200);
    let big = Worker::start(&server.url(), big);
    let mut small = WorkerSpec::new("small-card", store.path());
    small.classes = "[\"xs\"]";
    let _small = Worker::start(&server.url(), small);

    let mut j = job("oom-1", "acme", (768, 768), 2, 1);
    j.floor = Some(Floor { min_side: 256, min_steps: 2 });
    let s = shot(Priority::P1, j);
    let mut original = 0;
    shotfleet_producer::submit::submit(&js, std::slice::from_ref(&s), Default::default(), |_, ack| original = ack.sequence).await.unwrap();
    let result = results(&outcomes(&js, &[s], Duration::from_secs(90)).await).remove(0);
    assert_eq!(result.worker, "small-card", "{}", big.log());
    assert_eq!(result.status, ResultStatus::Degraded);
    let degrade = result.degrade.expect("the result says it was degraded");
    assert_eq!(degrade.level, 1);
    assert_eq!((degrade.from.width, degrade.from.height, degrade.from.steps), (768, 768, 2));
    assert_eq!((result.images[0].width, result.images[0].height), (512, 512), "one class down, aspect kept");
    // Its queue wait counts from the job's own publish, not its copy's: it spent the 2 s
    // handoff and more on A before it went down.
    assert!(result.timing.queue_ms >= 2000, "queue_ms {}", result.timing.queue_ms);
    check_store(store.path(), &result);
    // A saw a real ONNX Runtime allocation failure, twice (nak, then the in-place rungs).
    let log = big.log();
    assert!(log.contains("BFCArena::AllocateRawInternal"), "{log}");
    assert!(big.metrics().contains("outcome=\"degrade_republished\""), "{}", big.metrics());
    // The degraded copy was published as `<project>/<job>:deg:1:<the original's sequence>`.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("acme/oom-1:deg:1:{original}").as_str());
    let ack = js.publish_with_headers("shots.p1.xs.acme", headers, "{}".into()).await.unwrap().await.unwrap();
    assert!(ack.duplicate);
}

#[tokio::test]
async fn a_job_too_big_for_a_small_card_is_rendered_at_full_size_by_a_roomier_one() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // The small card runs out of memory for real on a 768x768 job; the fleet gets a minute to
    // take it at full size before anyone degrades it.
    let mut small = capped("small-card", store.path(), "[\"s\"]", 200);
    small.extra = "[degrade]\nhandoff = \"60s\"\n".into();
    let small = Worker::start(&server.url(), small);
    let s = shot(Priority::P1, job("handoff-1", "acme", (768, 768), 2, 1));
    submit(&js, std::slice::from_ref(&s)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !small.log().contains("out of memory") {
        assert!(Instant::now() < deadline, "{}", small.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A roomier card comes up later and renders it as asked.
    let mut roomy = WorkerSpec::new("roomy-card", store.path());
    roomy.classes = "[\"s\"]";
    let _roomy = Worker::start(&server.url(), roomy);
    let result = results(&outcomes(&js, &[s], Duration::from_secs(60)).await).remove(0);
    assert_eq!(result.worker, "roomy-card", "{}", small.log());
    assert_eq!(result.status, ResultStatus::Done, "rendered at full size, not degraded");
    assert_eq!((result.images[0].width, result.images[0].height), (768, 768));
    assert!(small.log().contains("offered to the fleet at 768x768"), "{}", small.log());
    assert!(!small.metrics().contains("outcome=\"degrade_republished\""), "{}", small.metrics());
}

#[tokio::test]
async fn out_of_memory_below_the_floor_fails_with_reason_oom() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let _big = Worker::start(&server.url(), capped("tight", store.path(), "[\"s\"]", 200));
    let mut j = job("oom-2", "acme", (768, 768), 2, 1);
    j.floor = Some(Floor { min_side: 768, min_steps: 2 });
    let s = shot(Priority::P1, j);
    submit(&js, std::slice::from_ref(&s)).await;
    match &outcomes(&js, &[s], Duration::from_secs(60)).await["oom-2"] {
        Outcome::Failed { reason, detail, .. } => {
            assert_eq!(reason, "oom");
            assert!(detail.contains("floor"), "{detail}");
        }
        other => panic!("expected an oom failure: {other:?}"),
    }
}

#[tokio::test]
async fn splitting_the_batch_in_place_renders_the_same_images() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // Six 384x384 images in one guided UNet batch do not fit 96 MiB; one at a time they do.
    let mut capped_worker = Worker::start(&server.url(), capped("capped", store.path(), "[\"xs\", \"s\"]", 96));
    let mut j = job("split-1", "acme", (384, 384), 2, 6);
    j.shot_id = "same".into();
    let s = shot(Priority::P1, j.clone());
    submit(&js, std::slice::from_ref(&s)).await;
    let split = results(&outcomes(&js, &[s], Duration::from_secs(120)).await).remove(0);
    assert_eq!(split.status, ResultStatus::Done, "in place: not degraded");
    assert_eq!(split.images.len(), 6);
    assert!(capped_worker.log().contains("degrading in place"), "{}", capped_worker.log());
    capped_worker.terminate(Duration::from_secs(20));

    // The same shot rendered in one batch by an uncapped worker gives the same bytes.
    let _free = Worker::start(&server.url(), WorkerSpec::new("uncapped", store.path()));
    let mut again = j;
    again.job_id = "split-2".into();
    let s = shot(Priority::P1, again);
    submit(&js, std::slice::from_ref(&s)).await;
    let whole = results(&outcomes(&js, &[s], Duration::from_secs(120)).await).remove(0);
    let shas = |r: &shotfleet_schema::ShotResult| r.images.iter().map(|i| i.sha256.clone()).collect::<Vec<_>>();
    assert_eq!(shas(&split), shas(&whole), "noise is per (seed, index): batching does not change images");
}

#[tokio::test]
async fn a_driver_fault_stops_the_worker_and_another_takes_the_job() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut faults = client.subscribe("shots.fault.>").await.unwrap();
    let mut spec = WorkerSpec::new("sick", store.path());
    spec.extra = "[faults]\ndriver_fault_on_render = 1\n".into();
    let mut sick = Worker::start(&server.url(), spec);
    let s = shot(Priority::P0, job("fault-1", "acme", (64, 64), 2, 1));
    submit(&js, std::slice::from_ref(&s)).await;
    let status = sick.wait_exit(Duration::from_secs(30)).expect("the worker exits");
    assert_eq!(status.code(), Some(75), "EXIT_DRIVER_FAULT:\n{}", sick.log());
    let event = tokio::time::timeout(Duration::from_secs(5), faults.next()).await.unwrap().unwrap();
    let event: serde_json::Value = serde_json::from_slice(&event.payload).unwrap();
    assert_eq!(event["worker"], "sick");
    assert_eq!(event["job_id"], "fault-1");
    assert!(event["detail"].as_str().unwrap().contains("CUDA failure 999"));
    // Naked at once, not after ack_wait (60 s): a healthy worker fetches it well before, however
    // long its start and render take on a loaded machine (`queue_ms`: publish to its fetch).
    let _healthy = Worker::start(&server.url(), WorkerSpec::new("healthy", store.path()));
    let result = results(&outcomes(&js, &[s], Duration::from_secs(150)).await).remove(0);
    assert_eq!(result.worker, "healthy");
    assert!(result.timing.queue_ms < 50_000, "fetched {} ms after publishing: the nak was not immediate", result.timing.queue_ms);
}

#[tokio::test]
async fn a_job_that_died_on_its_last_delivery_reaches_the_failed_stream() {
    let server = NatsServer::start();
    let topology = Topology { ack_wait: Duration::from_secs(2), max_deliver: 1, ..Topology::default() };
    let js = jetstream_with(&server.url(), &topology).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("doomed", store.path());
    spec.extra = "[faults]\ncrash_at = \"after_upload\"\n".into();
    let mut doomed = Worker::start(&server.url(), spec);
    let s = shot(Priority::P2, job("last-1", "acme", (64, 64), 2, 2));
    submit(&js, std::slice::from_ref(&s)).await;
    assert_eq!(doomed.wait_exit(Duration::from_secs(30)).and_then(|s| s.code()), Some(137));
    let job_dir = store.path().join("acme/last-1");
    assert_eq!(std::fs::read_dir(&job_dir).unwrap().count(), 2, "the dead worker uploaded two images");
    // The next worker's pulls make the server emit the advisory; the worker fails the job and
    // sweeps what the dead attempt uploaded.
    let _rescuer = Worker::start(&server.url(), WorkerSpec::new("rescuer", store.path()));
    match &outcomes(&js, &[s], Duration::from_secs(30)).await["last-1"] {
        Outcome::Failed { reason, attempts, .. } => {
            assert_eq!(reason, "max_deliveries");
            assert_eq!(attempts, "1");
        }
        other => panic!("expected a failed record: {other:?}"),
    }
    wait_settled(&js, Duration::from_secs(10)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_dir(&job_dir).map(|d| d.count()).unwrap_or(0) > 0 {
        assert!(Instant::now() < deadline, "a failed job's images stay in the store");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_leak_guard_rebuilds_then_asks_for_a_restart() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("leaky", store.path());
    // The leak is well above the limit: a rebuild also gives back some of what the process held
    // at its start (the host allocator's, 60-90 MiB of resident memory here), which lowers the
    // growth it measures after.
    spec.extra = "[faults]\nleak_mib_per_job = 400\n\n[leak_guard]\nmax_idle_growth_mib = 200\ncheck_every = \"500ms\"\n".into();
    let mut leaky = Worker::start(&server.url(), spec);
    let shots: Vec<_> = (0..2).map(|i| shot(Priority::P1, job(&format!("leak-{i}"), "acme", (64, 64), 2, 1))).collect();
    submit(&js, &shots[..1]).await;
    results(&outcomes(&js, &shots[..1], Duration::from_secs(30)).await);
    // Idle after one job: growth 400 MiB > 200: rebuild; the growth survives it; restart.
    let status = leaky.wait_exit(Duration::from_secs(60)).expect("the worker exits for a restart");
    assert_eq!(status.code(), Some(76), "EXIT_RESTART:\n{}", leaky.log());
    assert!(leaky.log().contains("rebuilding the sessions"), "{}", leaky.log());
}

#[tokio::test]
async fn the_leak_guard_rebuilds_by_age_and_keeps_serving() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("aging", store.path());
    spec.extra = "[leak_guard]\nrebuild_after_jobs = 1\n".into();
    let worker = Worker::start(&server.url(), spec);
    let shots: Vec<_> = (0..3).map(|i| shot(Priority::P1, job(&format!("age-{i}"), "acme", (64, 64), 2, 1))).collect();
    for s in &shots {
        submit(&js, std::slice::from_ref(s)).await;
        results(&outcomes(&js, std::slice::from_ref(s), Duration::from_secs(30)).await);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !worker.metrics().contains("shotfleet_session_rebuilds_total 2") && !worker.metrics().contains("shotfleet_session_rebuilds_total 3") {
        assert!(Instant::now() < deadline, "{}", worker.metrics());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Still serving after the rebuilds: the models are the reloaded ones.
    let stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    let mut stream = stream;
    assert_eq!(stream.info().await.unwrap().state.messages, 3);
}
