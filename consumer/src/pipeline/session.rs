//! ONNX Runtime: the process-wide environment, session building per device, and the tensors the
//! pipeline feeds (converted to whatever element type each graph declares).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use half::f16;
use ort::AsPointer;
use ort::environment::Environment;
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::session::Session;
use ort::session::builder::GraphOptimizationLevel;
use ort::value::{DynTensor, DynValue, Tensor, TensorElementType, ValueType};

use super::error::LoadError;
use super::{Device, PipelineOptions};

/// ONNX Runtime allows one environment per process (`ort` refuses a second `build`), so it lives
/// for the whole process and every pipeline shares it.
static ENVIRONMENT: Mutex<Option<(Environment, String)>> = Mutex::new(None);

/// The environment, created on first use from `library` or else `ORT_DYLIB_PATH`, and ONNX
/// Runtime's version.
///
/// # Errors
/// [`LoadError::Runtime`] when no library is named or it cannot be loaded.
pub(crate) fn environment(library: Option<&Path>) -> Result<(Environment, String), LoadError> {
    let mut slot = ENVIRONMENT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(env) = slot.as_ref() {
        return Ok(env.clone());
    }
    let path: PathBuf = match library {
        Some(p) => p.to_path_buf(),
        None => match std::env::var_os("ORT_DYLIB_PATH") {
            Some(p) if !p.is_empty() => p.into(),
            _ => {
                return Err(LoadError::Runtime {
                    path: PathBuf::from("$ORT_DYLIB_PATH"),
                    detail: "not set: run `bash scripts/setup.sh` once, then `source scripts/env.sh`".into(),
                });
            }
        },
    };
    if !path.is_file() {
        return Err(LoadError::Runtime { path, detail: "no such file".into() });
    }
    let runtime_err = |detail: String| LoadError::Runtime { path: path.clone(), detail };
    let env = ort::init_from(&path)
        .map_err(|e| runtime_err(e.to_string()))?
        .with_name("shotfleet")
        .with_telemetry(false)
        .build()
        .map_err(|e| runtime_err(e.to_string()))?;
    let version = library_version(&path).unwrap_or_else(|| ort::info().trim().to_owned());
    *slot = Some((env.clone(), version.clone()));
    Ok((env, version))
}

/// The cap of the CPU arena registered in the environment, once a load asked for one.
static CPU_ARENA_CAP: Mutex<Option<u64>> = Mutex::new(None);

/// Registers one CPU BFC arena of at most `max_mem` bytes as an environment allocator, which
/// sessions built with `session.use_env_allocators=1` share instead of their own uncapped
/// arenas. ONNX Runtime allows one allocator per device in an environment, and the environment
/// is the process's, so the cap is process-wide: the first load that asks for it registers it,
/// later loads must ask for the same cap (or none, which leaves their sessions uncapped).
///
/// # Errors
/// [`LoadError::CpuArena`] when another cap is already registered or ONNX Runtime refuses the
/// arena.
pub(crate) fn cap_cpu_arena(env: &Environment, max_mem: u64) -> Result<(), LoadError> {
    let mut slot = CPU_ARENA_CAP.lock().unwrap_or_else(|p| p.into_inner());
    match *slot {
        Some(cap) if cap == max_mem => return Ok(()),
        Some(cap) => {
            return Err(LoadError::CpuArena {
                detail: format!(
                    "asked for {max_mem} bytes, but this process already capped the CPU arena at {cap} bytes; the cap is process-wide and set by the first load that asks for one"
                ),
            });
        }
        None => {}
    }
    let runtime_err = |e: ort::Error| LoadError::CpuArena { detail: format!("ONNX Runtime cannot register it: {e}") };
    let max_mem = usize::try_from(max_mem).map_err(|_| LoadError::CpuArena { detail: format!("{max_mem} bytes do not fit this platform") })?;
    // kSameAsRequested (1): the arena grows by what a run asks for, no power-of-two overshoot,
    // so the cap is reached only when the live tensors really need it (as on the GPU).
    let keys = [c"max_mem".as_ptr(), c"arena_extend_strategy".as_ptr()];
    let values: [usize; 2] = [max_mem, 1];
    let api = ort::api();
    let mut cfg: *mut ort::sys::OrtArenaCfg = std::ptr::null_mut();
    // SAFETY: keys and values are arrays of the given length that outlive the call; `cfg` is
    // released below whatever the registration gives.
    unsafe { ort::Error::result_from_status((api.CreateArenaCfgV2)(keys.as_ptr(), values.as_ptr(), keys.len(), &mut cfg)) }
        .map_err(runtime_err)?;
    let registered = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Arena, MemoryType::Default).and_then(|info| {
        // SAFETY: env, info and cfg are live; ONNX Runtime copies what it keeps.
        unsafe { ort::Error::result_from_status((api.CreateAndRegisterAllocator)(env.ptr().cast_mut(), info.ptr(), cfg)) }
    });
    // SAFETY: created above, released once.
    unsafe { (api.ReleaseArenaCfg)(cfg) };
    registered.map_err(runtime_err)?;
    *slot = Some(max_mem as u64);
    Ok(())
}

