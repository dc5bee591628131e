//! What `submit --wait` shows while it waits: a bar per shot a worker holds (its step, images
//! and worker, from the progress events) and where the shots not yet taken stand in their
//! queues; plain lines instead of bars when the output is not a terminal.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use shotfleet_schema::progress::{self, ProgressEvent, ShotProgress};
use shotfleet_schema::subject::{self, Priority, SubjectClass};

use crate::wait::{Outcome, failure_line};

/// How often queue positions are read (consumer info is recomputed by the server per call).
const POSITIONS_EVERY: Duration = Duration::from_secs(2);
/// Off a terminal, a shot's step line is printed at most this often.
const LINE_EVERY: Duration = Duration::from_secs(5);
/// Waiting shots named on the waiting line.
const WAITING_NAMED: usize = 4;

/// A published job: where it waits.
#[derive(Debug, Clone)]
pub struct Placed {
    pub project: String,
    pub job_id: String,
    pub priority: Priority,
    pub class: SubjectClass,
    /// Its sequence in `SHOTS` (the PubAck's).
    pub sequence: u64,
}

impl Placed {
    /// `<project>/<job_id>`, as [`shotfleet_schema::job::key`].
    pub fn key(&self) -> String {
        shotfleet_schema::job::key(&self.project, &self.job_id)
    }
}

/// Where one shot is.
#[derive(Debug, Clone, PartialEq)]
enum Stage {
    /// In the queue: about this many jobs go before it (0: unknown yet, or about to be taken).
    Waiting { position: u64 },
    /// Given back to the queue, and why.
    Requeued(String),
    Rendering(Box<ShotProgress>),
    Finished,
}

/// The display: bars on a terminal, lines elsewhere. Jobs are kept by key (ids are unique
/// within a project only) and shown by id, or by key when the jobs span several projects.
pub struct Live {
    stages: BTreeMap<String, Stage>,
    order: Vec<String>,
    several_projects: bool,
    bars: Option<Bars>,
    printed: HashMap<String, Instant>,
}

struct Bars {
    multi: MultiProgress,
    waiting: ProgressBar,
    shots: HashMap<String, ProgressBar>,
}

