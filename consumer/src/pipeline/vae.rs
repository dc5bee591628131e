//! Latents to pixels with the VAE decoder.
//!
//! Images are decoded one at a time: the decoder's activations at 1024 px are several times
//! the UNet's per image, and decoding singly keeps its peak independent of the batch size (the
//! result is the same image).
//!
//! Every decoder run also shrinks the decoder's arena at its end, so each decode starts from the
//! weights alone (unless [`PipelineOptions::vae_keeps_arena`]). Kept, the arena, growing by what
//! each request asks (DESIGN.md's GPU memory), fragments over repeated decodes: on the H200
//! (2026-11-30, fifth lease) four 768x768 decodes in a row left it 1155 MiB larger than one, and
//! a first 1152x896 render of two images held 3.4 GiB more than a second one of the same shape.
//! Shrunk, a decode's peak is one image's whatever ran before, which is what the budget's probes
//! measure (sixth lease: 768x768 x 4 within 0.1% of its estimate, and the decoder's arena back to
//! its 189 MiB of weights after every render); the price is the regions allocated again for each
//! image: the decode of a 1024x1024 image took 157 ms against 94 ms.
//!
//! Tiled decoding ([`VaeDecode::Tiled`]), the next rung of the degrade ladder, is diffusers'
//! `AutoencoderKL.tiled_decode`: latent tiles overlapping by `overlap / 8`, each decoded alone,
//! blended linearly over `overlap` pixels with the tiles above and to the left, then cropped to
//! `tile - overlap` pixels. The decoder's peak follows the tile, not the image (its mid-block
//! attention is quadratic in the latent area). The image is close to, not equal to, the whole
//! decode: each tile sees only its own latents.

use std::sync::atomic::{AtomicBool, Ordering};

use ort::environment::Environment;
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};

use super::error::{LoadError, RenderError, Stage};
use super::model::{FolderConfig, VAE_DECODER};
use super::session::{Elem, ModelSession, Port, extract_f32, float_tensor};
use super::control::Runs;
use super::{PipelineOptions, VaeDecode};

pub(crate) struct VaeDecoder {
    session: ModelSession,
    /// [`PipelineOptions::vae_keeps_arena`].
    keeps_arena: bool,
    /// The arena holds nothing but the weights: its last run ended well and gave its regions
    /// back. False from the start of every run until then, and at load.
    weights_only: AtomicBool,
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
    pub(crate) fn session(&self) -> &ModelSession {
        &self.session
    }

    /// The decoder's latent element type (float16 or float32).
    pub(crate) fn elem(&self) -> Elem {
        self.input.elem
    }

    pub(crate) fn load(env: &Environment, config: &FolderConfig, options: &PipelineOptions) -> Result<VaeDecoder, LoadError> {
        let session = ModelSession::load_vae(env, &config.dir.join(VAE_DECODER), options)?;
        let input = session.require_input("latent_sample", Some(4), true)?.clone();
        // The decoder's dtype is the model folder's choice, made by its VAE config; one that
        // would run SDXL's own VAE in float16 renders black or NaN images, so it never loads.
        if input.elem == Elem::F16 && config.vae_force_upcast {
            return Err(LoadError::Invalid {
                path: config.dir.join(VAE_DECODER),
                detail: "is float16 but vae_decoder/config.json has force_upcast: true (this VAE overflows in float16); \
                         export the decoder in float32, or use a float16-safe VAE such as the fp16-fix one (force_upcast: false)"
                    .into(),
            });
        }
        let output = session
            .outputs
            .first()
            .filter(|o| o.rank() == 4)
            .ok_or_else(|| session.graph_err("expected one 4-D output (sample)".into()))?
            .name
            .clone();
        let latent_channels = usize::try_from(input.dims[1]).ok();
        Ok(VaeDecoder {
            session,
            keeps_arena: options.vae_keeps_arena,
            weights_only: AtomicBool::new(false),
            input,
            output,
            scaling_factor: config.vae_scaling_factor,
            latent_channels,
        })
    }

    /// Whether the arena holds nothing a shrink could give back ([`Pipeline::shrink_arenas`]
    /// leaves the decoder out then).
    ///
    /// [`Pipeline::shrink_arenas`]: super::Pipeline::shrink_arenas
    pub(crate) fn holds_only_weights(&self) -> bool {
        self.weights_only.load(Ordering::Acquire)
    }

    /// Decodes one image's final latents `[c, h, w]`, whole or in tiles. `is_last`: this is
    /// the render's last VAE work (where a decoder that keeps its arena may shrink it).
    pub(crate) fn decode(&self, latents: &[f32], shape: [usize; 3], how: VaeDecode, f: usize, runs: &Runs, is_last: bool) -> Result<Decoded, RenderError> {
        let [c, h, w] = shape;
        let scaled: Vec<f32> = latents.iter().map(|&x| x / self.scaling_factor).collect();
        let (tile, overlap) = match how {
            VaeDecode::Tiled { tile, overlap } => (tile as usize / f, overlap as usize / f),
            VaeDecode::Whole => (usize::MAX, 0),
        };
        // As diffusers: an image that fits in one tile is decoded whole.
        if h <= tile && w <= tile {
            return self.run(&scaled, c, h, w, runs, is_last);
        }
        let stride = tile - overlap;
        let (blend, keep) = (overlap * f, stride * f);
        let starts = |len: usize| (0..len).step_by(stride).collect::<Vec<_>>();
        let (rows, cols) = (starts(h), starts(w));
        let mut grid: Vec<Vec<Decoded>> = Vec::with_capacity(rows.len());
        for (ri, &y) in rows.iter().enumerate() {
            let mut row = Vec::with_capacity(cols.len());
            for (ci, &x) in cols.iter().enumerate() {
                let (th, tw) = (tile.min(h - y), tile.min(w - x));
                let mut crop = Vec::with_capacity(c * th * tw);
                for ch in 0..c {
                    for yy in y..y + th {
                        let at = (ch * h + yy) * w + x;
                        crop.extend_from_slice(&scaled[at..at + tw]);
                    }
                }
                let last = is_last && ri + 1 == rows.len() && ci + 1 == cols.len();
                row.push(self.run(&crop, c, th, tw, runs, last)?);
            }
            grid.push(row);
        }
        Ok(blend_tiles(grid, blend, keep, h * f, w * f))
    }