/// Counters of an ONNX Runtime BFC arena (the capped CPU arena, or a session's CUDA arena), bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// The cap (`max_mem`).
    pub limit: u64,
    /// Held by live tensors now.
    pub in_use: u64,
    /// Reserved from the system: in use, or free in the arena's regions.
    pub total_allocated: u64,
    /// The most ever in use at once: the process's peak so far.
    pub max_in_use: u64,
    /// The largest single allocation so far.
    pub max_alloc_size: u64,
    pub num_allocs: u64,
    /// How many times the arena grew by a new region.
    pub num_extensions: u64,
    /// How many times it gave free regions back (`memory.enable_memory_arena_shrinkage`).
    pub num_shrinkages: u64,
}

/// The counters of the arena `session` allocates its tensors from on `device`: on the CPU with
/// `session.use_env_allocators`, the environment's capped arena shared by every capped session of
/// the process; on a GPU, the session's own CUDA arena. `None` when ONNX Runtime gives none (an
/// arena that is not a BFC arena reports no counters).
fn arena_stats(session: &Session, device: &Device) -> Option<ArenaStats> {
    let info = match device {
        Device::Cpu => MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Arena, MemoryType::Default),
        Device::Cuda { gpu, .. } => MemoryInfo::new(AllocationDevice::CUDA, *gpu as i32, AllocatorType::Arena, MemoryType::Default),
    }
    .ok()?;
    let allocator = ort::memory::Allocator::new(session, info).ok()?;
    let api = ort::api();
    let mut kvps: *mut ort::sys::OrtKeyValuePairs = std::ptr::null_mut();
    // SAFETY: the allocator is live for this call; kvps is released below.
    unsafe { ort::Error::result_from_status((api.AllocatorGetStats)(allocator.ptr(), &mut kvps)) }.ok()?;
    let (mut keys, mut values, mut count) = (std::ptr::null(), std::ptr::null(), 0usize);
    // SAFETY: kvps is live; the arrays it gives live as long as it does.
    let pairs: Vec<(String, String)> = unsafe {
        (api.GetKeyValuePairs)(kvps, &mut keys, &mut values, &mut count);
        let pairs = (0..count)
            .map(|i| {
                let text = |p: *const std::ffi::c_char| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
                (text(*keys.add(i)), text(*values.add(i)))
            })
            .collect();
        (api.ReleaseKeyValuePairs)(kvps);
        pairs
    };
    if pairs.is_empty() {
        return None;
    }
    let get = |key: &str| pairs.iter().find(|(k, _)| k == key).and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    Some(ArenaStats {
        limit: get("Limit"),
        in_use: get("InUse"),
        total_allocated: get("TotalAllocated"),
        max_in_use: get("MaxInUse"),
        max_alloc_size: get("MaxAllocSize"),
        num_allocs: get("NumAllocs"),
        num_extensions: get("NumArenaExtensions"),
        num_shrinkages: get("NumArenaShrinkages"),
    })
}

/// "1.31.1" from the library's file name (`libonnxruntime.so.1.31.1`, symlinks followed): the
/// C API's version call lives on the API base, which `ort` keeps private under `load-dynamic`,
/// and the build info names only a commit.
fn library_version(path: &Path) -> Option<String> {
    let real = path.canonicalize().ok()?;
    let name = real.file_name()?.to_str()?;
    let version = name.split_once(".so.").or_else(|| name.split_once(".dylib.")).map(|(_, v)| v)?;
    version.chars().all(|c| c.is_ascii_digit() || c == '.').then(|| version.to_owned())
}

/// The element types the pipeline can feed and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    F32,
    F16,
    I32,
    I64,
}

impl Elem {
    fn from_ort(ty: TensorElementType) -> Option<Elem> {
        match ty {
            TensorElementType::Float32 => Some(Elem::F32),
            TensorElementType::Float16 => Some(Elem::F16),
            TensorElementType::Int32 => Some(Elem::I32),
            TensorElementType::Int64 => Some(Elem::I64),
            _ => None,
        }
    }

    pub(crate) fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F16)
    }
}

