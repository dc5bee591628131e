//! Running the `shotfleet` binary from tests, and what a worker writes that they stand in for.
// Each test crate uses its own part of this module.
#![allow(dead_code)]

use std::process::Output;

use async_nats::HeaderMap;
use async_nats::jetstream;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{ResultStatus, ShotResult, Timing, subject};

/// Runs `shotfleet ARGS` against `server` with no credentials from the environment.
pub async fn shotfleet(server: &str, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_shotfleet"))
        .args(args)
        .env("NATS_URL", server)
        .env_remove("NATS_CREDS")
        .env_remove("NATS_USER")
        .env_remove("NATS_PASSWORD")
        .output()
        .await
        .expect("run shotfleet")
}

/// Everything it printed, stdout then stderr.
pub fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// Publishes an outcome of `status` for `project`/`job_id` (shot `shot_id`, no images) as
/// `worker` would.
pub async fn publish_outcome(js: &jetstream::Context, project: &str, job_id: &str, shot_id: &str, worker: &str, status: ResultStatus) {
    let result = ShotResult {
        v: 1,
        job_id: job_id.into(),
        project: project.into(),
        shot_id: shot_id.into(),
        status,
        images: vec![],
        degrade: None,
        worker: worker.into(),
        device: "cpu".into(),
        attempt: 1,
        timing: Timing::default(),
        finished_at_ms: 0,
        failure: None,
        notes: vec![],
    };
    let mut headers = HeaderMap::new();
    headers.insert("Content-Type", ContentType::Json.as_str());
    let payload = encoding::encode(ContentType::Json, &result);
    js.publish_with_headers(subject::result(project, job_id), headers, payload.into()).await.unwrap().await.unwrap();
}
