//! `shotfleet submit` publishes a storyboard grouped by LoRA set inside each priority (and in
//! file order with `--no-group`): 48 shots over 4 characters, shuffled in the file.

use async_nats::jetstream;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{ShotJob, subject};
use shotfleet_testkit::nats::NatsServer;

mod support;
use support::{shotfleet, text};

/// The p0 shots: one anchor per character.
const ANCHORS: [usize; 4] = [0, 13, 26, 39];

/// 48 shots, 4 characters (one of them with a style LoRA stacked), p0 anchors and p1 shots,
/// in a fixed shuffled order.
fn storyboard() -> String {
    let characters = [r#"[{"name":"mei","weight":1.0}]"#, r#"[{"name":"kai","weight":0.9}]"#, r#"[{"name":"ink","weight":0.5},{"name":"ren","weight":1.0}]"#, r#"[{"name":"ren","weight":1.0}]"#];
    let mut lines: Vec<String> = (0..48)
        .map(|i| {
            let priority = if ANCHORS.contains(&i) { "p0" } else { "p1" };
            format!(
                r#"{{"job_id":"s{i:02}","project":"tide","shot_id":"s{i:02}","priority":"{priority}","prompt":"shot {i}","width":64,"height":64,"steps":2,"guidance":5.0,"seed":{i},"loras":{}}}"#,
                characters[i % 4]
            )
        })
        .collect();
    // A fixed shuffle: stride 7 over 48 visits every line once.
    lines = (0..48).map(|k| lines[(k * 7) % 48].clone()).collect();
    lines.join("\n") + "\n"
}

/// The jobs in the SHOTS stream, in stream order.
async fn published(server: &NatsServer) -> Vec<ShotJob> {
    let js = jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    let mut jobs = Vec::new();
    for seq in 1..=48u64 {
        let message = stream.get_raw_message(seq).await.unwrap();
        jobs.push(encoding::decode(ContentType::MessagePack, &message.payload).unwrap());
    }
    jobs
}

fn set_of(job: &ShotJob) -> Vec<String> {
    let mut names: Vec<String> = job.loras.iter().map(|l| format!("{}@{}", l.name, l.weight)).collect();
    names.sort();
    names
}

/// How many times consecutive jobs change set.
fn switches(jobs: &[ShotJob]) -> usize {
    jobs.windows(2).filter(|w| set_of(&w[0]) != set_of(&w[1])).count()
}

async fn submit(extra: &[&str]) -> Vec<ShotJob> {
    let server = NatsServer::start();
    let setup = shotfleet(&server.url(), &["setup"]).await;
    assert!(setup.status.success(), "{}", text(&setup));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("board.jsonl");
    std::fs::write(&file, storyboard()).unwrap();
    let mut args = vec!["submit", file.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = shotfleet(&server.url(), &args).await;
    assert!(out.status.success(), "{}", text(&out));
    published(&server).await
}

#[tokio::test]
async fn submit_groups_shots_by_lora_set_inside_each_priority() {
    let jobs = submit(&[]).await;
    // p0 first (4 anchors, one per character), then p1: 4 sets each contiguous.
    let anchor = |j: &ShotJob| ANCHORS.contains(&(j.seed as usize));
    let (p0, p1) = jobs.split_at(4);
    assert!(p0.iter().all(anchor), "the p0 anchors come first");
    assert_eq!((switches(p0), switches(p1)), (3, 3), "each of the 4 sets once per priority");
    assert!(switches(&jobs) <= 7);
    // Inside a set, the file's order is kept.
    let file_order: Vec<u64> = storyboard().lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["seed"].as_u64().unwrap()).collect();
    for set in jobs.iter().map(set_of).collect::<std::collections::BTreeSet<_>>() {
        let ours: Vec<u64> = p1.iter().filter(|j| set_of(j) == set).map(|j| j.seed).collect();
        let theirs: Vec<u64> = file_order.iter().copied().filter(|s| ours.contains(s)).collect();
        assert_eq!(ours, theirs, "set {set:?}");
    }
}

#[tokio::test]
async fn no_group_keeps_the_file_order() {
    let jobs = submit(&["--no-group"]).await;
    let file_order: Vec<u64> = storyboard().lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["seed"].as_u64().unwrap()).collect();
    assert_eq!(jobs.iter().map(|j| j.seed).collect::<Vec<_>>(), file_order);
    assert!(switches(&jobs) > 40, "shuffled: a switch almost every shot");
}
