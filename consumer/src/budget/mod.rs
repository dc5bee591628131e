//! The worker's GPU memory budget: which jobs fit on the card now.
//!
//! The budget knows nothing of NATS. The worker asks it, before each fetch, which memory
//! classes fit and how many jobs can start ([`Budget::admit`]); reserves a job's estimated need
//! when it starts ([`Budget::reserve`], released when the guard drops); and reports each render's
//! observed peak ([`Budget::observe`]) so the estimate learns.
//!
//! **Room.** `budget = min(total x max_fill - resident - reserve, free - margin)`, less what
//! the jobs in flight reserved. `resident` is the models, measured once after they load
//! ([`GpuSnapshot::resident_since`]). `free` is the driver's, so other processes on the card
//! count. Where NVML reports this process's own usage, what the process holds beyond the models
//! is counted back as free up to what the jobs in flight reserved: their live tensors are in
//! their reservations already. Arena cache beyond that (regions earlier renders left) is not:
//! each graph has its own arena, and one graph's cache cannot serve another's request, so on a
//! crowded card a job admitted against it ran out of device memory for real (second lease,
//! 2026-11-30). An idle worker that cannot admit anything shrinks its arenas instead (the
//! fetch loop). Where NVML cannot tell our usage (some containers), all of it counts as
//! someone else's, which errs on the safe side.
//!
//! **Need.** A render of `images` images of `w x h` needs a fixed part, a part per latent pixel
//! of the guidance batch (the UNet) and parts that grow with one image's latent pixels and their
//! square (the VAE), bytes ([`Estimate`] has the model and why). They are fitted to probe renders
//! at start and refined by every job whose render started from shrunk arenas (a peak above an
//! earlier job's cache says nothing of this shape); a shape never gets less than it was seen to
//! take. `safety` is added on top. Fits are stored per card, model and runtime
//! ([`FingerprintStore`]), so a restart skips calibration.
//!
//! **Steps cost time, not memory.** A denoising step overwrites the same latent and reuses the
//! same activations as the step before; nothing accumulates across steps. So the step count is
//! not in the model, and fewer steps is a degrade rung for time limits, not for memory.
//!
//! **LoRA sets** ([`DeviceLine`]): the LoRA pool's sets on the device are a line of their own
//! beside the models: the room subtracts their bytes as it does the models', a LoRA job's plan
//! adds its set's bytes when the set must be placed ([`Budget::reserve`]'s `set_bytes`), and
//! before the budget refuses a job it asks the pool for sets no render holds, least recently
//! used first ([`DeviceLine::reclaim`]).
//!
//! **Water levels** ([`Water`]) read the card's real fill and override the plan: above
//! `stop_fetch_at` admission is closed whatever the estimates say.
//!
//! **A share of a card** (`max_mib`): the budget reads every snapshot through the worker's
//! share (`share.rs`), so room, water levels and status are of the share.
//!
//! **Calibration** ([`Calibration`]) plans each probe render against the room before it runs
//! and turns a probe that ran out of memory into the card's ceiling for that shape; which
//! classes the result can hold is a [`ClassReport`].
//!
//! Modules: `config` (the `[budget]` section), `line` (the LoRA pool's line), `share` (`max_mib`),
//! `probe` (the [`GpuProbe`] trait and peak measurement), `nvml` (real cards), `visible`
//! (`CUDA_VISIBLE_DEVICES`: which card CUDA's device N is), `simulated` (CPU runs and tests),
//! `estimate` (the need model), `calibration` (probes planned against the room), `classes`
//! (the classes setting and what the budget holds of each), `fingerprint` (the estimate's
//! persistence), `water` (levels).

mod calibration;
mod classes;
mod config;
mod estimate;
mod fingerprint;
mod line;
mod nvml;
mod probe;
mod share;
mod simulated;
mod visible;
mod water;

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use shotfleet_schema::MemoryClass;
use tracing::warn;

pub use calibration::{Calibration, CalibrationError, ProbeOutcome, ProbeRecord};
pub use classes::{ClassHold, ClassReport, Classes, Hold};
pub use config::{BudgetConfig, ConfigError, MIB, SimulateConfig};
pub use estimate::{Coefficients, Estimate, EstimateError, Sample, Shape};
pub use fingerprint::{FingerprintError, FingerprintKey, FingerprintStore};
pub use line::DeviceLine;
pub use nvml::{CardInfo, NvmlProbe, visible_cards, watch_critical_events};
pub use probe::{GpuProbe, GpuSnapshot, Measured, PeakMeter, PeakWindow, ProbeError};
pub use simulated::{SIMULATED_DEVICE, SimulatedGpu};
pub use visible::{CUDA_VISIBLE_DEVICES, CardRef, Visible};
pub use water::Water;

/// Opens the probe the config asks for: the simulation for a CPU run (`gpu` is `None`), the card
/// that is CUDA's device `gpu` otherwise (`CUDA_VISIBLE_DEVICES` honoured). Neither stands in for
/// the other.
///
/// # Errors
///
/// A CPU run without `[budget.simulate]`, a GPU run with it, or NVML unavailable.
pub fn open_probe(config: &BudgetConfig, gpu: Option<u32>) -> Result<Arc<dyn GpuProbe>, ProbeError> {
    match (gpu, &config.simulate) {
        (None, Some(simulate)) => Ok(Arc::new(SimulatedGpu::new(simulate)?)),
        (Some(index), None) => Ok(Arc::new(NvmlProbe::open(index)?)),
        (None, None) => Err(ProbeError::SimulationRequired),
        (Some(index), Some(_)) => Err(ProbeError::SimulationOnGpu { index }),
    }
}

