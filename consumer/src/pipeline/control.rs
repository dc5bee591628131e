//! Stopping a render from another thread: the worker's per-job time limit.
//!
//! Every ONNX Runtime run of a render goes through [`RunOptions`] that a [`CancelHandle`] can
//! terminate (`RunOptions::terminate`): the graph in progress stops at its next node, and the
//! render returns [`RenderError::Terminated`]. Between runs the pipeline checks the handle too,
//! so a cancel between two UNet steps stops the render before the next one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ort::session::RunOptions;

use super::Device;
use super::error::{RenderError, Stage};

/// Stops renders from another thread. Clones share one state: the worker keeps one clone
/// (its time limit), the render thread passes another to [`Pipeline::render_cancellable`].
///
/// Once cancelled, a handle stays cancelled: every render given it, now or later, stops with
/// [`RenderError::Terminated`]. Use one handle per job.
///
/// [`Pipeline::render_cancellable`]: super::Pipeline::render_cancellable
#[derive(Clone, Default)]
pub struct CancelHandle {
    state: Arc<CancelState>,
}

#[derive(Default)]
struct CancelState {
    cancelled: AtomicBool,
    /// The run options of renders in progress, terminated on cancel.
    runs: Mutex<Vec<Weak<RunOptions>>>,
}

impl CancelHandle {
    pub fn new() -> CancelHandle {
        CancelHandle::default()
    }

    /// Stops the render in progress (ONNX Runtime stops the running graph at its next node;
    /// this call does not wait for it) and every later render given this handle.
    pub fn cancel(&self) {
        // Flag first, then terminate under the lock: `attach` checks the flag under the same
        // lock, so a run is either terminated here or sees the flag there.
        self.state.cancelled.store(true, Ordering::SeqCst);
        let runs = self.state.runs.lock().unwrap_or_else(|p| p.into_inner());
        for options in runs.iter().filter_map(Weak::upgrade) {
            if let Err(e) = options.terminate() {
                tracing::warn!(error = %e, "cannot set the terminate flag of a render");
            }
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.state.cancelled.load(Ordering::SeqCst)
    }

    fn attach(&self, options: &Arc<RunOptions>) -> ort::Result<()> {
        let mut runs = self.state.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.retain(|w| w.strong_count() > 0);
        runs.push(Arc::downgrade(options));
        if self.is_cancelled() {
            options.terminate()?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for CancelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelHandle").field("cancelled", &self.is_cancelled()).finish()
    }
}

/// When a render's runs shrink the arena (run option `memory.enable_memory_arena_shrinkage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shrink {
    Never,
    /// `AtEnd` if [`Pipeline::request_arena_shrink`] asked since the last render, else `Never`.
    ///
    /// [`Pipeline::request_arena_shrink`]: super::Pipeline::request_arena_shrink
    Requested,
    /// The last UNet and VAE runs ([`Pipeline::request_arena_shrink`]); a VAE that does not
    /// keep its arena shrinks after every run anyway ([`Runs::decode`]).
    ///
    /// [`Pipeline::request_arena_shrink`]: super::Pipeline::request_arena_shrink
    AtEnd,
    /// Every run, text encoders included when they run on the render's device
    /// ([`Pipeline::shrink_arenas`]'s tiny render; [`Runs::plain_on`]).
    ///
    /// [`Pipeline::shrink_arenas`]: super::Pipeline::shrink_arenas
    EveryRun,
}

/// Whether a render decodes its latents into images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decode {
    Images,
    /// The UNet's latents are left undecoded: the arena shrink's tiny render where the decoder's
    /// arena holds nothing to give back ([`Pipeline::shrink_arenas`]).
    ///
    /// [`Pipeline::shrink_arenas`]: super::Pipeline::shrink_arenas
    Skip,
}

/// The run options of one render: plain ones, and ones that also shrink the arena; both
/// terminate with the handle.
pub(crate) struct Runs {
    plain: Arc<RunOptions>,
    shrinking: Arc<RunOptions>,
    shrink: Shrink,
    handle: CancelHandle,
    /// The arenas `shrinking` names, as ONNX Runtime writes them ([`arenas_of`]).
    arenas: String,
}

/// The arenas a shrinking run on `device` names, as ONNX Runtime writes them.
fn arenas_of(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu:0".to_owned(),
        Device::Cuda { gpu, .. } => format!("gpu:{gpu}"),
    }
}