/// An input or output of a graph as the session declares it. Dimensions are -1 where dynamic.
#[derive(Debug, Clone)]
pub(crate) struct Port {
    pub name: String,
    pub elem: Elem,
    pub dims: Vec<i64>,
}

impl Port {
    pub(crate) fn rank(&self) -> usize {
        self.dims.len()
    }
}

/// One loaded graph. `Session::run` takes `&mut`, so renders through the same pipeline take
/// turns per graph (one GPU runs one graph at a time anyway).
pub(crate) struct ModelSession {
    pub path: PathBuf,
    session: Mutex<Session>,
    /// Where this graph runs: the pipeline's device, or the CPU for text encoders moved off a
    /// small card ([`PipelineOptions::text_encoders_on_cpu`]).
    pub device: Device,
    pub inputs: Vec<Port>,
    pub outputs: Vec<Port>,
}

impl ModelSession {
    /// Loads `path` for the device in `options`.
    ///
    /// # Errors
    /// [`LoadError::MissingFile`], [`LoadError::Session`] when ONNX Runtime refuses the file, or
    /// [`LoadError::Graph`] when an input or output has a type the pipeline cannot feed.
    pub(crate) fn load(env: &Environment, path: &Path, options: &PipelineOptions) -> Result<ModelSession, LoadError> {
        Self::load_file(env, path, options, Role::Plain)
    }

    /// Loads the UNet with `[cuda.unet]`: the speed options were measured on it, at fixed
    /// shapes, CUDA graphs included. On the 2026-11-30 lease a worker with `fuse_conv_bias` on
    /// every graph died with an illegal memory access once shapes changed (deploy/gpu/RESULTS.md),
    /// so each graph has its own table and the text encoders keep ONNX Runtime's defaults.
    pub(crate) fn load_unet(env: &Environment, path: &Path, options: &PipelineOptions) -> Result<ModelSession, LoadError> {
        Self::load_file(env, path, options, Role::Unet)
    }

    /// Loads the VAE decoder with `[cuda.vae]`.
    pub(crate) fn load_vae(env: &Environment, path: &Path, options: &PipelineOptions) -> Result<ModelSession, LoadError> {
        Self::load_file(env, path, options, Role::Vae)
    }

    fn load_file(env: &Environment, path: &Path, options: &PipelineOptions, role: Role) -> Result<ModelSession, LoadError> {
        if !path.is_file() {
            return Err(LoadError::MissingFile { path: path.to_path_buf() });
        }
        Self::build(env, path, None, options, role)
    }

    /// Loads a graph shipped inside the binary (`name` labels it in errors).
    pub(crate) fn load_bytes(env: &Environment, name: &Path, bytes: &[u8], options: &PipelineOptions) -> Result<ModelSession, LoadError> {
        Self::build(env, name, Some(bytes), options, Role::Plain)
    }

    fn build(env: &Environment, path: &Path, bytes: Option<&[u8]>, options: &PipelineOptions, role: Role) -> Result<ModelSession, LoadError> {
        let session_err = |source: ort::Error| LoadError::Session { path: path.to_path_buf(), source };
        let mut builder = Session::builder(env)
            .map_err(session_err)?
            .with_optimization_level(GraphOptimizationLevel::Level3)
            .map_err(|e| session_err(e.into()))?;
        // Each graph has its own intra-op pool; spinning workers of idle graphs (the encoders
        // while the UNet runs) steal the cores the running one needs: 5x slower on 2 cores.
        builder = builder.with_intra_op_spinning(false).map_err(|e| session_err(e.into()))?;
        if let Some(threads) = options.intra_threads {
            builder = builder.with_intra_threads(threads).map_err(|e| session_err(e.into()))?;
        }
        if options.cpu_arena_max_mem.is_some() {
            // The environment's capped arena (see `cap_cpu_arena`) instead of one per session;
            // weights outside it, so the cap bounds activations, as `gpu_mem_limit` does.
            builder = builder.with_env_allocators().map_err(|e| session_err(e.into()))?;
            builder = builder.with_device_allocated_initializers().map_err(|e| session_err(e.into()))?;
        }
        builder = configure_device(builder, &options.device, role).map_err(session_err)?;
        let session = match bytes {
            Some(bytes) => builder.commit_from_memory(bytes),
            None => builder.commit_from_file(path),
        }
        .map_err(session_err)?;
        let ports = |outlets: &[ort::value::Outlet]| -> Result<Vec<Port>, LoadError> {
            outlets.iter().map(|o| port(path, o.name(), o.dtype())).collect()
        };
        let inputs = ports(session.inputs())?;
        let outputs = ports(session.outputs())?;
        Ok(ModelSession { path: path.to_path_buf(), session: Mutex::new(session), device: options.device.clone(), inputs, outputs })
    }