impl Live {
    /// A display of `jobs` (in storyboard order); bars when `terminal`.
    pub fn new(jobs: &[Placed], terminal: bool) -> Self {
        let bars = terminal.then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let waiting = multi.add(ProgressBar::new_spinner());
            waiting.set_style(ProgressStyle::with_template("{spinner} {msg}").expect("valid template"));
            waiting.enable_steady_tick(Duration::from_millis(200));
            Bars { multi, waiting, shots: HashMap::new() }
        });
        let stages = jobs.iter().map(|j| (j.key(), Stage::Waiting { position: 0 })).collect();
        let order = jobs.iter().map(Placed::key).collect();
        let several_projects = spans_projects(jobs.iter().map(|j| j.project.as_str()));
        let mut live = Self { stages, order, several_projects, bars, printed: HashMap::new() };
        live.draw_waiting();
        live
    }

    /// A progress event of one of the jobs.
    pub fn progressed(&mut self, event: ShotProgress) {
        let job = event.key();
        let Some(stage) = self.stages.get_mut(&job) else { return };
        if *stage == Stage::Finished {
            return;
        }
        match event.event {
            ProgressEvent::Taken | ProgressEvent::Step => {
                let event_kind = event.event;
                let line = describe(&event);
                let fraction = fraction(&event);
                *stage = Stage::Rendering(Box::new(event));
                match &mut self.bars {
                    Some(bars) => {
                        let bar = bars.shots.entry(job.clone()).or_insert_with(|| {
                            let bar = bars.multi.add(ProgressBar::new(1000));
                            bar.set_style(
                                ProgressStyle::with_template("{prefix:<24} [{bar:30}] {msg}").expect("valid template").progress_chars("=> "),
                            );
                            bar.set_prefix(label(self.several_projects, &job).to_owned());
                            bar
                        });
                        bar.set_position((fraction * 1000.0) as u64);
                        bar.set_message(line);
                    }
                    None => self.line(&job, &line, event_kind == ProgressEvent::Taken),
                }
            }
            ProgressEvent::Queued => {
                let why = event.detail.clone().unwrap_or_else(|| "given back".into());
                *stage = Stage::Requeued(why.clone());
                self.remove_bar(&job);
                self.line(&job, &format!("back in the queue: {why}"), true);
            }
            // The outcome follows on the result subject; the bar goes with it.
            ProgressEvent::Settled => {}
        }
        self.draw_waiting();
    }

    /// New queue positions of waiting jobs, by key.
    pub fn positions(&mut self, positions: &HashMap<String, u64>) {
        for (job, position) in positions {
            if let Some(stage @ Stage::Waiting { .. }) = self.stages.get_mut(job) {
                *stage = Stage::Waiting { position: *position };
            }
        }
        self.draw_waiting();
    }

    /// The outcome of the job of key `job` arrived.
    pub fn finished(&mut self, job: &str, outcome: &Outcome) {
        if let Some(stage) = self.stages.get_mut(job) {
            *stage = Stage::Finished;
        }
        self.remove_bar(job);
        let text = match outcome {
            Outcome::Done(result) if result.degrade.is_some() => format!("degraded: {} image(s)", result.images.len()),
            Outcome::Done(result) => {
                let notes: String = result.notes.iter().map(|note| format!(" · {note}")).collect();
                format!("done: {} image(s) in {:.1}s{notes}", result.images.len(), result.timing.render_ms as f64 / 1000.0)
            }
            Outcome::Failed { reason, detail, .. } => failure_line(reason, detail),
        };
        self.line(job, &text, true);
        self.draw_waiting();
    }

    /// A line about the wait as a whole: above the bars on a terminal, else on stderr.
    pub fn note(&self, text: &str) {
        match &self.bars {
            Some(bars) => {
                let _ = bars.multi.println(text);
            }
            None => eprintln!("{text}"),
        }
    }

    /// Where the unfinished job of key `job` stands, for a table of what did not finish: its
    /// status (`waiting` or `rendering`) and what is known of it.
    pub fn unfinished(&self, job: &str) -> Option<(&'static str, String)> {
        match self.stages.get(job)? {
            Stage::Waiting { position: 0 } => Some(("waiting", "waiting in the queue".into())),
            Stage::Waiting { position } => Some(("waiting", format!("waiting in the queue, #{position}"))),
            Stage::Requeued(why) => Some(("waiting", format!("given back to the queue: {why}"))),
            Stage::Rendering(event) => Some(("rendering", describe(event))),
            Stage::Finished => None,
        }
    }

    /// The keys of the jobs not yet taken and not finished, in storyboard order.
    pub fn waiting(&self) -> Vec<&str> {
        self.order
            .iter()
            .filter(|job| matches!(self.stages.get(*job), Some(Stage::Waiting { .. } | Stage::Requeued(_))))
            .map(String::as_str)
            .collect()
    }

    /// Clears the bars.
    pub fn finish(&mut self) {
        if let Some(bars) = self.bars.take() {
            bars.waiting.finish_and_clear();
            for bar in bars.shots.values() {
                bar.finish_and_clear();
            }
        }
    }

    fn remove_bar(&mut self, job: &str) {
        if let Some(bars) = &mut self.bars
            && let Some(bar) = bars.shots.remove(job)
        {
            bar.finish_and_clear();
            bars.multi.remove(&bar);
        }
    }

    /// A line about one job: above the bars on a terminal, else on stderr. Step lines
    /// (`always` false) at most every [`LINE_EVERY`] per job.
    fn line(&mut self, job: &str, text: &str, always: bool) {
        let now = Instant::now();
        if !always {
            if self.printed.get(job).is_some_and(|at| now.duration_since(*at) < LINE_EVERY) {
                return;
            }
            self.printed.insert(job.to_owned(), now);
        }
        self.note(&format!("{}: {text}", label(self.several_projects, job)));
    }

    /// The waiting line: how many wait, and the next few with their positions.
    fn draw_waiting(&mut self) {
        let Some(bars) = &self.bars else { return };
        let finished = self.stages.values().filter(|s| **s == Stage::Finished).count();
        bars.waiting.set_message(format!("{finished}/{} finished · {}", self.stages.len(), self.waiting_text()));
    }

    /// How many wait, and the first few: with their queue positions where known; a job given
    /// back has none (the server redelivers it outside the queue's order), so it says so.
    fn waiting_text(&self) -> String {
        let waiting = self.waiting();
        let named: Vec<String> = waiting
            .iter()
            .take(WAITING_NAMED)
            .map(|job| {
                let shown = label(self.several_projects, job);
                match self.stages.get(*job) {
                    Some(Stage::Waiting { position }) if *position > 0 => format!("{shown} #{position}"),
                    Some(Stage::Requeued(_)) => format!("{shown} (again)"),
                    _ => shown.to_owned(),
                }
            })
            .collect();
        let more = if waiting.len() > WAITING_NAMED { ", …" } else { "" };
        format!("{} waiting in the queue: {}{more}", waiting.len(), named.join(", "))
    }

    /// Off a terminal: the waiting line, printed by the caller now and then.
    pub fn waiting_line(&self) -> Option<String> {
        let waiting = self.waiting();
        (!waiting.is_empty() && self.bars.is_none()).then(|| self.waiting_text())
    }
}

