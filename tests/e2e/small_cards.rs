//! Small cards: calibration that never kills a worker, the classes a card holds, and a share of
//! a card (`[budget] max_mib`). Real workers on the CPU with the tiny model; a capped ONNX
//! Runtime arena (`cpu_arena_max_mib`) runs out of memory for real, as a small card would.

use std::time::Duration;

use async_nats::jetstream;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{Priority, subject};
use shotfleet_testkit::NatsServer;
use shotfleet_testkit::process::http_get;
use shotfleet_tests::*;

/// `/readyz` of a worker: status and body.
fn readyz(worker: &Worker) -> (u16, String) {
    http_get(worker.metrics_port, "/readyz").expect("/readyz answers")
}

/// The worker's metrics once they show `line` (the card's gauges are first set by the fetch
/// loop, just after `/readyz` turns 200).
async fn metrics_with(worker: &Worker, line: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = worker.metrics();
        if metrics.contains(line) || std::time::Instant::now() > deadline {
            return metrics;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Jobs waiting on `consumer`, and fetched but not acked.
async fn waiting(js: &jetstream::Context, consumer: &str) -> (u64, usize) {
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let mut consumer: jetstream::consumer::PullConsumer = stream.get_consumer(consumer).await.unwrap();
    let info = consumer.info().await.unwrap();
    (info.num_pending, info.num_ack_pending)
}

#[tokio::test]
async fn a_probe_that_runs_out_of_memory_is_the_cards_ceiling_and_the_worker_serves_what_fits() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("capped", store.path());
    // The arena holds a 512x512 render of the tiny model (about 140 MiB of activations), not a
    // 768x768 one (over 500 MiB): the budget, on a roomy simulated card, cannot know.
    spec.top = "cpu_arena_max_mib = 300".into();
    spec.classes = "\"auto\"";
    spec.calibration = "[[128, 128, 1], [256, 256, 1], [512, 512, 1], [768, 768, 1], [1024, 1024, 1]]";
    let worker = Worker::start(&server.url(), spec);

    let log = worker.log();
    assert!(log.contains("probe ran out of memory"), "{log}");
    assert!(log.contains("probe skipped: past a probe that ran out of memory"), "1024x1024 is not tried:\n{log}");
    // Each size that fits measured on its second render, after a priming one.
    let measured: Vec<&str> = log.lines().filter(|l| l.contains("probe render ")).collect();
    assert_eq!(measured.len(), 3, "128, 256 and 512 measured:\n{log}");
    assert!(measured.iter().all(|l| l.contains("first_render_mib")), "{log}");
    assert!(log.contains("calibration not stored"), "{log}");
    let (status, body) = readyz(&worker);
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ready\nxs: served"), "{body}");
    assert!(body.contains("s: not served (out of memory: the 768x768x1 probe ran out at start"), "{body}");
    assert!(body.contains("xl: not served (out of memory"), "{body}");
    let metrics = worker.metrics();
    for line in [
        "shotfleet_class_servable{class=\"xs\",reason=\"fits\"} 1",
        "shotfleet_class_servable{class=\"s\",reason=\"out_of_memory\"} 0",
        "shotfleet_class_servable{class=\"m\",reason=\"out_of_memory\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }

    // It serves what fits, and leaves the rest to roomier workers.
    let small = shot(Priority::P1, job("fits-1", "acme", (512, 512), 2, 1));
    let large = shot(Priority::P0, job("too-big-1", "acme", (768, 768), 2, 1));
    submit(&js, &[large, small.clone()]).await;
    let done = results(&outcomes(&js, &[small], Duration::from_secs(60)).await);
    assert_eq!(done[0].worker, "capped");
    assert_eq!(waiting(&js, "render-p0-s").await, (1, 0), "the s job was never fetched:\n{}", worker.log());
    assert!(worker.metrics().contains("shotfleet_out_of_memory_total 0"), "no job ran out of memory:\n{}", worker.log());
}

#[tokio::test]
async fn a_worker_that_can_hold_nothing_exits_78_and_says_why() {
    let server = NatsServer::start();
    let _js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // As issue 19 found it: 128 and 256 fit the arena, 512 does not, and the worker serves xs
    // (up to 512x512) and s. Before, the 512x512 probe's out-of-memory stopped it with exit 3.
    let mut spec = WorkerSpec::new("tiny-card", store.path());
    spec.top = "cpu_arena_max_mib = 160".into();
    let mut worker = Worker::spawn(&server.url(), spec);
    let status = worker.wait_exit(Duration::from_secs(60)).expect("the worker stops by itself");
    let log = worker.log();
    assert_eq!(status.code(), Some(78), "exit 78 (EX_CONFIG: a restart will not help):\n{log}");
    assert!(log.contains("this card holds nothing this worker may serve"), "{log}");
    assert!(log.contains("xs: not served (out of memory: the 512x512x1 probe ran out at start"), "{log}");
    assert!(log.contains("s: not served (out of memory"), "{log}");
    assert!(!log.contains("cannot render a 512x512x1 probe"), "{log}");
}

/// A worker on a small simulated card and one given the same share of a card ten times larger
/// (`[budget] max_mib`) plan alike: the same probes skipped over the room, the same classes,
/// the same card size in their metrics.
#[tokio::test]
async fn a_share_of_a_large_card_behaves_as_a_small_card() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let with = |id: &str, total_mib: u64, budget: &'static str| {
        let mut spec = WorkerSpec::new(id, store.path());
        spec.classes = "\"auto\"";
        spec.total_mib = total_mib;
        spec.budget = budget;
        // About 560 MiB of room beside the models: 512x512 (235 MiB planned) fits, 1024x1024
        // (about 3 GiB predicted from the smaller probes) is not rendered at all.
        spec.calibration = "[[128, 128, 1], [256, 256, 1], [512, 512, 1], [1024, 1024, 1]]";
        spec
    };
    let small = Worker::start(&server.url(), with("small-card", 800, ""));
    let share = Worker::start(&server.url(), with("share-of-big", 8192, "max_mib = 800"));

    for worker in [&small, &share] {
        let log = worker.log();
        assert!(log.contains("probe skipped: over the room"), "{}:\n{log}", worker.spec.id);
        let (status, body) = readyz(worker);
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("xs: served"), "{}: {body}", worker.spec.id);
        assert!(body.contains("s: not served (over budget: one 768x768 image plans"), "{}: {body}", worker.spec.id);
        let total = format!("shotfleet_gpu_memory_total_bytes {}", 800 * 1024 * 1024);
        let metrics = metrics_with(worker, &total).await;
        assert!(metrics.contains(&total), "{metrics}");
        assert!(metrics.contains("shotfleet_class_servable{class=\"s\",reason=\"over_budget\"} 0"), "{metrics}");
    }
    // The share caps the arena as a card of its size would (at most 0.9 x 800 MiB less the
    // reserve); the small card's arena is uncapped, as it was.
    let log = share.log();
    assert!(log.lines().any(|l| l.contains("this worker's share of the card") && l.contains("arena_limit_mib")), "{log}");
    assert!(!small.log().contains("this worker's share of the card"));

    let jobs: Vec<_> = (0..4).map(|i| shot(Priority::P1, job(&format!("share-{i}"), "acme", (512, 512), 2, 1))).collect();
    submit(&js, &jobs).await;
    let done = results(&outcomes(&js, &jobs, Duration::from_secs(90)).await);
    assert_eq!(done.len(), 4);
}