    /// The counters of the arena this session allocates from on its device.
    pub(crate) fn arena_stats(&self) -> Option<ArenaStats> {
        self.arena_stats_on(&self.device)
    }

    /// The counters of the arena this session allocates from on `device`.
    pub(crate) fn arena_stats_on(&self, device: &Device) -> Option<ArenaStats> {
        arena_stats(&self.lock(), device)
    }

    /// Whether no run holds the session now (a poisoned lock counts as free, as `lock` takes it).
    pub(crate) fn is_idle(&self) -> bool {
        !matches!(self.session.try_lock(), Err(std::sync::TryLockError::WouldBlock))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Session> {
        // A panic inside ONNX Runtime's run leaves nothing half-written on our side.
        self.session.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn input(&self, name: &str) -> Option<&Port> {
        self.inputs.iter().find(|p| p.name == name)
    }

    pub(crate) fn output(&self, name: &str) -> Option<&Port> {
        self.outputs.iter().find(|p| p.name == name)
    }

    /// The input `name`, checked for rank and float-ness, or a [`LoadError::Graph`] saying what
    /// the graph has instead.
    pub(crate) fn require_input(&self, name: &str, rank: Option<usize>, float: bool) -> Result<&Port, LoadError> {
        let port = self.input(name).ok_or_else(|| self.graph_err(format!(
            "no input {name:?} (inputs: {})",
            names(&self.inputs)
        )))?;
        self.check(port, "input", rank, float)
    }

    pub(crate) fn require_output(&self, name: &str, rank: Option<usize>) -> Result<&Port, LoadError> {
        let port = self.output(name).ok_or_else(|| self.graph_err(format!(
            "no output {name:?} (outputs: {})",
            names(&self.outputs)
        )))?;
        self.check(port, "output", rank, true)
    }

    fn check<'p>(&self, port: &'p Port, kind: &str, rank: Option<usize>, float: bool) -> Result<&'p Port, LoadError> {
        if let Some(rank) = rank.filter(|&r| r != port.rank()) {
            return Err(self.graph_err(format!("{kind} {:?} has rank {} (shape {:?}), expected rank {rank}", port.name, port.rank(), port.dims)));
        }
        if float != port.elem.is_float() {
            let want = if float { "float" } else { "integer" };
            return Err(self.graph_err(format!("{kind} {:?} is {:?}, expected {want}", port.name, port.elem)));
        }
        Ok(port)
    }

    pub(crate) fn graph_err(&self, detail: String) -> LoadError {
        LoadError::Graph { path: self.path.clone(), detail }
    }
}

fn names(ports: &[Port]) -> String {
    ports.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
}

fn port(path: &Path, name: &str, ty: &ValueType) -> Result<Port, LoadError> {
    let graph_err = |detail: String| LoadError::Graph { path: path.to_path_buf(), detail };
    let (ty, shape) = match ty {
        ValueType::Tensor { ty, shape, .. } => (*ty, shape),
        other => return Err(graph_err(format!("{name:?} is not a tensor ({other:?})"))),
    };
    let elem = Elem::from_ort(ty).ok_or_else(|| graph_err(format!("{name:?} has unsupported element type {ty:?}")))?;
    Ok(Port { name: name.to_owned(), elem, dims: shape.iter().copied().collect() })
}

/// Which graph a session runs, for its CUDA options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Unet,
    Vae,
    /// The text encoders and graphs shipped in the binary: ONNX Runtime's defaults.
    Plain,
}

#[cfg(not(feature = "cuda"))]
fn configure_device(
    builder: ort::session::builder::SessionBuilder,
    device: &Device,
    _role: Role,
) -> ort::Result<ort::session::builder::SessionBuilder> {
    match device {
        Device::Cpu => Ok(builder),
        Device::Cuda { .. } => Err(ort::Error::new(
            "this build has no CUDA support: build the consumer with `--features cuda`",
        )),
    }
}