/// The budget of one card. Cheap to clone; clones share one plan.
#[derive(Clone)]
pub struct Budget {
    inner: Arc<Inner>,
}

struct Inner {
    config: BudgetConfig,
    probe: Arc<dyn GpuProbe>,
    max_age: Duration,
    cache: Mutex<Option<(Instant, GpuSnapshot)>>,
    plan: Mutex<Plan>,
    /// The LoRA pool's sets, once the worker counts them.
    line: OnceLock<Arc<dyn DeviceLine>>,
}

/// What the budget has promised.
struct Plan {
    estimate: Estimate,
    /// The models and what the process keeps outside its arenas ([`Budget::outside_arenas`]).
    resident: u64,
    /// The models alone, as measured at load.
    models: u64,
    reserved: u64,
    in_flight: u32,
}

/// Which classes fit now, and how many jobs of each could start.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    pub water: Water,
    /// Each class that fits, smallest first, with how many one-image jobs at the class's
    /// largest size the room holds at once (at least 1).
    pub fits: Vec<(MemoryClass, u32)>,
}

impl Admission {
    pub fn classes(&self) -> Vec<MemoryClass> {
        self.fits.iter().map(|(class, _)| *class).collect()
    }

    /// How many jobs of `class` could start now (0 when it does not fit).
    pub fn jobs(&self, class: MemoryClass) -> u32 {
        self.fits.iter().find(|(c, _)| *c == class).map_or(0, |(_, n)| *n)
    }
}

/// The budget for metrics and logs, bytes throughout.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetStatus {
    pub device: String,
    pub total: u64,
    pub used: u64,
    pub free: u64,
    /// Used by other processes, where this process's own usage is known.
    pub others_used: Option<u64>,
    pub resident: u64,
    /// Device bytes of the LoRA pool's sets (a line beside the models).
    pub line: u64,
    /// Room for renders, before reservations.
    pub budget: u64,
    pub reserved: u64,
    /// `budget - reserved`: what a new job can have.
    pub available: u64,
    pub in_flight: u32,
    pub water: Water,
    pub utilization: Option<f64>,
    pub temperature_c: Option<u32>,
}

/// A job's share of the budget, given back when dropped.
#[must_use = "the reservation is released as soon as it is dropped"]
pub struct Reservation {
    inner: Arc<Inner>,
    shape: Shape,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Gives back `bytes` of the reservation early: a LoRA set's, once placed, since the pool's
    /// line counts it from then on.
    pub fn release(&mut self, bytes: u64) {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        let mut plan = self.inner.plan();
        plan.reserved = plan.reserved.saturating_sub(bytes);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut plan = self.inner.plan();
        plan.reserved = plan.reserved.saturating_sub(self.bytes);
        plan.in_flight = plan.in_flight.saturating_sub(1);
    }
}

