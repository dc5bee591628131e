//! The reserve: jobs fetched ahead of the free render slots, so that each slot is dealt jobs
//! that can share its UNet batches also on a queue of mixed sizes (a storyboard), not only
//! among the few fetched for it.
//!
//! Each round with a free slot, the fetch loop tops the reserve up to `batch_jobs` per free
//! slot, plus up to `lookahead` more while the queue is deep, and fetches at least one job per
//! free slot the card has room for in any case (a new job of a higher priority must be seen);
//! then it deals every free slot one group (`Reserve::deal`):
//! - its **lead** is the waiting job that comes first: an overdue one (its priority's
//!   `[priorities]` bound passed since it was fetched and since a job of its priority was last
//!   dealt here: one jump per bound, as the scheduler's), the most overdue first; else by
//!   priority in the round's order (the scheduler's, taken before the fetch), then fetch order;
//! - unless **affinity** (`affinity_passes`) finds a job of that same priority more like the
//!   last group dealt: the same batch, else the last LoRA set, else the same size, with a group
//!   no smaller. It leads instead, and the job it passed over counts a pass; one passed over
//!   `affinity_passes` times leads. So a batch, set or size keeps the card for at most that many
//!   more groups while an older job of another waits first in line. Renders in a row then keep
//!   what the card has warm: a LoRA set on the device and the convolution plans of a size
//!   (ONNX Runtime's CUDA `Conv` plans again at every change of shape; what either switch costs
//!   on the H200: deploy/gpu/RESULTS.md);
//! - its **partners**, up to `batch_jobs - 1`, wait with the same LoRAs, size, steps and
//!   guidance, in the same order (never a second delivery of a job already in the group);
//! - each job counts against its class's room in the round's admission: a job whose class does
//!   not fit now waits, and leads no group.
//!
//! What it must not break:
//! - **Priorities.** A p0 job fetched this round leads before a p1 or p2 fetched earlier. A p1
//!   or p2 job waits in the stream until the scheduler polls its priority (its bound), then here
//!   until its priority is overdue again (the bound once more), then one render: about twice
//!   its bound at most, with room for its class. Affinity reorders jobs of one priority only,
//!   never passes an overdue job, and passes the first in line `affinity_passes` times at most:
//!   a job waits at most `affinity_passes` groups more than in arrival order for itself and for
//!   each job in line before it.
//! - **The ack clock.** Every waiting job is kept alive (in-progress acks) from its fetch; its
//!   keep-alive goes on with it into the slot (`Kept`), so no gap opens at the hand-over.
//! - **The fleet.** The lookahead is fetched only while the server reported at least
//!   `lookahead` more jobs waiting on a consumer fetched from: jobs of a short queue are not
//!   held away from idle workers. At the end of a queue (`drained`) what waits beyond each
//!   slot's next group goes back when the fleet says another worker is idle (tail.rs).
//! - **The card.** Looked at in each round with a free slot: a job whose class the card cannot
//!   start (not in the round's admission) goes back (nak) at once when the worker is idle after
//!   its one arena shrink (another process took the memory); else once it has been found so
//!   for 30 s on end, if it has deliveries to spare, and for `job_time_limit` in any case.
//! - **Stops.** On shutdown or a fault the whole reserve is given back at once.
//! - **Cancellation.** A waiting job cancelled meanwhile is settled by its outcome when it is
//!   dealt (job.rs), without rendering.

use std::cmp::Reverse;
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use shotfleet_schema::encoding::decode_job;
use shotfleet_schema::subject::{Priority, SubjectClass};
use shotfleet_schema::MemoryClass;

use crate::budget::Admission;
use crate::config::PriorityConfig;
use crate::telemetry;
use crate::worker::delivery::{Delivery, Kept, Origin};
use crate::worker::group::Batch;
use crate::worker::render::spares_deliveries;

/// How long a job whose class the card cannot start may wait here, found so in every round,
/// while the worker renders something else: long enough for renders to end and give their
/// memory back (a 1024² group of four takes seconds on an H200), short enough that a roomier
/// worker gets it soon.
pub(crate) const UNSTARTABLE_HOLD: Duration = Duration::from_secs(30);

/// What jobs sharing UNet batches need alike, by the LoRAs (names and weights) they name.
pub(crate) type BatchKey = Batch<Vec<(String, u32)>>;

/// What dealing looks at of a waiting job.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Candidate {
    pub priority: Priority,
    /// The class whose room it takes (its consumer's); `None` (an `auto` subject) never waits
    /// here, it is routed.
    pub class: Option<MemoryClass>,
    /// `None` for a payload that does not decode: it is dealt alone, and failed as invalid
    /// when taken.
    pub batch: Option<BatchKey>,
    /// `project/job_id`: two deliveries of one job never share a group.
    pub job: Option<String>,
    /// When it was fetched: its priority's bound counts from there.
    pub since: Instant,
    /// How many times a group more like the last one was dealt ahead of it while it was first
    /// in line (affinity).
    pub passed: u32,
}

impl Candidate {
    fn of(delivery: &Delivery, since: Instant) -> Self {
        let class = match delivery.origin.class {
            SubjectClass::Class(class) => Some(class),
            SubjectClass::Auto => None,
        };
        let job = decode_job(delivery.content_type().as_deref(), &delivery.message.payload).ok();
        let batch = job.as_ref().map(|job| BatchKey::of(job, job.lora_set()));
        let job = job.map(|job| job.key());
        Self { priority: delivery.origin.priority, class, batch, job, since, passed: 0 }
    }
}

/// A fetched job waiting for a slot, kept alive meanwhile.
struct Waiting {
    kept: Kept,
    candidate: Candidate,
    /// Since when every round found that the card cannot start it (`None`: it could, last time).
    unstartable_since: Option<Instant>,
    _counted: telemetry::Reserved,
}