    /// One decoder run on already scaled latents `[c, h, w]`; it shrinks the arena at its end
    /// unless the decoder keeps it (then as the render's `is_last` run says).
    fn run(&self, scaled: &[f32], c: usize, h: usize, w: usize, runs: &Runs, is_last: bool) -> Result<Decoded, RenderError> {
        let err = runs.err(Stage::Vae);
        runs.check(Stage::Vae)?;
        let input = float_tensor(&self.input, &[1, c, h, w], scaled).map_err(err)?;
        let mut session = self.session.lock();
        let mut binding = session.create_binding().map_err(err)?;
        let host = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default).map_err(err)?;
        binding.bind_input(self.input.name.as_str(), &input).map_err(err)?;
        binding.bind_output_to_device(self.output.as_str(), &host).map_err(err)?;
        let (options, gives_back) = if self.keeps_arena { (runs.last(is_last), false) } else { (runs.decode(), true) };
        self.weights_only.store(false, Ordering::Release);
        let outputs = session.run_binding_with_options(&binding, options).map_err(err)?;
        self.weights_only.store(gives_back, Ordering::Release);
        let (shape, chw) = extract_f32(&outputs[0]).map_err(|detail| RenderError::Output { stage: Stage::Vae, detail })?;
        if shape.len() != 4 || shape[0] != 1 || shape[1] != 3 {
            return Err(RenderError::Output { stage: Stage::Vae, detail: format!("{} has shape {shape:?}, expected [1, 3, H, W]", self.output) });
        }
        // A NaN would become a black pixel without a word: say so instead (a float16 decoder
        // overflowing, or latents already broken).
        if let Some(bad) = chw.iter().position(|v| !v.is_finite()) {
            return Err(RenderError::Output {
                stage: Stage::Vae,
                detail: format!("{} holds {} at element {bad} of {}: the decoder overflowed (a float16 VAE that is not float16-safe?)", self.output, chw[bad], chw.len()),
            });
        }
        Ok(Decoded { chw, height: shape[2], width: shape[3] })
    }
}

/// diffusers' `AutoencoderKL.tiled_decode` after the decoder runs: each tile is blended in place
/// with the (already blended) tile above and the one to its left over `blend` pixels, linearly,
/// then cropped to `keep` pixels and placed. A tile's blend reads its neighbours' blended values,
/// as diffusers' in-place `blend_v`/`blend_h` do.
fn blend_tiles(mut grid: Vec<Vec<Decoded>>, blend: usize, keep: usize, height: usize, width: usize) -> Decoded {
    for r in 0..grid.len() {
        for c in 0..grid[r].len() {
            let mut tile = std::mem::replace(&mut grid[r][c], Decoded { chw: Vec::new(), width: 0, height: 0 });
            if r > 0 {
                blend_v(&grid[r - 1][c], &mut tile, blend);
            }
            if c > 0 {
                blend_h(&grid[r][c - 1], &mut tile, blend);
            }
            grid[r][c] = tile;
        }
    }
    let mut chw = vec![0.0f32; 3 * height * width];
    for (r, row) in grid.iter().enumerate() {
        for (c, tile) in row.iter().enumerate() {
            let (y0, x0) = (r * keep, c * keep);
            let (th, tw) = (tile.height.min(keep), tile.width.min(keep));
            for ch in 0..3 {
                for y in 0..th {
                    let from = (ch * tile.height + y) * tile.width;
                    let to = (ch * height + y0 + y) * width + x0;
                    chw[to..to + tw].copy_from_slice(&tile.chw[from..from + tw]);
                }
            }
        }
    }
    Decoded { chw, width, height }
}

/// The top `extent` rows of `b` fade in from the bottom rows of `a` (same width).
fn blend_v(a: &Decoded, b: &mut Decoded, extent: usize) {
    let extent = extent.min(a.height).min(b.height);
    let w = b.width;
    for ch in 0..3 {
        for y in 0..extent {
            let t = y as f32 / extent as f32;
            let from = (ch * a.height + a.height - extent + y) * a.width;
            let to = (ch * b.height + y) * w;
            for x in 0..w {
                b.chw[to + x] = a.chw[from + x] * (1.0 - t) + b.chw[to + x] * t;
            }
        }
    }
}

/// The left `extent` columns of `b` fade in from the right columns of `a` (same height).
fn blend_h(a: &Decoded, b: &mut Decoded, extent: usize) {
    let extent = extent.min(a.width).min(b.width);
    for ch in 0..3 {
        for y in 0..b.height {
            let from = (ch * a.height + y) * a.width + a.width - extent;
            let to = (ch * b.height + y) * b.width;
            for x in 0..extent {
                let t = x as f32 / extent as f32;
                b.chw[to + x] = a.chw[from + x] * (1.0 - t) + b.chw[to + x] * t;
            }
        }
    }
}