impl Budget {
    /// A budget over `probe` with a calibrated or loaded `estimate`, and the `resident` bytes the
    /// models took ([`GpuSnapshot::resident_since`]).
    ///
    /// # Errors
    ///
    /// A config value out of range.
    pub fn new(
        config: BudgetConfig,
        probe: Arc<dyn GpuProbe>,
        estimate: Estimate,
        resident: u64,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let max_age = Duration::from_millis(config.snapshot_max_age_ms);
        let plan = Plan { estimate, resident, models: resident, reserved: 0, in_flight: 0 };
        let inner = Inner { config, probe, max_age, cache: Mutex::new(None), plan: Mutex::new(plan), line: OnceLock::new() };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Counts `line` (the LoRA pool's sets) beside the models from now on. Once: a second line
    /// is ignored.
    pub fn count_line(&self, line: Arc<dyn DeviceLine>) {
        if self.inner.line.set(line).is_err() {
            warn!("the budget counts one device line; a second was ignored");
        }
    }

    pub fn config(&self) -> &BudgetConfig {
        &self.inner.config
    }

    /// Which of `classes` fit now, and how many jobs of each could start. Nothing fits above
    /// `stop_fetch_at`.
    ///
    /// # Errors
    ///
    /// The card could not be read: on NVML, possibly a driver fault ([`ProbeError::nvml_error`]).
    pub fn admit(&self, classes: &[MemoryClass]) -> Result<Admission, ProbeError> {
        let snapshot = self.inner.snapshot()?;
        let (water, fits) = self.fits(&snapshot, &self.inner.plan(), classes);
        Ok(Admission { water, fits })
    }

    /// Whether giving back this process's idle arena cache (what it holds beyond its models and
    /// its jobs' reservations) would let in one of `classes` that does not fit now, or lift the
    /// stop-fetch level. Where the driver does not report this process's usage it cannot be
    /// told, and any class left out counts: a shrink is cheap. Asked by an idle worker that
    /// fetched nothing, not on every admission.
    ///
    /// # Errors
    /// The card could not be read.
    pub fn shrinking_opens(&self, classes: &[MemoryClass]) -> Result<bool, ProbeError> {
        let snapshot = self.inner.snapshot()?;
        let plan = self.inner.plan();
        let (_, fits) = self.fits(&snapshot, &plan, classes);
        let Some(own) = snapshot.own_used else {
            return Ok(classes.iter().any(|class| !fits.iter().any(|(fit, _)| fit == class)));
        };
        let cache = own.saturating_sub(plan.resident + self.inner.line_bytes()).saturating_sub(plan.reserved);
        if cache == 0 {
            return Ok(false);
        }
        let shrunk = GpuSnapshot {
            used: snapshot.used.saturating_sub(cache),
            free: snapshot.free + cache,
            own_used: Some(own - cache),
            ..snapshot
        };
        Ok(self.fits(&shrunk, &plan, classes).1.len() > fits.len())
    }

    /// The water level of `snapshot` and the classes its room holds (none above stop-fetch).
    fn fits(&self, snapshot: &GpuSnapshot, plan: &Plan, classes: &[MemoryClass]) -> (Water, Vec<(MemoryClass, u32)>) {
        let water = Water::at(snapshot.used_fraction(), &self.inner.config);
        if water == Water::Stop {
            return (water, Vec::new());
        }
        let available = self.inner.room(snapshot, plan).plannable();
        let mut fits: Vec<(MemoryClass, u32)> = classes
            .iter()
            .filter_map(|&class| {
                let need = self.inner.planned(plan, self.class_shape(class));
                let jobs = u32::try_from(available / need.max(1)).unwrap_or(u32::MAX);
                (jobs > 0).then_some((class, jobs))
            })
            .collect();
        fits.sort();
        fits.dedup();
        (water, fits)
    }

    /// The largest sub-batch of a job's `images` that the room holds now beside `set_bytes` (a
    /// LoRA set the render must place first; 0: none, or its set is on the device): `images` if
    /// all fit, 0 if not even one does. LoRA sets no render holds count as room (they are given
    /// back when the job is reserved).
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn largest_batch(&self, width: u32, height: u32, images: u32, set_bytes: u64) -> Result<u32, ProbeError> {
        let snapshot = self.inner.snapshot()?;
        // Above `lower_batch_at` the card is filling up whatever the plan says: half batches.
        let most = match Water::at(snapshot.used_fraction(), &self.inner.config) {
            Water::Lower => (images / 2).max(1),
            _ => images,
        };
        let plan = self.inner.plan();
        let available = self.inner.room(&snapshot, &plan).plannable();
        Ok((1..=most)
            .rev()
            .find(|&batch| self.inner.planned(&plan, Shape::new(width, height, batch)) + set_bytes <= available)
            .unwrap_or(0))
    }

    /// Reserves the planned need of a `batch` of `width x height` images and `set_bytes` (a
    /// LoRA set the render places first; 0: none, or its set is on the device), if the room
    /// holds it now; checked and taken under one lock, so two starts cannot both take the last
    /// room. Where the room falls short by no more than the LoRA sets no render holds, those
    /// are given back first (least recently used first): the pool shrinks before a job is
    /// refused.
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn reserve(&self, width: u32, height: u32, batch: u32, set_bytes: u64) -> Result<Option<Reservation>, ProbeError> {
        let snapshot = self.inner.snapshot()?;
        let shape = Shape::new(width, height, batch);
        let mut plan = self.inner.plan();
        let bytes = self.inner.planned(&plan, shape) + set_bytes;
        let room = self.inner.room(&snapshot, &plan);
        if bytes > room.plannable() {
            return Ok(None);
        }
        if bytes > room.available {
            let asked = bytes - room.available;
            let freed = self.inner.line.get().map_or(0, |line| line.reclaim(asked));
            tracing::info!(asked_mib = asked / MIB, freed_mib = freed / MIB, "LoRA sets moved off the device for a job");
            if bytes > self.inner.room(&snapshot, &plan).available {
                return Ok(None);
            }
        }
        plan.reserved += bytes;
        plan.in_flight += 1;
        Ok(Some(Reservation { inner: Arc::clone(&self.inner), shape, bytes }))
    }

    /// Whether one `width x height` image, beside `set_bytes` of a LoRA set to place, would fit
    /// this card with nothing else of this worker in flight (and so no LoRA set held): `false`
    /// means this card cannot render the job now whatever it waits for (its ceiling, or the
    /// other processes on it), so the job is for a roomier card or a smaller rung.
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn holds_one(&self, width: u32, height: u32, set_bytes: u64) -> Result<bool, ProbeError> {
        let snapshot = self.inner.snapshot()?;
        let plan = self.inner.plan();
        Ok(self.inner.planned(&plan, Shape::new(width, height, 1)) + set_bytes <= self.inner.idle_room(&snapshot, &plan))
    }

    /// What a `batch` of `width x height` images is planned to take: the estimate plus `safety`.
    pub fn planned(&self, width: u32, height: u32, batch: u32) -> u64 {
        self.inner.planned(&self.inner.plan(), Shape::new(width, height, batch))
    }

    /// Learns from a finished render's peak (bytes it added at its highest, e.g. from
    /// [`Budget::peak_window`]) and returns the estimate's error, `(observed - predicted) /
    /// predicted`, for the estimate-error metric. Above `safety`, the plan was too small.
    pub fn observe(&self, width: u32, height: u32, batch: u32, peak_bytes: u64) -> f64 {
        let shape = Shape::new(width, height, batch);
        let window = self.inner.config.learn_window;
        let error = self.inner.plan().estimate.observe(Sample { shape, peak_bytes }, window);
        if error > self.inner.config.safety {
            warn!(width, height, batch, peak_bytes, error, "render peaked above its planned memory");
        }
        error
    }

    /// Learns from a render that ran out of memory: what was planned for it becomes the least its
    /// shape needs, so the next attempt plans `safety` more. Returns the new plan, bytes.
    pub fn observe_oom(&self, width: u32, height: u32, batch: u32) -> u64 {
        let shape = Shape::new(width, height, batch);
        let mut plan = self.inner.plan();
        let planned = self.inner.planned(&plan, shape);
        plan.estimate.raise_floor(shape, planned);
        self.inner.planned(&plan, shape)
    }

    /// The card's water level now.
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn water(&self) -> Result<Water, ProbeError> {
        Ok(Water::at(self.inner.snapshot()?.used_fraction(), &self.inner.config))
    }

    /// Everything the budget knows, for metrics.
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn status(&self) -> Result<BudgetStatus, ProbeError> {
        let snapshot = self.inner.snapshot()?;
        let plan = self.inner.plan();
        let room = self.inner.room(&snapshot, &plan);
        Ok(BudgetStatus {
            others_used: snapshot.own_used.map(|own| snapshot.used.saturating_sub(own)),
            resident: plan.resident,
            line: self.inner.line_bytes(),
            budget: room.budget,
            reserved: plan.reserved,
            available: room.available,
            in_flight: plan.in_flight,
            water: Water::at(snapshot.used_fraction(), &self.inner.config),
            device: snapshot.device,
            total: snapshot.total,
            used: snapshot.used,
            free: snapshot.free,
            utilization: snapshot.utilization,
            temperature_c: snapshot.temperature_c,
        })
    }

    /// Starts measuring a render's peak on this budget's card (one at a time per process).
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn peak_window(&self) -> Result<PeakWindow<'_>, ProbeError> {
        PeakWindow::start(&*self.inner.probe)
    }

    /// The estimate as learned so far, to store with [`FingerprintStore::save`].
    pub fn estimate(&self) -> Estimate {
        self.inner.plan().estimate.clone()
    }

    /// Counts `floor` bytes that the process keeps outside its arenas, above the models
    /// (kernels the libraries loaded on first use: [`PeakMeter::note_floor`]), as resident from
    /// now on, the LoRA pool's sets left out (its line counts them). It only grows: a lower
    /// reading changes nothing.
    pub fn outside_arenas(&self, floor: u64) {
        let sets = self.inner.line_bytes();
        let mut plan = self.inner.plan();
        plan.resident = plan.resident.max(plan.models + floor.saturating_sub(sets));
    }

    /// Makes the next query read the card, not the cached snapshot.
    pub fn refresh(&self) {
        *lock(&self.inner.cache) = None;
    }

    /// Which of `classes` fit this card's budget when it holds no job: a class left out never
    /// runs here, however long the worker idles.
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn admits_when_idle(&self, classes: &[MemoryClass]) -> Result<Vec<MemoryClass>, ProbeError> {
        let snapshot = self.inner.snapshot()?;
        let plan = self.inner.plan();
        let room = self.inner.idle_room(&snapshot, &plan);
        Ok(classes.iter().copied().filter(|&class| self.inner.planned(&plan, self.class_shape(class)) <= room).collect())
    }

    /// The largest one-image shape of `class`: a square of its pixel bound. Admission fetches
    /// a class only while one such image fits.
    pub fn class_shape(&self, class: MemoryClass) -> Shape {
        let side = class.max_pixels().map_or(self.inner.config.xl_max_side, |pixels| pixels.isqrt() as u32);
        Shape::new(side, side, 1)
    }
}

/// The room a render would have now beside `resident` bytes of models with nothing in flight,
/// bytes: what calibration plans its probes against, before there is an estimate to make a
/// [`Budget`] with.
///
/// # Errors
///
/// The card could not be read.
pub fn room_now(config: &BudgetConfig, probe: &dyn GpuProbe, resident: u64) -> Result<u64, ProbeError> {
    let snapshot = config.view(probe.snapshot()?);
    Ok(room(config, &snapshot, resident, 0).budget)
}

/// Locks one of the budget's mutexes. Every value under them is replaced or updated in a few
/// steps that cannot panic halfway, so a lock poisoned by a panic elsewhere still guards a
/// consistent value, and the worker keeps its budget.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The room before and after reservations.
struct Room {
    budget: u64,
    available: u64,
    /// LoRA sets no render holds: room once given back.
    reclaimable: u64,
}

impl Room {
    /// What a job can be planned against: the room left, and the LoRA sets that would be given
    /// back for it.
    fn plannable(&self) -> u64 {
        self.available + self.reclaimable
    }
}

/// The room on the card of `snapshot` (as the worker views it) beside `resident` bytes of
/// models, with `reserved` bytes promised to jobs in flight.
fn room(config: &BudgetConfig, snapshot: &GpuSnapshot, resident: u64, reserved: u64) -> Room {
    let capped = (snapshot.total as f64 * config.max_fill) as u64;
    let cap_room = capped.saturating_sub(resident).saturating_sub(config.reserve_bytes());
    // What we hold beyond the models is in-flight renders (already in `reserved`) and arena
    // cache: count it back as free up to the reservations, where the driver tells us.
    let ours_in_flight = snapshot.own_used.map_or(0, |own| own.saturating_sub(resident)).min(reserved);
    let free_room = (snapshot.free + ours_in_flight).saturating_sub(config.margin_bytes());
    let budget = cap_room.min(free_room);
    Room { budget, available: budget.saturating_sub(reserved), reclaimable: 0 }
}

impl Inner {
    fn plan(&self) -> MutexGuard<'_, Plan> {
        lock(&self.plan)
    }

