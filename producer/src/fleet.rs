//! The fleet as clients see it: workers answering `shots.workers.ping` ([`WorkerState`]),
//! workers seen through progress events ([`ShotProgress`]), and the warnings a queue deserves
//! when no live worker serves or can admit its class.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use shotfleet_schema::progress::{PING_SUBJECT, ProgressEvent, ShotProgress, WorkerState};
use shotfleet_schema::{GpuMemory, MemoryClass, SubjectClass};

pub use shotfleet_schema::nats::ping;

use crate::status::Status;

/// A worker counts as live this long after it was last heard of.
pub const LIVE_FOR: Duration = Duration::from_secs(60);

/// What is known of one worker.
#[derive(Debug, Clone, Default)]
pub struct Worker {
    /// From its last answer to a ping (none for a worker seen only through progress events).
    pub state: Option<WorkerState>,
    pub gpu: Option<GpuMemory>,
    /// The jobs it holds (`project/job_id`), from progress events.
    pub holds: BTreeMap<String, ShotProgress>,
    pub seen: Option<Instant>,
}

/// Every worker heard of.
#[derive(Debug, Clone, Default)]
pub struct Fleet {
    pub workers: BTreeMap<String, Worker>,
}

impl Fleet {
    /// Records a worker's answer to a ping.
    pub fn answered(&mut self, state: WorkerState, at: Instant) {
        let worker = self.workers.entry(state.worker.clone()).or_default();
        // A worker that holds nothing says so: what its progress events left before the answer
        // (a process killed mid-render and restarted under the same name, a job that left
        // without a last event) is gone; an event sent after the answer stands. A starting
        // process knows neither its holds nor its card (it may answer beside its draining
        // predecessor under the same name).
        if state.in_flight == 0 && !state.starting {
            worker.holds.retain(|_, event| event.at_ms > state.at_ms);
        }
        if !state.starting {
            worker.gpu = Some(state.gpu);
        }
        worker.state = Some(state);
        worker.seen = Some(at);
    }

    /// Records a progress event.
    pub fn progressed(&mut self, event: ShotProgress, at: Instant) {
        let worker = self.workers.entry(event.worker.clone()).or_default();
        worker.seen = Some(at);
        if let Some(gpu) = event.gpu {
            worker.gpu = Some(gpu);
        }
        let key = event.key();
        match event.event {
            ProgressEvent::Taken | ProgressEvent::Step => {
                worker.holds.insert(key, event);
            }
            ProgressEvent::Queued | ProgressEvent::Settled => {
                worker.holds.remove(&key);
            }
        }
    }

    /// Workers heard of within [`LIVE_FOR`] of `now`.
    pub fn live(&self, now: Instant) -> impl Iterator<Item = (&String, &Worker)> {
        self.workers.iter().filter(move |(_, w)| w.seen.is_some_and(|seen| now.duration_since(seen) <= LIVE_FOR))
    }

    /// One line per queue whose jobs wait in a class that no live worker serves, or that none
    /// can admit (its largest one-image job is over every live worker's budget). Only workers
    /// that answered a ping say what they serve: without any, every waiting class is named.
    pub fn warnings(&self, status: &Status, now: Instant) -> Vec<String> {
        let answered = || self.live(now).filter_map(|(_, w)| w.state.as_ref());
        let states: Vec<&WorkerState> = answered().filter(|s| s.taking_jobs).collect();
        // Starting (a restart's grace) or draining (a deploy's old process): they take no job now,
        // but the workers' unserved watch counts what they admit as held, as here.
        let idle: Vec<&WorkerState> = answered().filter(|s| !s.taking_jobs).collect();
        let serves: BTreeSet<MemoryClass> = states.iter().flat_map(|s| s.serves.iter().copied()).collect();
        let admits: BTreeSet<MemoryClass> = states.iter().flat_map(|s| s.admits.iter().copied()).collect();
        let mut lines = Vec::new();
        for queue in status.queues.iter().filter(|q| q.pending + q.in_progress > 0) {
            let waiting = queue.pending + queue.in_progress;
            let holder = match queue.class {
                SubjectClass::Class(class) if !admits.contains(&class) => idle.iter().find(|s| s.admits.contains(&class)).map(|s| (*s, class)),
                _ => None,
            };
            let why = match queue.class {
                _ if holder.is_some() => holder.map(|(worker, class)| held_by(worker, class)),
                _ if states.is_empty() && !idle.is_empty() => Some(format!(
                    "no live worker takes jobs now ({})",
                    idle.iter().map(|s| format!("{} {}", s.worker, if s.starting { "starting" } else { "draining" })).collect::<Vec<_>>().join(", ")
                )),
                _ if states.is_empty() => Some("no live worker answers (is the fleet running?)".to_owned()),
                SubjectClass::Auto => None,
                SubjectClass::Class(class) if !serves.contains(&class) => {
                    Some(format!("no live worker serves class {class} (they serve {})", names(&serves)))
                }
                SubjectClass::Class(class) if !admits.contains(&class) => Some(format!(
                    "no live worker can admit class {class}: its largest image is over every budget (they admit {})",
                    names(&admits)
                )),
                SubjectClass::Class(_) => None,
            };
            if let Some(why) = why {
                lines.push(format!("warning: {waiting} job(s) wait in {}: {why}", queue.consumer));
            }
        }
        lines
    }
}