/// `[budget] cold_renders`: every render gives its arenas back at its end, so a small job after
/// a large one starts from (nearly) the models alone instead of the large one's arena cache. On
/// the CPU the process keeps some memory that a GPU's arenas would give back, so this compares
/// what the small job found held at its start, with and without. Each graph keeps its own
/// arena here, as on a GPU (a capped CPU arena is one for all graphs, which every VAE decode
/// shrinks anyway).
#[tokio::test]
async fn cold_renders_start_every_job_without_the_last_ones_cache() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let mut held = Vec::new();
    for (id, budget) in [("measuring", "cold_renders = true"), ("plain", "")] {
        let mut spec = WorkerSpec::new(id, store.path());
        spec.budget = budget;
        // Queued before the worker starts: the p0 512x512 job renders first, the 128x128 one next.
        let (large, small) = (format!("{id}-large"), format!("{id}-small"));
        let jobs = [shot(Priority::P0, job(&large, "acme", (512, 512), 2, 1)), shot(Priority::P1, job(&small, "acme", (128, 128), 2, 1))];
        submit(&js, &jobs).await;
        let worker = Worker::start(&server.url(), spec);
        assert_eq!(results(&outcomes(&js, &jobs, Duration::from_secs(60)).await).len(), 2);
        let log = worker.plain_log();
        let line = log.lines().find(|l| l.contains("observed peak") && l.contains(&small)).unwrap_or_else(|| panic!("no observed peak:\n{log}"));
        let mib = line.split("held_at_start_mib=").nth(1).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse::<u64>().ok());
        held.push(mib.unwrap_or_else(|| panic!("no held_at_start_mib in {line}")));
    }
    // The 512x512 UNet's arena (about 70 MiB on the tiny model) is what the plain worker kept.
    assert!(held[0] + 40 < held[1], "held at the small job's start: {} MiB with cold_renders, {} MiB without", held[0], held[1]);
}

/// A small card: it serves xs only, and gives a larger class 2 s for a roomier worker to show up.
fn xs_only_with_a_short_handoff(store: &std::path::Path) -> WorkerSpec {
    let mut spec = WorkerSpec::new("xs-only", store);
    spec.classes = "[\"xs\"]";
    spec.extra = "[degrade]\nhandoff = \"2s\"\n".into();
    spec
}

