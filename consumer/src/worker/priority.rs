//! Priority order without starvation.
//!
//! Strict order (p0, then p1, then p2) with one exception: a lower priority that has gone
//! unserved for longer than its bound jumps the queue for one fetch. "Served" means a job of
//! that priority was taken, or its queues were polled and found empty (nothing was waiting, so
//! nothing starved). Under sustained p0 load a p2 job therefore waits at most about
//! `p2_max_wait` plus one render before a slot goes to it.

use std::time::{Duration, Instant};

use shotfleet_schema::Priority;

use crate::config::PriorityConfig;

#[derive(Debug)]
pub struct Scheduler {
    bounds: [Option<Duration>; 3],
    last_served: [Instant; 3],
}

impl Scheduler {
    pub fn new(config: &PriorityConfig, now: Instant) -> Self {
        Self { bounds: [Priority::P0, Priority::P1, Priority::P2].map(|p| config.max_wait(p)), last_served: [now; 3] }
    }

    /// The order to poll in now: overdue priorities first (most overdue first), then the rest
    /// in strict order.
    pub fn order(&self, now: Instant) -> Vec<Priority> {
        let overdue_by = |p: Priority| {
            self.bounds[p.rank()].and_then(|bound| now.duration_since(self.last_served[p.rank()]).checked_sub(bound))
        };
        let mut overdue: Vec<(Duration, Priority)> =
            Priority::ALL.iter().filter_map(|&p| overdue_by(p).map(|d| (d, p))).collect();
        overdue.sort_by_key(|&(by, _)| std::cmp::Reverse(by));
        let mut order: Vec<Priority> = overdue.iter().map(|(_, p)| *p).collect();
        let rest: Vec<Priority> = Priority::ALL.iter().copied().filter(|p| !order.contains(p)).collect();
        order.extend(rest);
        order
    }

    /// A job of `priority` was taken, or its queues were empty.
    pub fn served(&mut self, priority: Priority, now: Instant) {
        self.last_served[priority.rank()] = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduler(now: Instant) -> Scheduler {
        let config = PriorityConfig { p1_max_wait: Duration::from_secs(10), p2_max_wait: Duration::from_secs(30) };
        Scheduler::new(&config, now)
    }

    #[test]
    fn strict_order_until_a_bound_passes() {
        let t0 = Instant::now();
        let mut s = scheduler(t0);
        assert_eq!(s.order(t0 + Duration::from_secs(5)), [Priority::P0, Priority::P1, Priority::P2]);
        // p1 unserved for 11 s: it goes first.
        s.served(Priority::P2, t0 + Duration::from_secs(11));
        assert_eq!(s.order(t0 + Duration::from_secs(11)), [Priority::P1, Priority::P0, Priority::P2]);
        s.served(Priority::P1, t0 + Duration::from_secs(11));
        assert_eq!(s.order(t0 + Duration::from_secs(12)), [Priority::P0, Priority::P1, Priority::P2]);
    }

    #[test]
    fn the_most_overdue_goes_first() {
        let t0 = Instant::now();
        let s = scheduler(t0);
        // At 45 s: p1 is 35 s over, p2 15 s over.
        assert_eq!(s.order(t0 + Duration::from_secs(45)), [Priority::P1, Priority::P2, Priority::P0]);
    }
}
