//! `shotfleet cancel` end to end: a worker mid-render (tiny model, many steps) stops at its next
//! step and sweeps its uploads, queued jobs behind it are removed from SHOTS without rendering,
//! a job of a class nobody serves is cancelled by its shot, and every job ends with exactly one
//! outcome of status `cancelled` that `--wait` sees. A finished job is left alone; an unknown one
//! is reported.

#[path = "seeing.rs"]
mod seeing;

use std::time::{Duration, Instant};

use seeing::{OneWorker, progress_events, shotfleet, text, wait_for};
use shotfleet_producer::wait::Outcome;
use shotfleet_schema::progress::ProgressEvent;
use shotfleet_schema::{Priority, ResultStatus, ShotResult, subject};
use shotfleet_tests::{job, outcomes, shot, submit, wait_settled};

async fn last_outcome(js: &async_nats::jetstream::Context, project: &str, job_id: &str) -> ShotResult {
    let stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    let message = stream.direct_get_last_for_subject(subject::result(project, job_id)).await.expect("an outcome");
    serde_json::from_slice(&message.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_stops_a_render_and_removes_queued_jobs() {
    let fleet = OneWorker::start().await;
    let (js, store) = (&fleet.js, &fleet.store);
    let mut events = progress_events(&js.client(), "cx").await;

    // One long render holds the only slot; two jobs wait behind it, one more in a class
    // nobody serves.
    let long = job("cx-long", "cx", (128, 128), 150, 4);
    let (queued, kept) = (job("cx-q1", "cx", (64, 64), 2, 1), job("cx-q2", "cx", (64, 64), 2, 1));
    let mut stuck = job("cx-xl", "cx", (1600, 1600), 1, 1);
    stuck.shot_id = "s-xl".into();
    let shots = vec![shot(Priority::P1, long), shot(Priority::P1, queued), shot(Priority::P1, kept), shot(Priority::P1, stuck)];
    submit(js, &shots).await;
    let step = wait_for(&mut events, "cx-long", ProgressEvent::Step).await;
    assert!(step.step < step.steps, "the render is under way: {step:?}");

    let started = Instant::now();
    // A job named by id, or by key as `submit --wait` names a board of several projects' jobs.
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cx", "--by", "tester", "cx-long", "cx/cx-q1"]).await;
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("cx-long") && said.contains("cx-q1") && said.contains("2 cancelled"), "{said}");
    // The render stops at its next step: long before its 150 x 4 steps.
    let settled = wait_for(&mut events, "cx-long", ProgressEvent::Settled).await;
    assert!(started.elapsed() < Duration::from_secs(20), "stopped after {:?}", started.elapsed());
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cx", "--shot", "s-xl"]).await;
    assert!(out.status.success() && text(&out).contains("cx-xl"), "{}", text(&out));

    // Every job has one outcome; the cancelled ones say who.
    let ended = outcomes(js, &shots, Duration::from_secs(60)).await;
    for id in ["cx-long", "cx-q1", "cx-xl"] {
        match &ended[id] {
            Outcome::Failed { reason, detail, .. } => assert!(reason == "cancelled" && detail.contains("cancelled by"), "{id}: {reason}: {detail}"),
            other => panic!("{id} was not cancelled: {other:?}"),
        }
        let result = last_outcome(js, "cx", id).await;
        assert_eq!(result.status, ResultStatus::Cancelled, "{id}");
    }
    assert_eq!(last_outcome(js, "cx", "cx-long").await.failure.unwrap().detail, "cancelled by tester");
    assert!(matches!(&ended["cx-q2"], Outcome::Done(_)), "the job behind the cancelled ones renders: {:?}", ended["cx-q2"]);
    wait_settled(js, Duration::from_secs(30)).await;
    // Nothing of the stopped render is left, and the queued job was never rendered.
    for id in ["cx-long", "cx-q1"] {
        let folder = store.path().join("cx").join(id);
        let left: Vec<_> = std::fs::read_dir(&folder).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        assert!(left.is_empty(), "{id} left {left:?}");
    }
    assert!(settled.images_done < 4, "stopped before finishing: {settled:?}");

    // Cancelling what is finished changes nothing; an unknown job is said to be so.
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cx", "cx-q2"]).await;
    assert!(out.status.success() && text(&out).contains("already finished"), "{}", text(&out));
    assert_eq!(last_outcome(js, "cx", "cx-q2").await.status, ResultStatus::Done);
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cx", "nope"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("unknown"), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_does_not_say_which_jobs_cancels_nothing() {
    let fleet = OneWorker::start().await;
    let js = &fleet.js;
    // Jobs of a class nobody serves stay queued: what a request may not touch by mistake.
    let shots: Vec<_> = ["cz-1", "cz-2"].iter().map(|id| shot(Priority::P1, job(id, "cz", (1600, 1600), 1, 1))).collect();
    submit(js, &shots).await;
    let client = js.client();
    // What an outside client may send by mistake: none of it reads as the whole project.
    for payload in [r#"{"v":1,"jobs":[]}"#, r#"{"v":1,"job":"cz-1"}"#, r#"{"job_ids":["cz-1"]}"#, r#"{"v":2,"all":true}"#, "{}"] {
        let answer = client.request("shots.cancel.cz.@project", payload.to_owned().into()).await.unwrap();
        let reply: shotfleet_schema::cancel::CancelReply = serde_json::from_slice(&answer.payload).unwrap();
        assert!(reply.error.is_some() && reply.jobs.is_empty(), "{payload}: {reply:?}");
    }
    // The CLI never reads "no jobs named" as "all of them" either.
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cz"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--all"), "{}", text(&out));
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cz", "cx/cz-1"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("`cx/cz-1` is a job of project `cx`, not of --project cz"), "{}", text(&out));
    let stream = js.get_stream(subject::RESULTS_STREAM).await.unwrap();
    for id in ["cz-1", "cz-2"] {
        assert!(stream.direct_get_last_for_subject(subject::result("cz", id)).await.is_err(), "{id} has an outcome");
    }
    // An empty payload on a job's own subject names that job (as `nats req ... ''` sends it).
    let answer = client.request("shots.cancel.cz.cz-1", bytes::Bytes::new()).await.unwrap();
    let reply: shotfleet_schema::cancel::CancelReply = serde_json::from_slice(&answer.payload).unwrap();
    assert!(reply.error.is_none() && reply.jobs.len() == 1, "{reply:?}");
    assert_eq!(reply.jobs[0].result, shotfleet_schema::cancel::CancelResult::Cancelled, "{reply:?}");
    // Asked for, the whole project goes.
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cz", "--all"]).await;
    assert!(out.status.success() && text(&out).contains("1 cancelled"), "{}", text(&out));
    for id in ["cz-1", "cz-2"] {
        assert_eq!(last_outcome(js, "cz", id).await.status, ResultStatus::Cancelled, "{id}");
    }
    // A shot with nothing unfinished is said to be so, as an unknown job is.
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "cz", "--shot", "no-such-shot"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("no unfinished job of shot `no-such-shot`"), "{}", text(&out));
}