    fn snapshot(&self) -> Result<GpuSnapshot, ProbeError> {
        let mut cache = lock(&self.cache);
        if let Some((at, snapshot)) = cache.as_ref()
            && at.elapsed() < self.max_age
        {
            return Ok(snapshot.clone());
        }
        let snapshot = self.config.view(self.probe.snapshot()?);
        *cache = Some((Instant::now(), snapshot.clone()));
        Ok(snapshot)
    }

    /// The room beside the models and the LoRA pool's line.
    fn room(&self, snapshot: &GpuSnapshot, plan: &Plan) -> Room {
        let Some(line) = self.line.get() else {
            return room(&self.config, snapshot, plan.resident, plan.reserved);
        };
        let reclaimable = line.reclaimable_bytes();
        Room { reclaimable, ..room(&self.config, snapshot, plan.resident + line.device_bytes(), plan.reserved) }
    }

    /// The room a render has when this worker holds its models alone: what it holds beyond
    /// them (jobs in flight, arena cache, the LoRA pool's sets) is given back when it idles, so
    /// it counts as free; busy or not, the answer is the same. Where the driver does not report
    /// this process's usage, only what the card has free now can count.
    fn idle_room(&self, snapshot: &GpuSnapshot, plan: &Plan) -> u64 {
        room(&self.config, snapshot, plan.resident, u64::MAX).budget
    }