/// One round of dealing: its priority order, its clock, and the room its admission gives.
#[derive(Clone)]
pub(crate) struct Round {
    order: Vec<Priority>,
    now: Instant,
    room: HashMap<MemoryClass, u32>,
}

impl Round {
    /// `order` is the scheduler's for this round, taken before the fetch marks priorities
    /// served (an overdue priority leads); `admission` says how many jobs of each class can
    /// start now.
    pub fn new(order: Vec<Priority>, admission: &Admission) -> Self {
        Self { order, now: Instant::now(), room: admission.fits.iter().copied().collect() }
    }

    /// A round in strict priority order with room for every job: what would be dealt next
    /// whatever the card holds.
    fn unbounded() -> Self {
        let room = MemoryClass::ALL.iter().map(|&class| (class, u32::MAX)).collect();
        Self { order: Priority::ALL.to_vec(), now: Instant::now(), room }
    }

    fn fits(&self, candidate: &Candidate) -> bool {
        candidate.class.is_some_and(|class| self.room.get(&class).is_some_and(|&n| n > 0))
    }

    fn take_room(&mut self, candidate: &Candidate) {
        if let Some(n) = candidate.class.and_then(|class| self.room.get_mut(&class)) {
            *n = n.saturating_sub(1);
        }
    }

    fn rank(&self, priority: Priority) -> usize {
        self.order.iter().position(|&p| p == priority).unwrap_or(self.order.len())
    }

    /// How many jobs the card has room for this round, over its classes.
    fn room_total(&self) -> usize {
        self.room.values().map(|&n| n as usize).sum()
    }
}

/// The jobs fetched and not yet dealt to a slot, in fetch order.
pub(crate) struct Reserve {
    waiting: Vec<Waiting>,
    /// Jobs fetched beyond `batch_jobs` per free slot while the queue is deep.
    lookahead: usize,
    /// Whether the last fetch saw at least `lookahead` jobs waiting behind it.
    deep: bool,
    /// Whether the last fetch saw none behind it (or brought none): the queue is drained for
    /// every worker, and what waits here is all there is.
    drained: bool,
    keep_alive: Option<Duration>,
    clock: Clock,
    affinity: Affinity,
    /// The longest a job the card cannot start waits here (`job_time_limit`), spare deliveries
    /// or not.
    hold_limit: Duration,
}

impl Reserve {
    /// `affinity_passes`: how many times a job may be passed over for one more like the last
    /// group dealt (0: never).
    pub fn new(lookahead: usize, affinity_passes: u32, keep_alive: Option<Duration>, priorities: &PriorityConfig, hold_limit: Duration) -> Self {
        let affinity = Affinity::new(affinity_passes);
        Self { waiting: Vec::new(), lookahead, deep: false, drained: false, keep_alive, clock: Clock::new(priorities), affinity, hold_limit }
    }

    /// How many jobs to fetch in `round` for `free` slots of `per_slot` jobs each: up to the
    /// reserve's size, and one a free slot the card has room for at least, so that a new job of
    /// a higher priority than those waiting is seen this round.
    pub fn wanted(&self, free: usize, per_slot: usize, round: &Round) -> usize {
        let lookahead = if self.deep { self.lookahead } else { 0 };
        to_fetch(self.waiting.len(), free, per_slot, lookahead, round.room_total())
    }

    /// Adds what a fetch brought, and learns from it whether the queue is deep.
    pub fn add(&mut self, fetched: Vec<Delivery>) {
        let behind = behind(fetched.iter().map(|delivery| (delivery.origin, delivery.pending)));
        self.deep = self.lookahead > 0 && behind >= self.lookahead as u64;
        self.drained = behind == 0;
        let now = Instant::now();
        for delivery in fetched {
            let candidate = Candidate::of(&delivery, now);
            let kept = Kept::start(delivery, self.keep_alive);
            self.waiting.push(Waiting { kept, candidate, unstartable_since: None, _counted: telemetry::reserved() });
        }
    }

    /// Deals one slot's group of at most `per_slot` jobs, its lead first (none when nothing
    /// waiting can start), taking its room from the round's.
    pub fn deal(&mut self, per_slot: usize, round: &mut Round) -> Vec<Kept> {
        let before = self.affinity.size();
        let taken = deal_from(&mut self.waiting, |waiting| &mut waiting.candidate, per_slot, &mut self.clock, &mut self.affinity, round);
        if before.is_some() && self.affinity.size() != before {
            telemetry::size_switch();
        }
        let mut group: Vec<Kept> = taken.into_iter().map(|waiting| waiting.kept).collect();
        for kept in &mut group {
            // The wait a result reports is up to its render: in the stream and in this reserve.
            kept.delivery.queued = SystemTime::now().duration_since(kept.delivery.queued_since).unwrap_or_default();
        }
        group
    }

    /// Looks at what the card cannot start now (its class not in `admission`; `None`: the card
    /// could not be read) and gives back what `goes_back` says: other workers may hold it.
    /// `idle`: nothing runs here that could end and make room.
    pub async fn give_back_unstartable(&mut self, admission: Option<&Admission>, idle: bool, max_deliver: u64) {
        let now = Instant::now();
        let startable = |candidate: &Candidate| {
            admission.is_some_and(|admission| candidate.class.is_some_and(|class| admission.jobs(class) > 0))
        };
        for waiting in &mut self.waiting {
            waiting.unstartable_since = if startable(&waiting.candidate) { None } else { Some(waiting.unstartable_since.unwrap_or(now)) };
        }
        let hold_limit = self.hold_limit;
        let (back, keep): (Vec<Waiting>, Vec<Waiting>) = self.waiting.drain(..).partition(|waiting| {
            let unstartable_for = waiting.unstartable_since.map(|since| now.saturating_duration_since(since));
            goes_back(unstartable_for, idle, spares_deliveries(waiting.kept.delivery.attempt, max_deliver), hold_limit)
        });
        self.waiting = keep;
        if !back.is_empty() {
            tracing::info!(jobs = back.len(), idle, "giving back jobs fetched ahead that this card cannot start now");
            give_back(back).await;
        }
    }

