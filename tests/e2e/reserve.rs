//! The reserve (consumer/src/worker/reserve.rs) in a real worker: jobs fetched ahead of the free
//! slot give each render batch partners on a queue of mixed sizes, wait without the server
//! redelivering them, go back to the stream at once when the worker stops, and at the end of a
//! queue go to another worker that is idle (worker/tail.rs).

use std::time::{Duration, Instant};

use shotfleet_schema::nats::Topology;
use shotfleet_schema::{subject, Priority};
use shotfleet_testkit::NatsServer;
use shotfleet_tests::*;

/// `count` shots over three sizes in turn, as a storyboard interleaves them.
fn storyboard(prefix: &str, count: usize, steps: u32) -> Vec<shotfleet_producer::storyboard::Shot> {
    let sizes = [(64, 64), (64, 96), (96, 64)];
    (0..count).map(|i| shot(Priority::P1, job(&format!("{prefix}-{i:02}"), "board", sizes[i % 3], steps, 1))).collect()
}

/// A batching worker's renders in its log, for `jobs` jobs: (renders, jobs rendered in groups).
fn renders(log: &str, jobs: usize) -> (usize, usize) {
    let groups: Vec<usize> = log
        .lines()
        .filter(|line| line.contains("rendered a group"))
        .map(|line| {
            let at = line.find("jobs=").unwrap_or_else(|| panic!("a group line names its jobs: {line}"));
            line[at + 5..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
        })
        .collect();
    let grouped: usize = groups.iter().sum();
    (groups.len() + jobs - grouped, grouped)
}

/// The gauge's (or counter's) value in a worker's metrics (0 when absent).
fn gauge(metrics: &str, name: &str) -> f64 {
    metrics.lines().find_map(|line| line.strip_prefix(name)?.trim().parse().ok()).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_mixed_queue_the_reserve_deals_each_render_a_fuller_batch() {
    const JOBS: usize = 24;
    let mut seen = Vec::new();
    for lookahead in [0, 12] {
        let server = NatsServer::start();
        let js = jetstream_with(&server.url(), &Topology::default()).await;
        let store = tempfile::tempdir().unwrap();
        // Queued before the worker starts: the rounds it deals are the same on every machine.
        let shots = storyboard(&format!("look{lookahead}"), JOBS, 2);
        submit(&js, &shots).await;
        let mut spec = WorkerSpec::new(&format!("look{lookahead}"), store.path());
        spec.top = format!("batch_jobs = 4\nlookahead = {lookahead}");
        let worker = Worker::start(&server.url(), spec);
        for result in results(&outcomes(&js, &shots, Duration::from_secs(180)).await) {
            check_store(store.path(), &result);
            assert_eq!(result.attempt, 1, "{}: never redelivered", result.job_id);
        }
        wait_settled(&js, Duration::from_secs(20)).await;
        let switches = gauge(&worker.metrics(), "shotfleet_size_switches_total") as usize;
        seen.push((lookahead, renders(&worker.plain_log(), JOBS), switches));
    }
    for (lookahead, (count, grouped), switches) in &seen {
        println!(
            "lookahead {lookahead}: {JOBS} jobs over 3 sizes in {count} renders ({grouped} jobs in groups), {:.2} jobs a render, {switches} size switches",
            JOBS as f64 / *count as f64
        );
        // Every group after the first is dealt at its size or another: the counter sees each.
        assert!((1..*count).contains(switches), "{seen:?}");
    }
    let [(_, (without, _), _), (_, (with, _), _)] = seen[..] else { unreachable!() };
    // Without a reserve a render finds its partners among the four fetched for it: in this
    // order, one. With twelve more held while the queue is deep, most renders are full batches
    // of four (six renders is the least possible).
    assert!(without >= 12, "{seen:?}");
    assert!(with + 3 <= without, "{seen:?}");
}

/// `jobs` renders of 256x256 at 30 steps queued on a server whose `ack_wait` is given, then a
/// worker (`id`) that renders them two at a time with `lookahead` more fetched ahead.
struct Queued {
    _server: NatsServer,
    js: async_nats::jetstream::Context,
    store: tempfile::TempDir,
    shots: Vec<shotfleet_producer::storyboard::Shot>,
    worker: Worker,
}

async fn queued(ack_wait: Duration, id: &str, jobs: usize, lookahead: usize) -> Queued {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology { ack_wait, ..Topology::default() }).await;
    let store = tempfile::tempdir().unwrap();
    let shots: Vec<_> = (0..jobs).map(|i| shot(Priority::P1, job(&format!("{id}-{i:02}"), "board", (256, 256), 30, 1))).collect();
    submit(&js, &shots).await;
    let mut spec = WorkerSpec::new(id, store.path());
    spec.top = format!("batch_jobs = 2\nlookahead = {lookahead}");
    // Room to admit the whole lookahead in one round (4 GiB admits eleven of these at once).
    spec.total_mib = 16384;
    let worker = Worker::start(&server.url(), spec);
    Queued { _server: server, js, store, shots, worker }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_waiting_in_the_reserve_are_kept_alive_past_ack_wait() {
    let Queued { _server, js, store: _store, shots, worker } = queued(Duration::from_secs(2), "patient", 12, 6).await;
    let done = results(&outcomes(&js, &shots, Duration::from_secs(240)).await);
    for result in &done {
        assert_eq!(result.attempt, 1, "{} was redelivered while it waited:\n{}", result.job_id, worker.log());
    }
    // Jobs 2 to 9 are fetched after the first render and wait behind up to four more renders of
    // two (seconds each here): the wait a result reports, up to its render, counts the reserve's.
    let longest = done.iter().map(|r| r.timing.queue_ms).max().unwrap();
    assert!(longest > 2_000, "the longest queue_ms is {longest}: no job waited past ack_wait");
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    assert_eq!(stream.consumer_info("render-p1-xs").await.unwrap().num_redelivered, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_gives_its_reserve_back_at_once() {
    // Jobs left to ack_wait would come back after two minutes: the successor must be faster.
    let Queued { _server: server, js, store, shots, worker: mut leaving } = queued(Duration::from_secs(120), "leaving", 12, 6).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while gauge(&leaving.metrics(), "shotfleet_reserved_jobs") < 4.0 {
        assert!(Instant::now() < deadline, "the reserve never held four jobs:\n{}", leaving.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(leaving.terminate(Duration::from_secs(60)), Some(0), "{}", leaving.log());
    assert!(leaving.log().contains("giving back the jobs fetched ahead"), "{}", leaving.log());

    let _successor = Worker::start(&server.url(), WorkerSpec::new("successor", store.path()));
    // Well inside ack_wait: only a nak brings the jobs back this soon.
    let done = results(&outcomes(&js, &shots, Duration::from_secs(90)).await);
    // The reserve's jobs come to the successor on their second delivery; the jobs the first
    // worker never fetched, on their first.
    let given_back = done.iter().filter(|r| r.worker == "successor" && r.attempt == 2).count();
    assert!(given_back >= 4, "the reserve's four jobs or more went to the successor: {done:?}");
    assert!(done.iter().all(|r| r.attempt <= 2), "{done:?}");
    for result in &done {
        check_store(store.path(), result);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_end_of_a_queue_what_the_reserve_holds_beyond_its_next_group_goes_to_an_idle_worker() {
    // Twenty renders of 256x256 at 30 steps (a second or so for two here); the first worker
    // takes two at a time and sixteen ahead: after its first render it holds all eighteen left,
    // and the queue is drained.
    let Queued { _server: server, js, store, shots, worker: first } = queued(Duration::from_secs(120), "tail", 20, 16).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while gauge(&first.metrics(), "shotfleet_reserved_jobs") < 14.0 {
        assert!(Instant::now() < deadline, "the reserve never held fourteen jobs:\n{}", first.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A second worker joins the drained queue: only the first's give-back brings it work (jobs on
    // their second delivery), and nothing goes back twice.
    let _second = Worker::start(&server.url(), WorkerSpec::new("second", store.path()));
    let done = results(&outcomes(&js, &shots, Duration::from_secs(180)).await);
    let by_second = done.iter().filter(|r| r.worker == "second").count();
    let given = done.iter().filter(|r| r.worker == "second" && r.attempt == 2).count();
    println!("the second worker rendered {by_second} of the 20 jobs, {given} of them given back by the first");
    // It and the first share what was given back (the first fetches a job each free slot too).
    assert!(given >= 2, "{done:?}\n{}", first.log());
    assert!(done.iter().all(|r| r.attempt <= 2), "{done:?}");
    assert!(first.log().contains("another worker is idle: giving back"), "{}", first.log());
    for result in &done {
        check_store(store.path(), result);
    }
}
