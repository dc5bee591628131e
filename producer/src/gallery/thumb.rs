//! Thumbnails: a worker's PNG read, scaled down and written as a JPEG data URI, with the
//! parameters the PNG carries as text (the prompt, seed, steps, guidance, size, model).

use std::collections::HashMap;

use base64::Engine as _;
use fast_image_resize::images::Image;
use fast_image_resize::{PixelType, ResizeOptions, Resizer};

/// The longest side of a thumbnail, pixels (twice the CSS size: sharp on high-density screens).
pub const SIDE: u32 = 320;
/// JPEG quality of thumbnails.
const QUALITY: u8 = 82;

/// One image, ready for the page.
#[derive(Debug, Clone, PartialEq)]
pub struct Thumb {
    /// `data:image/jpeg;base64,...`
    pub data_uri: String,
    pub width: u32,
    pub height: u32,
    /// The PNG's text chunks (`prompt`, `seed`, `steps`, `guidance`, `model`, `parameters`).
    pub text: HashMap<String, String>,
}

/// Makes a thumbnail of a PNG.
///
/// # Errors
/// The PNG could not be decoded, or scaled.
pub fn thumbnail(png_bytes: &[u8]) -> Result<Thumb, String> {
    let mut decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(|e| format!("not a PNG: {e}"))?;
    let mut buffer = vec![0; reader.output_buffer_size().ok_or("the PNG is too large")?];
    let frame = reader.next_frame(&mut buffer).map_err(|e| format!("cannot decode the PNG: {e}"))?;
    let text = texts(reader.info());
    let (width, height) = (frame.width, frame.height);
    let rgb = to_rgb(&buffer[..frame.buffer_size()], frame.color_type)?;
    let scale = f64::from(SIDE) / f64::from(width.max(height));
    let (w, h) = if scale < 1.0 {
        (((f64::from(width) * scale).round() as u32).max(1), ((f64::from(height) * scale).round() as u32).max(1))
    } else {
        (width, height)
    };
    let source = Image::from_vec_u8(width, height, rgb, PixelType::U8x3).map_err(|e| e.to_string())?;
    let mut small = Image::new(w, h, PixelType::U8x3);
    Resizer::new().resize(&source, &mut small, &ResizeOptions::new()).map_err(|e| e.to_string())?;
    let mut jpeg = Vec::new();
    jpeg_encoder::Encoder::new(&mut jpeg, QUALITY)
        .encode(small.buffer(), w as u16, h as u16, jpeg_encoder::ColorType::Rgb)
        .map_err(|e| e.to_string())?;
    let data_uri = format!("data:image/jpeg;base64,{}", base64::engine::general_purpose::STANDARD.encode(&jpeg));
    Ok(Thumb { data_uri, width, height, text })
}

fn texts(info: &png::Info<'_>) -> HashMap<String, String> {
    let mut text: HashMap<String, String> =
        info.uncompressed_latin1_text.iter().map(|t| (t.keyword.clone(), t.text.clone())).collect();
    for t in &info.utf8_text {
        if let Ok(value) = t.get_text() {
            text.insert(t.keyword.clone(), value);
        }
    }
    text
}

fn to_rgb(pixels: &[u8], color: png::ColorType) -> Result<Vec<u8>, String> {
    Ok(match color {
        png::ColorType::Rgb => pixels.to_vec(),
        png::ColorType::Rgba => pixels.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => pixels.iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => pixels.chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => return Err("an indexed PNG was not expanded".into()),
    })
}