    /// Whether the queue behind this reserve is drained and it holds jobs beyond the next group
    /// of each of `slots` slots of `per_slot` jobs that may go back: what another worker could
    /// render now.
    pub fn holds_beyond_next_groups(&self, slots: usize, per_slot: usize) -> bool {
        self.drained && self.beyond_next_groups(slots, per_slot).next().is_some()
    }

    /// Gives back to the stream what waits beyond the next group of each of `slots` slots (as
    /// `deal` would pick them now, with room for all), of the classes `wanted` names: an idle
    /// worker elsewhere admits them, and fetches them at its next poll. How many.
    pub async fn give_back_beyond_next_groups(&mut self, slots: usize, per_slot: usize, wanted: impl Fn(MemoryClass) -> bool) -> usize {
        let back: Vec<usize> = self.beyond_next_groups(slots, per_slot).filter(|&i| self.waiting[i].candidate.class.is_some_and(&wanted)).collect();
        let count = back.len();
        give_back(take_picked(&mut self.waiting, &back)).await;
        count
    }

    /// The waiting jobs beyond the next groups that may go back: only a job on its first
    /// delivery, so a job passes from worker to worker so once at most (each pass is a delivery).
    fn beyond_next_groups(&self, slots: usize, per_slot: usize) -> impl Iterator<Item = usize> + '_ {
        let candidates: Vec<Candidate> = self.waiting.iter().map(|waiting| waiting.candidate.clone()).collect();
        beyond_next_groups(candidates, slots, per_slot, &self.clock, &self.affinity)
            .into_iter()
            .filter(|&i| self.waiting[i].kept.delivery.attempt <= 1)
    }

    /// Gives every waiting job back to the stream at once, for any worker to take: the worker
    /// stops.
    pub async fn give_back_all(&mut self) {
        if !self.waiting.is_empty() {
            tracing::info!(jobs = self.waiting.len(), "giving back the jobs fetched ahead");
        }
        give_back(self.waiting.drain(..).collect()).await;
        self.deep = false;
    }
}

/// Indices into `waiting` of the jobs left after `slots` groups of `per_slot` dealt now (as
/// `deal_from` deals, on copies of the clock and affinity) in strict priority order, with room
/// for every job.
fn beyond_next_groups(waiting: Vec<Candidate>, slots: usize, per_slot: usize, clock: &Clock, affinity: &Affinity) -> Vec<usize> {
    let mut left: Vec<(usize, Candidate)> = waiting.into_iter().enumerate().collect();
    let (mut clock, mut affinity, mut round) = (clock.clone(), affinity.clone(), Round::unbounded());
    for _ in 0..slots {
        if deal_from(&mut left, |(_, candidate)| candidate, per_slot, &mut clock, &mut affinity, &mut round).is_empty() {
            break;
        }
    }
    left.into_iter().map(|(i, _)| i).collect()
}

/// How many jobs wait behind a fetch, from each delivery's origin and `pending`: per consumer
/// the last delivery's count (an earlier one's counts the rest of the fetch too), the most of
/// those.
fn behind(deliveries: impl Iterator<Item = (Origin, u64)>) -> u64 {
    let mut last: Vec<(Origin, u64)> = Vec::new();
    for (origin, pending) in deliveries {
        match last.iter_mut().find(|(o, _)| *o == origin) {
            Some((_, least)) => *least = (*least).min(pending),
            None => last.push((origin, pending)),
        }
    }
    last.into_iter().map(|(_, pending)| pending).max().unwrap_or(0)
}

/// See `Reserve::wanted`; `lookahead` is 0 while the queue is not deep, `room` the jobs the
/// card has room for this round.
fn to_fetch(waiting: usize, free: usize, per_slot: usize, lookahead: usize, room: usize) -> usize {
    (free * per_slot + lookahead).saturating_sub(waiting).max(free.min(room))
}

/// Whether a waiting job goes back to the stream, given how long every round has found that the
/// card cannot start it (`None`: it can): at once when the worker is `idle`; else after
/// `UNSTARTABLE_HOLD` if it `spares` deliveries (a job past half its `max_deliver` waits for
/// room here, as a taken job does), and after `hold_limit` in any case.
fn goes_back(unstartable_for: Option<Duration>, idle: bool, spares: bool, hold_limit: Duration) -> bool {
    match unstartable_for {
        None => false,
        Some(_) if idle => true,
        Some(waited) => (spares && waited >= UNSTARTABLE_HOLD) || waited >= hold_limit,
    }
}

async fn give_back(waiting: Vec<Waiting>) {
    for waiting in waiting {
        // The keep-alive first: an in-progress ack after the nak would hold the job back.
        let (delivery, alive, _in_flight) = waiting.kept.into_parts();
        drop(alive);
        delivery.nak(None).await;
    }
}

/// When each priority's jobs are overdue here: their `[priorities]` bound passed since the job
/// was fetched and since a job of its priority was last dealt (one jump per bound, as the
/// scheduler's).
#[derive(Clone)]
struct Clock {
    /// Each priority's bound, by rank.
    bounds: [Option<Duration>; 3],
    /// When a job of each priority was last dealt, by rank.
    last_dealt: [Option<Instant>; 3],
}

impl Clock {
    fn new(priorities: &PriorityConfig) -> Self {
        Self { bounds: [Priority::P0, Priority::P1, Priority::P2].map(|p| priorities.max_wait(p)), last_dealt: [None; 3] }
    }