/// A cancelled job submitted again inside the duplicate window: the server drops the copy and
/// the CLI says why; with `--again` it is queued again, renders, and `--wait` reports that.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_job_is_queued_again_when_asked() {
    let fleet = OneWorker::start().await;
    let js = &fleet.js;
    let mut events = progress_events(&js.client(), "ag").await;
    // One long render holds the only slot while ag-1 waits behind it and is cancelled.
    submit(js, &[shot(Priority::P1, job("ag-long", "ag", (128, 128), 150, 2))]).await;
    wait_for(&mut events, "ag-long", ProgressEvent::Step).await;
    let dir = tempfile::tempdir().unwrap();
    let board = dir.path().join("board.jsonl");
    std::fs::write(&board, serde_json::to_string(&job("ag-1", "ag", (64, 64), 2, 1)).unwrap()).unwrap();
    let board = board.to_str().unwrap();
    assert!(shotfleet(&fleet.url(), &["submit", board]).await.status.success());
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "ag", "ag-1", "ag-long"]).await;
    assert!(text(&out).contains("2 cancelled"), "{}", text(&out));

    let out = shotfleet(&fleet.url(), &["submit", board]).await;
    let said = text(&out);
    assert!(said.contains("queued 0 job(s)") && said.contains("1 ended failed or cancelled: `--again` queues them again (ag/ag-1)"), "{said}");
    let out = shotfleet(&fleet.url(), &["submit", board, "--again", "--wait", "--timeout", "2m"]).await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("queued 1 job(s) again: they had ended failed or cancelled (ag/ag-1)"), "{said}");
    assert!(said.lines().any(|l| l.starts_with("ag-1 ") && l.contains(" done ")), "{said}");
    // Asked again, nothing more is queued: the rendered job is final.
    let out = shotfleet(&fleet.url(), &["submit", board, "--again"]).await;
    assert!(text(&out).contains("1 already rendered"), "{}", text(&out));
    // Waited on again, it is told as rendered, not first as the cancellation it was before.
    let out = shotfleet(&fleet.url(), &["submit", board, "--wait", "--timeout", "1m"]).await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("ag-1: done") && !said.contains("ag-1: cancelled"), "{said}");
}