/// CUDA, configured as DESIGN.md's "GPU memory" asks: the arena grows only by what is requested
/// (no power-of-two overshoot eating the budget), is capped at the worker's budget, and weights
/// live outside it so shrinking the arena after a large job returns activations only.
/// `role` picks the graph's `[cuda.*]` table (see `ModelSession::load_unet`).
#[cfg(feature = "cuda")]
fn configure_device(
    builder: ort::session::builder::SessionBuilder,
    device: &Device,
    role: Role,
) -> ort::Result<ort::session::builder::SessionBuilder> {
    use ort::ep::cuda::{AttentionBackend, ConvAlgorithmSearch};
    use ort::ep::{ArenaExtendStrategy, CUDA};

    use super::{AttentionKernels, ConvSearch};
    match device {
        Device::Cpu => Ok(builder),
        Device::Cuda { gpu, mem_limit_bytes, cuda: config } => {
            let tuning = match role {
                Role::Unet => config.unet,
                Role::Vae => config.vae,
                // The text encoders and the step graphs: ONNX Runtime's defaults (no convolutions).
                Role::Plain => super::CudaTuning { conv_algo_search: ConvSearch::Exhaustive, ..Default::default() },
            };
            let search = match tuning.conv_algo_search {
                ConvSearch::Exhaustive => ConvAlgorithmSearch::Exhaustive,
                ConvSearch::Heuristic => ConvAlgorithmSearch::Heuristic,
                ConvSearch::Default => ConvAlgorithmSearch::Default,
            };
            let mut cuda = CUDA::default()
                .with_device_id(*gpu as i32)
                .with_arena_extend_strategy(ArenaExtendStrategy::SameAsRequested)
                .with_conv_algorithm_search(search)
                .with_conv_max_workspace(tuning.conv_max_workspace)
                .with_fuse_conv_bias(tuning.fuse_conv_bias)
                .with_cuda_graph(tuning.graph);
            if let Some(limit) = mem_limit_bytes {
                cuda = cuda.with_memory_limit(*limit as usize);
            }
            let attention = match tuning.attention {
                AttentionKernels::Auto => None,
                AttentionKernels::Flash => Some(AttentionBackend::FLASH_ATTENTION),
                AttentionKernels::Efficient => Some(AttentionBackend::EFFICIENT_ATTENTION),
                AttentionKernels::Cudnn => Some(AttentionBackend::CUDNN_FLASH_ATTENTION),
            };
            if let Some(kernels) = attention {
                cuda = cuda.with_attention_backend(kernels);
            }
            Ok(builder
                .with_memory_pattern(tuning.mem_pattern)?
                .with_device_allocated_initializers()?
                .with_execution_providers([cuda.build().error_on_failure()])?)
        }
    }
}

/// A float tensor for `port`, converted to f16 where the graph wants it.
pub(crate) fn float_tensor(port: &Port, shape: &[usize], data: &[f32]) -> ort::Result<DynTensor> {
    let shape = shape.to_vec();
    Ok(match port.elem {
        Elem::F16 => Tensor::from_array((shape, data.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()))?.upcast(),
        _ => Tensor::from_array((shape, data.to_vec()))?.upcast(),
    })
}

/// An integer tensor for `port` (token ids), as i32 or i64.
pub(crate) fn int_tensor(port: &Port, shape: &[usize], data: &[i64]) -> ort::Result<DynTensor> {
    let shape = shape.to_vec();
    Ok(match port.elem {
        Elem::I32 => Tensor::from_array((shape, data.iter().map(|&x| x as i32).collect::<Vec<_>>()))?.upcast(),
        _ => Tensor::from_array((shape, data.to_vec()))?.upcast(),
    })
}

/// A timestep as the UNet declares it: scalar or 1-D of length `batch`, float or integer.
pub(crate) fn timestep_tensor(port: &Port, t: f32, batch: usize) -> ort::Result<DynTensor> {
    let shape: Vec<usize> = if port.rank() == 0 { vec![] } else { vec![batch] };
    let n = shape.iter().product::<usize>().max(1);
    Ok(match port.elem {
        Elem::F32 => Tensor::from_array((shape, vec![t; n]))?.upcast(),
        Elem::F16 => Tensor::from_array((shape, vec![f16::from_f32(t); n]))?.upcast(),
        Elem::I32 => Tensor::from_array((shape, vec![t as i32; n]))?.upcast(),
        Elem::I64 => Tensor::from_array((shape, vec![t as i64; n]))?.upcast(),
    })
}

/// A float output read back as f32 with its shape.
pub(crate) fn extract_f32(value: &DynValue) -> Result<(Vec<usize>, Vec<f32>), String> {
    if let Ok((shape, data)) = value.try_extract_tensor::<f32>() {
        return Ok((dims(shape), data.to_vec()));
    }
    if let Ok((shape, data)) = value.try_extract_tensor::<f16>() {
        return Ok((dims(shape), data.iter().map(|x| x.to_f32()).collect()));
    }
    Err(format!("expected a float tensor, got {:?}", value.dtype()))
}

fn dims(shape: &ort::value::Shape) -> Vec<usize> {
    shape.iter().map(|&d| d as usize).collect()
}
