//! The reserve: jobs fetched ahead of the free render slots, so that each slot is dealt jobs
//! that can share its UNet batches also on a queue of mixed sizes (a storyboard), not only
//! among the few fetched for it.
//!
//! Each round the fetch loop tops the reserve up to `batch_jobs` per free slot, plus
//! `lookahead` more while the queue is deep, and deals every free slot one group
//! ([`Reserve::deal`]):
//! - its **lead** is the waiting job that comes first: by priority in the round's order (the
//!   scheduler's, taken before the fetch, so an overdue priority leads), then in fetch order;
//! - its **partners**, up to `batch_jobs - 1`, wait with the same LoRAs, size, steps and
//!   guidance, higher priorities and older first;
//! - each job counts against its class's room in the round's admission: a job whose class does
//!   not fit now waits, and never leads.
//!
//! What it must not break:
//! - **Priorities.** A p0 job fetched this round leads before a p2 fetched earlier. A waiting
//!   job of a lower priority leads once the scheduler says its priority is overdue (the clock
//!   started when it was fetched), so it waits at most about that bound plus one render.
//! - **The ack clock.** Every waiting job is kept alive (in-progress acks) until it is dealt;
//!   the job's own keep-alive takes over from there (job.rs).
//! - **The fleet.** The lookahead is fetched only while the server reported at least as many
//!   jobs waiting behind the last one fetched: jobs of a short queue are not held away from
//!   idle workers. At the end of a queue a worker holds at most `lookahead` jobs the others
//!   could have had.
//! - **Stops and the card.** On shutdown or a fault the whole reserve is given back at once
//!   (nak), and so is what an idle worker cannot start (its classes no longer fit: another
//!   process took the memory), after the fetch loop's one arena shrink.
//! - **Cancellation.** A waiting job cancelled meanwhile is settled by its outcome when it is
//!   dealt (job.rs), without rendering.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use shotfleet_schema::encoding::decode_job;
use shotfleet_schema::subject::{Priority, SubjectClass};
use shotfleet_schema::MemoryClass;

use crate::budget::Admission;
use crate::telemetry;
use crate::worker::delivery::{Delivery, KeepAlive};

/// What jobs sharing UNet batches need alike: LoRAs with their weights, size, steps, guidance.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct BatchKey {
    set: Vec<(String, u32)>,
    width: u32,
    height: u32,
    steps: u32,
    guidance_bits: u32,
}

impl BatchKey {
    /// The key of a delivery's payload; `None` when it does not decode (it is dealt alone, and
    /// failed as invalid when taken).
    fn of(delivery: &Delivery) -> Option<Self> {
        let job = decode_job(delivery.content_type().as_deref(), &delivery.message.payload).ok()?;
        Some(Self { set: job.lora_set(), width: job.width, height: job.height, steps: job.steps, guidance_bits: job.guidance.to_bits() })
    }
}

/// What dealing looks at of a waiting job.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Candidate {
    pub priority: Priority,
    /// The class whose room it takes (its consumer's); `None` (an `auto` subject) never waits
    /// here, it is routed.
    pub class: Option<MemoryClass>,
    pub batch: Option<BatchKey>,
}

/// A fetched job waiting for a slot, kept alive meanwhile.
struct Waiting {
    delivery: Delivery,
    candidate: Candidate,
    _alive: KeepAlive,
    _counted: telemetry::Reserved,
}

/// The jobs fetched and not yet dealt to a slot, in fetch order.
pub(crate) struct Reserve {
    waiting: Vec<Waiting>,
    /// Jobs fetched beyond `batch_jobs` per free slot while the queue is deep.
    lookahead: usize,
    /// Whether the last fetch saw at least `lookahead` jobs waiting behind it.
    deep: bool,
    keep_alive: Option<Duration>,
}

impl Reserve {
    pub fn new(lookahead: usize, keep_alive: Option<Duration>) -> Self {
        Self { waiting: Vec::new(), lookahead, deep: false, keep_alive }
    }

    /// How many jobs to fetch now for `free` slots of `per_slot` jobs each.
    pub fn wanted(&self, free: usize, per_slot: usize) -> usize {
        let lookahead = if self.deep { self.lookahead } else { 0 };
        (free * per_slot + lookahead).saturating_sub(self.waiting.len())
    }

