//! Bad LoRAs lose nothing (issue 14, point 6): a file corrupt in the library, a truncated
//! upload (its bytes no longer match the sidecar's sha256), a corrupt local copy, a LoRA deleted
//! from the library while jobs name it (also with its set on the device, and with its file in
//! the worker's cache) and an S3 outage in the middle of a LoRA's download. Each job ends in a
//! failed record saying what to do, or is retried and rendered; the worker never stops.

mod loras;
mod seeing;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use loras::{KAI, MEI, RIN, TAO, library_dir, push, with_loras};
use shotfleet_producer::wait::Outcome;
use shotfleet_schema::lora::library::{LoraEntry, sha256_hex};
use shotfleet_schema::nats::Topology;
use shotfleet_schema::progress::ProgressEvent;
use shotfleet_schema::Priority;
use shotfleet_testkit::{NatsServer, S3Server, TcpProxy};
use shotfleet_tests::*;

/// A worker whose LoRA cache is `cache` (the test looks into it, or hands it to a second worker).
fn worker_spec(id: &str, store: &Path, cache: &Path) -> WorkerSpec {
    let mut spec = WorkerSpec::new(id, store);
    spec.extra = format!("\n[lora]\ncache_dir = \"{}\"\n", cache.display());
    spec
}

/// A NATS server with the topology, a store folder with `characters` in its library, a folder
/// for the workers' LoRA cache.
async fn setup(characters: &[(&str, &str)]) -> (NatsServer, async_nats::jetstream::Context, tempfile::TempDir, tempfile::TempDir) {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let (store, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let url = format!("file://{}", store.path().display());
    for &character in characters {
        push(&url, character, &[]).await;
    }
    (server, js, store, cache)
}

/// The failure of `job_id` among `outcomes`: (reason, detail).
fn failure<'a>(outcomes: &'a HashMap<String, Outcome>, job_id: &str) -> (&'a str, &'a str) {
    match &outcomes[job_id] {
        Outcome::Failed { reason, detail, .. } => (reason, detail),
        Outcome::Done(result) => panic!("{job_id} rendered: {result:?}"),
    }
}

