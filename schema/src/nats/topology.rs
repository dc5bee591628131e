//! The streams and consumers of a shotfleet deployment, created idempotently.
//!
//! | stream | subjects | retention |
//! | --- | --- | --- |
//! | `SHOTS` | `shots.<prio>.<class>.*`, one per render consumer | work queue, file, duplicate window, max age and bytes (a full queue refuses new jobs) |
//! | `SHOT_RESULTS` | `shots.done.>` | limits, max age |
//! | `SHOTS_FAILED` | `shots.failed.>` | limits, max age |
//! | `KV_SHOT_ATTEMPTS` | `$KV.SHOT_ATTEMPTS.>`: the key-value bucket of failed attempts per job message | history 1, max age |
//!
//! and one durable pull consumer per (priority, class), `render-<prio>-<class>`, each with one
//! filter subject (nats-server 2.9 silently ignores `filter_subjects`), `auto` included.
//!
//! Existing streams and consumers are compared with what this topology wants; a difference is
//! reported, field by field, and changed only when the caller asks for an update.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use serde::{Deserialize, Serialize};

use crate::subject::{self, Priority, SubjectClass};

/// The tunable parts of the topology.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Topology {
    /// Stream replicas: 1 on a single server, 3 on a cluster.
    pub replicas: usize,
    /// How long `Nats-Msg-Id`s are remembered: re-submitting inside it queues nothing twice.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// How long results are kept.
    #[serde(with = "humantime_serde")]
    pub results_max_age: Duration,
    /// How long failed records are kept for replay.
    #[serde(with = "humantime_serde")]
    pub failed_max_age: Duration,
    /// How long a queued job may wait before the server drops it.
    #[serde(with = "humantime_serde")]
    pub jobs_max_age: Duration,
    /// The most the job queue may hold, bytes; when full, publishing a job is refused (the
    /// producer is told) rather than an older job dropped.
    pub jobs_max_bytes: i64,
    /// How long a job message's failure count is remembered.
    #[serde(with = "humantime_serde")]
    pub attempts_max_age: Duration,
    /// A delivered job not acked (nor progressed) for this long is redelivered.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// Deliveries before a job is given up on as `max_deliveries` (the rescue copies it to the
    /// failed stream). Only a backstop for jobs that kill their worker: a job fails after the
    /// workers' own count of failed attempts (`[attempts] max_failures`), and giving a job back
    /// (no room, shutdown, a first out-of-memory) is not a failure, but it is a delivery.
    pub max_deliver: i64,
    /// Jobs in flight per consumer across the fleet.
    pub max_ack_pending: i64,
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            replicas: 1,
            duplicate_window: Duration::from_secs(20 * 60),
            results_max_age: Duration::from_secs(14 * 24 * 3600),
            failed_max_age: Duration::from_secs(30 * 24 * 3600),
            jobs_max_age: Duration::from_secs(7 * 24 * 3600),
            jobs_max_bytes: 1 << 30,
            attempts_max_age: Duration::from_secs(24 * 3600),
            ack_wait: Duration::from_secs(60),
            max_deliver: 20,
            max_ack_pending: 10_000,
        }
    }
}

/// Parses a duration as the topology's settings and the CLI write them: `90s`, `20m`, `2h`,
/// `14d`, `250ms` (humantime's syntax).
///
/// # Errors
/// A message with an example.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| format!("`{text}` is not a duration like 90s, 20m, 2h or 14d: {e}"))
}


/// Something in the server that does not match, or could not be done.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    #[error(
        "{what} exists with a different configuration: {}; run `shotfleet setup --update` to change what \
         the server allows changing, or delete it by hand if the change needs a new one",
        differences.join(", ")
    )]
    Incompatible { what: String, differences: Vec<String> },
    #[error("JetStream is not available on this server (start nats-server with -js): {0}")]
    NoJetStream(String),
    #[error("cannot {action} {what}: {detail}")]
    Server { action: &'static str, what: String, detail: String },
}

/// What `ensure` did, for the CLI to print.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TopologyReport {
    pub created: Vec<String>,
    pub unchanged: Vec<String>,
    pub updated: Vec<String>,
}

