//! The LoRA pool: merged sets on the device, least recently used first out, to host memory and
//! then dropped.
//!
//! Switching to a set on the device is handing out its `Arc` (renders bind it by name); a set
//! in host memory is placed on the device again; a dropped one is merged again from its LoRA
//! files. The pool's device bytes are exact (the sum of the merged tensors) and include sets it
//! evicted that a render still holds, until that render ends: what the budget counts. It never
//! blocks on a merge while holding its lock, so asking its size is always quick.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use super::super::Pipeline;
use super::device::{MergedSet, ResidentSet};
use super::error::LoraError;
use super::merge::Adapter;

/// Which set: its LoRAs by identity (the library's sha256, or a name) and weight, in a fixed
/// order; LoRAs at weight 0 are left out (they change nothing), so a set of only those is the
/// base model.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SetKey(Vec<(String, u32)>);

impl SetKey {
    pub fn new<S: Into<String>>(loras: impl IntoIterator<Item = (S, f32)>) -> SetKey {
        let mut items: Vec<(String, u32)> =
            loras.into_iter().filter(|(_, w)| *w != 0.0).map(|(id, w)| (id.into(), w.to_bits())).collect();
        items.sort();
        SetKey(items)
    }

    /// No LoRA: the base model, nothing to bind.
    pub fn is_base(&self) -> bool {
        self.0.is_empty()
    }
}

/// How much the pool may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimits {
    /// Device bytes for sets; the budget moves it with [`LoraPool::set_device_limit`].
    pub device_bytes: u64,
    /// Host bytes for merged sets kept to place again without merging.
    pub host_bytes: u64,
}

/// Where an acquired set came from: the switch's cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Already on the device: a rebind.
    Resident,
    /// From host memory: one copy to the device.
    Host,
    /// Merged from the LoRA files, then placed.
    Merged,
}

/// A set ready to render with.
pub struct Acquired {
    pub set: Arc<ResidentSet>,
    pub source: Source,
    /// What getting it took (merge, placement).
    pub elapsed: Duration,
    /// Whether it is another set than the one acquired before it (a switch).
    pub switched: bool,
}

/// Counters since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Acquisitions of another set than the previous one.
    pub switches: u64,
    pub resident_hits: u64,
    pub host_hits: u64,
    pub merges: u64,
    /// Sets moved off the device (kept in host memory or dropped).
    pub device_evictions: u64,
    /// Merged sets dropped from host memory.
    pub host_drops: u64,
}

#[derive(Default)]
struct Entry {
    device: Option<Arc<ResidentSet>>,
    host: Option<Arc<MergedSet>>,
    bytes: u64,
    last_used: u64,
}

struct State {
    entries: HashMap<SetKey, Entry>,
    limits: PoolLimits,
    /// The pipeline instance whose device sets the entries hold.
    pipeline: Option<u64>,
    /// Sets evicted while a render held them: on the device until it lets go.
    leaving: Vec<(Weak<ResidentSet>, u64)>,
    clock: u64,
    last: Option<SetKey>,
    stats: PoolStats,
}

/// Merged LoRA sets for one pipeline.
pub struct LoraPool {
    state: Mutex<State>,
}