/// Whether jobs of these projects span more than one: their jobs are then named by key.
pub fn spans_projects<'a>(mut projects: impl Iterator<Item = &'a str>) -> bool {
    let first = projects.next();
    projects.any(|p| Some(p) != first)
}

/// How a job of key `key` is shown: its id, or its key when the jobs span several projects
/// (ids are unique within a project only).
pub fn label(several_projects: bool, key: &str) -> &str {
    if several_projects { key } else { key.split_once('/').map_or(key, |(_, job_id)| job_id) }
}

/// How far along a rendering job is, 0..=1.
fn fraction(event: &ShotProgress) -> f64 {
    let images = f64::from(event.images.max(1));
    let in_batch = if event.steps == 0 { 0.0 } else { f64::from(event.batch) * f64::from(event.step) / f64::from(event.steps) };
    ((f64::from(event.images_done) + in_batch) / images).clamp(0.0, 1.0)
}

fn describe(event: &ShotProgress) -> String {
    let degraded = if event.degrade_level > 0 { format!(" · degraded {}", event.degrade_level) } else { String::new() };
    match event.event {
        ProgressEvent::Taken => format!("taken by {}{degraded}", event.worker),
        _ => format!(
            "step {}/{} · {}/{} image(s) · {} · {:.0}s{degraded}",
            event.step,
            event.steps,
            event.images_done,
            event.images,
            event.worker,
            event.elapsed_ms as f64 / 1000.0
        ),
    }
}

/// Follows the jobs' progress events and queue positions into `live` until dropped.
///
/// # Errors
/// The subscription to a project's progress events failed.
pub async fn follow(js: &jetstream::Context, jobs: Vec<Placed>, live: Arc<Mutex<Live>>) -> Result<FollowTask, String> {
    let client = js.client();
    let mut projects: Vec<&str> = jobs.iter().map(|j| j.project.as_str()).collect();
    projects.sort_unstable();
    projects.dedup();
    let mut feeds = Vec::new();
    for project in projects {
        feeds.push(client.subscribe(progress::project_subjects(project)).await.map_err(|e| e.to_string())?);
    }
    let mut events = futures::stream::select_all(feeds);
    let js = js.clone();
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(POSITIONS_EVERY);
        // Off a terminal the line is printed when it changes, not at every tick (a log fills).
        let mut printed = String::new();
        // The client reconnects on its own; the person should know why nothing moves meanwhile.
        let mut connected = true;
        loop {
            tokio::select! {
                Some(message) = events.next() => {
                    if let Ok(event) = serde_json::from_slice::<ShotProgress>(&message.payload) {
                        lock(&live).progressed(event);
                    }
                }
                _ = tick.tick() => {
                    let now_connected = js.client().connection_state() == async_nats::connection::State::Connected;
                    if now_connected != connected {
                        connected = now_connected;
                        let said = if connected { "connected to NATS again" } else { "lost the connection to NATS; reconnecting (the wait goes on)" };
                        lock(&live).note(said);
                    }
                    if !connected {
                        continue;
                    }
                    let waiting: Vec<Placed> = {
                        let live = lock(&live);
                        let waiting: std::collections::HashSet<&str> = live.waiting().into_iter().collect();
                        jobs.iter().filter(|j| waiting.contains(j.key().as_str())).cloned().collect()
                    };
                    let found = positions(&js, &waiting).await;
                    let mut live = lock(&live);
                    live.positions(&found);
                    if let Some(line) = live.waiting_line().filter(|line| *line != printed) {
                        eprintln!("{line}");
                        printed = line;
                    }
                }
            }
        }
    });
    Ok(FollowTask(task))
}

/// Stops following when dropped.
pub struct FollowTask(tokio::task::JoinHandle<()>);

impl Drop for FollowTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn lock(live: &Mutex<Live>) -> std::sync::MutexGuard<'_, Live> {
    live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// About how many jobs go before each of `waiting`: those of higher priorities in its class, and
