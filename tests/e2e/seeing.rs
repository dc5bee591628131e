//! What the tests of progress, cancel, status, gallery and the dashboard share: running the
//! `shotfleet` binary, and following a project's progress events.

#![allow(dead_code)]

use std::process::Output;
use std::time::Duration;

use futures::StreamExt;
use shotfleet_schema::progress::{self, ProgressEvent, ShotProgress};
use shotfleet_tests::binary;

/// Runs `shotfleet ARGS` against `url`, output captured (so not on a terminal).
pub async fn shotfleet(url: &str, args: &[&str]) -> Output {
    shotfleet_with(url, &[], args).await
}

/// [`shotfleet`] with more environment.
pub async fn shotfleet_with(url: &str, env: &[(String, String)], args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(binary("shotfleet"));
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("NATS_") || name.starts_with("SHOTFLEET_")) {
        command.env_remove(name);
    }
    command.args(args).env("NATS_URL", url).envs(env.iter().cloned()).output().await.expect("run shotfleet")
}

/// Stdout and stderr of a run, for assertions and their messages.
pub fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// Every progress event of `project`, as they arrive.
pub async fn progress_events(client: &async_nats::Client, project: &str) -> tokio::sync::mpsc::UnboundedReceiver<ShotProgress> {
    let mut subscription = client.subscribe(progress::project_subjects(project)).await.expect("subscribe to progress");
    client.flush().await.expect("flush");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(message) = subscription.next().await {
            let event: ShotProgress = serde_json::from_slice(&message.payload).expect("a progress event");
            if tx.send(event).is_err() {
                return;
            }
        }
    });
    rx
}

/// Waits for an event of `job` of kind `kind`; returns it.
pub async fn wait_for(events: &mut tokio::sync::mpsc::UnboundedReceiver<ShotProgress>, job: &str, kind: ProgressEvent) -> ShotProgress {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let event = events.recv().await.expect("progress events");
            if event.job_id == job && event.event == kind {
                return event;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {kind:?} event of {job} within a minute"))
}

/// A nats-server with the topology, a folder store and one worker (`w1`, classes xs and s).
pub struct OneWorker {
    pub server: shotfleet_testkit::NatsServer,
    pub js: async_nats::jetstream::Context,
    pub store: tempfile::TempDir,
    pub worker: shotfleet_tests::Worker,
}

impl OneWorker {
    pub async fn start() -> Self {
        let server = shotfleet_testkit::NatsServer::start();
        let js = shotfleet_tests::jetstream_with(&server.url(), &Default::default()).await;
        let store = tempfile::tempdir().expect("store folder");
        let worker = shotfleet_tests::Worker::start(&server.url(), shotfleet_tests::WorkerSpec::new("w1", store.path()));
        Self { server, js, store, worker }
    }

    pub fn url(&self) -> String {
        self.server.url()
    }
}
