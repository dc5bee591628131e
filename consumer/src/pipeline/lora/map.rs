//! `<part>/lora_map.json` (written by `onnx/lora_ready.py`): which overridable initializer holds
//! each LoRA-targetable module and how, and where its base values lie in the data file.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use half::f16;
use serde::Deserialize;
use shotfleet_schema::lora::Part;

use super::super::error::LoadError;
use super::super::session::Elem;

pub(crate) const MAP_FILE: &str = "lora_map.json";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MapFile {
    version: u32,
    part: String,
    data_file: String,
    initializers: BTreeMap<String, InitializerEntry>,
    modules: BTreeMap<String, Placement>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct InitializerEntry {
    dtype: String,
    shape: Vec<usize>,
    offset: u64,
    length: u64,
}

/// An overridable initializer: its graph input name, element type, shape and base values' place.
#[derive(Debug, Clone)]
pub(crate) struct Initializer {
    pub name: String,
    pub elem: Elem,
    pub shape: Vec<usize>,
    offset: u64,
    length: u64,
}

impl Initializer {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of one copy of it (what a merged override holds).
    pub fn bytes(&self) -> u64 {
        self.length
    }
}

/// How a module's weight sits in its initializer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Layout {
    /// As torch keeps it: `[out, in]` (Gemm with transB) or `[out, in, kh, kw]` (Conv).
    AsIs,
    /// `[in, out]` (MatMul), maybe some columns of a packed weight.
    Transposed,
    /// `[out, kh, kw, in]` (ONNX Runtime's fused NhwcConv).
    Nhwc,
}

/// Output row `o` of the module is column `offset + (o / run) * stride + o % run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Columns {
    pub run: usize,
    pub stride: usize,
    pub offset: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Placement {
    pub initializer: String,
    /// `linear` or `conv` (informative: `shape`'s rank says the same).
    #[allow(dead_code)]
    kind: String,
    /// The torch weight's shape: `[out, in]` or `[out, in, kh, kw]`.
    pub shape: Vec<usize>,
    pub layout: Layout,
    #[serde(default)]
    pub columns: Option<Columns>,
}

/// One part's map, checked against itself and its data file.
#[derive(Debug)]
pub(crate) struct WeightMap {
    pub part: Part,
    pub initializers: BTreeMap<String, Initializer>,
    pub modules: BTreeMap<String, Placement>,
    data_path: PathBuf,
    data: File,
}