    fn line_bytes(&self) -> u64 {
        self.line.get().map_or(0, |line| line.device_bytes())
    }

    fn planned(&self, plan: &Plan, shape: Shape) -> u64 {
        (plan.estimate.need(shape) as f64 * (1.0 + self.config.safety)).ceil() as u64
    }
}

#[cfg(test)]
mod tests {
        use super::*;

    /// A card whose readings the test sets: exact numbers for the arithmetic.
    struct Scripted(Mutex<GpuSnapshot>);

    impl GpuProbe for Scripted {
        fn snapshot(&self) -> Result<GpuSnapshot, ProbeError> {
            Ok(self.0.lock().unwrap().clone())
        }
        fn start_peak(&self) -> Result<u64, ProbeError> {
            Ok(0)
        }
        fn peak_since_start(&self) -> Result<u64, ProbeError> {
            Ok(0)
        }
    }

    const TOTAL: u64 = 4096 * MIB;
    const RESIDENT: u64 = 1000 * MIB;

    /// A 4 GiB card with 1000 MiB of models; `ours` beyond them, `others` by other processes.
    fn card(ours: u64, others: u64, own_known: bool) -> GpuSnapshot {
        let used = RESIDENT + ours + others;
        GpuSnapshot {
            device: "scripted".into(),
            total: TOTAL,
            used,
            free: TOTAL - used,
            own_used: own_known.then_some(RESIDENT + ours),
            utilization: None,
            temperature_c: None,
        }
    }

    /// Needs of 300 MiB + 4 KiB per unit: one 1024x1024 image is 428 MiB, 470.8 planned.
    fn estimate() -> Estimate {
        let samples = [512, 1024].map(|side| {
            let shape = Shape::new(side, side, 1);
            Sample { shape, peak_bytes: 300 * MIB + 4096 * shape.units() as u64 }
        });
        Estimate::calibrate(&samples).unwrap()
    }

    fn budget(snapshot: GpuSnapshot) -> (Budget, Arc<Scripted>) {
        let probe = Arc::new(Scripted(Mutex::new(snapshot)));
        let config = BudgetConfig { snapshot_max_age_ms: 0, ..BudgetConfig::default() };
        (Budget::new(config, probe.clone(), estimate(), RESIDENT).unwrap(), probe)
    }

    #[test]
    fn room_is_the_lower_of_the_cap_and_what_others_leave_free() {
        // Cap: 4096 x 0.9 - 1000 resident - 512 reserve = 2174.4 MiB; free: 3096 - 256 margin.
        let (budget, probe) = budget(card(0, 0, true));
        assert_eq!(budget.status().unwrap().budget, (TOTAL as f64 * 0.9) as u64 - RESIDENT - 512 * MIB);
        // Another process takes 1500 MiB: free 1596 - 256 margin is now the bound.
        *probe.0.lock().unwrap() = card(0, 1500 * MIB, true);
        let status = budget.status().unwrap();
        assert_eq!(status.budget, 1340 * MIB);
        assert_eq!(status.others_used, Some(1500 * MIB));
    }

    #[test]
    fn only_in_flight_usage_counts_back_as_free() {
        // 800 MiB of idle arena cache: used until the arenas are shrunk, whoever NVML says
        // holds it (free 796 - 256 margin).
        let (idle, _) = budget(card(800 * MIB, 1500 * MIB, true));
        assert_eq!(idle.status().unwrap().budget, 540 * MIB);
        let (unknown, _) = budget(card(800 * MIB, 1500 * MIB, false));
        assert_eq!(unknown.status().unwrap().budget, 540 * MIB);
        // A job in flight reserved 470.8 MiB and holds 400 MiB of it: that much is its own, so
        // it counts back (and its reservation is taken from the room instead).
        let (busy, probe) = budget(card(0, 1500 * MIB, true));
        let reservation = busy.reserve(1024, 1024, 1, 0).unwrap().unwrap();
        *probe.0.lock().unwrap() = card(400 * MIB, 1500 * MIB, true);
        let status = busy.status().unwrap();
        assert_eq!(status.budget, 1340 * MIB);
        assert_eq!(status.available, 1340 * MIB - reservation.bytes());
        // What it holds beyond its reservation (cache of an earlier, larger render) does not.
        *probe.0.lock().unwrap() = card(800 * MIB, 1500 * MIB, true);
        assert_eq!(busy.status().unwrap().budget, 540 * MIB + reservation.bytes());
    }