/// A failed job its owner cancels is not rendered by a later replay of failed jobs: the cancel
/// lands over the failure, and replay skips a job cancelled after it failed.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_job_its_owner_cancels_is_not_replayed() {
    use shotfleet_tests::{Worker, WorkerSpec, jetstream_with};
    let server = shotfleet_testkit::NatsServer::start();
    let js = jetstream_with(&server.url(), &shotfleet_schema::nats::Topology::default()).await;
    let store = tempfile::tempdir().unwrap();
    // A card serving xs only fails a 768x768 job whose floor is its own size after a 2 s handoff.
    let mut spec = WorkerSpec::new("xs-only", store.path());
    spec.classes = "[\"xs\"]";
    spec.extra = "[degrade]\nhandoff = \"2s\"\n".into();
    let worker = Worker::start(&server.url(), spec);
    let mut j = job("failed-then-cancelled", "acme", (768, 768), 2, 1);
    j.floor = Some(shotfleet_schema::Floor { min_side: 768, min_steps: 0 });
    let s = shot(Priority::P1, j);
    submit(&js, std::slice::from_ref(&s)).await;
    match outcomes(&js, std::slice::from_ref(&s), Duration::from_secs(60)).await.remove("failed-then-cancelled") {
        Some(Outcome::Failed { reason, .. }) => assert_eq!(reason, "oom", "{}", worker.log()),
        other => panic!("expected a failure below the floor, got {other:?}\n{}", worker.log()),
    }

    let out = shotfleet(&server.url(), &["cancel", "--project", "acme", "failed-then-cancelled"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("a replay of failed jobs skips it"), "{}", text(&out));
    assert!(text(&out).contains("shot-failed-then-cancelled"), "the shot is named from the failure: {}", text(&out));
    let last = shotfleet_schema::nats::outcome::last(&js.get_stream(subject::RESULTS_STREAM).await.unwrap(), "acme", "failed-then-cancelled")
        .await
        .unwrap()
        .expect("an outcome");
    assert_eq!(last.result.status, ResultStatus::Cancelled);
    // Cancelling it again changes nothing.
    let again = shotfleet(&server.url(), &["cancel", "--project", "acme", "failed-then-cancelled"]).await;
    assert!(text(&again).contains("already finished"), "{}", text(&again));

    let filter = shotfleet_producer::replay::Filter { jobs: vec!["failed-then-cancelled".into()], ..Default::default() };
    let mut skipped = Vec::new();
    shotfleet_producer::replay::replay(&js, &filter, false, |_, outcome| {
        if let shotfleet_producer::replay::Outcome::Skipped { why } = outcome {
            skipped.push(why.clone());
        }
    })
    .await
    .expect("replay");
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0].contains("after it failed"), "{skipped:?}");
}
