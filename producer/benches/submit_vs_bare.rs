//! `shotfleet submit`'s publishing path beside a bare async-nats loop, same payloads, same run.
//!
//!     cargo bench -p shotfleet-producer --bench submit_vs_bare [-- JOBS ROUNDS]
//!
//! Starts its own nats-server 2.15.1 (the venv's), creates the topology, and alternates the two
//! publishers over fresh streams. Both await every PubAck. The bare loop pre-encodes its
//! payloads and publishes with a 4,096-deep window under the client's 5,000; `submit` encodes as it goes
//! and bounds its in-flight acks (256 by default). Prints jobs/s per round and the median ratio.

use std::time::Instant;

use async_nats::jetstream;
use async_nats::jetstream::message::PublishMessage;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use shotfleet_producer::storyboard::Shot;
use shotfleet_producer::submit::{self, SubmitOptions};
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{Priority, ShotJob};
use shotfleet_testkit::NatsServer;

fn shots(n: usize, round: usize) -> Vec<Shot> {
    (0..n)
        .map(|i| Shot {
            line: i + 1,
            priority: Priority::ALL[i % 3],
            job: ShotJob {
                v: 1,
                job_id: format!("bench-{round}-{i}"),
                project: format!("proj{}", i % 4),
                shot_id: format!("s{i}"),
                prompt: "a lighthouse keeper on a cliff at dawn, ink wash, dramatic light".into(),
                negative_prompt: Some("blurry, text".into()),
                width: [512, 768, 1024][i % 3],
                height: 1024,
                steps: 30,
                guidance: 6.0,
                seed: i as u64,
                images: 1 + (i % 4) as u32,
                loras: vec![],
                floor: None,
                degrade: None,
            },
        })
        .collect()
}

async fn bare_loop(js: &jetstream::Context, shots: &[Shot]) -> f64 {
    let options = SubmitOptions::default();
    let messages: Vec<(String, PublishMessage)> = shots.iter().map(|s| submit::message(s, options.content_type)).collect();
    let started = Instant::now();
    let mut acks: FuturesUnordered<_> = FuturesUnordered::new();
    for (subject, publish) in messages {
        // The client holds at most 5,000 unacknowledged publishes (its default window); acks
        // must be drained or the next publish waits forever for a permit.
        if acks.len() >= 4096 {
            let done: Result<(), async_nats::jetstream::context::PublishError> = acks.next().await.expect("pending ack");
            done.expect("ack");
        }
        let ack = js.send_publish(subject, publish).await.expect("publish");
        acks.push(async move { ack.await.map(|_| ()) });
    }
    while let Some(ack) = acks.next().await {
        ack.expect("ack");
    }
    shots.len() as f64 / started.elapsed().as_secs_f64()
}

async fn shotfleet_submit(js: &jetstream::Context, shots: &[Shot]) -> f64 {
    let summary = submit::submit(js, shots, SubmitOptions::default(), |_, _| {}).await.expect("submit");
    assert_eq!(summary.queued, shots.len());
    shots.len() as f64 / summary.elapsed.as_secs_f64()
}

async fn fresh_topology(js: &jetstream::Context) {
    for name in ["SHOTS", "SHOT_RESULTS", "SHOTS_FAILED"] {
        let _ = js.delete_stream(name).await;
    }
    Topology::default().ensure(js, false).await.expect("topology");
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let jobs = args.first().copied().unwrap_or(10_000);
    let rounds = args.get(1).copied().unwrap_or(3);
    let server = NatsServer::start();
    let js = jetstream::new(async_nats::connect(server.url()).await.expect("connect"));
    println!("{jobs} jobs per run, nats-server {}, PubAcks awaited", server.binary().version());
    println!("{:<6} {:>14} {:>16} {:>7}", "round", "bare jobs/s", "submit jobs/s", "ratio");
    let mut ratios = Vec::new();
    for round in 0..rounds {
        fresh_topology(&js).await;
        let bare = bare_loop(&js, &shots(jobs, round * 2)).await;
        fresh_topology(&js).await;
        let ours = shotfleet_submit(&js, &shots(jobs, round * 2 + 1)).await;
        ratios.push(ours / bare);
        println!("{round:<6} {bare:>14.0} {ours:>16.0} {:>7.2}", ours / bare);
    }
    ratios.sort_by(f64::total_cmp);
    println!("median ratio submit/bare: {:.2}", ratios[ratios.len() / 2]);
}