impl Runs {
    /// `device`: whose arenas the shrinking runs shrink.
    pub(crate) fn new(handle: &CancelHandle, shrink: Shrink, device: &Device) -> Result<Runs, RenderError> {
        let err = RenderError::runtime(Stage::TextEncode);
        let plain = Arc::new(RunOptions::new().map_err(err)?);
        handle.attach(&plain).map_err(err)?;
        let arenas = arenas_of(device);
        let mut shrinking = RunOptions::new().map_err(err)?;
        shrinking.set("memory.enable_memory_arena_shrinkage", arenas.as_str()).map_err(err)?;
        let shrinking = Arc::new(shrinking);
        handle.attach(&shrinking).map_err(err)?;
        Ok(Runs { plain, shrinking, shrink, handle: handle.clone(), arenas })
    }

    /// Options for a run that is not a graph's last of the render.
    pub(crate) fn plain(&self) -> &RunOptions {
        self.last(false)
    }

    /// Options for a run of a graph whose session runs on `device`, which may not be the
    /// render's (text encoders moved to the CPU of a small card). Such a run never shrinks:
    /// ONNX Runtime fails a run whose shrink list names a device the session has no arena on
    /// ("Did not find an arena based allocator registered for device-id combination"), and the
    /// host's arena is not the card's budget anyway.
    pub(crate) fn plain_on(&self, device: &Device) -> &RunOptions {
        if arenas_of(device) == self.arenas { self.plain() } else { &self.plain }
    }

    /// Options for a run; `is_last`: the graph's last run of the render.
    pub(crate) fn last(&self, is_last: bool) -> &RunOptions {
        match self.shrink {
            Shrink::EveryRun => &self.shrinking,
            Shrink::AtEnd if is_last => &self.shrinking,
            Shrink::AtEnd | Shrink::Requested | Shrink::Never => &self.plain,
        }
    }

    /// Options for a VAE decoder run that does not keep its arena, whatever the render's
    /// [`Shrink`]: they shrink it at the end of the run, so that every decode starts from the
    /// weights alone (vae.rs says why).
    pub(crate) fn decode(&self) -> &RunOptions {
        &self.shrinking
    }

    /// Options for a UNet run in a session that captures CUDA graphs: `gpu_graph_id` names the
    /// graph to capture or replay, -1 runs without one. Never shrinking: a captured graph keeps
    /// the addresses of its arena's regions.
    pub(crate) fn for_graph(&self, id: i32) -> Result<Arc<RunOptions>, RenderError> {
        let err = RenderError::runtime(Stage::Unet);
        let mut options = RunOptions::new().map_err(err)?;
        options.set("gpu_graph_id", id.to_string()).map_err(err)?;
        let options = Arc::new(options);
        self.handle.attach(&options).map_err(err)?;
        Ok(options)
    }

    /// [`RenderError::Terminated`] once the handle is cancelled.
    pub(crate) fn check(&self, stage: Stage) -> Result<(), RenderError> {
        if self.handle.is_cancelled() { Err(RenderError::Terminated { stage }) } else { Ok(()) }
    }

    /// Maps an ONNX Runtime error of `stage`: a run stopped by the handle becomes
    /// [`RenderError::Terminated`], anything else stays [`RenderError::Runtime`].
    pub(crate) fn err(&self, stage: Stage) -> impl Fn(ort::Error) -> RenderError + Copy + '_ {
        move |source| {
            if self.handle.is_cancelled() { RenderError::Terminated { stage } } else { RenderError::Runtime { stage, source } }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::CudaConfig;

    /// A render on the card whose text encoders run on the CPU: every run of theirs takes the
    /// plain options, even when the render shrinks every run. A CUDA run cannot happen here, so
    /// this checks the choice of options.
    #[test]
    fn a_graph_on_another_device_takes_options_that_never_shrink() {
        crate::pipeline::session::environment(None).expect("ONNX Runtime: source scripts/env.sh");
        let card = Device::Cuda { gpu: 0, mem_limit_bytes: None, cuda: CudaConfig::default() };
        let runs = Runs::new(&CancelHandle::new(), Shrink::EveryRun, &card).unwrap();
        assert!(std::ptr::eq(runs.plain_on(&card), &*runs.shrinking), "the card's graphs shrink every run");
        assert!(std::ptr::eq(runs.plain_on(&Device::Cpu), &*runs.plain), "a CPU graph beside them never shrinks");

        let on_cpu = Runs::new(&CancelHandle::new(), Shrink::EveryRun, &Device::Cpu).unwrap();
        assert!(std::ptr::eq(on_cpu.plain_on(&Device::Cpu), &*on_cpu.shrinking), "all on the CPU: the CPU arena shrinks");
    }
}
