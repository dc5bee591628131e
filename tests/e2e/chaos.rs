//! The chaos suite: hundreds of jobs on the tiny model while workers are SIGKILLed and restarted,
//! the nats-server restarts, a 3-node cluster loses its stream leader, and the S3 endpoint goes
//! away for a while. Then an accounting, printed as a table and asserted: every job has exactly
//! one result or one failed record, every image a result names exists with its sha256, and no
//! image stays under a job that has no result (or that its result does not name).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use shotfleet_consumer::store::{Store, StoreConfig};
use shotfleet_producer::storyboard::Shot;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{subject, Priority};
use shotfleet_testkit::nats::Cluster;
use shotfleet_testkit::{NatsServer, S3Server, TcpProxy};
use shotfleet_tests::accounting::{account, local_store, print_header};
use shotfleet_tests::*;

const JOBS_PER_SCENARIO: usize = 80;

fn storyboard(prefix: &str) -> Vec<Shot> {
    (0..JOBS_PER_SCENARIO)
        .map(|i| {
            let priority = Priority::ALL[i % 3];
            shot(priority, job(&format!("{prefix}-{i}"), if i % 2 == 0 { "north" } else { "south" }, (64, 64), 2, 1 + (i % 2) as u32))
        })
        .collect()
}

fn chaos_worker(id: &str, store: &std::path::Path, store_url: Option<String>, env: Vec<(String, String)>) -> WorkerSpec {
    let mut spec = WorkerSpec::new(id, store);
    spec.calibration = "[[64, 64, 1], [128, 128, 1], [192, 192, 1]]";
    if let Some(url) = store_url {
        spec.store_url = url;
    }
    spec.env = env;
    spec.extra = "\n[store.retry]\nmax_elapsed_ms = 60000\nmax_backoff_ms = 1000\n".into();
    spec
}

/// Workers that can be killed and restarted from another task; their logs are kept.
struct Crew {
    nats_url: String,
    specs: Vec<WorkerSpec>,
    workers: Mutex<Vec<Option<Worker>>>,
    logs: Mutex<Vec<String>>,
}

impl Crew {
    fn start(nats_url: String, specs: Vec<WorkerSpec>) -> Arc<Self> {
        let workers = specs.iter().map(|s| Some(Worker::start(&nats_url, s.clone()))).collect();
        Arc::new(Self { nats_url, specs, workers: Mutex::new(workers), logs: Mutex::new(Vec::new()) })
    }

    /// SIGKILL worker `i` and start it again (blocking: call from a blocking task).
    fn kill_and_restart(&self, i: usize) {
        let old = self.workers.lock().unwrap()[i].take();
        if let Some(mut worker) = old {
            worker.kill();
            self.logs.lock().unwrap().push(worker.log());
        }
        let fresh = Worker::start(&self.nats_url, self.specs[i].clone());
        self.workers.lock().unwrap()[i] = Some(fresh);
    }

    fn logs(&self) -> Vec<String> {
        let mut logs = self.logs.lock().unwrap().clone();
        logs.extend(self.workers.lock().unwrap().iter().flatten().map(Worker::log));
        logs
    }
}

