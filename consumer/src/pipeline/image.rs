//! Decoded images to bytes: diffusers' float-to-uint8 conversion and PNG with parameters.

use std::fmt::Write as _;

/// One VAE output image, `[3, h, w]` in [-1, 1], to interleaved RGB bytes `[h, w, 3]`.
///
/// Exactly as diffusers' `VaeImageProcessor.postprocess`: `(x / 2 + 0.5).clamp(0, 1)` in f32,
/// then numpy's `(x * 255).round()` (half to even) and a cast to uint8.
pub fn to_rgb8(chw: &[f32], width: usize, height: usize) -> Vec<u8> {
    let plane = width * height;
    debug_assert_eq!(chw.len(), 3 * plane);
    let mut rgb = vec![0u8; 3 * plane];
    for (p, px) in rgb.chunks_exact_mut(3).enumerate() {
        for (c, out) in px.iter_mut().enumerate() {
            let x = (chw[c * plane + p] / 2.0 + 0.5).clamp(0.0, 1.0);
            *out = (x * 255.0).round_ties_even() as u8;
        }
    }
    rgb
}

/// How a request's images were made: what their PNGs say, less each image's own seed, index and
/// size ([`Recipe::meta`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    pub prompt: String,
    /// `None` for an empty one too.
    pub negative_prompt: Option<String>,
    pub steps: u32,
    pub guidance: f32,
    pub model: String,
}

impl Recipe {
    pub fn of(req: &super::RenderRequest, model: &str) -> Self {
        Self {
            prompt: req.prompt.clone(),
            negative_prompt: req.negative_prompt.clone().filter(|n| !n.is_empty()),
            steps: req.steps,
            guidance: req.guidance,
            model: model.to_owned(),
        }
    }

    /// The whole of one image's PNG text.
    pub fn meta(&self, seed: u64, index: u32, width: u32, height: u32) -> ImageMeta<'_> {
        ImageMeta {
            prompt: &self.prompt,
            negative_prompt: self.negative_prompt.as_deref(),
            steps: self.steps,
            guidance: self.guidance,
            seed,
            index,
            width,
            height,
            model: &self.model,
        }
    }
}

/// What a PNG says about how it was made.
#[derive(Debug, Clone)]
pub struct ImageMeta<'a> {
    pub prompt: &'a str,
    pub negative_prompt: Option<&'a str>,
    pub steps: u32,
    pub guidance: f32,
    pub seed: u64,
    pub index: u32,
    pub width: u32,
    pub height: u32,
    pub model: &'a str,
}

impl ImageMeta<'_> {
    /// The "parameters" text as AUTOMATIC1111 and tools that read it (ComfyUI, civitai, Forge)
    /// expect: prompt line, optional "Negative prompt:" line, then comma-separated settings.
    pub fn parameters(&self) -> String {
        let mut s = String::new();
        s.push_str(self.prompt);
        if let Some(negative) = self.negative_prompt.filter(|n| !n.is_empty()) {
            let _ = write!(s, "\nNegative prompt: {negative}");
        }
        let _ = write!(
            s,
            "\nSteps: {}, Sampler: Euler, CFG scale: {}, Seed: {}, Image index: {}, Size: {}x{}, Model: {}",
            self.steps, self.guidance, self.seed, self.index, self.width, self.height, self.model
        );
        s
    }

    fn entries(&self) -> Vec<(&'static str, String)> {
        vec![
            ("parameters", self.parameters()),
            ("prompt", self.prompt.to_owned()),
            ("negative_prompt", self.negative_prompt.unwrap_or("").to_owned()),
            ("steps", self.steps.to_string()),
            ("guidance", self.guidance.to_string()),
            ("sampler", "euler".to_owned()),
            ("seed", self.seed.to_string()),
            ("image_index", self.index.to_string()),
            ("model", self.model.to_owned()),
        ]
    }
}

/// Encodes RGB bytes as a PNG carrying `meta` as text chunks (tEXt where the text is Latin-1,
/// iTXt otherwise, as PIL does, so non-Latin prompts survive).
///
/// # Errors
/// The PNG encoder's error (only on inconsistent sizes or text keywords, both fixed here).
pub fn encode_png(rgb: &[u8], meta: &ImageMeta<'_>) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::with_capacity(rgb.len() / 2 + 1024);
    {
        let mut encoder = png::Encoder::new(&mut out, meta.width, meta.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        // fdeflate's PNG-tuned level: several times faster than the default (Balanced) for files
        // a little larger; a job's images are encoded while the next job renders.
        encoder.set_compression(png::Compression::Fast);
        for (key, text) in meta.entries() {
            if text.chars().all(|c| u32::from(c) <= 0xFF) {
                encoder.add_text_chunk(key.to_owned(), text)?;
            } else {
                encoder.add_itxt_chunk(key.to_owned(), text)?;
            }
        }
        let mut writer = encoder.write_header()?;
        writer.write_image_data(rgb)?;
        writer.finish()?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversion_matches_diffusers_rounding() {
        // (x/2+0.5)*255: -1 -> 0, 1 -> 255, 0 -> 127.5 -> 128 (half to even), clamped outside.
        let chw = [-1.0f32, 1.0, 0.0, 5.0, -5.0, 0.5];
        let rgb = to_rgb8(&chw, 2, 1);
        assert_eq!(rgb, vec![0, 128, 0, 255, 255, 191]);
    }

    #[test]
    fn png_round_trips_with_text() {
        let meta = ImageMeta {
            prompt: "a cat, 猫",
            negative_prompt: Some("blurry"),
            steps: 4,
            guidance: 5.0,
            seed: 9,
            index: 1,
            width: 2,
            height: 1,
            model: "tiny",
        };
        let png = encode_png(&[1, 2, 3, 4, 5, 6], &meta).unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        reader.next_frame(&mut buf).unwrap();
        assert_eq!(&buf[..6], &[1, 2, 3, 4, 5, 6]);
        let info = reader.info();
        let params = info.utf8_text.iter().find(|t| t.keyword == "parameters").unwrap();
        assert!(params.get_text().unwrap().starts_with("a cat, 猫\nNegative prompt: blurry\nSteps: 4,"));
        assert!(info.uncompressed_latin1_text.iter().any(|t| t.keyword == "seed" && t.text == "9"));
    }
}