impl Topology {
    /// The three stream configs.
    pub fn streams(&self) -> Vec<stream::Config> {
        let base = |name: &str, subjects: Vec<String>, description: &str| stream::Config {
            name: name.to_owned(),
            subjects,
            description: Some(description.to_owned()),
            storage: stream::StorageType::File,
            num_replicas: self.replicas,
            duplicate_window: self.duplicate_window,
            allow_direct: true,
            ..Default::default()
        };
        vec![
            stream::Config {
                retention: stream::RetentionPolicy::WorkQueue,
                max_age: self.jobs_max_age,
                max_bytes: self.jobs_max_bytes,
                discard: stream::DiscardPolicy::New,
                ..base(subject::JOBS_STREAM, subject::jobs_stream_subjects(), "shotfleet jobs, by priority and memory class")
            },
            stream::Config {
                max_age: self.results_max_age,
                ..base(subject::RESULTS_STREAM, subject::results_stream_subjects(), "shotfleet results, one per job")
            },
            stream::Config {
                max_age: self.failed_max_age,
                ..base(subject::FAILED_STREAM, subject::failed_stream_subjects(), "shotfleet failed jobs, replayable")
            },
            // The key-value bucket of failed attempts, made as the KV conventions make one (what
            // async-nats' `create_key_value` does, which cannot talk to nats-server 2.9).
            stream::Config {
                max_age: self.attempts_max_age,
                max_messages_per_subject: 1,
                discard: stream::DiscardPolicy::New,
                allow_rollup: true,
                deny_delete: true,
                ..base(
                    &format!("KV_{}", subject::ATTEMPTS_BUCKET),
                    vec![format!("$KV.{}.>", subject::ATTEMPTS_BUCKET)],
                    "shotfleet failed attempts and out-of-memory errors per job message",
                )
            },
        ]
    }

    /// The render consumers: one per (priority, class), `auto` included.
    pub fn consumers(&self) -> Vec<consumer::pull::Config> {
        let classes: Vec<SubjectClass> = subject::job_classes().collect();
        Priority::ALL
            .iter()
            .copied()
            .flat_map(|priority| classes.iter().map(move |class| (priority, *class)))
            .map(|(priority, class)| {
                let (name, filter) = subject::consumer(priority, class);
                consumer::pull::Config {
                    durable_name: Some(name),
                    description: Some(format!("shotfleet workers: {priority} jobs of class {class}")),
                    filter_subject: filter,
                    ack_policy: consumer::AckPolicy::Explicit,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_wait: self.ack_wait,
                    max_deliver: self.max_deliver,
                    max_ack_pending: self.max_ack_pending,
                    ..Default::default()
                }
            })
            .collect()
    }

    /// Creates what is missing; compares what exists. With `update`, changes what differs.
    ///
    /// # Errors
    /// [`TopologyError::Incompatible`] listing the differences when `update` is false, or the
    /// server's refusal.
    pub async fn ensure(
        &self,
        js: &jetstream::Context,
        update: bool,
    ) -> Result<TopologyReport, TopologyError> {
        let mut report = TopologyReport::default();
        for wanted in self.streams() {
            let what = format!("stream {}", wanted.name);
            match js.get_stream(&wanted.name).await {
                Ok(mut existing) => {
                    let info = existing.info().await.map_err(|e| server("read", &what, e))?;
                    let differences = stream_differences(&info.config, &wanted);
                    if differences.is_empty() {
                        report.unchanged.push(what);
                    } else if update {
                        js.update_stream(&wanted).await.map_err(|e| server("update", &what, e))?;
                        report.updated.push(format!("{what} ({})", differences.join(", ")));
                    } else {
                        return Err(TopologyError::Incompatible { what, differences });
                    }
                }
                Err(e) if is_not_found(&e) => {
                    js.create_stream(wanted).await.map_err(|e| create_error(&what, e))?;
                    report.created.push(what);
                }
                Err(e) => return Err(no_jetstream_or(&what, e)),
            }
        }
        let stream = js
            .get_stream(subject::JOBS_STREAM)
            .await
            .map_err(|e| server("open", subject::JOBS_STREAM, e))?;
        for wanted in self.consumers() {
            let name = wanted.durable_name.clone().unwrap_or_default();
            let what = format!("consumer {}/{name}", subject::JOBS_STREAM);
            match stream.consumer_info(&name).await {
                Ok(info) => {
                    let differences = consumer_differences(&info.config, &wanted);
                    if differences.is_empty() {
                        report.unchanged.push(what);
                    } else if update {
                        stream
                            .update_consumer(wanted)
                            .await
                            .map_err(|e| server("update", &what, e))?;
                        report.updated.push(format!("{what} ({})", differences.join(", ")));
                    } else {
                        return Err(TopologyError::Incompatible { what, differences });
                    }
                }
                Err(_) => {
                    stream.create_consumer(wanted).await.map_err(|e| server("create", &what, e))?;
                    report.created.push(what);
                }
            }
        }
        Ok(report)
    }
}