async fn settle(js: &jetstream::Context, shots: &[Shot]) {
    let _ = outcomes(js, shots, Duration::from_secs(240)).await;
    wait_settled(js, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_workers_killed_at_random() {
    let server = NatsServer::start();
    let topology = Topology { ack_wait: Duration::from_secs(3), ..Topology::default() };
    let js = jetstream_with(&server.url(), &topology).await;
    let dir = tempfile::tempdir().unwrap();
    let specs = (0..3).map(|i| chaos_worker(&format!("k{i}"), dir.path(), None, vec![])).collect();
    let crew = Crew::start(server.url(), specs);
    let shots = storyboard("kill");
    submit(&js, &shots).await;
    let chaos = {
        let crew = crew.clone();
        tokio::task::spawn_blocking(move || {
            // A fixed sequence of victims: reproducible, and every worker dies at least once.
            for victim in [0, 2, 1, 0, 1] {
                std::thread::sleep(Duration::from_millis(700));
                crew.kill_and_restart(victim);
            }
        })
    };
    chaos.await.unwrap();
    settle(&js, &shots).await;
    let acc = account("workers SIGKILLed", &js, &local_store(dir.path()), &shots, &crew.logs()).await;
    print_header();
    acc.print();
    acc.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_nats_server_restarts() {
    let mut server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology { ack_wait: Duration::from_secs(3), ..Topology::default() }).await;
    let dir = tempfile::tempdir().unwrap();
    let specs = (0..2).map(|i| chaos_worker(&format!("r{i}"), dir.path(), None, vec![])).collect();
    let crew = Crew::start(server.url(), specs);
    let shots = storyboard("restart");
    submit(&js, &shots).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    server.restart();
    // The client reconnects by itself; the accounting reads after the server is back.
    settle(&js, &shots).await;
    let acc = account("nats-server restarted", &js, &local_store(dir.path()), &shots, &crew.logs()).await;
    print_header();
    acc.print();
    acc.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_cluster_loses_its_stream_leader() {
    let mut cluster = Cluster::start();
    let topology = Topology { replicas: 3, ack_wait: Duration::from_secs(3), ..Topology::default() };
    let urls = cluster.urls();
    let js = {
        // The cluster elects its meta leader shortly after it is healthy: retry the topology.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let client = async_nats::connect(urls.split(',').next().unwrap()).await.unwrap();
            let js = jetstream::new(client);
            match topology.ensure(&js, false).await {
                Ok(_) => break js,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("topology not ready yet: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("{e}"),
            }
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let specs = (0..2).map(|i| chaos_worker(&format!("c{i}"), dir.path(), None, vec![])).collect();
    let crew = Crew::start(urls.clone(), specs);
    let shots = storyboard("cluster");
    submit(&js, &shots).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let leader = stream.info().await.unwrap().cluster.as_ref().and_then(|c| c.leader.clone()).expect("a stream leader");
    println!("killing the SHOTS leader {leader}");
    cluster.node_mut(&leader).kill();
    tokio::time::sleep(Duration::from_secs(4)).await;
    cluster.node_mut(&leader).start_again();
    // Read through a node that stayed up.
    let survivor = cluster.nodes().iter().find(|n| n.name() != leader).unwrap().url();
    let js = jetstream::new(async_nats::connect(survivor).await.unwrap());
    settle(&js, &shots).await;
    let acc = account("cluster leader lost", &js, &local_store(dir.path()), &shots, &crew.logs()).await;
    print_header();
    acc.print();
    acc.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_s3_endpoint_down_for_a_while() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology { ack_wait: Duration::from_secs(5), ..Topology::default() }).await;
    let s3 = S3Server::start();
    s3.create_bucket("chaos");
    let mut proxy = TcpProxy::start(&s3.endpoint());
    let mut env: Vec<(String, String)> = S3Server::credentials().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    env.push(("AWS_ENDPOINT_URL".into(), proxy.endpoint()));
    let dir = tempfile::tempdir().unwrap();
    let specs = (0..2).map(|i| chaos_worker(&format!("s{i}"), dir.path(), Some("s3://chaos/renders".into()), env.clone())).collect();
    let crew = Crew::start(server.url(), specs);
    let shots = storyboard("s3");
    submit(&js, &shots).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    proxy.down();
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxy.up();
    settle(&js, &shots).await;
    let config = StoreConfig { url: "s3://chaos/renders".into(), endpoint: Some(s3.endpoint()), allow_http: true, ..Default::default() };
    let store = Store::open(&config, S3Server::credentials()).unwrap();
    let acc = account("S3 endpoint down 4 s", &js, &store, &shots, &crew.logs()).await;
    print_header();
    acc.print();
    acc.assert_clean();
}