impl LoraPool {
    pub fn new(limits: PoolLimits) -> LoraPool {
        LoraPool {
            state: Mutex::new(State {
                entries: HashMap::new(),
                limits,
                pipeline: None,
                leaving: Vec::new(),
                clock: 0,
                last: None,
                stats: PoolStats::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The set `key` names, on `pipeline`'s device: resident already, placed from host memory,
    /// or merged from what `load` gives (called only then: it may fetch files). Other sets are
    /// moved off the device, least recently used first, until the pool's device bytes are
    /// within its limit again (the set just acquired stays whatever its size). `Ok(None)` for
    /// the base model.
    ///
    /// # Errors
    /// `load`'s error; a [`LoraError`] (converted) when the LoRAs do not fit the model, the base
    /// weights cannot be read, or the device cannot take the set.
    pub fn acquire<E: From<LoraError>>(
        &self,
        pipeline: &Pipeline,
        key: &SetKey,
        load: impl FnOnce() -> Result<Vec<Adapter>, E>,
    ) -> Result<Option<Acquired>, E> {
        if key.is_base() {
            return Ok(None);
        }
        let started = Instant::now();
        let switched;
        let host = {
            let mut state = self.lock();
            state.follow(pipeline.instance());
            switched = state.note_use(key);
            let clock = state.tick();
            let (resident, host) = match state.entries.get_mut(key) {
                Some(entry) => {
                    entry.last_used = clock;
                    (entry.device.clone(), entry.host.clone())
                }
                None => (None, None),
            };
            if let Some(set) = resident {
                state.stats.resident_hits += 1;
                return Ok(Some(Acquired { set, source: Source::Resident, elapsed: started.elapsed(), switched }));
            }
            host
        };
        let (merged, source) = match host {
            Some(host) => (host, Source::Host),
            None => (Arc::new(pipeline.merge_loras(&load()?)?), Source::Merged),
        };
        let placed = Arc::new(pipeline.place_loras(&merged)?);
        let mut state = self.lock();
        let clock = state.tick();
        match source {
            Source::Merged => state.stats.merges += 1,
            _ => state.stats.host_hits += 1,
        }
        let entry = state.entries.entry(key.clone()).or_default();
        entry.bytes = merged.bytes();
        entry.last_used = clock;
        // Another thread may have placed it meanwhile: keep one.
        let set = Arc::clone(entry.device.get_or_insert(placed));
        entry.host.get_or_insert(merged);
        let limit = state.limits.device_bytes;
        state.evict_device_to(limit, Some(key));
        state.trim_host();
        Ok(Some(Acquired { set, source, elapsed: started.elapsed(), switched }))
    }

    /// The exact device bytes of sets: resident ones and evicted ones a render still holds.
    pub fn device_bytes(&self) -> u64 {
        self.lock().device_bytes()
    }

    /// Host bytes of merged sets kept.
    pub fn host_bytes(&self) -> u64 {
        self.lock().host_bytes()
    }

    /// Moves sets off the device, least recently used first, until the pool's device bytes are
    /// at most `bytes` (sets in use by a render count until it ends); returns the device bytes
    /// after. The budget calls this before it refuses a job.
    pub fn shrink_device_to(&self, bytes: u64) -> u64 {
        let mut state = self.lock();
        state.evict_device_to(bytes, None);
        state.trim_host();
        state.device_bytes()
    }

    /// A new device limit (the budget's line for sets); shrinks to it at once.
    pub fn set_device_limit(&self, bytes: u64) -> u64 {
        self.lock().limits.device_bytes = bytes;
        self.shrink_device_to(bytes)
    }

    /// Whether `key`'s set is on the device now (the worker prefers jobs whose set is).
    pub fn is_resident(&self, key: &SetKey) -> bool {
        key.is_base() || self.lock().entries.get(key).is_some_and(|e| e.device.is_some())
    }

    /// The exact bytes of `key`'s set where the pool has it (on the device or in host memory).
    pub fn bytes_of(&self, key: &SetKey) -> Option<u64> {
        self.lock().entries.get(key).map(|e| e.bytes)
    }

    /// Device bytes of resident sets that no render holds: what [`reclaim`](Self::reclaim)
    /// can give back now.
    pub fn idle_device_bytes(&self) -> u64 {
        self.lock().entries.values().filter(|e| e.device.as_ref().is_some_and(|s| Arc::strong_count(s) == 1)).map(|e| e.bytes).sum()
    }

    /// Moves resident sets that no render holds off the device, least recently used first,
    /// until at least `bytes` are given back or none is left; returns the bytes given back. The
    /// budget calls this before it refuses a job (a set a render holds would stay on the device
    /// until that render ends, so it is left alone).
    pub fn reclaim(&self, bytes: u64) -> u64 {
        let mut state = self.lock();
        let mut freed = 0;
        while freed < bytes {
            let victim = state
                .entries
                .iter()
                .filter(|(_, e)| e.device.as_ref().is_some_and(|s| Arc::strong_count(s) == 1))
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            let entry = state.entries.get_mut(&victim).expect("found above");
            entry.device = None;
            freed += entry.bytes;
            state.stats.device_evictions += 1;
        }
        state.trim_host();
        freed
    }

    /// Where `key`'s set is: on the device, in host memory, or nowhere (`None`).
    pub fn whereabouts(&self, key: &SetKey) -> Option<Source> {
        let state = self.lock();
        let entry = state.entries.get(key)?;
        if entry.device.is_some() {
            Some(Source::Resident)
        } else {
            entry.host.as_ref().map(|_| Source::Host)
        }
    }

    pub fn stats(&self) -> PoolStats {
        self.lock().stats
    }

    /// Forgets every set (after a reload the device sets belong to sessions that are gone).
    pub fn clear(&self) {
        let mut state = self.lock();
        state.entries.clear();
        state.last = None;
    }
}

impl State {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Whether `key` is a switch from the set used before.
    fn note_use(&mut self, key: &SetKey) -> bool {
        if self.last.as_ref() == Some(key) {
            return false;
        }
        self.stats.switches += 1;
        self.last = Some(key.clone());
        true
    }

    /// Device sets made for an earlier pipeline instance are useless to this one.
    fn follow(&mut self, pipeline: u64) {
        if self.pipeline != Some(pipeline) {
            for entry in self.entries.values_mut() {
                entry.device = None;
            }
            self.entries.retain(|_, e| e.host.is_some());
            self.pipeline = Some(pipeline);
        }
    }

    fn device_bytes(&mut self) -> u64 {
        self.leaving.retain(|(set, _)| set.strong_count() > 0);
        let resident: u64 = self.entries.values().filter(|e| e.device.is_some()).map(|e| e.bytes).sum();
        resident + self.leaving.iter().map(|(_, b)| b).sum::<u64>()
    }

    fn host_bytes(&self) -> u64 {
        self.entries.values().filter(|e| e.host.is_some()).map(|e| e.bytes).sum()
    }

    fn evict_device_to(&mut self, limit: u64, keep: Option<&SetKey>) {
        while self.device_bytes() > limit {
            let victim = self
                .entries
                .iter()
                .filter(|(k, e)| e.device.is_some() && Some(*k) != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            let entry = self.entries.get_mut(&victim).expect("found above");
            let set = entry.device.take().expect("resident");
            if Arc::strong_count(&set) > 1 {
                self.leaving.push((Arc::downgrade(&set), entry.bytes));
            }
            self.stats.device_evictions += 1;
        }
        self.entries.retain(|_, e| e.device.is_some() || e.host.is_some());
    }

    /// Drops host copies of sets that are off the device, least recently used first, until the
    /// host bytes are within the limit; then copies of resident sets if still over.
    fn trim_host(&mut self) {
        let limit = self.limits.host_bytes;
        while self.host_bytes() > limit {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.host.is_some())
                .min_by_key(|(_, e)| (e.device.is_some(), e.last_used))
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            self.entries.get_mut(&victim).expect("found above").host = None;
            self.stats.host_drops += 1;
        }
        self.entries.retain(|_, e| e.device.is_some() || e.host.is_some());
    }
}