fn is_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

fn server(action: &'static str, what: &str, e: impl std::fmt::Display) -> TopologyError {
    TopologyError::Server { action, what: what.to_owned(), detail: e.to_string() }
}

fn create_error(what: &str, e: jetstream::context::CreateStreamError) -> TopologyError {
    let detail = e.to_string();
    if detail.contains("not enabled") || detail.contains("timed out") {
        TopologyError::NoJetStream(detail)
    } else {
        TopologyError::Server { action: "create", what: what.to_owned(), detail }
    }
}

fn no_jetstream_or(what: &str, e: jetstream::context::GetStreamError) -> TopologyError {
    let detail = e.to_string();
    if matches!(e.kind(), jetstream::context::GetStreamErrorKind::Request) || detail.contains("not enabled") {
        TopologyError::NoJetStream(detail)
    } else {
        TopologyError::Server { action: "read", what: what.to_owned(), detail }
    }
}

/// The fields this topology sets, compared one by one.
fn stream_differences(existing: &stream::Config, wanted: &stream::Config) -> Vec<String> {
    let mut out = Vec::new();
    let mut cmp = |field: &str, have: String, want: String| {
        if have != want {
            out.push(format!("{field} is {have}, wanted {want}"));
        }
    };
    let mut have_subjects = existing.subjects.clone();
    have_subjects.sort();
    let mut want_subjects = wanted.subjects.clone();
    want_subjects.sort();
    cmp("subjects", format!("{have_subjects:?}"), format!("{want_subjects:?}"));
    cmp("retention", format!("{:?}", existing.retention), format!("{:?}", wanted.retention));
    cmp("storage", format!("{:?}", existing.storage), format!("{:?}", wanted.storage));
    cmp("replicas", existing.num_replicas.max(1).to_string(), wanted.num_replicas.max(1).to_string());
    cmp("duplicate_window", format!("{:?}", existing.duplicate_window), format!("{:?}", wanted.duplicate_window));
    cmp("max_age", format!("{:?}", existing.max_age), format!("{:?}", wanted.max_age));
    // The server reports "no limit" as -1 whatever was asked (0 or -1).
    let limit = |bytes: i64| if bytes <= 0 { -1 } else { bytes };
    cmp("max_bytes", limit(existing.max_bytes).to_string(), limit(wanted.max_bytes).to_string());
    cmp("discard", format!("{:?}", existing.discard), format!("{:?}", wanted.discard));
    cmp("allow_direct", existing.allow_direct.to_string(), wanted.allow_direct.to_string());
    out
}

fn consumer_differences(existing: &consumer::Config, wanted: &consumer::pull::Config) -> Vec<String> {
    let mut out = Vec::new();
    let mut cmp = |field: &str, have: String, want: String| {
        if have != want {
            out.push(format!("{field} is {have}, wanted {want}"));
        }
    };
    cmp("filter_subject", existing.filter_subject.clone(), wanted.filter_subject.clone());
    cmp("ack_policy", format!("{:?}", existing.ack_policy), format!("{:?}", wanted.ack_policy));
    cmp("ack_wait", format!("{:?}", existing.ack_wait), format!("{:?}", wanted.ack_wait));
    cmp("max_deliver", existing.max_deliver.to_string(), wanted.max_deliver.to_string());
    cmp("max_ack_pending", existing.max_ack_pending.to_string(), wanted.max_ack_pending.to_string());
    if existing.deliver_subject.is_some() {
        out.push("it is a push consumer; workers need a pull consumer".into());
    }
    out
}