fn rendered(outcomes: &HashMap<String, Outcome>, job_id: &str) {
    assert!(matches!(&outcomes[job_id], Outcome::Done(_)), "{job_id}: {:?}", outcomes[job_id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_and_truncated_loras_fail_their_jobs_saying_to_push_them_again() {
    let (server, js, store, cache) = setup(&[MEI, KAI, RIN, TAO]).await;
    let library = library_dir(store.path());
    // kai's upload cut short: its bytes no longer match the sidecar.
    let kai = library.join("kai.safetensors");
    let bytes = std::fs::read(&kai).unwrap();
    std::fs::write(&kai, &bytes[..bytes.len() / 2]).unwrap();
    // rin's file is garbage that its sidecar describes (a library written by hand or another tool).
    let garbage = vec![0x5a; 4096];
    let mut entry: LoraEntry = serde_json::from_slice(&std::fs::read(library.join("rin.json")).unwrap()).unwrap();
    (entry.sha256, entry.bytes) = (sha256_hex(&garbage), garbage.len() as u64);
    std::fs::write(library.join("rin.safetensors"), &garbage).unwrap();
    std::fs::write(library.join("rin.json"), serde_json::to_vec(&entry).unwrap()).unwrap();

    let mut worker = Worker::start(&server.url(), worker_spec("bad-files", store.path(), cache.path()));
    let shots = [
        shot(Priority::P1, with_loras(job("truncated", "acme", (64, 64), 2, 1), &[("kai", 0.7)])),
        shot(Priority::P1, with_loras(job("corrupt", "acme", (64, 64), 2, 1), &[("rin", 1.0)])),
        shot(Priority::P1, with_loras(job("stacked", "acme", (64, 64), 2, 1), &[("mei.v2", 0.8), ("kai", 0.5)])),
        shot(Priority::P1, with_loras(job("fine", "acme", (64, 64), 2, 1), &[("mei.v2", 1.0)])),
    ];
    submit(&js, &shots).await;
    let outcomes = outcomes(&js, &shots, Duration::from_secs(120)).await;
    for job_id in ["truncated", "stacked"] {
        let (reason, detail) = failure(&outcomes, job_id);
        assert_eq!(reason, "invalid", "{job_id}: {detail}");
        assert!(detail.contains("LoRA `kai`") && detail.contains("does not match its sidecar") && detail.contains("push it again"), "{detail}");
    }
    let (reason, detail) = failure(&outcomes, "corrupt");
    assert_eq!(reason, "invalid");
    assert!(detail.starts_with("LoRA `rin`: "), "{detail}");
    rendered(&outcomes, "fine");

    // mei's local copy goes bad on disk: tao (the same file at another weight, a set the pool
    // does not have) finds it, throws it away and fetches the file again.
    let copy = cache.path().join(format!("{}.safetensors", sha256_hex(&std::fs::read(loras::fixture(MEI.1)).unwrap())));
    let len = std::fs::metadata(&copy).unwrap().len() as usize;
    std::fs::write(&copy, vec![0u8; len]).unwrap();
    let again = [shot(Priority::P1, with_loras(job("from-a-bad-copy", "acme", (64, 64), 2, 1), &[("tao", 0.6)]))];
    submit(&js, &again).await;
    rendered(&outcomes_of(&js, &again).await, "from-a-bad-copy");
    assert!(worker.log().contains("cached LoRA file does not match its sha256; removed"), "{}", worker.log());
    assert!(worker.running(), "the worker goes on");
}

async fn outcomes_of(js: &async_nats::jetstream::Context, shots: &[shotfleet_producer::storyboard::Shot]) -> HashMap<String, Outcome> {
    outcomes(js, shots, Duration::from_secs(120)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_deleted_from_the_library_fails_the_jobs_that_still_name_it() {
    let (server, js, store, cache) = setup(&[MEI, KAI]).await;
    let delete = |name: &str| {
        for ext in ["safetensors", "json"] {
            std::fs::remove_file(library_dir(store.path()).join(format!("{name}.{ext}"))).unwrap();
        }
    };
    let mut first = Worker::start(&server.url(), worker_spec("first", store.path(), cache.path()));
    let warm = [
        shot(Priority::P1, with_loras(job("mei-1", "acme", (64, 64), 2, 1), &[("mei.v2", 1.0)])),
        shot(Priority::P1, with_loras(job("kai-1", "acme", (64, 64), 2, 1), &[("kai", 0.7)])),
    ];
    submit(&js, &warm).await;
    let outcomes = outcomes_of(&js, &warm).await;
    rendered(&outcomes, "mei-1");
    rendered(&outcomes, "kai-1");

    // mei is deleted while its set is on this worker's device: the library decides.
    delete("mei.v2");
    let gone = [shot(Priority::P1, with_loras(job("mei-2", "acme", (64, 64), 2, 1), &[("mei.v2", 1.0)]))];
    submit(&js, &gone).await;
    let outcomes = outcomes_of(&js, &gone).await;
    let (reason, detail) = failure(&outcomes, "mei-2");
    assert_eq!(reason, "invalid");
    assert!(detail.contains("no LoRA named `mei.v2`") && detail.contains("shotfleet lora push FILE --name mei.v2"), "{detail}");
    assert_eq!(first.terminate(Duration::from_secs(20)), Some(0));

    // kai is deleted while jobs naming it wait in the queue; the next worker has kai's file in
    // its cache, and still fails them. The base job behind them renders.
    let queued = [
        shot(Priority::P1, with_loras(job("kai-2", "acme", (64, 64), 2, 1), &[("kai", 0.7)])),
        shot(Priority::P1, with_loras(job("kai-3", "acme", (64, 64), 2, 1), &[("kai", 0.0)])),
        shot(Priority::P1, job("base-1", "acme", (64, 64), 2, 1)),
    ];
    submit(&js, &queued).await;
    delete("kai");
    let mut second = Worker::start(&server.url(), worker_spec("second", store.path(), cache.path()));
    let outcomes = outcomes_of(&js, &queued).await;
    for job_id in ["kai-2", "kai-3"] {
        let (reason, detail) = failure(&outcomes, job_id);
        assert_eq!(reason, "invalid", "{job_id}");
        assert!(detail.contains("no LoRA named `kai`"), "{job_id}: {detail}");
    }
    rendered(&outcomes, "base-1");
    wait_settled(&js, Duration::from_secs(20)).await;
    assert!(second.running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_outage_in_the_middle_of_a_lora_download_is_retried() {
    let server = NatsServer::start();
    let js = jetstream_with(&server.url(), &Topology::default()).await;
    let s3 = S3Server::start();
    s3.create_bucket("renders");
    let mut proxy = TcpProxy::start(&s3.endpoint());
    let credentials: Vec<(String, String)> = S3Server::credentials().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let mut direct = credentials.clone();
    direct.extend([("AWS_ENDPOINT_URL".to_string(), s3.endpoint()), ("AWS_ALLOW_HTTP".to_string(), "true".to_string())]);
    push("s3://renders/shotfleet", MEI, &direct).await;

    // The worker reaches S3 through the proxy, retries a store call twice at most, and backs a
    // failed job off for a second.
    let store = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("outage", store.path());
    spec.store_url = "s3://renders/shotfleet".into();
    spec.env = credentials;
    spec.env.push(("AWS_ENDPOINT_URL".into(), proxy.endpoint()));
    spec.extra = "\n[store.retry]\nmax_attempts = 2\ninitial_backoff_ms = 100\nmax_elapsed_ms = 500\n\n[attempts]\nbackoff = \"1s\"\n".into();
    let mut worker = Worker::start(&server.url(), spec);

    // 284 KB at 16 KB/s: the download lasts some 18 s, and the store goes away in its middle.
    proxy.throttle(Some(16_000));
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut events = seeing::progress_events(&client, "acme").await;
    let shots = [shot(Priority::P1, with_loras(job("mid-download", "acme", (64, 64), 2, 1), &[("mei.v2", 1.0)]))];
    submit(&js, &shots).await;
    seeing::wait_for(&mut events, "mid-download", ProgressEvent::Taken).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.down();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !worker.log().contains("job failed, will retry") {
        assert!(Instant::now() < deadline, "{}", worker.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.throttle(None);
    proxy.up();

    let result = results(&outcomes(&js, &shots, Duration::from_secs(120)).await).remove(0);
    assert!(result.attempt >= 2, "rendered on a delivery after the failed one");
    let log = worker.plain_log();
    let failed = log.lines().find(|l| l.contains("job failed, will retry")).unwrap();
    println!("{failed}");
    assert!(failed.contains("LoRA `mei.v2`") && failed.contains("retryable"), "{failed}");
    assert!(worker.running(), "the worker goes on");
}
