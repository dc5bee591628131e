//! Latents to pixels with the VAE decoder.
//!
//! Images are decoded one at a time: the decoder's activations at 1024 px are several times
//! the UNet's per image, and decoding singly keeps its peak independent of the batch size (the
//! result is the same image). Tiled decoding, the next rung of the degrade ladder, belongs in
//! [`VaeDecoder::decode_one`]: split the latent into overlapping tiles, decode each, blend.

use ort::environment::Environment;
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};

use super::error::{LoadError, RenderError, Stage};
use super::model::{FolderConfig, VAE_DECODER};
use super::session::{ModelSession, Port, extract_f32, float_tensor};
use super::PipelineOptions;

pub(crate) struct VaeDecoder {
    session: ModelSession,
    input: Port,
    output: String,
    scaling_factor: f32,
    /// Latent channels when the graph fixes them.
    pub latent_channels: Option<usize>,
}

/// One decoded image: `[3, height, width]` in about [-1, 1].
pub(crate) struct Decoded {
    pub chw: Vec<f32>,
    pub width: usize,
    pub height: usize,
}

impl VaeDecoder {
    pub(crate) fn load(env: &Environment, config: &FolderConfig, options: &PipelineOptions) -> Result<VaeDecoder, LoadError> {
        let session = ModelSession::load(env, &config.dir.join(VAE_DECODER), options)?;
        let input = session.require_input("latent_sample", Some(4), true)?.clone();
        let output = session
            .outputs
            .first()
            .filter(|o| o.rank() == 4)
            .ok_or_else(|| session.graph_err("expected one 4-D output (sample)".into()))?
            .name
            .clone();
        let latent_channels = usize::try_from(input.dims[1]).ok();
        Ok(VaeDecoder { session, input, output, scaling_factor: config.vae_scaling_factor, latent_channels })
    }

    /// Decodes one image's final latents `[c, h, w]`.
    pub(crate) fn decode_one(&self, latents: &[f32], c: usize, h: usize, w: usize, shrink_key: Option<&str>) -> Result<Decoded, RenderError> {
        let err = RenderError::runtime(Stage::Vae);
        let scaled: Vec<f32> = latents.iter().map(|&x| x / self.scaling_factor).collect();
        let input = float_tensor(&self.input, &[1, c, h, w], &scaled).map_err(err)?;
        let mut session = self.session.lock();
        let mut binding = session.create_binding().map_err(err)?;
        let host = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default).map_err(err)?;
        binding.bind_input(self.input.name.as_str(), &input).map_err(err)?;
        binding.bind_output_to_device(self.output.as_str(), &host).map_err(err)?;
        let outputs = match shrink_key {
            Some(key) => {
                let mut options = ort::session::RunOptions::new().map_err(err)?;
                options.set("memory.enable_memory_arena_shrinkage", key).map_err(err)?;
                session.run_binding_with_options(&binding, &options).map_err(err)?
            }
            None => session.run_binding(&binding).map_err(err)?,
        };
        let (shape, chw) = extract_f32(&outputs[0]).map_err(|detail| RenderError::Output { stage: Stage::Vae, detail })?;
        if shape.len() != 4 || shape[0] != 1 || shape[1] != 3 {
            return Err(RenderError::Output { stage: Stage::Vae, detail: format!("{} has shape {shape:?}, expected [1, 3, H, W]", self.output) });
        }
        Ok(Decoded { chw, height: shape[2], width: shape[3] })
    }
}
