//! The real card, read through NVML.
//!
//! NVML is loaded at run time (`libnvidia-ml.so` ships with the driver), so this builds and links
//! on machines without a GPU; opening it there fails with [`ProbeError::NvmlUnavailable`], never
//! a silent simulation.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::lock;
use super::probe::{GpuProbe, GpuSnapshot, PeakSampler, ProbeError};
use super::visible::{CardRef, Visible};

/// Fine enough to catch a UNet step's activations; one NVML memory query costs microseconds.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// The card that is CUDA's device `ordinal` in this process (the one ONNX Runtime renders on),
/// read through NVML: `CUDA_VISIBLE_DEVICES` is honoured (`visible.rs`).
pub struct NvmlProbe {
    nvml: Arc<Nvml>,
    index: u32,
    name: String,
    sampler: Mutex<Option<PeakSampler>>,
}

impl NvmlProbe {
    /// # Errors
    ///
    /// [`ProbeError::NvmlUnavailable`] without a driver or library, [`ProbeError::NoDevice`]
    /// for an index the machine does not have, [`ProbeError::NotVisible`] for a device
    /// `CUDA_VISIBLE_DEVICES` does not make visible.
    pub fn open(ordinal: u32) -> Result<Self, ProbeError> {
        let nvml = Nvml::init().map_err(|source| ProbeError::NvmlUnavailable { source })?;
        let index = nvml_index(&nvml, ordinal, &Visible::of_this_process())?;
        let device = nvml.device_by_index(index).map_err(|source| ProbeError::NoDevice { index, source })?;
        let name = device.name().map_err(|source| ProbeError::Nvml { call: "name", index, source })?;
        Ok(Self { nvml: Arc::new(nvml), index, name, sampler: Mutex::new(None) })
    }
}

impl GpuProbe for NvmlProbe {
    fn snapshot(&self) -> Result<GpuSnapshot, ProbeError> {
        let index = self.index;
        let err = |call| move |source| ProbeError::Nvml { call, index, source };
        let device = self.nvml.device_by_index(index).map_err(err("device_by_index"))?;
        let memory = device.memory_info().map_err(err("memory_info"))?;
        let utilization = optional(device.utilization_rates()).map_err(err("utilization_rates"))?;
        let temperature_c = optional(device.temperature(TemperatureSensor::Gpu)).map_err(err("temperature"))?;
        let own_used = own_usage(&device).map_err(err("running_compute_processes"))?;
        Ok(GpuSnapshot {
            device: self.name.clone(),
            total: memory.total,
            used: memory.used,
            free: memory.free,
            own_used,
            utilization: utilization.map(|u| f64::from(u.gpu) / 100.0),
            temperature_c,
        })
    }

    fn start_peak(&self) -> Result<u64, ProbeError> {
        let mut sampler = lock(&self.sampler);
        if let Some(old) = sampler.take() {
            old.finish();
        }
        // Decided once per window, so the start and the samples are of the same thing.
        let (start, measure) = match read(&self.nvml, self.index, Measure::Process)? {
            Some(own) => (own, Measure::Process),
            None => (read(&self.nvml, self.index, Measure::Card)?.unwrap_or(0), Measure::Card),
        };
        let (nvml, index) = (Arc::clone(&self.nvml), self.index);
        *sampler = Some(PeakSampler::start(SAMPLE_EVERY, start, move || read(&nvml, index, measure).ok().flatten()));
        Ok(start)
    }

    fn peak_since_start(&self) -> Result<u64, ProbeError> {
        lock(&self.sampler).take().map(PeakSampler::finish).ok_or(ProbeError::PeakNotStarted)
    }
}

/// What a peak is measured in: this process's memory where NVML reports it, else the card's.
#[derive(Debug, Clone, Copy)]
enum Measure {
    Process,
    Card,
}

fn read(nvml: &Nvml, index: u32, measure: Measure) -> Result<Option<u64>, ProbeError> {
    let err = |call| move |source| ProbeError::Nvml { call, index, source };
    let device = nvml.device_by_index(index).map_err(err("device_by_index"))?;
    match measure {
        Measure::Process => own_usage(&device).map_err(err("running_compute_processes")),
        Measure::Card => Ok(Some(device.memory_info().map_err(err("memory_info"))?.used)),
    }
}

/// This process's memory on the card, if NVML can tell (not inside a PID namespace it cannot
/// see, not under WDDM).
fn own_usage(device: &Device<'_>) -> Result<Option<u64>, NvmlError> {
    let pid = std::process::id();
    let processes = optional(device.running_compute_processes())?.unwrap_or_default();
    Ok(processes.into_iter().find(|p| p.pid == pid).and_then(|p| match p.used_gpu_memory {
        UsedGpuMemory::Used(bytes) => Some(bytes),
        UsedGpuMemory::Unavailable => None,
    }))
}

/// A query some cards do not answer (temperature on some boards, utilization under MIG) is
/// absent, not an error; every other error, a lost GPU above all, still is one.
fn optional<T>(result: Result<T, NvmlError>) -> Result<Option<T>, NvmlError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(NvmlError::NotSupported | NvmlError::NoPermission) => Ok(None),
        Err(other) => Err(other),
    }
}