impl WeightMap {
    /// Reads `<part_dir>/lora_map.json`; `Ok(None)` when there is none (a model not prepared for
    /// LoRAs).
    ///
    /// # Errors
    /// [`LoadError`] naming the map and what is inconsistent in it.
    pub fn load(part_dir: &Path, part: Part) -> Result<Option<WeightMap>, LoadError> {
        let path = part_dir.join(MAP_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let bytes = std::fs::read(&path).map_err(|source| LoadError::Io { path: path.clone(), source })?;
        let file: MapFile = serde_json::from_slice(&bytes).map_err(|source| LoadError::Json { path: path.clone(), source })?;
        let invalid = |detail: String| LoadError::Invalid { path: path.clone(), detail };
        if file.version != 1 {
            return Err(invalid(format!("version {} is not supported (1 is); rerun onnx/lora_ready.py", file.version)));
        }
        if file.part != part.as_str() {
            return Err(invalid(format!("maps part `{}`, but lies in the {part} folder", file.part)));
        }
        let data_path = part_dir.join(&file.data_file);
        let data = File::open(&data_path).map_err(|source| LoadError::Io { path: data_path.clone(), source })?;
        let data_len = data.metadata().map_err(|source| LoadError::Io { path: data_path.clone(), source })?.len();
        let mut initializers = BTreeMap::new();
        for (name, entry) in file.initializers {
            let elem = match entry.dtype.as_str() {
                "float32" => Elem::F32,
                "float16" => Elem::F16,
                other => return Err(invalid(format!("initializer {name:?} has dtype {other}; float32 or float16 expected"))),
            };
            let numel: usize = entry.shape.iter().product();
            let size = if elem == Elem::F16 { 2 } else { 4 };
            if entry.length != (numel * size) as u64 || entry.offset + entry.length > data_len {
                return Err(invalid(format!(
                    "initializer {name:?} ({numel} values of {} bytes at {}+{}) does not fit {} ({data_len} bytes): rerun onnx/lora_ready.py",
                    size,
                    entry.offset,
                    entry.length,
                    data_path.display()
                )));
            }
            initializers.insert(name.clone(), Initializer { name, elem, shape: entry.shape, offset: entry.offset, length: entry.length });
        }
        for (module, placement) in &file.modules {
            let init = initializers
                .get(&placement.initializer)
                .ok_or_else(|| invalid(format!("module {module:?} names initializer {:?}, which is not listed", placement.initializer)))?;
            check_placement(placement, init).map_err(|detail| invalid(format!("module {module:?}: {detail}")))?;
        }
        Ok(Some(WeightMap { part, initializers, modules: file.modules, data_path, data }))
    }

    /// The base values of `init`, as f32, into `out` (resized to fit); `raw` is scratch.
    ///
    /// # Errors
    /// The read's I/O error.
    pub fn read_base(&self, init: &Initializer, raw: &mut Vec<f16>, out: &mut Vec<f32>) -> std::io::Result<()> {
        let n = init.numel();
        out.resize(n, 0.0);
        match init.elem {
            Elem::F16 => {
                raw.resize(n, f16::ZERO);
                self.data.read_exact_at(bytes_of_mut(raw.as_mut_slice()), init.offset)?;
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(raw.as_slice(), out.as_mut_slice());
            }
            _ => {
                self.data.read_exact_at(bytes_of_mut(out.as_mut_slice()), init.offset)?;
            }
        }
        Ok(())
    }

    pub fn data_path(&self) -> &Path {
        &self.data_path
    }
}

/// Numbers every bit pattern of which is a value, with no padding.
trait Plain: Copy {}
impl Plain for f16 {}
impl Plain for f32 {}

/// The bytes of a slice of plain numbers, to read little-endian data straight into it.
fn bytes_of_mut<T: Plain>(values: &mut [T]) -> &mut [u8] {
    const { assert!(cfg!(target_endian = "little"), "ONNX data files are little-endian") };
    // SAFETY: f16 and f32 have no padding and every bit pattern is a valid value; the byte slice
    // covers exactly the values' memory and borrows it mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// The initializer's shape agrees with where the module is said to sit in it.
fn check_placement(p: &Placement, init: &Initializer) -> Result<(), String> {
    let s = &p.shape;
    let fits = match (p.layout, s.len(), &p.columns) {
        (Layout::AsIs, 2 | 4, None) => init.shape == *s || (s.len() == 4 && s[2..] == [1, 1] && init.shape == s[..2]),
        (Layout::Transposed, 2, None) => init.shape == [s[1], s[0]],
        (Layout::Transposed, 4, None) if s[2..] == [1, 1] => init.shape == [s[1], s[0]],
        (Layout::Transposed, 2, Some(c)) => {
            init.shape.len() == 2
                && init.shape[0] == s[1]
                && c.run > 0
                && s[0].is_multiple_of(c.run)
                && c.stride >= c.run
                && c.offset + (s[0] / c.run - 1) * c.stride + c.run <= init.shape[1]
        }
        (Layout::Nhwc, 4, None) => init.shape == [s[0], s[2], s[3], s[1]],
        _ => false,
    };
    if fits {
        Ok(())
    } else {
        Err(format!("weight {s:?} laid out {:?}{} does not fit initializer {:?} of shape {:?}", p.layout, p.columns.map(|c| format!(" {c:?}")).unwrap_or_default(), init.name, init.shape))
    }
}