    #[test]
    fn a_busy_worker_admits_when_idle_what_its_card_holds_idle() {
        // Idle with no cache: 1340 MiB of room beside the other process holds xs..xl (l 646.8,
        // xl 893.2 MiB planned).
        let (budget, probe) = budget(card(0, 1500 * MIB, true));
        assert_eq!(budget.admits_when_idle(MemoryClass::ALL).unwrap(), MemoryClass::ALL);
        // Busy: a render holds 400 MiB of its 470.8 reserved and the arenas cache 800 MiB more;
        // the room now is 540 MiB (no xl, no l beside the job), but all of it goes back when the
        // worker idles, so it still admits every class (and tells the fleet so), and one image
        // of each still fits the card.
        let _job = budget.reserve(1024, 1024, 1, 0).unwrap().unwrap();
        *probe.0.lock().unwrap() = card(1200 * MIB, 1500 * MIB, true);
        assert!(budget.status().unwrap().available < budget.planned(1536, 1536, 1));
        assert_eq!(budget.admits_when_idle(MemoryClass::ALL).unwrap(), MemoryClass::ALL);
        assert!(budget.holds_one(2048, 2048, 0).unwrap());
        // Our usage unknown: only what is free now can count (396 - 256 margin: no class).
        *probe.0.lock().unwrap() = card(1200 * MIB, 1500 * MIB, false);
        assert_eq!(budget.admits_when_idle(MemoryClass::ALL).unwrap(), []);
        // Another process grew to 2300 MiB: idle, 396 free + our 400 - 256 margin holds xs..m only.
        *probe.0.lock().unwrap() = card(400 * MIB, 2300 * MIB, true);
        assert_eq!(budget.admits_when_idle(MemoryClass::ALL).unwrap(), [MemoryClass::Xs, MemoryClass::S, MemoryClass::M]);
    }

    #[test]
    fn what_the_process_keeps_outside_its_arenas_counts_beside_the_models() {
        // Kernels loaded since the models: 300 MiB that no shrink gives back.
        let (budget, _) = budget(card(300 * MIB, 0, true));
        let before = budget.status().unwrap();
        budget.outside_arenas(300 * MIB);
        let after = budget.status().unwrap();
        assert_eq!(after.resident, RESIDENT + 300 * MIB);
        assert_eq!(before.budget - after.budget, 300 * MIB, "the card's cap holds them now");
        // A lower reading (taken with less loaded, or a LoRA set counted by its line) changes nothing.
        budget.outside_arenas(100 * MIB);
        assert_eq!(budget.status().unwrap().resident, RESIDENT + 300 * MIB);
    }

    #[test]
    fn admission_counts_jobs_per_class_at_its_largest_size() {
        // 1340 MiB of room; planned one-image needs: xs 365.2, s 409.2, m 470.8, l 646.8, xl 893.2 MiB.
        let (budget, _) = budget(card(0, 1500 * MIB, true));
        let admission = budget.admit(MemoryClass::ALL).unwrap();
        assert_eq!(admission.water, Water::Normal, "61% used");
        let jobs: Vec<u32> = MemoryClass::ALL.iter().map(|&c| admission.jobs(c)).collect();
        assert_eq!(jobs, [3, 3, 2, 2, 1]);
        // Asked only for some classes, it answers only for those.
        assert_eq!(
            budget.admit(&[MemoryClass::Xl, MemoryClass::S]).unwrap().classes(),
            [MemoryClass::S, MemoryClass::Xl]
        );
    }

    #[test]
    fn shrinking_opens_only_where_idle_cache_keeps_a_class_out() {
        // 800 MiB of idle cache: room 540 MiB holds xs..m, not l (646.8) or xl (893.2); given
        // back, the room is 1340 MiB and holds all five.
        let (cached, _) = budget(card(800 * MIB, 1500 * MIB, true));
        let admission = cached.admit(MemoryClass::ALL).unwrap();
        assert_eq!(admission.classes(), [MemoryClass::Xs, MemoryClass::S, MemoryClass::M]);
        assert!(cached.shrinking_opens(MemoryClass::ALL).unwrap());
        // No cache, another process holds the card: xl is out, and a shrink would not change it.
        let (crowded, _) = budget(card(0, 2000 * MIB, true));
        let admission = crowded.admit(MemoryClass::ALL).unwrap();
        assert_eq!(admission.jobs(MemoryClass::Xl), 0);
        assert!(!crowded.shrinking_opens(MemoryClass::ALL).unwrap());
        // Everything fits: nothing to open.
        let (roomy, _) = budget(card(800 * MIB, 0, true));
        assert!(!roomy.shrinking_opens(MemoryClass::ALL).unwrap());
        // Our usage unknown: a class left out may be our cache's doing.
        let (unknown, _) = budget(card(800 * MIB, 1500 * MIB, false));
        assert!(unknown.shrinking_opens(MemoryClass::ALL).unwrap());
    }