/// A card as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardInfo {
    /// NVML's index (PCI bus order; `nvidia-smi -i`).
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_bytes: u64,
}

/// The cards CUDA sees under `visible`, in CUDA's order (the first is CUDA's device 0).
///
/// # Errors
/// NVML unavailable, or an entry of `visible` that names no card.
pub fn visible_cards(visible: &Visible) -> Result<Vec<CardInfo>, ProbeError> {
    let nvml = Nvml::init().map_err(|source| ProbeError::NvmlUnavailable { source })?;
    let count = match visible {
        Visible::All => nvml.device_count().map_err(|source| ProbeError::Nvml { call: "device_count", index: 0, source })?,
        Visible::Listed(cards) => cards.len() as u32,
    };
    (0..count)
        .map(|ordinal| {
            let index = nvml_index(&nvml, ordinal, visible)?;
            let err = |call| move |source| ProbeError::Nvml { call, index, source };
            let device = nvml.device_by_index(index).map_err(|source| ProbeError::NoDevice { index, source })?;
            Ok(CardInfo {
                index,
                uuid: device.uuid().map_err(err("uuid"))?,
                name: device.name().map_err(err("name"))?,
                total_bytes: device.memory_info().map_err(err("memory_info"))?.total,
            })
        })
        .collect()
}

/// NVML's index of CUDA's device `ordinal` under `visible`.
fn nvml_index(nvml: &Nvml, ordinal: u32, visible: &Visible) -> Result<u32, ProbeError> {
    let not_visible = |detail: String| ProbeError::NotVisible { ordinal, detail };
    match visible.card(ordinal).map_err(not_visible)? {
        CardRef::Index(index) => Ok(index),
        CardRef::Uuid(prefix) => {
            let count = nvml.device_count().map_err(|source| ProbeError::Nvml { call: "device_count", index: 0, source })?;
            let matching: Vec<u32> = (0..count)
                .filter(|&index| nvml.device_by_index(index).and_then(|d| d.uuid()).is_ok_and(|uuid| uuid.starts_with(&prefix)))
                .collect();
            match matching[..] {
                [index] => Ok(index),
                [] => Err(not_visible(format!("no card's UUID starts with `{prefix}` (nvidia-smi -L lists them)"))),
                _ => Err(not_visible(format!("`{prefix}` begins the UUIDs of cards {matching:?}; give more of it"))),
            }
        }
        CardRef::Mig(id) => Err(not_visible(format!(
            "`{id}` is a MIG instance; a worker budgets a whole card (give it the card's UUID, or an index)"
        ))),
    }
}

/// Watches CUDA's device `ordinal` (the card [`NvmlProbe::open`] reads) for NVML's critical events (XID errors, double-bit ECC errors) on a thread
/// of its own, calling `on_fault` with what happened. NVML delivers XIDs such as 79 ("fallen off
/// the bus") or 48 (double-bit ECC) here before a CUDA call fails, so the worker can stop taking
/// jobs at once. The thread ends when `stop` is set or the card cannot report events (then it
/// logs why: some virtualised cards and older drivers have no event support).
///
/// # Errors
/// NVML or the device could not be opened.
pub fn watch_critical_events(
    ordinal: u32,
    stop: Arc<std::sync::atomic::AtomicBool>,
    on_fault: impl Fn(String) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, ProbeError> {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    use std::sync::atomic::Ordering;

    let nvml = Nvml::init().map_err(|source| ProbeError::NvmlUnavailable { source })?;
    let index = nvml_index(&nvml, ordinal, &Visible::of_this_process())?;
    nvml.device_by_index(index).map_err(|source| ProbeError::NoDevice { index, source })?;
    Ok(std::thread::Builder::new()
        .name(format!("nvml-events-gpu{index}"))
        .spawn(move || {
            let events = nvml
                .create_event_set()
                .map_err(|e| e.to_string())
                .and_then(|set| {
                    let device = nvml.device_by_index(index).map_err(|e| e.to_string())?;
                    device
                        .register_events(EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR, set)
                        .map_err(|e| e.to_string())
                });
            let events = match events {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!(gpu = index, error = %e, "NVML events unavailable; driver faults are seen through CUDA errors only");
                    return;
                }
            };
            while !stop.load(Ordering::Relaxed) {
                match events.wait(1000) {
                    Ok(event) => {
                        let what = match event.event_data {
                            Some(XidError::Value(xid)) => format!("NVML critical XID error {xid}"),
                            Some(XidError::Unknown) => "NVML critical XID error (unknown)".to_owned(),
                            None => format!("NVML event {:?}", event.event_type),
                        };
                        on_fault(what);
                        return;
                    }
                    Err(NvmlError::Timeout) => {}
                    Err(NvmlError::GpuLost) => {
                        on_fault("NVML: GPU is lost (fallen off the bus)".to_owned());
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(gpu = index, error = %e, "NVML event wait failed; no longer watching");
                        return;
                    }
                }
            }
        })
        .expect("spawn the NVML event thread"))
}
