//! The budget on the simulated GPU, with real memory: "renders" here allocate and touch a known
//! number of bytes, and the simulation must see them through the kernel's accounting.
//!
//! Peaks are process-wide (`VmHWM`), so these tests rely on nextest's one process per test.

use std::hint::black_box;
use std::sync::Arc;

use shotfleet_consumer::budget::{
    Budget, BudgetConfig, Estimate, GpuProbe, MIB, PeakWindow, ProbeError, SIMULATED_DEVICE, Sample, Shape,
    SimulateConfig, SimulatedGpu, Water, open_probe,
};
use shotfleet_schema::MemoryClass;

/// The stand-in render's memory: 16 MiB whatever the size, 1 KiB per latent pixel of the batch.
const FIXED: u64 = 16 * MIB;
const PER_UNIT: u64 = 1024;

fn simulate(total_mib: u64) -> SimulateConfig {
    SimulateConfig { total_mib, others_used_mib: 0 }
}

/// Allocates and writes `bytes`, as a render's activations would be, then frees them.
fn touch(bytes: u64) {
    let buffer = vec![1_u8; usize::try_from(bytes).unwrap()];
    black_box(&buffer);
}

/// Runs the stand-in render of `shape` and returns its peak as the simulation measured it.
fn measured_render(probe: &dyn GpuProbe, shape: Shape) -> u64 {
    let window = PeakWindow::start(probe).unwrap();
    touch(FIXED + PER_UNIT * shape.units() as u64);
    window.finish().unwrap()
}

#[test]
fn simulated_peak_sees_a_real_allocation() {
    let gpu = SimulatedGpu::new(&simulate(4096)).unwrap();
    let before = gpu.snapshot().unwrap();
    let window = PeakWindow::start(&gpu).unwrap();
    touch(64 * MIB);
    let peak = window.finish().unwrap();
    // Within a few MiB: the allocator may reuse pages the process already held.
    assert!((60 * MIB..72 * MIB).contains(&peak), "peak {} MiB", peak / MIB);
    // The memory is gone again: the peak came from the high-water mark, not from what is held.
    let after = gpu.snapshot().unwrap();
    assert!(after.used < before.used + 16 * MIB, "used {} -> {} MiB", before.used / MIB, after.used / MIB);
    assert_eq!(after.device, SIMULATED_DEVICE);
    // A second window starts from the current size, not from the old mark.
    let window = PeakWindow::start(&gpu).unwrap();
    assert!(window.finish().unwrap() < 8 * MIB);
}

#[test]
fn a_peak_must_be_started_before_it_is_read() {
    let gpu = SimulatedGpu::new(&simulate(4096)).unwrap();
    assert!(matches!(gpu.peak_since_start(), Err(ProbeError::PeakNotStarted)));
}

#[test]
fn simulated_usage_is_this_process_plus_the_configured_others() {
    let gpu = SimulatedGpu::new(&SimulateConfig { total_mib: 4096, others_used_mib: 1000 }).unwrap();
    let snapshot = gpu.snapshot().unwrap();
    let own = snapshot.own_used.expect("the simulation knows its own usage");
    assert_eq!(snapshot.total, 4096 * MIB);
    assert_eq!(snapshot.used - own, 1000 * MIB);
    assert_eq!(snapshot.free, snapshot.total - snapshot.used);
    // Models that load and stay are resident.
    let models = vec![1_u8; 64 * MIB as usize];
    let loaded = gpu.snapshot().unwrap();
    assert!(loaded.resident_since(&snapshot) >= 64 * MIB);
    drop(models);
    gpu.set_others_used(3000 * MIB);
    let later = gpu.snapshot().unwrap();
    assert_eq!(later.used - later.own_used.unwrap(), 3000 * MIB);
}

#[test]
fn the_probe_is_what_the_config_says_never_a_fallback() {
    let cpu_without_simulation = open_probe(&BudgetConfig::default(), None).err().unwrap();
    assert!(matches!(cpu_without_simulation, ProbeError::SimulationRequired));
    assert!(cpu_without_simulation.to_string().contains("[budget.simulate]"));
    let simulated = BudgetConfig { simulate: Some(simulate(4096)), ..BudgetConfig::default() };
    assert!(matches!(open_probe(&simulated, Some(0)), Err(ProbeError::SimulationOnGpu { index: 0 })));
    assert_eq!(open_probe(&simulated, None).unwrap().snapshot().unwrap().device, SIMULATED_DEVICE);
}

/// Calibrates from measured peaks, admits by class, reacts to another process taking memory,
/// and learns from an observed render: the worker's whole use of the budget, on the CPU.
#[test]
fn calibrated_budget_admits_and_learns_on_the_simulation() {
    let config = BudgetConfig { simulate: Some(simulate(4096)), snapshot_max_age_ms: 0, ..BudgetConfig::default() };
    let gpu = Arc::new(SimulatedGpu::new(config.simulate.as_ref().unwrap()).unwrap());
    let before_load = gpu.snapshot().unwrap();
    let resident = gpu.snapshot().unwrap().resident_since(&before_load);

    // Probe renders from the smallest up.
    let samples: Vec<Sample> = [512, 768, 1024]
        .map(|side| Shape::new(side, side, 1))
        .map(|shape| Sample { shape, peak_bytes: measured_render(&*gpu, shape) })
        .into();
    let estimate = Estimate::calibrate(&samples).unwrap();
    let terms = estimate.coefficients();
    assert!((terms.fixed - FIXED as f64).abs() < 2.0 * MIB as f64, "{terms:?}");
    // One image per probe: the batch and the image size cannot be told apart, and the
    // simplest model (per unit) takes it all.
    assert!((terms.per_unit / PER_UNIT as f64 - 1.0).abs() < 0.05, "{terms:?}");

    let budget = Budget::new(config, gpu.clone(), estimate, resident).unwrap();
    let roomy = budget.admit(MemoryClass::ALL).unwrap();
    assert_eq!(roomy.classes(), MemoryClass::ALL);
    assert!(roomy.jobs(MemoryClass::Xl) > 10, "{roomy:?}");

    // Another process takes 3500 of 4096 MiB: about 340 MiB of room is left, and the card is
    // past the lower-batch level.
    gpu.set_others_used(3500 * MIB);
    let crowded = budget.admit(MemoryClass::ALL).unwrap();
    assert_eq!(crowded.water, Water::Lower);
    let xl = budget.planned(2048, 2048, 1);
    let room = budget.status().unwrap().available;
    assert_eq!(crowded.jobs(MemoryClass::Xl), u32::try_from(room / xl).unwrap());
    assert!(crowded.jobs(MemoryClass::Xl) < roomy.jobs(MemoryClass::Xl));
    gpu.set_others_used(0);

    // A real batch the calibration never rendered: the estimate was close, and learns from it.
    let reservation = budget.reserve(1024, 1024, 2, 0).unwrap().expect("room for a batch of two");
    let peak = measured_render(&*gpu, Shape::new(1024, 1024, 2));
    drop(reservation);
    let error = budget.observe(1024, 1024, 2, peak);
    assert!(error.abs() < 0.05, "estimate error {error}");
    assert!(budget.planned(1024, 1024, 2) as f64 >= peak as f64 * (1.0 + budget.config().safety) - 1.0);
}