    /// Adds what a fetch brought, and learns from it whether the queue is deep.
    pub fn add(&mut self, fetched: Vec<Delivery>) {
        if fetched.is_empty() {
            self.deep = false;
            return;
        }
        let behind = fetched.iter().map(|delivery| delivery.pending).max().unwrap_or(0);
        self.deep = self.lookahead > 0 && behind >= self.lookahead as u64;
        for delivery in fetched {
            let class = match delivery.origin.class {
                SubjectClass::Class(class) => Some(class),
                SubjectClass::Auto => None,
            };
            let candidate = Candidate { priority: delivery.origin.priority, class, batch: BatchKey::of(&delivery) };
            let _alive = KeepAlive::start(&delivery, self.keep_alive);
            self.waiting.push(Waiting { delivery, candidate, _alive, _counted: telemetry::reserved() });
        }
    }

    /// Deals one slot's group of at most `per_slot` jobs, its lead first (none when nothing
    /// waiting can start), taking its room from `room`. `order` is the round's priority order.
    pub fn deal(&mut self, per_slot: usize, order: &[Priority], room: &mut Room) -> Vec<Delivery> {
        let candidates: Vec<&Candidate> = self.waiting.iter().map(|waiting| &waiting.candidate).collect();
        let picked = pick_group(&candidates, per_slot, order, room);
        let mut group: Vec<Delivery> = take_picked(&mut self.waiting, &picked).into_iter().map(|waiting| waiting.delivery).collect();
        for delivery in &mut group {
            // The wait a result reports is up to its render: in the stream and in this reserve.
            delivery.queued = SystemTime::now().duration_since(delivery.published).unwrap_or_default();
        }
        group
    }

    /// Gives every waiting job back to the stream at once, for any worker to take.
    pub async fn give_back(&mut self) {
        if !self.waiting.is_empty() {
            tracing::info!(jobs = self.waiting.len(), "giving back the jobs fetched ahead");
        }
        for waiting in self.waiting.drain(..) {
            waiting.delivery.nak(None).await;
        }
        self.deep = false;
    }
}

/// Takes the items at `picked` (distinct indices) out of `items`, in the order of `picked`.
fn take_picked<T>(items: &mut Vec<T>, picked: &[usize]) -> Vec<T> {
    let mut from_the_back = picked.to_vec();
    // Removed from the back, so the indices left stay valid.
    from_the_back.sort_unstable_by(|a, b| b.cmp(a));
    let mut taken: HashMap<usize, T> = from_the_back.into_iter().map(|i| (i, items.remove(i))).collect();
    picked.iter().map(|i| taken.remove(i).expect("each index picked once")).collect()
}

/// How many more jobs of each class can start in this round (the admission's counts).
pub(crate) struct Room(HashMap<MemoryClass, u32>);

impl Room {
    pub fn of(admission: &Admission) -> Self {
        Self(admission.fits.iter().copied().collect())
    }

    fn fits(&self, candidate: &Candidate) -> bool {
        candidate.class.is_some_and(|class| self.0.get(&class).is_some_and(|&n| n > 0))
    }