    #[test]
    fn reservations_hold_room_until_dropped() {
        let (budget, _) = budget(card(0, 1500 * MIB, true));
        let planned = budget.planned(1024, 1024, 1);
        assert_eq!(planned, (428.0 * MIB as f64 * 1.1).ceil() as u64);
        let first = budget.reserve(1024, 1024, 1, 0).unwrap().expect("room for one");
        let second = budget.reserve(1024, 1024, 1, 0).unwrap().expect("room for two");
        assert!(budget.reserve(1024, 1024, 1, 0).unwrap().is_none(), "1340 MiB holds two 470.8 MiB jobs");
        let status = budget.status().unwrap();
        assert_eq!((status.reserved, status.in_flight), (2 * planned, 2));
        assert_eq!(status.available, 1340 * MIB - 2 * planned);
        // Batches of n plan 1.1 x (300 + 128 n) MiB: none fits beside two jobs, three beside one.
        assert_eq!(budget.largest_batch(1024, 1024, 4, 0).unwrap(), 0);
        drop(first);
        assert_eq!(budget.largest_batch(1024, 1024, 4, 0).unwrap(), 3);
        drop(second);
        assert_eq!(budget.largest_batch(1024, 1024, 4, 0).unwrap(), 4);
        assert_eq!(budget.largest_batch(1024, 1024, 1, 0).unwrap(), 1);
        assert_eq!(budget.status().unwrap().in_flight, 0);
    }

    /// LoRA sets on the device: (bytes, held by a render).
    struct Sets(Mutex<Vec<(u64, bool)>>);

    impl DeviceLine for Sets {
        fn device_bytes(&self) -> u64 {
            self.0.lock().unwrap().iter().map(|(b, _)| b).sum()
        }
        fn reclaimable_bytes(&self) -> u64 {
            self.0.lock().unwrap().iter().filter(|(_, held)| !held).map(|(b, _)| b).sum()
        }
        fn reclaim(&self, bytes: u64) -> u64 {
            let mut sets = self.0.lock().unwrap();
            let mut freed = 0;
            while freed < bytes {
                let Some(i) = sets.iter().position(|(_, held)| !held) else { break };
                freed += sets.remove(i).0;
            }
            freed
        }
    }

    #[test]
    fn lora_sets_are_a_line_of_the_budget_given_back_before_a_job_is_refused() {
        // 2174.4 MiB of room beside the models; two idle 300 MiB sets on the device take 600 of it.
        let (budget, _) = budget(card(0, 0, true));
        let sets = Arc::new(Sets(Mutex::new(vec![(300 * MIB, false), (300 * MIB, false)])));
        budget.count_line(sets.clone());
        let cap = (TOTAL as f64 * 0.9) as u64 - RESIDENT - 512 * MIB;
        let status = budget.status().unwrap();
        assert_eq!((status.line, status.budget), (600 * MIB, cap - 600 * MIB));
        // Sets no render holds are room: every class is admitted as if they were gone.
        assert_eq!(budget.admit(MemoryClass::ALL).unwrap().jobs(MemoryClass::Xl), 2, "2174.4 MiB hold two 893.2 MiB images");
        // One 1024x1024 image (470.8 MiB) beside a 1200 MiB set to place: 1670.8 MiB, over the
        // 1574.4 left; one idle set goes (the plan counts the set to place), then it fits.
        let planned = budget.planned(1024, 1024, 1);
        let mut reservation = budget.reserve(1024, 1024, 1, 1200 * MIB).unwrap().expect("room once a set is given back");
        assert_eq!(sets.device_bytes(), 300 * MIB, "only as much as the job needs is given back");
        assert_eq!(reservation.bytes(), planned + 1200 * MIB);
        // Placed, the set is the line's: the reservation gives its bytes back.
        sets.0.lock().unwrap().push((1200 * MIB, true));
        reservation.release(1200 * MIB);
        assert_eq!(budget.status().unwrap().reserved, planned);
        // A set a render holds is not given back: 2174.4 - 1500 - 470.8 leaves 203.6 MiB, and the
        // idle 300 MiB set makes 503.6: one more image fits, not two.
        let second = budget.reserve(1024, 1024, 1, 0).unwrap().expect("room once the idle set is given back");
        assert_eq!(sets.device_bytes(), 1200 * MIB, "the idle set went for the second image");
        assert_eq!(budget.largest_batch(1024, 1024, 4, 0).unwrap(), 0, "32.8 MiB left beside a held set");
        assert!(budget.reserve(1024, 1024, 1, 0).unwrap().is_none());
        // With nothing in flight every set could go: one image and a 1200 MiB set fit this card.
        drop((reservation, second));
        assert!(budget.holds_one(1024, 1024, 1200 * MIB).unwrap());
        assert!(!budget.holds_one(1024, 1024, 2000 * MIB).unwrap(), "470.8 + 2000 MiB is over the card's 2174.4");
    }

    #[test]
    fn water_closes_admission_whatever_the_plan() {
        let total = 16 * 1024 * MIB;
        let filled = |fraction: f64| {
            let used = (total as f64 * fraction) as u64;
            GpuSnapshot { total, used, free: total - used, own_used: Some(RESIDENT), ..card(0, 0, true) }
        };
        let (budget, probe) = budget(filled(0.93));
        assert!(budget.status().unwrap().available > budget.planned(512, 512, 1), "the plan alone would admit xs");
        assert_eq!(budget.water().unwrap(), Water::Stop);
        assert!(budget.admit(MemoryClass::ALL).unwrap().fits.is_empty());
        *probe.0.lock().unwrap() = filled(0.88);
        assert_eq!(budget.water().unwrap(), Water::Lower);
        assert!(!budget.admit(MemoryClass::ALL).unwrap().fits.is_empty());
        assert_eq!(budget.largest_batch(64, 64, 4, 0).unwrap(), 2, "lower water halves the batch");
        *probe.0.lock().unwrap() = filled(0.5);
        assert_eq!(budget.admit(MemoryClass::ALL).unwrap().water, Water::Normal);
        assert_eq!(budget.largest_batch(64, 64, 4, 0).unwrap(), 4);
    }

