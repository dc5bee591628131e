//! The worker's control plane per job (admission, fetch, decode, outcome look-up, upload, the
//! outcome's claim, sweep, ack) beside a bare async-nats fetch + double-ack loop, same server,
//! same run.
//!
//!     cargo build --release --workspace --bins && cargo bench -p shotfleet-tests --bench control_plane [-- JOBS ROUNDS]
//!
//! Starts its own nats-server 2.15.1 and a real worker process with `[faults] noop_render =
//! true` (every image a fixed 1x1 PNG: the render is skipped, nothing else), on a local-folder
//! store, at concurrency 1 and 4. Each round publishes JOBS jobs and times them until the last
//! is settled: the bare loop publishes pre-encoded payloads to a stream of its own and
//! double-acks each as it fetches it, twice: fetching 64 at a time (the most a loop can do), and
//! fetching as many as the worker has slots (the worker's own pattern: it pulls only what it can
//! start); the worker is sent the same number of jobs with `shotfleet submit`'s library and timed
//! until the last outcome. Prints jobs/s per round and the ratios.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::nats::Topology;
use shotfleet_schema::Priority;
use shotfleet_testkit::NatsServer;
use shotfleet_tests::*;

const BARE_STREAM: &str = "BARE";

async fn bare_loop(js: &jetstream::Context, jobs: usize, round: usize, fetch: usize) -> f64 {
    let payloads: Vec<Vec<u8>> = (0..jobs)
        .map(|i| encoding::encode(ContentType::MessagePack, &job(&format!("bare-{fetch}-{round}-{i}"), "bench", (64, 64), 1, 1)))
        .collect();
    let stream = js.get_stream(BARE_STREAM).await.unwrap();
    let consumer: consumer::PullConsumer = stream.get_consumer("bare").await.unwrap();
    let started = Instant::now();
    let mut acks = futures::stream::FuturesUnordered::new();
    for payload in payloads {
        let ack = js.publish(format!("bare.{round}"), payload.into()).await.unwrap();
        acks.push(async move { ack.await });
    }
    while let Some(ack) = acks.next().await {
        ack.unwrap();
    }
    let mut settled = 0;
    while settled < jobs {
        let mut batch = consumer.fetch().max_messages(fetch).messages().await.unwrap();
        while let Some(message) = batch.next().await {
            message.unwrap().double_ack().await.unwrap();
            settled += 1;
        }
    }
    jobs as f64 / started.elapsed().as_secs_f64()
}

async fn worker_loop(js: &jetstream::Context, jobs: usize, tag: &str) -> f64 {
    let shots: Vec<_> = (0..jobs).map(|i| shot(Priority::P1, job(&format!("{tag}-{i}"), "bench", (64, 64), 1, 1))).collect();
    let started = Instant::now();
    submit(js, &shots).await;
    let done = outcomes(js, &shots, Duration::from_secs(600)).await;
    assert_eq!(results(&done).len(), jobs);
    jobs as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let jobs = args.first().copied().unwrap_or(400);
    let rounds = args.get(1).copied().unwrap_or(3);
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let bare = js
        .create_stream(stream::Config {
            name: BARE_STREAM.into(),
            subjects: vec!["bare.>".into()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..Default::default()
        })
        .await
        .unwrap();
    bare.create_consumer(consumer::pull::Config {
        durable_name: Some("bare".into()),
        ack_policy: consumer::AckPolicy::Explicit,
        ..Default::default()
    })
    .await
    .unwrap();
    // The images go to memory (tmpfs where there is one): object_store's local folder syncs each
    // new file and folder to disk, milliseconds a job on this machine's disk, which is the
    // disk's figure and not the control plane's.
    let shm = std::path::Path::new("/dev/shm");
    let store = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.unwrap();
    println!("control plane: {jobs} jobs a round, {rounds} rounds, nats-server {}", server.binary().version());
    println!("| concurrency | round | bare loop, fetch 64 | bare loop, fetch per slot | worker jobs/s | ratio to 64 | ratio to per slot |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for concurrency in [1, 4] {
        let mut spec = WorkerSpec::new(&format!("bench-c{concurrency}"), store.path());
        spec.concurrency = concurrency;
        spec.extra = "[faults]\nnoop_render = true\n".into();
        let mut worker = Worker::start(&server.url(), spec);
        let (mut to_batched, mut to_matched) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let batched = bare_loop(&js, jobs, round, 64).await;
            let matched = bare_loop(&js, jobs, round, concurrency).await;
            let ours = worker_loop(&js, jobs, &format!("c{concurrency}-r{round}")).await;
            to_batched.push(ours / batched);
            to_matched.push(ours / matched);
            println!("| {concurrency} | {round} | {batched:.0} | {matched:.0} | {ours:.0} | {:.2} | {:.2} |", ours / batched, ours / matched);
        }
        println!("| {concurrency} | median | | | | {:.2} | {:.2} |", median(to_batched), median(to_matched));
        worker.terminate(Duration::from_secs(30));
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