#[tokio::test]
async fn a_class_no_live_worker_holds_goes_one_rung_down_after_the_handoff() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // A fleet of one small card.
    let worker = Worker::start(&server.url(), xs_only_with_a_short_handoff(store.path()));
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut progress = client.subscribe(shotfleet_schema::progress::subject("acme", "too-big-1")).await.unwrap();
    let mut big = job("too-big-1", "acme", (768, 768), 2, 1);
    big.floor = Some(shotfleet_schema::Floor { min_side: 256, min_steps: 0 });
    let big = shot(Priority::P1, big);
    submit(&js, std::slice::from_ref(&big)).await;
    let result = results(&outcomes(&js, &[big], Duration::from_secs(60)).await).remove(0);
    assert_eq!(result.status, shotfleet_schema::ResultStatus::Degraded, "{}", worker.log());
    let degrade = result.degrade.expect("degraded");
    assert_eq!((degrade.from.width, degrade.from.height), (768, 768));
    assert_eq!((result.images[0].width, result.images[0].height), (512, 512), "one class down, into xs");
    assert!(worker.log().contains("no live worker holds this class"), "{}", worker.log());
    // Nothing is left in the queue: the job did not wait forever.
    wait_settled(&js, Duration::from_secs(20)).await;
    // Its followers heard it leave the worker that sent it down (else `status --watch` shows it
    // held there for good), then the copy's render end.
    let mut events = Vec::new();
    while let Ok(Some(message)) = tokio::time::timeout(Duration::from_millis(500), futures::StreamExt::next(&mut progress)).await {
        let event: shotfleet_schema::ShotProgress = serde_json::from_slice(&message.payload).unwrap();
        if event.event != shotfleet_schema::progress::ProgressEvent::Step {
            events.push((event.event, event.detail.unwrap_or_default()));
        }
    }
    use shotfleet_schema::progress::ProgressEvent::{Queued, Settled, Taken};
    assert_eq!(events.iter().map(|(e, _)| *e).collect::<Vec<_>>(), [Taken, Queued, Taken, Settled], "{events:?}");
    assert!(events[1].1.contains("one rung down"), "{events:?}");
}

/// A small card serving xs only, which sends a larger class down after 2 s held by nobody, and a
/// roomy one serving xs and s, restarted to take 8 s to start (four of the small one's handoffs)
/// with `restart_grace`; a job of class s queued while it starts. Its result, and both logs.
async fn a_job_queued_while_the_roomy_worker_restarts(restart_grace: &str) -> (shotfleet_schema::ShotResult, String, String) {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    let small = Worker::start(&server.url(), xs_only_with_a_short_handoff(store.path()));
    let roomy_spec = WorkerSpec::new("roomy", store.path());
    let mut roomy = Worker::start(&server.url(), roomy_spec.clone());
    assert_eq!(roomy.terminate(Duration::from_secs(30)), Some(0), "{}", roomy.log());

    let mut slow = roomy_spec.clone();
    slow.extra = format!("[faults]\nslow_start = \"8s\"\n[degrade]\nrestart_grace = \"{restart_grace}\"\n");
    roomy.respawn(&server.url(), slow);
    // Queued once the new process answers pings as starting (what it answers is the point).
    let client = async_nats::connect(server.url()).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let states = shotfleet_schema::nats::ping(&client, Duration::from_millis(300)).await.unwrap();
        if states.iter().any(|s| s.worker == "roomy" && s.starting) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the restarted worker never answered a ping:\n{}", roomy.log());
    }
    let waiting = shot(Priority::P1, job("while-restarting", "acme", (768, 768), 2, 1));
    submit(&js, std::slice::from_ref(&waiting)).await;
    let result = results(&outcomes(&js, &[waiting], Duration::from_secs(90)).await).remove(0);
    (result, small.log(), roomy.log())
}

#[tokio::test]
async fn a_restarting_worker_keeps_its_classes_while_it_starts() {
    let (result, small, roomy) = a_job_queued_while_the_roomy_worker_restarts("5m").await;
    assert_eq!(result.status, shotfleet_schema::ResultStatus::Done, "{small}");
    assert!(result.degrade.is_none(), "{:?}", result.degrade);
    assert_eq!((result.images[0].width, result.images[0].height), (768, 768));
    assert_eq!(result.worker, "roomy");
    assert!(roomy.contains("restarting: the fleet leaves the classes this worker admitted to it"), "{roomy}");
    assert!(!small.contains("no live worker holds this class"), "{small}");
}

#[tokio::test]
async fn without_a_restart_grace_the_job_goes_down_while_the_worker_starts() {
    let (result, small, _) = a_job_queued_while_the_roomy_worker_restarts("0s").await;
    assert_eq!(result.status, shotfleet_schema::ResultStatus::Degraded, "{small}");
    assert_eq!((result.images[0].width, result.images[0].height), (512, 512), "one class down, into xs");
    assert!(small.contains("no live worker holds this class"), "{small}");
}