    fn take(&mut self, candidate: &Candidate) {
        if let Some(n) = candidate.class.and_then(|class| self.0.get_mut(&class)) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Indices into `waiting` (in fetch order) of one slot's group: the lead, the first that can
/// start by priority in `order` then by place, and up to `per_slot - 1` that can start and
/// share its batches, in the same order. Their room is taken from `room`.
fn pick_group(waiting: &[&Candidate], per_slot: usize, order: &[Priority], room: &mut Room) -> Vec<usize> {
    let rank = |candidate: &Candidate| order.iter().position(|&p| p == candidate.priority).unwrap_or(order.len());
    let mut queue: Vec<usize> = (0..waiting.len()).collect();
    // Stable: within a priority, fetch order.
    queue.sort_by_key(|&i| rank(waiting[i]));
    let mut group = Vec::new();
    let mut lead: Option<&Candidate> = None;
    for i in queue {
        if group.len() == per_slot.max(1) {
            break;
        }
        let candidate = waiting[i];
        let joins = match lead {
            None => true,
            Some(lead) => lead.batch.is_some() && candidate.batch == lead.batch,
        };
        if joins && room.fits(candidate) {
            room.take(candidate);
            group.push(i);
            if lead.is_none() {
                lead = Some(candidate);
                if candidate.batch.is_none() {
                    break;
                }
            }
        }
    }
    group
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRICT: [Priority; 3] = [Priority::P0, Priority::P1, Priority::P2];

    /// A waiting job of `priority` at a square `size` (0: a payload that does not decode).
    fn job(priority: Priority, size: u32) -> Candidate {
        let batch = (size > 0).then(|| BatchKey { set: Vec::new(), width: size, height: size, steps: 30, guidance_bits: 5.0f32.to_bits() });
        Candidate { priority, class: Some(MemoryClass::M), batch }
    }

    fn room(jobs: u32) -> Room {
        Room(HashMap::from([(MemoryClass::M, jobs)]))
    }

    /// Deals `slots` groups from `waiting`, as the fetch loop does in one round.
    fn deal(mut waiting: Vec<Candidate>, slots: usize, per_slot: usize, order: &[Priority], room: &mut Room) -> Vec<Vec<Candidate>> {
        let mut groups = Vec::new();
        for _ in 0..slots {
            let refs: Vec<&Candidate> = waiting.iter().collect();
            let picked = pick_group(&refs, per_slot, order, room);
            if picked.is_empty() {
                break;
            }
            groups.push(take_picked(&mut waiting, &picked));
        }
        groups
    }

    fn sizes(group: &[Candidate]) -> Vec<u32> {
        group.iter().map(|c| c.batch.as_ref().map_or(0, |b| b.width)).collect()
    }

    #[test]
    fn a_slot_is_dealt_its_leads_batch_partners_from_the_whole_reserve() {
        use Priority::P1;
        // A storyboard's interleaved sizes: the lead (1024) finds its partners further back.
        let waiting = vec![job(P1, 1024), job(P1, 1152), job(P1, 896), job(P1, 1024), job(P1, 1152), job(P1, 1024), job(P1, 1024), job(P1, 1024)];
        let groups = deal(waiting, 2, 4, &STRICT, &mut room(8));
        assert_eq!(groups.iter().map(|g| sizes(g)).collect::<Vec<_>>(), [vec![1024; 4], vec![1152, 1152]]);
    }

    #[test]
    fn a_new_higher_priority_leads_before_older_lower_ones_and_an_overdue_one_before_all() {
        use Priority::{P0, P2};
        // Two p2 fetched earlier, then a p0 of another size.
        let waiting = || vec![job(P2, 1024), job(P2, 1024), job(P0, 896)];
        let groups = deal(waiting(), 1, 4, &STRICT, &mut room(8));
        assert_eq!(groups[0], [job(P0, 896)]);
        // The scheduler says p2 is overdue: p2 leads, and the p0 waits for the next slot.
        let groups = deal(waiting(), 1, 4, &[P2, P0, Priority::P1], &mut room(8));
        assert_eq!(sizes(&groups[0]), [1024, 1024]);
    }

    #[test]
    fn partners_of_higher_priority_come_first() {
        use Priority::{P0, P1, P2};
        let waiting = vec![job(P1, 1024), job(P2, 1024), job(P2, 1024), job(P0, 896), job(P1, 1024)];
        let groups = deal(waiting, 1, 3, &[P1, P0, P2], &mut room(8));
        assert_eq!(groups[0], [job(P1, 1024), job(P1, 1024), job(P2, 1024)]);
    }

    #[test]
    fn a_group_takes_no_more_than_its_class_has_room_for_and_a_class_without_room_waits() {
        use Priority::P1;
        let waiting = vec![job(P1, 1024), job(P1, 1024), job(P1, 1024)];
        let mut room_for_two = room(2);
        let groups = deal(waiting.clone(), 2, 4, &STRICT, &mut room_for_two);
        assert_eq!(groups, [vec![job(P1, 1024), job(P1, 1024)]], "two fit; the third waits");
        let mut other_class = Room(HashMap::from([(MemoryClass::S, 4)]));
        assert!(deal(waiting, 1, 4, &STRICT, &mut other_class).is_empty());
    }

    #[test]
    fn a_payload_that_does_not_decode_goes_alone_in_its_place() {
        use Priority::P1;
        let waiting = vec![job(P1, 0), job(P1, 1024), job(P1, 0), job(P1, 1024)];
        let groups = deal(waiting, 3, 4, &STRICT, &mut room(8));
        assert_eq!(groups.iter().map(|g| sizes(g)).collect::<Vec<_>>(), [vec![0], vec![1024, 1024], vec![0]]);
    }

    #[test]
    fn one_job_per_slot_without_batching_keeps_priority_then_fetch_order() {
        use Priority::{P0, P1};
        let waiting = vec![job(P1, 1024), job(P1, 896), job(P0, 1152), job(P1, 1024)];
        let groups = deal(waiting, 4, 1, &STRICT, &mut room(8));
        assert_eq!(groups.iter().map(|g| sizes(g)).collect::<Vec<_>>(), [vec![1152], vec![1024], vec![896], vec![1024]]);
    }
}