    /// By how much `candidate` is overdue at `now` (`None`: not overdue).
    fn overdue(&self, candidate: &Candidate, now: Instant) -> Option<Duration> {
        let rank = candidate.priority.rank();
        let from = self.last_dealt[rank].map_or(candidate.since, |dealt| dealt.max(candidate.since));
        self.bounds[rank].and_then(|bound| now.saturating_duration_since(from).checked_sub(bound))
    }
}

/// What the card has warm from the groups dealt here, and how often a job may be passed over
/// for a lead more like it.
#[derive(Clone, Default)]
struct Affinity {
    /// The last group's batch.
    batch: Option<BatchKey>,
    /// The last LoRA set dealt (not none: a group without LoRAs leaves the set on the device).
    set: Option<Vec<(String, u32)>>,
    /// The last group's jobs (`project/job_id`): another delivery of one of them is not alike.
    jobs: Vec<String>,
    passes: u32,
}

impl Affinity {
    fn new(passes: u32) -> Self {
        Self { passes, ..Self::default() }
    }

    /// The last group's size.
    fn size(&self) -> Option<(u32, u32)> {
        self.batch.as_ref().map(|batch| (batch.width, batch.height))
    }

    /// How like what the card has warm `candidate` is, best first: the last group's batch, the
    /// last LoRA set, the last group's size; `None`: unlike it (or a second delivery of a job of
    /// the last group, which is no reason to jump the line).
    fn likeness(&self, candidate: &Candidate) -> Option<u8> {
        let batch = candidate.batch.as_ref()?;
        if candidate.job.as_ref().is_some_and(|job| self.jobs.contains(job)) {
            None
        } else if self.batch.as_ref() == Some(batch) {
            Some(0)
        } else if !batch.set.is_empty() && self.set.as_ref() == Some(&batch.set) {
            Some(1)
        } else if self.size() == Some((batch.width, batch.height)) {
            Some(2)
        } else {
            None
        }
    }

    /// Remembers a group dealt: `lead` and the jobs of its group.
    fn dealt(&mut self, lead: &Candidate, jobs: Vec<String>) {
        let Some(batch) = lead.batch.clone() else { return };
        if !batch.set.is_empty() {
            self.set = Some(batch.set.clone());
        }
        self.batch = Some(batch);
        self.jobs = jobs;
    }
}

/// Takes one slot's group out of `waiting` (see `pick_group`), its lead first: restarts the
/// clock of each priority it holds, counts a pass for the job it passed over, and remembers
/// the group for affinity.
fn deal_from<T>(
    waiting: &mut Vec<T>,
    candidate: impl Fn(&mut T) -> &mut Candidate,
    per_slot: usize,
    clock: &mut Clock,
    affinity: &mut Affinity,
    round: &mut Round,
) -> Vec<T> {
    let now = round.now;
    let picked = {
        let candidates: Vec<&Candidate> = waiting.iter_mut().map(|item| &*candidate(item)).collect();
        pick_group(&candidates, per_slot, |c| clock.overdue(c, now), affinity, round)
    };
    if let Some(i) = picked.passed {
        candidate(&mut waiting[i]).passed += 1;
    }
    let mut taken = take_picked(waiting, &picked.group);
    for item in &mut taken {
        clock.last_dealt[candidate(item).priority.rank()] = Some(now);
    }
    let jobs = taken.iter_mut().filter_map(|item| candidate(item).job.clone()).collect();
    if let Some(lead) = taken.first_mut() {
        affinity.dealt(candidate(lead), jobs);
    }
    taken
}

/// Takes the items at `picked` (distinct indices) out of `items`, in the order of `picked`.
fn take_picked<T>(items: &mut Vec<T>, picked: &[usize]) -> Vec<T> {
    let mut from_the_back = picked.to_vec();
    // Removed from the back, so the indices left stay valid.
    from_the_back.sort_unstable_by(|a, b| b.cmp(a));
    let mut taken: HashMap<usize, T> = from_the_back.into_iter().map(|i| (i, items.remove(i))).collect();
    picked.iter().map(|i| taken.remove(i).expect("each index picked once")).collect()
}

/// One slot's group, as indices into the waiting jobs: its lead first; and the job that would
/// have led it, where affinity passed it over.
struct Picked {
    group: Vec<usize>,
    passed: Option<usize>,
}

/// Picks one slot's group from `waiting` (in fetch order), taking its room from the round's.
///
/// The queue: overdue jobs (by how much, `overdue`) first, most overdue first, then by
/// priority in the round's order, then by place. Its first job that can start (the plain lead)
/// leads, unless it is not overdue, has been passed over fewer than `affinity.passes` times,
/// and a later job of its priority is more like the last group (`Affinity::likeness`) with a
/// group no smaller: the most alike of those leads, the first of them in the queue. The
/// partners: up to `per_slot - 1` that can start and share the lead's batches, in queue order.
fn pick_group(
    waiting: &[&Candidate],
    per_slot: usize,
    overdue: impl Fn(&Candidate) -> Option<Duration>,
    affinity: &Affinity,
    round: &mut Round,
) -> Picked {
    let mut queue: Vec<usize> = (0..waiting.len()).collect();
    let overdue: Vec<Option<Duration>> = waiting.iter().map(|c| overdue(c)).collect();
    // Stable: ties keep fetch order.
    queue.sort_by_key(|&i| match overdue[i] {
        Some(by) => (0, Reverse(by), 0),
        None => (1, Reverse(Duration::ZERO), round.rank(waiting[i].priority)),
    });
    let Some(first) = queue.iter().position(|&i| round.fits(waiting[i])) else {
        return Picked { group: Vec::new(), passed: None };
    };
    let plain = queue[first];
    let plain_group = group_for(plain, &queue, waiting, per_slot, &mut round.clone());
    let alike = if overdue[plain].is_none() && waiting[plain].passed < affinity.passes {
        alike_lead(&queue[first..], plain_group.len(), waiting, per_slot, affinity, round)
    } else {
        None
    };
    let (group, passed) = match alike {
        // A lead more alike has another batch than the plain lead's: the plain lead is not in its group.
        Some(group) => (group, Some(plain)),
        None => (plain_group, None),
    };
    for &i in &group {
        round.take_room(waiting[i]);
    }
    Picked { group, passed }
}

