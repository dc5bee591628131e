//! LoRA sets: merged into the model's weights, held on the device, bound by the renders that
//! use them.
//!
//! The mechanism (see README, "LoRA adapters"): `onnx/lora_ready.py` lists every LoRA-targetable
//! weight of the UNet and both text encoders as a graph input of the same name as its
//! initializer. A render that binds nothing there runs on the initializer (the base model, same
//! kernels, no extra memory); a render that binds a tensor runs on it. A set of LoRAs (with the
//! job's weights) becomes merged weights `W' = W + sum_i w_i * scale_i * up_i @ down_i`, laid out
//! as each initializer is ([`merge`]); placed on the device once ([`ResidentSet`]), it is bound
//! by every render of a job that names that set, and by no other render: bindings are made per
//! render, never kept. Switching between sets on the device costs a rebind; the [`LoraPool`]
//! keeps sets on the device (least recently used first out), in host memory, or drops them.
//!
//! - `map`: `<part>/lora_map.json`, where each module's weight sits.
//! - `merge`: the merge itself ([`Adapter`]: a LoRA file and its weight).
//! - `device`: [`MergedSet`] (host) and [`ResidentSet`] (device).
//! - `pool`: [`LoraPool`], [`SetKey`].
//! - `error`: [`LoraError`].

mod device;
mod error;
pub(crate) mod map;
mod merge;
mod pool;

use std::ops::ControlFlow;

use shotfleet_schema::lora::Part;

pub use device::{MergedSet, ResidentSet};
pub use error::LoraError;
pub use merge::Adapter;
pub use merge::WeightMaps;
pub use pool::{Acquired, LoraPool, PoolLimits, PoolStats, SetKey, Source};

use super::error::RenderError;
use super::{Pipeline, RenderControl, RenderOutput, RenderRequest, StepProgress, Trace};
use super::control::{Decode, Shrink};

impl Pipeline {
    /// Whether the model was prepared for LoRAs (its UNet has a `lora_map.json`).
    pub fn takes_loras(&self) -> bool {
        self.lora_maps.takes_loras()
    }

    /// Where the model's LoRA-targetable weights sit.
    pub fn lora_maps(&self) -> &WeightMaps {
        &self.lora_maps
    }

    /// Why a job with LoRAs cannot run on this model, if it cannot.
    ///
    /// # Errors
    /// [`LoraError::Packed`] for a quantized UNet, else [`LoraError::NotPrepared`] without maps.
    pub fn require_loras(&self) -> Result<(), LoraError> {
        if let Some(packed) = self.info.unet_packed {
            return Err(LoraError::Packed { model: self.model_dir.clone(), bits: packed.bits });
        }
        if self.takes_loras() { Ok(()) } else { Err(LoraError::NotPrepared { model: self.model_dir.clone() }) }
    }

    /// The exact bytes `adapters` would take merged (on the device, and in host memory while
    /// kept there), without merging; checks that they fit the model.
    ///
    /// # Errors
    /// [`LoraError::NotPrepared`], or [`LoraError::NotInModel`] / [`LoraError::Shape`] naming
    /// the first layer that does not fit (the job is invalid).
    pub fn lora_set_bytes(&self, adapters: &[Adapter]) -> Result<u64, LoraError> {
        self.require_loras()?;
        self.lora_maps.set_bytes(adapters)
    }

    /// Merges `adapters` into the model's weights, in host memory (CPU work, seconds for a
    /// full-size SDXL set on a few cores; no session is touched, renders go on meanwhile).
    ///
    /// # Errors
    /// As [`Pipeline::lora_set_bytes`]; [`LoraError::BaseWeights`] when the model's data file
    /// cannot be read.
    pub fn merge_loras(&self, adapters: &[Adapter]) -> Result<MergedSet, LoraError> {
        self.require_loras()?;
        self.lora_maps.merge(adapters)
    }

    /// Places a merged set on this pipeline's device.
    ///
    /// # Errors
    /// [`LoraError::Device`] when ONNX Runtime cannot allocate or copy it.
    pub fn place_loras(&self, set: &MergedSet) -> Result<ResidentSet, LoraError> {
        ResidentSet::place(set, self.instance, |part| match part {
            Part::Unet => self.unet.idle_session(),
            Part::TextEncoder => self.text.sessions()[0],
            Part::TextEncoder2 => self.text.sessions()[1],
        })
    }

    /// [`Pipeline::render_group`] with a LoRA set (`None`: the base model). Every request of the
    /// group renders with the set: jobs batched together must share it.
    ///
    /// # Errors
    /// As [`Pipeline::render_group`]; [`RenderError::InvalidRequest`] for a set another pipeline
    /// made.
    pub fn render_with_loras(
        &self,
        reqs: &[RenderRequest],
        loras: Option<&ResidentSet>,
        control: &RenderControl,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<Vec<RenderOutput>, RenderError> {
        self.check_set(loras)?;
        self.render_parts(reqs, None, None, loras, control, Shrink::Requested, Decode::Images, on_step)
    }

    /// [`Pipeline::render_traced`] with a LoRA set: the parity tests against diffusers.
    ///
    /// # Errors
    /// As [`Pipeline::render_with_loras`].
    pub fn render_traced_with_loras(
        &self,
        req: &RenderRequest,
        noise: Option<&[f32]>,
        loras: Option<&ResidentSet>,
        on_step: &mut dyn FnMut(StepProgress) -> ControlFlow<()>,
    ) -> Result<(RenderOutput, Trace), RenderError> {
        self.check_set(loras)?;
        let mut trace = Trace::default();
        let mut outputs =
            self.render_parts(std::slice::from_ref(req), noise, Some(&mut trace), loras, &RenderControl::default(), Shrink::Requested, Decode::Images, on_step)?;
        Ok((outputs.remove(0), trace))
    }

    fn check_set(&self, loras: Option<&ResidentSet>) -> Result<(), RenderError> {
        match loras {
            Some(set) if set.pipeline != self.instance => Err(RenderError::InvalidRequest(LoraError::ForeignSet.to_string())),
            _ => Ok(()),
        }
    }

    /// This pipeline's identity among all loads of the process (sets are bound to it).
    pub(crate) fn instance(&self) -> u64 {
        self.instance
    }
}
