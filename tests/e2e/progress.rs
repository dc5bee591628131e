//! Seeing the work while it runs: progress events (a few a second at most, from taken to
//! settled), followed from Python as the README shows; `submit --wait` off a terminal prints
//! who holds each shot, its steps and the queue positions of the rest; `status` and
//! `status --watch` list the live worker and warn about a class no live worker serves.

#[path = "seeing.rs"]
mod seeing;

use std::io::BufRead as _;
use std::time::Duration;

use seeing::{OneWorker, shotfleet, text};
use shotfleet_schema::Priority;
use shotfleet_testkit::paths;
use shotfleet_tests::{binary, job, shot, submit};

#[tokio::test(flavor = "multi_thread")]
async fn python_follows_a_job_from_taken_to_settled() {
    let fleet = OneWorker::start().await;
    let js = &fleet.js;

    let script = paths::repo_root().join("tests/python/follow_progress.py");
    let mut follower = std::process::Command::new(paths::require(paths::python(), "the venv's python"))
        .args([script.to_str().unwrap(), &fleet.url(), "pp", "pp-1"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(follower.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    submit(js, &[shot(Priority::P1, job("pp-1", "pp", (128, 128), 60, 2))]).await;
    let events: Vec<String> = tokio::task::spawn_blocking(move || lines.map_while(Result::ok).collect()).await.unwrap();
    assert!(follower.wait().unwrap().success(), "{events:?}");
    assert!(events.first().is_some_and(|e| e.starts_with("taken w1 step 0/60 images 0/2")), "{events:?}");
    assert!(events.last().is_some_and(|e| e.starts_with("settled w1")), "{events:?}");
    let steps: Vec<&String> = events.iter().filter(|e| e.starts_with("step w1")).collect();
    assert!(!steps.is_empty(), "{events:?}");
    // Throttled: 2 x 60 steps, a few events a second at most.
    assert!(steps.len() < 60, "{} step events", steps.len());

    // The README's snippet is the script's, word for word.
    let source = std::fs::read_to_string(&script).unwrap();
    let snippet: String = source
        .split("# README: begin\n")
        .nth(1)
        .and_then(|rest| rest.split("    # README: end").next())
        .unwrap()
        .lines()
        .map(|line| line.strip_prefix("    ").unwrap_or(line))
        .map(|line| format!("{line}\n"))
        .collect();
    let readme = std::fs::read_to_string(paths::repo_root().join("README.md")).unwrap();
    assert!(readme.contains(&snippet), "README.md lacks the snippet of follow_progress.py:\n{snippet}");
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_wait_shows_holders_steps_and_queue_positions() {
    let fleet = OneWorker::start().await;
    let board = tempfile::NamedTempFile::with_suffix(".jsonl").unwrap();
    // Renders long enough (about a second each) that the queue changes more slowly than the
    // waiting line is printed: each state of it, sw-6 among the first named included, shows.
    let lines: Vec<String> = (1..=6)
        .map(|n| serde_json::to_string(&job(&format!("sw-{n}"), "sw", (128, 128), 120, 2)).unwrap())
        .collect();
    std::fs::write(board.path(), lines.join("\n")).unwrap();
    let out = shotfleet(&fleet.url(), &["submit", board.path().to_str().unwrap(), "--wait", "--timeout", "3m"]).await;
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("sw-1: taken by w1"), "{said}");
    assert!(said.contains("sw-1: step "), "{said}");
    assert!(said.contains("sw-6: done: 2 image(s)"), "{said}");
    // Positions of the shots behind: sw-6 waits behind the others at first.
    assert!(said.lines().any(|l| l.contains("waiting in the queue") && l.contains("sw-6 #")), "{said}");
}

#[tokio::test(flavor = "multi_thread")]
async fn status_names_live_workers_and_classes_nobody_serves() {
    let fleet = OneWorker::start().await;
    let js = &fleet.js;
    // A small fleet (xs and s) and a job labelled xl: it would wait forever, silently.
    submit(js, &[shot(Priority::P1, job("big-1", "st", (1600, 1600), 1, 1))]).await;

    let out = shotfleet(&fleet.url(), &["status"]).await;
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("w1") && said.contains("xs,s"), "{said}");
    assert!(said.contains("warning: 1 job(s) wait in render-p1-xl: no live worker serves class xl"), "{said}");

    // --watch off a terminal: one frame a second until interrupted.
    let mut watch = tokio::process::Command::new(binary("shotfleet"))
        .args(["status", "--watch"])
        .env("NATS_URL", fleet.url())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    watch.start_kill().unwrap();
    let out = watch.wait_with_output().await.unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    let frames = said.matches("consumer ").count();
    assert!(frames >= 2, "{frames} frame(s):\n{said}");
    assert!(said.contains("no live worker serves class xl"), "{said}");
    assert!(said.lines().any(|l| l.trim_start().starts_with("w1 ")), "{said}");
    // The first frame already has the worker's answer to its ping.
    let second = said.match_indices("consumer ").nth(1).map_or(said.len(), |(at, _)| at);
    let first = &said[..said[..second].rfind('\n').unwrap_or(second)];
    assert!(first.lines().any(|l| l.trim_start().starts_with("w1 ")), "the first frame:\n{first}");
}

/// `submit --wait` of a job the server took as a duplicate of one still queued waits for that
/// message's outcome: a failure written before it is an earlier request's (a server restart, or
/// a window shorter than the gap, lets a failed job be queued again under its id).
#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_of_a_queued_job_waits_for_its_own_outcome_not_an_older_failure() {
    let server = shotfleet_testkit::NatsServer::start();
    // A window long enough for the third submit below to fall inside the second's, on a slow
    // machine too, and short enough to wait out once.
    let topology = shotfleet_schema::nats::Topology { duplicate_window: Duration::from_secs(4), ..Default::default() };
    let _js = shotfleet_tests::jetstream_with(&server.url(), &topology).await;
    let store = tempfile::tempdir().unwrap();
    let mut worker = shotfleet_tests::Worker::start(&server.url(), shotfleet_tests::WorkerSpec::new("dq", store.path()));
    let board = store.path().join("board.jsonl");
    // A LoRA the library lacks: refused as invalid at once.
    std::fs::write(
        &board,
        r#"{"v":1,"job_id":"dq-1","project":"dq","shot_id":"s1","prompt":"a boat","width":64,"height":64,"steps":2,"guidance":5,"seed":1,"loras":[{"name":"absent","weight":0.5}]}"#,
    )
    .unwrap();
    let out = shotfleet(&server.url(), &["submit", board.to_str().unwrap(), "--wait", "--timeout", "60s"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    worker.kill();
    // Past the window the same job is queued again, and nobody renders it now.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let out = shotfleet(&server.url(), &["submit", board.to_str().unwrap()]).await;
    assert!(out.status.success() && text(&out).contains("queued 1 job(s)"), "{}", text(&out));
    // A duplicate of that queued message: its outcome is still to come.
    // `--again` queues nothing more: the old failure is an earlier request's.
    let out = shotfleet(&server.url(), &["submit", board.to_str().unwrap(), "--again", "--wait", "--timeout", "3s"]).await;
    assert!(text(&out).contains("1 without an outcome yet: still queued") && !text(&out).contains("failed invalid"), "{}", text(&out));
    assert!(!text(&out).contains("again:"), "{}", text(&out));
    assert_ne!(out.status.code(), Some(1), "the old failure was taken for this request's: {}", text(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn one_status_of_a_project_shows_its_jobs_steps() {
    let fleet = OneWorker::start().await;
    let js = &fleet.js;
    let mut events = seeing::progress_events(&js.client(), "sp").await;
    submit(js, &[shot(Priority::P1, job("sp-long", "sp", (128, 128), 150, 4))]).await;
    seeing::wait_for(&mut events, "sp-long", shotfleet_schema::progress::ProgressEvent::Step).await;
    let out = shotfleet(&fleet.url(), &["status", "--project", "sp"]).await;
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.lines().any(|l| l.contains("w1") && l.contains("sp-long step ")), "{said}");
}

/// A failure then a result of one job, both stored before the wait began (a failed job
/// replayed and rendered): the wait reads the stored outcomes through, and the result stands.
#[tokio::test]
async fn a_wait_reads_stored_outcomes_through_before_a_failure_stands() {
    let server = shotfleet_testkit::NatsServer::start();
    let js = shotfleet_tests::jetstream_with(&server.url(), &Default::default()).await;
    let outcome = |status: &str, failure: serde_json::Value| {
        serde_json::json!({
            "v": 1, "job_id": "rr-1", "project": "rr", "shot_id": "s1", "status": status, "images": [],
            "worker": "w", "device": "cpu", "attempt": 1, "timing": {"queue_ms": 0, "render_ms": 0, "upload_ms": 0},
            "finished_at_ms": 0, "failure": failure
        })
    };
    let failed = outcome("failed", serde_json::json!({"reason": "invalid", "detail": "no LoRA named `ghost`", "attempts": 1}));
    let done = outcome("done", serde_json::Value::Null);
    for result in [failed, done] {
        js.publish("shots.done.rr.rr-1", serde_json::to_vec(&result).unwrap().into()).await.unwrap().await.unwrap();
    }
    let awaited = [shotfleet_producer::wait::Awaited { project: "rr".into(), job_id: "rr-1".into(), duplicate: true, queued_at: None }];
    let ended = shotfleet_producer::wait::wait(&js, &awaited, std::time::SystemTime::now(), Some(Duration::from_secs(10)), |_, _| {}).await.unwrap();
    assert!(matches!(ended["rr/rr-1"], shotfleet_producer::wait::Outcome::Done(_)), "{:?}", ended["rr/rr-1"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wait_that_times_out_shows_what_finished_and_names_what_did_not() {
    let fleet = OneWorker::start().await;
    let dir = tempfile::tempdir().unwrap();
    let board = dir.path().join("board.jsonl");
    // One job the worker renders, one still rendering at the timeout, one of a class it does
    // not hold (it waits past the timeout).
    let line = |id: &str, side: u32, steps: u32| {
        format!(r#"{{"job_id":"{id}","project":"tw","shot_id":"{id}","prompt":"a boat","width":{side},"height":{side},"steps":{steps},"guidance":5,"seed":1}}"#)
    };
    std::fs::write(&board, format!("{}\n{}\n{}\n", line("tw-small", 64, 2), line("tw-long", 512, 150).replace(r#""seed":1"#, r#""seed":1,"images":4"#), line("tw-xl", 1600, 2))).unwrap();
    let out = shotfleet(&fleet.url(), &["submit", board.to_str().unwrap(), "--wait", "--timeout", "8s"]).await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(124), "{said}");
    assert!(said.lines().any(|l| l.starts_with("tw-small") && l.contains(" done ")), "{said}");
    assert!(said.lines().any(|l| l.starts_with("tw-long") && l.contains(" rendering ") && l.contains("step ")), "{said}");
    assert!(said.lines().any(|l| l.starts_with("tw-xl") && l.contains(" waiting ") && l.contains("waiting in the queue")), "{said}");
    assert!(said.contains("2 of the jobs have no result or failed record yet (tw/tw-long, tw/tw-xl)"), "{said}");
}

/// Ids are unique within a project: one board with `shot-1` in two episodes waits for both
/// jobs, each with its own outcome (one rendered, one refused), named by project and id.
#[tokio::test(flavor = "multi_thread")]
async fn one_id_in_two_projects_is_two_jobs_with_their_own_outcomes() {
    let fleet = OneWorker::start().await;
    let board = tempfile::NamedTempFile::with_suffix(".jsonl").unwrap();
    let mut refused = serde_json::to_value(job("shot-1", "ep2", (64, 64), 2, 1)).unwrap();
    refused["loras"] = serde_json::json!([{"name": "absent", "weight": 0.5}]);
    let lines = [serde_json::to_string(&job("shot-1", "ep1", (64, 64), 2, 1)).unwrap(), refused.to_string()];
    std::fs::write(board.path(), lines.join("\n")).unwrap();
    let out = shotfleet(&fleet.url(), &["submit", board.path().to_str().unwrap(), "--wait", "--timeout", "2m"]).await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "one of the two failed: {said}");
    assert!(said.lines().any(|l| l.starts_with("ep1/shot-1 ") && l.contains(" done ")), "{said}");
    assert!(said.lines().any(|l| l.starts_with("ep2/shot-1 ") && l.contains(" failed ")), "{said}");
    assert!(said.contains("1 done, 0 degraded, 1 failed, 0 cancelled"), "{said}");
}

/// The server gone during `submit --wait`: the wait says so, and goes on until its timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_wait_says_when_nats_is_gone() {
    let mut fleet = OneWorker::start().await;
    let board = tempfile::NamedTempFile::with_suffix(".jsonl").unwrap();
    std::fs::write(board.path(), serde_json::to_string(&job("ng-xl", "ng", (1600, 1600), 1, 1)).unwrap()).unwrap();
    let (url, args) = (fleet.url(), ["submit", board.path().to_str().unwrap(), "--wait", "--timeout", "10s"]);
    let waiting = shotfleet(&url, &args);
    let stop = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        fleet.server.stop();
    };
    let (out, ()) = tokio::join!(waiting, stop);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(124), "{said}");
    assert!(said.contains("lost the connection to NATS; reconnecting (the wait goes on)"), "{said}");
}
