//! Merged weights placed where the graphs run, ready to bind.

use std::fmt;
use std::sync::Mutex;

use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::value::{DynTensor, Tensor, TensorRef};
use shotfleet_schema::lora::Part;

use super::error::LoraError;
use super::merge::{Override, Values};
use super::super::Device;
use super::super::session::ModelSession;

/// A LoRA set merged into the model's weights, in host memory: what the pool keeps when a set
/// leaves the device, to place it again without merging.
pub struct MergedSet {
    pub(crate) overrides: Vec<Override>,
    bytes: u64,
}

impl MergedSet {
    pub(crate) fn new(overrides: Vec<Override>) -> MergedSet {
        let bytes = overrides.iter().map(Override::bytes).sum();
        MergedSet { overrides, bytes }
    }

    /// Bytes of the merged weights: what the set takes in host memory, and on the device once placed.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Merged initializers.
    pub fn len(&self) -> usize {
        self.overrides.len()
    }

    pub fn is_empty(&self) -> bool {
        self.overrides.is_empty()
    }
}

/// A LoRA set on the pipeline's device: bound by name in every render that uses it, and in no
/// other. Its tensors come from the part's session allocator on a GPU (so they count in that
/// graph's arena), and are plain host tensors on the CPU.
pub struct ResidentSet {
    /// [`Pipeline`](super::super::Pipeline) instance that made it.
    pub(crate) pipeline: u64,
    parts: Vec<(Part, Vec<(String, DynTensor)>)>,
    bytes: u64,
    /// Declared last: dropped after the tensors they allocated. Never used again, only kept
    /// (a `Mutex` makes the set `Sync`: an allocator handle is only `Send`).
    _allocators: Mutex<Vec<Allocator>>,
}

impl fmt::Debug for ResidentSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tensors: usize = self.parts.iter().map(|(_, o)| o.len()).sum();
        f.debug_struct("ResidentSet").field("bytes", &self.bytes).field("tensors", &tensors).finish_non_exhaustive()
    }
}

impl fmt::Debug for MergedSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MergedSet").field("bytes", &self.bytes).field("tensors", &self.overrides.len()).finish()
    }
}

impl ResidentSet {
    /// Exact bytes of the merged tensors (on the device, but for parts whose graphs run on the
    /// CPU: see [`ResidentSet::place`]).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Overrides of one part, by initializer name.
    pub(crate) fn part(&self, part: Part) -> &[(String, DynTensor)] {
        self.parts.iter().find(|(p, _)| *p == part).map_or(&[], |(_, o)| o.as_slice())
    }

    /// Places `set` where each part's session (`session_of`) runs: allocated through that
    /// session on a GPU, host tensors on the CPU.
    pub(crate) fn place<'s>(set: &MergedSet, pipeline: u64, session_of: impl Fn(Part) -> &'s ModelSession) -> Result<ResidentSet, LoraError> {
        let err = |source: ort::Error| LoraError::Device { source };
        let mut parts: Vec<(Part, Vec<(String, DynTensor)>)> = Vec::new();
        let mut allocators = Vec::new();
        for part in Part::ALL {
            let overrides: Vec<&Override> = set.overrides.iter().filter(|o| o.part == part).collect();
            if overrides.is_empty() {
                continue;
            }
            let session = session_of(part);
            let placed = match &session.device {
                Device::Cpu => overrides.iter().map(|o| Ok((o.name.clone(), host_tensor(o)?))).collect::<ort::Result<Vec<_>>>().map_err(err)?,
                Device::Cuda { gpu, .. } => {
                    let info = MemoryInfo::new(AllocationDevice::CUDA, *gpu as i32, AllocatorType::Device, MemoryType::Default).map_err(err)?;
                    let allocator = Allocator::new(&session.lock(), info).map_err(err)?;
                    let placed = overrides.iter().map(|o| Ok((o.name.clone(), device_tensor(o, &allocator)?))).collect::<ort::Result<Vec<_>>>().map_err(err)?;
                    allocators.push(allocator);
                    placed
                }
            };
            parts.push((part, placed));
        }
        // All parts count, those of text encoders on the CPU too: the budget reserves a set's
        // bytes before it is merged, from the LoRA files alone, and over-counting by the text
        // encoders' share is the safe side of that line.
        Ok(ResidentSet { pipeline, parts, bytes: set.bytes(), _allocators: Mutex::new(allocators) })
    }
}

/// An owned host tensor holding a copy of the override (the merged set keeps its own).
fn host_tensor(o: &Override) -> ort::Result<DynTensor> {
    let shape = o.shape.clone();
    Ok(match &o.values {
        Values::F16(v) => Tensor::from_array((shape, v.clone()))?.upcast(),
        Values::F32(v) => Tensor::from_array((shape, v.clone()))?.upcast(),
    })
}

/// A tensor from `allocator` (on the device) with the override copied in.
fn device_tensor(o: &Override, allocator: &Allocator) -> ort::Result<DynTensor> {
    fn copied<T: ort::value::PrimitiveTensorElementType + std::fmt::Debug + Copy + 'static>(
        shape: &[usize],
        values: &[T],
        allocator: &Allocator,
    ) -> ort::Result<DynTensor> {
        let mut target = Tensor::<T>::new(allocator, shape.to_vec())?;
        TensorRef::<T>::from_array_view((shape.to_vec(), values))?.copy_into(&mut target)?;
        Ok(target.upcast())
    }
    match &o.values {
        Values::F16(v) => copied(&o.shape, v, allocator),
        Values::F32(v) => copied(&o.shape, v, allocator),
    }
}