/// The group of the job after the plain lead (`line[0]`), of its priority, most like what the
/// card has warm and more than the plain lead, whose group is no smaller than `plain_len`; the
/// first of those in line. `None`: the plain lead leads.
fn alike_lead(line: &[usize], plain_len: usize, waiting: &[&Candidate], per_slot: usize, affinity: &Affinity, round: &Round) -> Option<Vec<usize>> {
    let plain = waiting[line[0]];
    let mut best = (affinity.likeness(plain), None);
    // Overdue jobs sort first, so none after a plain lead that is not.
    for &i in line[1..].iter().take_while(|&&i| waiting[i].priority == plain.priority) {
        let Some(likeness) = affinity.likeness(waiting[i]) else { continue };
        if best.0.is_some_and(|best| best <= likeness) || !round.fits(waiting[i]) {
            continue;
        }
        let group = group_for(i, line, waiting, per_slot, &mut round.clone());
        if group.len() >= plain_len {
            best = (Some(likeness), Some(group));
        }
    }
    best.1
}

/// The group `lead` would lead: itself, then up to `per_slot - 1` from `queue` (in its order)
/// that share its batches, that the round (`room`, spent as they join) has room for, and that
/// are not a second delivery of a job already in it. A payload that does not decode goes alone.
fn group_for(lead: usize, queue: &[usize], waiting: &[&Candidate], per_slot: usize, room: &mut Round) -> Vec<usize> {
    room.take_room(waiting[lead]);
    let mut group = vec![lead];
    let Some(batch) = waiting[lead].batch.as_ref() else { return group };
    for &i in queue {
        if group.len() == per_slot.max(1) {
            break;
        }
        let candidate = waiting[i];
        let second_delivery = candidate.job.is_some() && group.iter().any(|&member| waiting[member].job == candidate.job);
        if i != lead && candidate.batch.as_ref() == Some(batch) && !second_delivery && room.fits(candidate) {
            room.take_room(candidate);
            group.push(i);
        }
    }
    group
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRICT: [Priority; 3] = [Priority::P0, Priority::P1, Priority::P2];

    /// A round's clock an hour ahead, so that jobs can have been fetched minutes before it.
    fn later() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// A waiting job of `priority` at a square `size` (0: a payload that does not decode),
    /// fetched `ago` seconds before `now`; `id` names it.
    fn waited(id: u32, priority: Priority, size: u32, ago: u64, now: Instant) -> Candidate {
        let batch = (size > 0).then(|| key(size, ""));
        let job = (size > 0).then(|| format!("board/{id}"));
        Candidate { priority, class: Some(MemoryClass::M), batch, job, since: now - Duration::from_secs(ago), passed: 0 }
    }

    fn job(id: u32, priority: Priority, size: u32, now: Instant) -> Candidate {
        waited(id, priority, size, 0, now)
    }

    fn round(order: &[Priority], jobs: u32, now: Instant) -> Round {
        Round { order: order.to_vec(), now, room: HashMap::from([(MemoryClass::M, jobs)]) }
    }

    /// `[priorities]`'s defaults: p1 20 s, p2 60 s.
    fn clock() -> Clock {
        Clock::new(&PriorityConfig::default())
    }

    /// Deals up to `slots` groups from `waiting` in one round, with the default affinity and no
    /// group dealt before; each group as its jobs' ids (0 for a payload that does not decode).
    fn deal(mut waiting: Vec<Candidate>, slots: usize, per_slot: usize, clock: &mut Clock, round: &mut Round) -> Vec<Vec<u32>> {
        deal_alike(&mut waiting, slots, per_slot, clock, &mut affinity(2, None), round)
    }

    /// `deal` with the `affinity` given; what is not dealt stays in `waiting`.
    fn deal_alike(waiting: &mut Vec<Candidate>, slots: usize, per_slot: usize, clock: &mut Clock, affinity: &mut Affinity, round: &mut Round) -> Vec<Vec<u32>> {
        let id = |c: &Candidate| c.job.as_ref().map_or(0, |job| job.rsplit('/').next().unwrap().parse().unwrap());
        (0..slots)
            .map(|_| deal_from(waiting, |c| c, per_slot, clock, affinity, round).iter().map(id).collect::<Vec<u32>>())
            .take_while(|group| !group.is_empty())
            .collect()
    }

    /// Affinity after a group of `last` (a square size and a LoRA set; `None`: no group yet).
    fn affinity(passes: u32, last: Option<(u32, &str)>) -> Affinity {
        let mut affinity = Affinity::new(passes);
        if let Some((size, set)) = last {
            affinity.dealt(&with_set(0, size, set, Instant::now()), Vec::new());
        }
        affinity
    }

    /// The batch of a square `size` at 30 steps, guidance 5, with the LoRA `set` at 1.0 ("": none).
    fn key(size: u32, set: &str) -> BatchKey {
        let set = if set.is_empty() { Vec::new() } else { vec![(set.to_string(), 1.0f32.to_bits())] };
        BatchKey { set, width: size, height: size, steps: 30, guidance_bits: 5.0f32.to_bits() }
    }

    #[test]
    fn a_slot_is_dealt_its_leads_batch_partners_from_the_whole_reserve() {
        use Priority::P1;
        let now = later();
        // A storyboard's interleaved sizes: the lead (1024) finds its partners further back.
        let sizes = [1024, 1152, 896, 1024, 1152, 1024, 1024, 1024];
        let waiting = sizes.iter().enumerate().map(|(i, &size)| job(i as u32 + 1, P1, size, now)).collect();
        assert_eq!(deal(waiting, 2, 4, &mut clock(), &mut round(&STRICT, 8, now)), [vec![1, 4, 6, 7], vec![2, 5]]);
    }

    #[test]
    fn a_new_higher_priority_leads_before_older_lower_ones_and_an_overdue_priority_before_all() {
        use Priority::{P0, P1, P2};
        let now = later();
        // Two p2 fetched earlier, then a p0 of another size.
        let waiting = || vec![waited(1, P2, 1024, 10, now), waited(2, P2, 1024, 10, now), job(3, P0, 896, now)];
        assert_eq!(deal(waiting(), 1, 4, &mut clock(), &mut round(&STRICT, 8, now)), [vec![3]]);
        // The scheduler says p2 is overdue: p2 leads, and the p0 waits for the next slot.
        assert_eq!(deal(waiting(), 1, 4, &mut clock(), &mut round(&[P2, P0, P1], 8, now)), [vec![1, 2]]);
    }

    #[test]
    fn a_priority_overdue_here_leads_once_per_bound_whatever_the_scheduler_says() {
        use Priority::{P0, P1, P2};
        let now = later();
        // Under a stream of p0 jobs the scheduler keeps strict order (p2's queue is empty: its
        // jobs are here). The p2 jobs fetched 61 s ago are past p2's 60 s, the p1 one 25 s ago
        // past p1's 20 s by more: the p1 leads, then one p2, then the p0s; the second p2 waits
        // for the next bound, counted from the first one's deal.
        let waiting = vec![
            waited(1, P2, 1024, 61, now),
            waited(2, P1, 896, 25, now),
            waited(5, P2, 1152, 61, now),
            job(3, P0, 640, now),
            job(4, P0, 640, now),
        ];
        let mut clock = clock();
        assert_eq!(deal(waiting, 5, 1, &mut clock, &mut round(&STRICT, 8, now)), [vec![2], vec![1], vec![3], vec![4], vec![5]]);
        // Within their bounds they wait behind the p0s.
        let waiting = vec![waited(1, P2, 1024, 59, now), waited(2, P1, 896, 19, now), job(3, P0, 1152, now)];
        assert_eq!(deal(waiting, 3, 1, &mut Clock::new(&PriorityConfig::default()), &mut round(&STRICT, 8, now)), [vec![3], vec![2], vec![1]]);
    }

    #[test]
    fn partners_of_higher_priority_come_first() {
        use Priority::{P0, P1, P2};
        let now = later();
        let waiting = vec![job(1, P1, 1024, now), job(2, P2, 1024, now), job(3, P2, 1024, now), job(4, P0, 896, now), job(5, P1, 1024, now)];
        assert_eq!(deal(waiting, 1, 3, &mut clock(), &mut round(&[P1, P0, P2], 8, now)), [vec![1, 5, 2]]);
    }

    #[test]
    fn a_group_takes_no_more_than_its_class_has_room_for_and_a_class_without_room_waits() {
        use Priority::P1;
        let now = later();
        let waiting = vec![job(1, P1, 1024, now), job(2, P1, 1024, now), job(3, P1, 1024, now)];
        assert_eq!(deal(waiting.clone(), 2, 4, &mut clock(), &mut round(&STRICT, 2, now)), [vec![1, 2]], "two fit; the third waits");
        let mut other_class = Round { order: STRICT.to_vec(), now, room: HashMap::from([(MemoryClass::S, 4)]) };
        assert!(deal(waiting, 1, 4, &mut clock(), &mut other_class).is_empty());
    }

    #[test]
    fn a_payload_that_does_not_decode_goes_alone_in_its_place() {
        use Priority::P1;
        let now = later();
        let waiting = vec![job(1, P1, 0, now), job(2, P1, 1024, now), job(3, P1, 0, now), job(4, P1, 1024, now)];
        assert_eq!(deal(waiting, 3, 4, &mut clock(), &mut round(&STRICT, 8, now)), [vec![0], vec![2, 4], vec![0]]);
    }

    #[test]
    fn two_deliveries_of_one_job_never_share_a_group() {
        use Priority::P1;
        let now = later();
        // Job 1 published twice (two messages), then job 2 of the same size.
        let waiting = vec![job(1, P1, 1024, now), job(1, P1, 1024, now), job(2, P1, 1024, now)];
        assert_eq!(deal(waiting, 2, 4, &mut clock(), &mut round(&STRICT, 8, now)), [vec![1, 2], vec![1]]);
    }

    #[test]
    fn one_job_per_slot_without_batching_keeps_priority_then_fetch_order_or_the_last_size() {
        use Priority::{P0, P1};
        let now = later();
        let waiting = vec![job(1, P1, 1024, now), job(2, P1, 896, now), job(3, P0, 1152, now), job(4, P1, 1024, now)];
        let mut off = affinity(0, None);
        assert_eq!(deal_alike(&mut waiting.clone(), 4, 1, &mut clock(), &mut off, &mut round(&STRICT, 8, now)), [vec![3], vec![1], vec![2], vec![4]]);
        // With affinity the second 1024 passes the 896 once.
        assert_eq!(deal(waiting, 4, 1, &mut clock(), &mut round(&STRICT, 8, now)), [vec![3], vec![1], vec![4], vec![2]]);
    }

    /// A waiting p1 job of a square `size` with the LoRA `set` ("": none).
    fn with_set(id: u32, size: u32, set: &str, now: Instant) -> Candidate {
        Candidate { batch: Some(key(size, set)), ..job(id, Priority::P1, size, now) }
    }

    #[test]
    fn a_lead_like_the_last_group_comes_first_when_its_group_is_no_smaller() {
        use Priority::P1;
        let now = later();
        let waiting = || vec![job(1, P1, 896, now), job(2, P1, 896, now), job(3, P1, 1024, now), job(4, P1, 1024, now), job(5, P1, 1152, now)];
        // After a 1024 group the 1024 pair leads: a pair like the plain lead's.
        let mut alike = affinity(2, Some((1024, "")));
        assert_eq!(deal_alike(&mut waiting(), 3, 4, &mut clock(), &mut alike, &mut round(&STRICT, 8, now)), [vec![3, 4], vec![1, 2], vec![5]]);
        // Not for a smaller group: one 1152 does not pass the 896 pair.
        let mut alike = affinity(2, Some((1152, "")));
        assert_eq!(deal_alike(&mut waiting(), 1, 4, &mut clock(), &mut alike, &mut round(&STRICT, 8, now)), [vec![1, 2]]);
        // Off: arrival order.
        let mut off = affinity(0, Some((1024, "")));
        assert_eq!(deal_alike(&mut waiting(), 1, 4, &mut clock(), &mut off, &mut round(&STRICT, 8, now)), [vec![1, 2]]);
        // One slot a job: the groups are alike in size, so the last group's size runs on.
        let mut alike = affinity(2, Some((1152, "")));
        assert_eq!(deal_alike(&mut waiting(), 5, 1, &mut clock(), &mut alike, &mut round(&STRICT, 8, now)), [vec![5], vec![1], vec![2], vec![3], vec![4]]);
    }

    #[test]
    fn the_same_batch_comes_before_the_same_set_and_the_same_set_before_the_same_size() {
        let now = later();
        let waiting = || vec![with_set(1, 896, "", now), with_set(2, 1024, "", now), with_set(3, 896, "kai", now), with_set(4, 1024, "kai", now)];
        let lead = |last| deal_alike(&mut waiting(), 1, 1, &mut clock(), &mut affinity(2, Some(last)), &mut round(&STRICT, 8, now))[0][0];
        assert_eq!(lead((1024, "kai")), 4, "the same batch");
        assert_eq!(lead((640, "kai")), 3, "the same set, first of two");
        assert_eq!(lead((1024, "mei")), 2, "the same size, first of two");
        // Jobs without LoRAs share no set to keep: the size decides.
        assert_eq!(lead((1024, "")), 2);
    }

    #[test]
    fn a_set_stays_warm_across_a_group_without_loras_and_no_set_is_not_a_set() {
        let now = later();
        // kai at 640, then a group without LoRAs at 896: kai is still on the device.
        let mut alike = affinity(2, Some((640, "kai")));
        alike.dealt(&with_set(0, 896, "", now), Vec::new());
        let mut waiting = vec![with_set(1, 896, "mei", now), with_set(2, 1024, "kai", now)];
        assert_eq!(deal_alike(&mut waiting, 1, 1, &mut clock(), &mut alike, &mut round(&STRICT, 8, now)), [vec![2]]);
        // After jobs without LoRAs, one without at another size is not alike.
        let mut waiting = vec![with_set(1, 896, "kai", now), with_set(2, 1024, "", now)];
        let dealt = deal_alike(&mut waiting, 1, 1, &mut clock(), &mut affinity(2, Some((640, ""))), &mut round(&STRICT, 8, now));
        assert_eq!(dealt, [vec![1]]);
    }

    #[test]
    fn another_delivery_of_a_job_just_dealt_does_not_jump_the_line() {
        use Priority::P1;
        let now = later();
        let mut alike = affinity(2, None);
        alike.dealt(&job(7, P1, 1024, now), vec!["board/7".into()]);
        let mut waiting = vec![job(1, P1, 896, now), job(7, P1, 1024, now)];
        assert_eq!(deal_alike(&mut waiting, 2, 1, &mut clock(), &mut alike, &mut round(&STRICT, 8, now)), [vec![1], vec![7]]);
    }

    #[test]
    fn an_alike_group_takes_only_the_room_there_is() {
        use Priority::P1;
        let now = later();
        let mut waiting = vec![job(1, P1, 896, now), job(2, P1, 1024, now), job(3, P1, 1024, now), job(4, P1, 1024, now)];
        let mut alike = affinity(2, Some((1024, "")));
        // Room for two: the 1024 pair leads (no smaller than the 896 alone), the rest waits.
        assert_eq!(deal_alike(&mut waiting, 2, 4, &mut clock(), &mut alike, &mut round(&STRICT, 2, now)), [vec![2, 3]]);
        assert_eq!(waiting.len(), 2);
    }

    /// p1 jobs of square `sizes` (ids from 1) dealt one a slot after a 1024 group, `passes` each.
    fn singles_after_1024(passes: u32, sizes: &[u32]) -> Vec<Vec<u32>> {
        let now = later();
        let mut waiting = sizes.iter().zip(1..).map(|(&size, id)| job(id, Priority::P1, size, now)).collect();
        deal_alike(&mut waiting, sizes.len(), 1, &mut clock(), &mut affinity(passes, Some((1024, ""))), &mut round(&STRICT, 8, now))
    }

    #[test]
    fn a_job_is_passed_over_for_affinity_no_more_than_its_passes() {
        // An 896 job first, then a stream of 1024 jobs.
        let dealt = singles_after_1024(2, &[896, 1024, 1024, 1024, 1024]);
        assert_eq!(dealt, [vec![2], vec![3], vec![1], vec![4], vec![5]], "passed twice, then it leads");
    }

    #[test]
    fn a_pass_counts_against_the_first_in_line_only() {
        // One pass each: the 896 is passed for the 1024 and then leads; the 640, first in line
        // now, is passed once in turn, for the 896 like it.
        let dealt = singles_after_1024(1, &[896, 640, 1024, 896, 1024]);
        assert_eq!(dealt, [vec![3], vec![1], vec![4], vec![2], vec![5]]);
    }

    #[test]
    fn affinity_keeps_to_the_lead_priority_and_never_passes_an_overdue_job() {
        use Priority::{P0, P1, P2};
        let now = later();
        let alike = || affinity(2, Some((1024, "")));
        // A p0 of another size leads before a p1 like the last group.
        let waiting = vec![job(1, P1, 1024, now), job(2, P0, 896, now)];
        assert_eq!(deal_alike(&mut waiting.clone(), 2, 1, &mut clock(), &mut alike(), &mut round(&STRICT, 8, now)), [vec![2], vec![1]]);
        // A p2 past its bound leads before a p0 like the last group.
        let waiting = vec![waited(1, P2, 896, 61, now), job(2, P0, 1024, now)];
        assert_eq!(deal_alike(&mut waiting.clone(), 2, 1, &mut clock(), &mut alike(), &mut round(&STRICT, 8, now)), [vec![1], vec![2]]);
        // And a p1 past its bound before a p1 like the last group.
        let waiting = vec![waited(1, P1, 896, 25, now), job(2, P1, 1024, now)];
        assert_eq!(deal_alike(&mut waiting.clone(), 2, 1, &mut clock(), &mut alike(), &mut round(&STRICT, 8, now)), [vec![1], vec![2]]);
    }

    #[test]
    fn a_job_waiting_for_room_is_not_counted_as_passed_over() {
        use Priority::P1;
        let now = later();
        let mut alike = affinity(1, Some((1024, "")));
        // The plain lead (896) is passed once; the job of class L, which has no room, not at all.
        let mut waiting = vec![Candidate { class: Some(MemoryClass::L), ..job(1, P1, 1536, now) }, job(2, P1, 896, now), job(3, P1, 1024, now)];
        let dealt = deal_alike(&mut waiting, 1, 1, &mut clock(), &mut alike, &mut round(&STRICT, 8, now));
        assert_eq!(dealt, [vec![3]]);
        assert_eq!(waiting.iter().map(|c| c.passed).collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn beyond_the_next_groups_is_what_the_slots_would_not_take_next() {
        use Priority::{P0, P1};
        let now = later();
        let waiting = vec![job(1, P1, 1024, now), job(2, P1, 896, now), job(3, P0, 640, now), job(4, P1, 1024, now), job(5, P1, 896, now), job(6, P1, 1152, now)];
        let beyond = |slots, per_slot| beyond_next_groups(waiting.clone(), slots, per_slot, &clock(), &affinity(2, None));
        // Two slots of two: the p0 first (alone), then the 1024 pair; the 896 pair and the 1152 wait.
        assert_eq!(beyond(2, 2), [1, 4, 5]);
        // Three slots: the 896 pair as well.
        assert_eq!(beyond(3, 2), [5]);
        assert!(beyond(4, 2).is_empty());
        assert_eq!(beyond(0, 2).len(), 6);
        // As dealing counts passes: the 896 passed over once already leads the second slot.
        let waiting = vec![Candidate { passed: 1, ..job(1, P1, 896, now) }, job(2, P1, 1024, now), job(3, P1, 1024, now)];
        assert_eq!(beyond_next_groups(waiting, 2, 1, &clock(), &affinity(2, Some((1024, "")))), [2]);
    }

    #[test]
    fn behind_a_fetch_is_each_consumers_last_count_the_most_of_them() {
        let origin = |priority| Origin { priority, class: SubjectClass::Class(MemoryClass::M) };
        let (p0, p1) = (origin(Priority::P0), origin(Priority::P1));
        // Ten fetched from a consumer that had ten: the first says nine behind it, the last none.
        assert_eq!(behind((0..10).rev().map(|n| (p1, n))), 0);
        assert_eq!(behind([(p0, 0), (p1, 5), (p1, 4)].into_iter()), 4);
        assert_eq!(behind(std::iter::empty()), 0);
    }

    #[test]
    fn a_free_slot_fetches_even_with_a_full_reserve_as_far_as_the_card_has_room() {
        // (waiting, free slots, batch_jobs, lookahead while deep, room) -> jobs to fetch.
        assert_eq!(to_fetch(0, 2, 4, 0, 8), 8, "a shallow queue: batch_jobs per free slot");
        assert_eq!(to_fetch(3, 1, 4, 12, 8), 13, "a deep one: up to the lookahead more");
        assert_eq!(to_fetch(20, 1, 4, 12, 8), 1, "a full reserve still looks for one new job a free slot");
        assert_eq!(to_fetch(20, 2, 4, 12, 1), 1, "but not for more than the card has room for");
        assert_eq!(to_fetch(20, 0, 4, 12, 8), 0);
    }

    #[test]
    fn a_job_the_card_cannot_start_goes_back_when_idle_after_its_hold_with_deliveries_to_spare_or_after_the_limit() {
        let limit = Duration::from_secs(600);
        let secs = |s| Some(Duration::from_secs(s));
        assert!(!goes_back(None, true, true, limit), "one it can start stays");
        assert!(goes_back(secs(0), true, false, limit), "an idle worker gives back at once");
        assert!(!goes_back(secs(29), false, true, limit));
        assert!(goes_back(secs(30), false, true, limit), "busy: after 30 s found so");
        assert!(!goes_back(secs(300), false, false, limit), "past half its deliveries it waits for room");
        assert!(goes_back(secs(600), false, false, limit), "but not past job_time_limit");
    }
}
