//! The state of the queues, per priority and class: pending, in progress, oldest age; failed.

use std::time::{Duration, SystemTime};

use async_nats::jetstream;
use async_nats::jetstream::stream::RawMessageErrorKind;
use futures::StreamExt;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::subject::{self, Priority, SubjectClass};

/// One (priority, class) consumer's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueStatus {
    pub consumer: String,
    pub priority: Priority,
    pub class: SubjectClass,
    /// Jobs not yet delivered.
    pub pending: u64,
    /// Jobs delivered and not yet acked: being rendered (or about to be redelivered).
    pub in_progress: u64,
    /// Jobs redelivered at least once.
    pub redelivered: u64,
    /// Age of the oldest job still in the queue (pending or in progress).
    pub oldest: Option<Duration>,
}

/// Everything `shotfleet status` prints.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub queues: Vec<QueueStatus>,
    /// Failed records per subject (`shots.failed.<prio>.<project>`).
    pub failed: Vec<(String, u64)>,
    pub results: u64,
}

/// Reads the state from the server. Consumer info is recomputed by the server on each call
/// (NATS-NOTES), so this is for people and dashboards, not for per-job polling.
///
/// # Errors
/// The server's answer as text when a stream or consumer cannot be read (run `shotfleet setup`).
pub async fn read(js: &jetstream::Context) -> Result<Status, String> {
    let jobs = js.get_stream(subject::JOBS_STREAM).await.map_err(|e| missing(subject::JOBS_STREAM, e))?;
    let mut status = Status::default();
    // The oldest job's age reads a job from the stream, which a producer's permissions refuse
    // (another project's prompt); after one refusal the column stays empty instead of waiting
    // out a refusal per consumer.
    let mut oldest_readable = true;
    for ((priority, class), config) in queues().zip(Topology::default().consumers()) {
        let name = config.durable_name.clone().unwrap_or_default();
        let mut consumer = jobs
            .get_consumer::<jetstream::consumer::pull::Config>(&name)
            .await
            .map_err(|e| missing(&name, e))?;
        let info = consumer.info().await.map_err(|e| e.to_string())?;
        let waiting = info.num_pending + info.num_ack_pending as u64 > 0;
        let oldest = if waiting && oldest_readable {
            match jobs.get_first_raw_message_by_subject(&config.filter_subject, 1).await {
                Ok(m) => SystemTime::now().duration_since(m.time.into()).ok(),
                Err(e) => {
                    oldest_readable = matches!(e.kind(), RawMessageErrorKind::NoMessageFound);
                    None
                }
            }
        } else {
            None
        };
        status.queues.push(QueueStatus {
            consumer: name,
            priority,
            class,
            pending: info.num_pending,
            in_progress: info.num_ack_pending as u64,
            redelivered: info.num_redelivered as u64,
            oldest,
        });
    }
    let failed = js.get_stream(subject::FAILED_STREAM).await.map_err(|e| missing(subject::FAILED_STREAM, e))?;
    let subjects = failed
        .info_with_subjects(format!("{}.failed.>", subject::ROOT))
        .await
        .map_err(|e| e.to_string())?;
    let mut subjects: Vec<(String, u64)> = subjects
        .filter_map(|s| async move { s.ok().map(|(subject, n)| (subject, n as u64)) })
        .collect()
        .await;
    subjects.sort();
    status.failed = subjects;
    let mut results = js.get_stream(subject::RESULTS_STREAM).await.map_err(|e| missing(subject::RESULTS_STREAM, e))?;
    status.results = results.info().await.map_err(|e| e.to_string())?.state.messages;
    Ok(status)
}

/// Every (priority, class) in the order of the topology's consumers.
fn queues() -> impl Iterator<Item = (Priority, SubjectClass)> {
    Priority::ALL.iter().copied().flat_map(|p| subject::job_classes().map(move |c| (p, c)))
}

fn missing(what: &str, e: impl std::fmt::Display) -> String {
    format!("cannot read {what}: {e} (has `shotfleet setup` been run against this server?)")
}

/// The status as `shotfleet status` prints it: the queues, failed records, the live workers
/// (with what they hold) and the warnings about classes nobody serves.
pub fn render(status: &Status, fleet: &crate::fleet::Fleet, now: std::time::Instant) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "{:<18} {:>8} {:>12} {:>12} {:>10}", "consumer", "pending", "in_progress", "redelivered", "oldest");
    for q in &status.queues {
        let oldest = q.oldest.map(|d| format!("{:.0}s", d.as_secs_f64())).unwrap_or_else(|| "-".into());
        let _ = writeln!(out, "{:<18} {:>8} {:>12} {:>12} {:>10}", q.consumer, q.pending, q.in_progress, q.redelivered, oldest);
    }
    let failed: u64 = status.failed.iter().map(|(_, n)| n).sum();
    let _ = writeln!(out, "results: {}   failed: {failed}", status.results);
    for (subject, n) in &status.failed {
        let _ = writeln!(out, "  {subject}: {n}");
    }
    let live: Vec<_> = fleet.live(now).collect();
    let _ = writeln!(out, "workers heard of in the last minute: {}", live.len());
    if !live.is_empty() {
        let _ = writeln!(out, "  {:<22} {:<20} {:>15} {:>9} {:<12} {:<12} holds", "worker", "device", "gpu used/total", "budget", "serves", "admits");
    }
    for (name, worker) in live {
        let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
        let gpu = worker.gpu.map_or_else(|| "-".into(), |g| format!("{:.1}/{:.1} GiB", gib(g.used_bytes), gib(g.total_bytes)));
        let budget = worker.gpu.map_or_else(|| "-".into(), |g| format!("{:.1} GiB", gib(g.budget_bytes)));
        let list = |classes: &[shotfleet_schema::MemoryClass]| classes.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(",");
        let (device, serves, admits) = worker.state.as_ref().map_or(("-".into(), "?".into(), "?".into()), |s| {
            (s.device.clone(), list(&s.serves), list(&s.admits))
        });
        // The progress events heard while listening name the jobs rendering; a worker's answer
        // counts what it holds (waiting for a slot and committing too), also between events.
        let held = worker.state.as_ref().map_or(0, |s| s.in_flight);
        let holds = if !worker.holds.is_empty() {
            worker
                .holds
                .iter()
                .map(|(job, p)| format!("{job} step {}/{} ({}/{} images)", p.step, p.steps, p.images_done, p.images))
                .collect::<Vec<_>>()
                .join("; ")
        } else if held > 0 {
            format!("{held} job(s), no progress heard yet")
        } else if worker.state.as_ref().is_some_and(|s| s.starting) {
            "starting: loading models and calibrating".to_owned()
        } else {
            "idle".to_owned()
        };
        let _ = writeln!(out, "  {name:<22} {device:<20} {gpu:>15} {budget:>9} {serves:<12} {admits:<12} {holds}");
    }
    for warning in fleet.warnings(status, now) {
        let _ = writeln!(out, "{warning}");
    }
    out
}