/// Why the jobs of `class` wait for `worker`, which admits it but takes no job now.
fn held_by(worker: &WorkerState, class: MemoryClass) -> String {
    let name = &worker.worker;
    if worker.starting {
        format!("worker {name} is starting; it admitted class {class} when it last served, and the fleet leaves these jobs to it meanwhile")
    } else {
        format!(
            "worker {name} is draining and takes no new jobs; the fleet leaves class {class} to it until it is gone, then a handoff more before sending these jobs down (start a worker that admits {class})"
        )
    }
}

fn names(classes: &BTreeSet<MemoryClass>) -> String {
    if classes.is_empty() {
        return "none".into();
    }
    classes.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(", ")
}

/// Sends a ping whose answers arrive on `inbox` (a subscription the caller reads).
///
/// # Errors
/// The NATS client's failure to publish.
pub async fn ping_to(client: &async_nats::Client, inbox: &str) -> Result<(), String> {
    client.publish_with_reply(PING_SUBJECT, inbox.to_owned(), bytes::Bytes::new()).await.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::QueueStatus;
    use shotfleet_schema::Priority;

    fn queue(class: SubjectClass, pending: u64) -> QueueStatus {
        let (consumer, _) = shotfleet_schema::subject::consumer(Priority::P1, class);
        QueueStatus { consumer, priority: Priority::P1, class, pending, in_progress: 0, redelivered: 0, oldest: None }
    }

    fn worker(name: &str, serves: &[MemoryClass], admits: &[MemoryClass]) -> WorkerState {
        WorkerState {
            v: 1,
            worker: name.into(),
            device: "card".into(),
            serves: serves.to_vec(),
            admits: admits.to_vec(),
            gpu: GpuMemory::default(),
            in_flight: 0,
            taking_jobs: true,
            starting: false,
            at_ms: 0,
        }
    }

    #[test]
    fn waiting_classes_without_a_live_server_or_room_are_named() {
        use MemoryClass::{L, M, S, Xl, Xs};
        let status = Status {
            queues: vec![
                queue(SubjectClass::Class(Xs), 2),
                queue(SubjectClass::Class(M), 1),
                queue(SubjectClass::Class(Xl), 3),
                queue(SubjectClass::Class(L), 0),
                queue(SubjectClass::Auto, 4),
            ],
            ..Status::default()
        };
        let now = Instant::now();
        let mut fleet = Fleet::default();
        let none = fleet.warnings(&status, now);
        assert_eq!(none.len(), 4, "with no live worker every waiting queue is named: {none:?}");
        assert!(none.iter().all(|w| w.contains("no live worker answers")), "{none:?}");

        fleet.answered(worker("small", &[Xs, S, M], &[Xs, S]), now);
        let warnings = fleet.warnings(&status, now);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("render-p1-m") && warnings[0].contains("no live worker can admit class m"), "{warnings:?}");
        assert!(warnings[1].contains("render-p1-xl") && warnings[1].contains("no live worker serves class xl (they serve xs, s, m)"), "{warnings:?}");

        // A worker not heard of for a minute no longer counts.
        let later = now + LIVE_FOR + Duration::from_secs(1);
        assert_eq!(fleet.warnings(&status, later).len(), 4);
    }

    #[test]
    fn a_restarting_worker_is_named_for_the_classes_it_holds() {
        use MemoryClass::{M, S};
        let status = Status { queues: vec![queue(SubjectClass::Class(S), 1), queue(SubjectClass::Class(M), 2)], ..Status::default() };
        let now = Instant::now();
        let mut fleet = Fleet::default();
        let starting = |name: &str, admits: &[MemoryClass]| WorkerState { taking_jobs: false, starting: true, ..worker(name, &[S, M], admits) };
        fleet.answered(starting("big", &[S, M]), now);
        let alone = fleet.warnings(&status, now);
        assert_eq!(alone.len(), 2, "{alone:?}");
        assert!(alone.iter().all(|w| w.contains("worker big is starting")), "{alone:?}");

        fleet.answered(worker("small", &[S, M], &[S]), now);
        let warnings = fleet.warnings(&status, now);
        assert_eq!(warnings.len(), 1, "class s is admitted by a worker taking jobs: {warnings:?}");
        assert!(warnings[0].contains("render-p1-m") && warnings[0].contains("worker big is starting"), "{warnings:?}");

        // Past its grace a starting worker holds nothing: the class is named as nobody's.
        fleet.answered(starting("big", &[]), now);
        let warnings = fleet.warnings(&status, now);
        assert!(warnings[0].contains("no live worker can admit class m"), "{warnings:?}");
    }

    #[test]
    fn a_draining_worker_is_named_for_the_classes_it_still_admits() {
        use MemoryClass::{M, S};
        let status = Status { queues: vec![queue(SubjectClass::Class(S), 1), queue(SubjectClass::Class(M), 2)], ..Status::default() };
        let now = Instant::now();
        let mut fleet = Fleet::default();
        let draining = |name: &str| WorkerState { taking_jobs: false, ..worker(name, &[S, M], &[S, M]) };
        fleet.answered(draining("old"), now);
        let alone = fleet.warnings(&status, now);
        assert_eq!(alone.len(), 2, "{alone:?}");
        assert!(alone.iter().all(|w| w.contains("worker old is draining")), "{alone:?}");

        // A deploy: the new process starts holding nothing yet beside the old one draining.
        fleet.answered(WorkerState { taking_jobs: false, starting: true, ..worker("new", &[S, M], &[]) }, now);
        fleet.answered(worker("small", &[S, M], &[S]), now);
        let warnings = fleet.warnings(&status, now);
        assert_eq!(warnings.len(), 1, "class s is admitted by a worker taking jobs: {warnings:?}");
        assert!(warnings[0].contains("render-p1-m") && warnings[0].contains("worker old is draining"), "{warnings:?}");
    }

    #[test]
    fn with_nobody_taking_jobs_the_idle_workers_are_listed() {
        use MemoryClass::{M, S};
        let status = Status { queues: vec![queue(SubjectClass::Auto, 1)], ..Status::default() };
        let now = Instant::now();
        let mut fleet = Fleet::default();
        fleet.answered(WorkerState { taking_jobs: false, ..worker("old", &[S, M], &[S, M]) }, now);
        fleet.answered(WorkerState { taking_jobs: false, starting: true, ..worker("new", &[S, M], &[]) }, now);
        let warnings = fleet.warnings(&status, now);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("no live worker takes jobs now (") && warnings[0].contains("new starting") && warnings[0].contains("old draining"), "{warnings:?}");
    }

    #[test]
    fn progress_events_say_what_a_worker_holds() {
        let now = Instant::now();
        let mut fleet = Fleet::default();
        let event = |kind| ShotProgress {
            v: 1,
            project: "p".into(),
            job_id: "j".into(),
            shot_id: "s".into(),
            event: kind,
            worker: "w".into(),
            step: 3,
            steps: 30,
            batch: 1,
            images_done: 0,
            images: 1,
            elapsed_ms: 0,
            degrade_level: 0,
            detail: None,
            gpu: Some(GpuMemory { used_bytes: 1, total_bytes: 2, budget_bytes: 1 }),
            at_ms: 0,
        };
        fleet.progressed(event(ProgressEvent::Step), now);
        assert_eq!(fleet.workers["w"].holds.len(), 1);
        assert_eq!(fleet.workers["w"].gpu.map(|g| g.total_bytes), Some(2));
        fleet.progressed(event(ProgressEvent::Settled), now);
        assert!(fleet.workers["w"].holds.is_empty());
        assert_eq!(fleet.live(now).count(), 1);

        // A worker that answers it holds nothing drops what its events left before the answer
        // (killed mid-render and restarted), not an event sent after it.
        let at = |kind, at_ms| ShotProgress { at_ms, ..event(kind) };
        fleet.progressed(at(ProgressEvent::Step, 10), now);
        fleet.answered(WorkerState { at_ms: 20, ..worker("w", &[], &[]) }, now);
        assert!(fleet.workers["w"].holds.is_empty(), "idle since the step");
        fleet.progressed(at(ProgressEvent::Taken, 30), now);
        fleet.answered(WorkerState { at_ms: 25, ..worker("w", &[], &[]) }, now);
        assert_eq!(fleet.workers["w"].holds.len(), 1, "taken after it answered");
    }
}