/// those before it in its own queue (counted as the queue's undelivered jobs less ours behind
/// it: jobs others published after it count too, so this errs high). A job the server already
/// delivered (taken, or given back and waiting for its redelivery) is left out. Keyed by
/// [`Placed::key`].
pub async fn positions(js: &jetstream::Context, waiting: &[Placed]) -> HashMap<String, u64> {
    let Ok(stream) = js.get_stream_no_info(subject::JOBS_STREAM).await else { return HashMap::new() };
    let mut queues: HashMap<(Priority, SubjectClass), (u64, u64)> = HashMap::new();
    let mut wanted: Vec<(Priority, SubjectClass)> = Vec::new();
    for job in waiting {
        for priority in Priority::ALL.iter().copied().filter(|p| *p <= job.priority) {
            wanted.push((priority, job.class));
        }
    }
    wanted.sort_by_key(|(p, c)| (*p, c.as_str()));
    wanted.dedup();
    for (priority, class) in wanted {
        let (name, _) = subject::consumer(priority, class);
        if let Ok(mut consumer) = stream.get_consumer::<consumer::pull::Config>(&name).await
            && let Ok(info) = consumer.info().await
        {
            queues.insert((priority, class), (info.num_pending, info.delivered.stream_sequence));
        }
    }
    let mut found = HashMap::new();
    for job in waiting {
        let Some(&(pending, delivered)) = queues.get(&(job.priority, job.class)) else { continue };
        if job.sequence <= delivered {
            continue;
        }
        let ours_behind = waiting
            .iter()
            .filter(|other| (other.priority, other.class) == (job.priority, job.class) && other.sequence > job.sequence)
            .count() as u64;
        let higher: u64 = Priority::ALL
            .iter()
            .copied()
            .filter(|p| *p < job.priority)
            .filter_map(|p| queues.get(&(p, job.class)).map(|(pending, _)| *pending))
            .sum();
        found.insert(job.key(), higher + pending.saturating_sub(ours_behind).max(1));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(step: u32, steps: u32, batch: u32, images_done: u32, images: u32) -> ShotProgress {
        ShotProgress {
            v: 1,
            project: "p".into(),
            job_id: "j".into(),
            shot_id: "s".into(),
            event: ProgressEvent::Step,
            worker: "w".into(),
            step,
            steps,
            batch,
            images_done,
            images,
            elapsed_ms: 1500,
            degrade_level: 0,
            detail: None,
            gpu: None,
            at_ms: 0,
        }
    }

    #[test]
    fn a_job_advances_through_its_sub_batches() {
        // 4 images in sub-batches of 2: half way through the first batch is a quarter done.
        assert!((fraction(&event(15, 30, 2, 0, 4)) - 0.25).abs() < 1e-9);
        assert!((fraction(&event(30, 30, 2, 2, 4)) - 1.0).abs() < 1e-9);
        assert_eq!(fraction(&event(0, 0, 0, 0, 1)), 0.0);
    }

    fn placed(project: &str, job_id: &str) -> Placed {
        Placed { project: project.into(), job_id: job_id.into(), priority: Priority::P1, class: SubjectClass::Auto, sequence: 1 }
    }

    #[test]
    fn waiting_jobs_leave_the_line_when_taken_and_finished() {
        let placed: Vec<Placed> = ["a", "b", "c"].iter().map(|id| placed("p", id)).collect();
        let mut live = Live::new(&placed, false);
        assert_eq!(live.waiting(), ["p/a", "p/b", "p/c"]);
        live.positions(&HashMap::from([("p/b".to_owned(), 7)]));
        assert_eq!(live.waiting_line().unwrap(), "3 waiting in the queue: a, b #7, c", "one project: shown by id");
        live.progressed(ShotProgress { job_id: "a".into(), ..event(1, 30, 1, 0, 1) });
        assert_eq!(live.waiting(), ["p/b", "p/c"]);
        live.progressed(ShotProgress { job_id: "a".into(), event: ProgressEvent::Queued, detail: Some("no room".into()), ..event(1, 30, 1, 0, 1) });
        assert_eq!(live.waiting(), ["p/a", "p/b", "p/c"], "given back: waiting again");
        assert_eq!(live.waiting_line().unwrap(), "3 waiting in the queue: a (again), b #7, c");
    }

    #[test]
    fn one_id_in_two_projects_is_two_jobs() {
        let mut live = Live::new(&[placed("ep1", "shot-001"), placed("ep2", "shot-001")], false);
        live.progressed(ShotProgress { project: "ep2".into(), job_id: "shot-001".into(), ..event(1, 30, 1, 0, 1) });
        assert_eq!(live.waiting(), ["ep1/shot-001"], "ep2's job was taken, ep1's still waits");
        assert_eq!(live.waiting_line().unwrap(), "1 waiting in the queue: ep1/shot-001", "several projects: shown by key");
        live.finished("ep1/shot-001", &Outcome::Failed { reason: "cancelled".into(), detail: String::new(), attempts: "0".into() });
        assert!(live.waiting().is_empty());
        assert_eq!(live.waiting_line(), None);
    }
}