    #[test]
    fn an_out_of_memory_raises_the_plan_by_the_safety_margin() {
        let (budget, _) = budget(card(0, 0, true));
        let before = budget.planned(1024, 1024, 2);
        let after = budget.observe_oom(1024, 1024, 2);
        assert_eq!(after, (before as f64 * 1.1).ceil() as u64);
        assert!(budget.planned(1024, 1024, 3) >= after, "larger shapes inherit the floor");
    }

    #[test]
    fn a_share_is_budgeted_as_a_card_of_its_size() {
        // Another worker holds 2600 MiB of the 4 GiB card; this one may use 2500 MiB of it.
        let shared = |others: u64| {
            let probe = Arc::new(Scripted(Mutex::new(card(0, others, true))));
            let config = BudgetConfig { snapshot_max_age_ms: 0, max_mib: Some(2500), ..BudgetConfig::default() };
            (Budget::new(config, probe.clone(), estimate(), RESIDENT).unwrap(), probe)
        };
        let (share, probe) = shared(0);
        // As a 2500 MiB card holding only this worker: 2500 x 0.9 - 1000 resident - 512 reserve.
        let alone = GpuSnapshot { total: 2500 * MIB, used: RESIDENT, free: 2500 * MIB - RESIDENT, ..card(0, 0, true) };
        let (small, _) = budget(alone);
        let status = share.status().unwrap();
        assert_eq!(status.budget, (2500.0 * 0.9 * MIB as f64) as u64 - RESIDENT - 512 * MIB);
        assert_eq!((status.budget, status.total, status.used), {
            let small = small.status().unwrap();
            (small.budget, small.total, small.used)
        });
        // The other worker's 2600 MiB are not in this one's water: 40% of the share, not 88% of
        // the card. But they leave 496 MiB free on the card, less than the share has left.
        *probe.0.lock().unwrap() = card(0, 2600 * MIB, true);
        assert_eq!(share.water().unwrap(), Water::Normal);
        assert_eq!(share.status().unwrap().budget, (496 - 256) * MIB);
        assert_eq!(share.admit(MemoryClass::ALL).unwrap().classes(), [] as [MemoryClass; 0], "xs plans 365.2 MiB");
        // This worker's own renders fill its share: 2350 of 2500 MiB is past stop-fetch.
        let (share, probe) = shared(0);
        *probe.0.lock().unwrap() = card(1350 * MIB, 0, true);
        assert_eq!(share.water().unwrap(), Water::Stop);
    }

    #[test]
    fn the_class_report_says_why_a_class_is_not_served() {
        use MemoryClass::{L, S, Xl, Xs};
        // 540 MiB of room: one image plans xs 365.2, s 409.2, m 470.8, l 646.8, xl 893.2 MiB.
        let (budget, _) = budget(card(0, 2300 * MIB, true));
        let reasons = |report: &ClassReport| report.holds.iter().map(|h| h.hold.reason()).collect::<Vec<_>>();
        let fresh = ClassReport::of(&Classes::Auto, &budget, &Calibration::new(0.1)).unwrap();
        assert_eq!(reasons(&fresh), ["fits", "fits", "fits", "over_budget", "over_budget"]);
        assert_eq!(fresh.served(), [Xs, S, MemoryClass::M]);
        let lines = fresh.lines();
        assert!(lines.contains("xs: served (one 512x512 image plans 365 MiB of 540 MiB of room)"), "{lines}");
        assert!(lines.contains("l: not served (over budget: one 1536x1536 image plans 646 MiB, the room beside the models is 540 MiB)"), "{lines}");
        // A 1024x1024 probe ran out of memory: m and everything larger is past the ceiling.
        let mut calibration = Calibration::new(0.1);
        calibration.ran_out(Shape::new(1024, 1024, 1), 540 * MIB);
        let listed = ClassReport::of(&Classes::List(vec![Xs, L, Xl]), &budget, &calibration).unwrap();
        assert_eq!(reasons(&listed), ["fits", "not_configured", "not_configured", "out_of_memory", "out_of_memory"]);
        assert_eq!(listed.served(), [Xs]);
        assert!(listed.lines().contains("l: not served (out of memory: the 1024x1024x1 probe ran out at start"), "{}", listed.lines());
    }

    #[test]
    fn snapshots_are_cached_for_their_max_age() {
        let probe = Arc::new(Scripted(Mutex::new(card(0, 0, true))));
        let config = BudgetConfig { snapshot_max_age_ms: 60_000, ..BudgetConfig::default() };
        let budget = Budget::new(config, probe.clone(), estimate(), RESIDENT).unwrap();
        let first = budget.status().unwrap().budget;
        *probe.0.lock().unwrap() = card(0, 1500 * MIB, true);
        assert_eq!(budget.status().unwrap().budget, first);
        budget.refresh();
        assert_eq!(budget.status().unwrap().budget, 1340 * MIB);
    }
}
