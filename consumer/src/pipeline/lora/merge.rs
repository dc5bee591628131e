//! A LoRA set to merged weights: for every overridable initializer a set touches,
//! `W' = W + sum_i weight_i * scale_i * (up_i @ down_i)`, laid out as the initializer is.
//!
//! The work is one small GEMM per (LoRA, module) accumulated in f32 into the base weight read
//! from the model's data file, then rounded once to the initializer's type; initializers are
//! merged in parallel (rayon), each GEMM on one thread. `gemm` was measured against
//! `matrixmultiply` on SDXL shapes and is faster (BENCHMARKS.md, LoRA merge).

use std::collections::BTreeMap;
use std::sync::Arc;

use half::f16;
use rayon::prelude::*;
use shotfleet_schema::lora::{LoraFile, Part, Target};

use super::error::LoraError;
use super::map::{Initializer, Layout, Placement, WeightMap};
use super::super::session::Elem;

/// One LoRA of a set, with the weight a job gives it.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// For messages: the library name (or file name) of the LoRA.
    pub name: String,
    pub file: Arc<LoraFile>,
    pub weight: f32,
}

/// Where every LoRA-targetable weight of a model sits (its parts' `lora_map.json`): what merges
/// a set, without any ONNX Runtime session.
#[derive(Debug, Default)]
pub struct WeightMaps {
    pub(crate) maps: Vec<WeightMap>,
}

impl WeightMaps {
    /// The maps of a model folder's parts; a part without one takes no LoRA.
    ///
    /// # Errors
    /// [`LoadError`](crate::pipeline::LoadError) naming a map that is unreadable or inconsistent
    /// with its data file.
    pub fn load(model_dir: &std::path::Path) -> Result<WeightMaps, crate::pipeline::LoadError> {
        let mut maps = Vec::new();
        for part in Part::ALL {
            if let Some(map) = WeightMap::load(&model_dir.join(part.as_str()), part)? {
                maps.push(map);
            }
        }
        Ok(WeightMaps { maps })
    }

    pub(crate) fn get(&self, part: Part) -> Option<&WeightMap> {
        self.maps.iter().find(|m| m.part == part)
    }

    /// Whether the model takes LoRAs at all (its UNet has a map).
    pub fn takes_loras(&self) -> bool {
        self.get(Part::Unet).is_some()
    }

    /// The adaptable modules of `part` with their torch weight shapes.
    pub fn modules(&self, part: Part) -> Vec<(String, Vec<usize>)> {
        self.get(part).map_or_else(Vec::new, |m| m.modules.iter().map(|(k, p)| (k.clone(), p.shape.clone())).collect())
    }

    /// See [`set_bytes`].
    ///
    /// # Errors
    /// As [`set_bytes`].
    pub fn set_bytes(&self, adapters: &[Adapter]) -> Result<u64, LoraError> {
        set_bytes(self, adapters)
    }

    /// `adapters` merged into this model's weights, in host memory.
    ///
    /// # Errors
    /// As [`merge`].
    pub fn merge(&self, adapters: &[Adapter]) -> Result<super::MergedSet, LoraError> {
        Ok(super::MergedSet::new(merge(self, adapters)?))
    }
}

/// A merged weight, in host memory: what a render binds to the initializer's name.
pub(crate) struct Override {
    pub part: Part,
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Values,
}

pub(crate) enum Values {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Override {
    pub fn bytes(&self) -> u64 {
        match &self.values {
            Values::F16(v) => 2 * v.len() as u64,
            Values::F32(v) => 4 * v.len() as u64,
        }
    }
}

/// What one initializer receives: each (target, weight x scale) with where the target sits.
type Plan<'a> = BTreeMap<(Part, &'a str), Vec<(&'a Target, f32, &'a Placement)>>;

/// Checks that every target of every adapter (weight not 0) is in the maps with the shape the
/// LoRA expects, and groups them by initializer.
fn plan<'a>(maps: &'a WeightMaps, adapters: &'a [Adapter]) -> Result<Plan<'a>, LoraError> {
    let mut plan: Plan<'a> = BTreeMap::new();
    for adapter in adapters.iter().filter(|a| a.weight != 0.0) {
        for target in &adapter.file.targets {
            let map = maps.get(target.part).ok_or_else(|| LoraError::NotInModel {
                lora: adapter.name.clone(),
                part: target.part,
                module: target.module.clone(),
                detail: "the model's export has no LoRA map for this part".into(),
            })?;
            let placement = map.modules.get(&target.module).ok_or_else(|| LoraError::NotInModel {
                lora: adapter.name.clone(),
                part: target.part,
                module: target.module.clone(),
                detail: "the model has no such layer".into(),
            })?;
            if !same_weight_shape(&placement.shape, &target.weight_shape()) {
                return Err(LoraError::Shape {
                    lora: adapter.name.clone(),
                    part: target.part,
                    module: target.module.clone(),
                    model: placement.shape.clone(),
                    lora_shape: target.weight_shape(),
                });
            }
            plan.entry((target.part, placement.initializer.as_str())).or_default().push((
                target,
                adapter.weight * target.scale,
                placement,
            ));
        }
    }
    Ok(plan)
}

/// `[out, in]` and `[out, in, 1, 1]` are one weight.
fn same_weight_shape(model: &[usize], lora: &[usize]) -> bool {
    let squeeze = |s: &[usize]| -> Vec<usize> { if s.len() == 4 && s[2..] == [1, 1] { s[..2].to_vec() } else { s.to_vec() } };
    squeeze(model) == squeeze(lora)
}

/// The bytes the merged set would hold (one copy of every initializer it touches), without
/// merging: what the budget counts before a set is made.
///
/// # Errors
/// As [`merge`], for a LoRA that does not fit the model.
pub(crate) fn set_bytes(maps: &WeightMaps, adapters: &[Adapter]) -> Result<u64, LoraError> {
    let plan = plan(maps, adapters)?;
    Ok(plan.keys().map(|&(part, name)| initializer(maps, part, name).bytes()).sum())
}

fn initializer<'m>(maps: &'m WeightMaps, part: Part, name: &str) -> &'m Initializer {
    &maps.get(part).expect("planned parts have maps").initializers[name]
}

/// Merges `adapters` into overrides of the model's initializers.
///
/// # Errors
/// [`LoraError::NotInModel`] / [`LoraError::Shape`] when a LoRA does not fit the model (the
/// job is invalid); [`LoraError::BaseWeights`] when the model's data file cannot be read.
pub(crate) fn merge(maps: &WeightMaps, adapters: &[Adapter]) -> Result<Vec<Override>, LoraError> {
    let plan = plan(maps, adapters)?;
    plan.into_par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |(raw, values), ((part, name), contributions)| {
                let map = maps.get(part).expect("planned parts have maps");
                let init = &map.initializers[name];
                map.read_base(init, raw, values).map_err(|source| LoraError::BaseWeights { path: map.data_path().to_path_buf(), source })?;
                for (target, factor, placement) in contributions {
                    add_delta(values, &init.shape, target, factor, placement);
                }
                let values = match init.elem {
                    Elem::F16 => {
                        let mut out = vec![f16::ZERO; values.len()];
                        half::slice::HalfFloatSliceExt::convert_from_f32_slice(out.as_mut_slice(), values);
                        Values::F16(out)
                    }
                    _ => Values::F32(values.clone()),
                };
                Ok(Override { part, name: init.name.clone(), shape: init.shape.clone(), values })
            },
        )
        .collect()
}

/// `w += factor * up @ down`, written where `placement` says the module sits in `w` (shaped
/// `shape`).
fn add_delta(w: &mut [f32], shape: &[usize], target: &Target, factor: f32, placement: &Placement) {
    let (out, rank, inputs) = (target.out_features(), target.rank(), target.in_elements());
    let up = Mat { data: &target.up.data, offset: 0, rs: rank, cs: 1 };
    let down = Mat { data: &target.down.data, offset: 0, rs: inputs, cs: 1 };
    match (placement.layout, placement.columns) {
        // [out, in(*kh*kw)]: w[o, n] += up[o, :] . down[:, n]
        (Layout::AsIs, _) => {
            let dst = Dst { offset: 0, rs: inputs, cs: 1 };
            accumulate(w, dst, out, inputs, rank, up, down, factor);
        }
        // [in, M]: w[i, col(o)] += down[:, i] . up[o, :], one GEMM per run of columns.
        (Layout::Transposed, columns) => {
            let m = shape[1];
            let down_t = Mat { data: &target.down.data, offset: 0, rs: 1, cs: inputs };
            let (run, stride, offset) = columns.map_or((out, out, 0), |c| (c.run, c.stride, c.offset));
            for block in 0..out / run {
                let up_t = Mat { data: &target.up.data, offset: block * run * rank, rs: 1, cs: rank };
                let dst = Dst { offset: offset + block * stride, rs: m, cs: 1 };
                accumulate(w, dst, inputs, run, rank, down_t, up_t, factor);
            }
        }
        // [out, kh, kw, in]: for each kernel position, w[o, y, x, c] += up[o, :] . down[:, c, y, x]
        (Layout::Nhwc, _) => {
            let channels = target.down.shape[1];
            let taps = inputs / channels;
            for tap in 0..taps {
                let down_tap = Mat { data: &target.down.data, offset: tap, rs: inputs, cs: taps };
                let dst = Dst { offset: tap * channels, rs: taps * channels, cs: 1 };
                accumulate(w, dst, out, channels, rank, up, down_tap, factor);
            }
        }
    }
}

/// A strided view of a matrix in a slice (strides in elements).
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    offset: usize,
    rs: usize,
    cs: usize,
}

#[derive(Clone, Copy)]
struct Dst {
    offset: usize,
    rs: usize,
    cs: usize,
}

/// The last element a `rows` x `cols` view starting at `offset` touches.
fn last_index(offset: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    offset + (rows - 1) * rs + (cols - 1) * cs
}

/// `dst[r, c] += factor * sum_k lhs[r, k] * rhs[k, c]` for `r < m`, `c < n`.
#[allow(clippy::too_many_arguments)]
fn accumulate(w: &mut [f32], dst: Dst, m: usize, n: usize, k: usize, lhs: Mat<'_>, rhs: Mat<'_>, factor: f32) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    assert!(last_index(dst.offset, m, n, dst.rs, dst.cs) < w.len(), "merge destination out of bounds");
    assert!(last_index(lhs.offset, m, k, lhs.rs, lhs.cs) < lhs.data.len(), "merge lhs out of bounds");
    assert!(last_index(rhs.offset, k, n, rhs.rs, rhs.cs) < rhs.data.len(), "merge rhs out of bounds");
    // SAFETY: the asserts above keep every element gemm reads or writes inside its slice; `w` is
    // borrowed mutably and distinct from the read-only operands.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            w.as_mut_ptr().add(dst.offset),
            dst.cs as isize,
            dst.rs as isize,
            true,
            lhs.data.as_ptr().add(lhs.offset),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr().add(rhs.offset),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            factor,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::map::Columns;
    use shotfleet_schema::lora::Tensor;

    fn target(out: usize, rank: usize, down_shape: &[usize]) -> Target {
        let n: usize = down_shape.iter().product();
        Target {
            part: Part::Unet,
            module: "m".into(),
            down: Tensor { shape: down_shape.to_vec(), data: (0..n).map(|i| (i as f32 * 0.37).sin()).collect() },
            up: Tensor { shape: vec![out, rank], data: (0..out * rank).map(|i| (i as f32 * 0.11).cos()).collect() },
            scale: 1.0,
        }
    }

    /// The delta in torch's layout, `[out, in * kh * kw]`, by plain loops.
    fn delta(t: &Target) -> Vec<f32> {
        let (out, rank, n) = (t.out_features(), t.rank(), t.in_elements());
        let mut d = vec![0.0; out * n];
        for o in 0..out {
            for c in 0..n {
                d[o * n + c] = (0..rank).map(|r| t.up.data[o * rank + r] * t.down.data[r * n + c]).sum();
            }
        }
        d
    }

    fn placement(shape: &[usize], layout: Layout, columns: Option<Columns>) -> Placement {
        serde_json::from_value(serde_json::json!({
            "initializer": "w", "kind": "linear", "shape": shape, "layout": layout_name(layout),
            "columns": columns.map(|c| serde_json::json!({"run": c.run, "stride": c.stride, "offset": c.offset})),
        }))
        .unwrap()
    }

    fn layout_name(layout: Layout) -> &'static str {
        match layout {
            Layout::AsIs => "as_is",
            Layout::Transposed => "transposed",
            Layout::Nhwc => "nhwc",
        }
    }

    #[test]
    fn as_is_and_transposed_linear() {
        let t = target(5, 2, &[2, 3]);
        let d = delta(&t);
        let mut w = vec![1.0; 15];
        add_delta(&mut w, &[5, 3], &t, 0.5, &placement(&[5, 3], Layout::AsIs, None));
        for (got, want) in w.iter().zip(&d) {
            assert!((got - (1.0 + 0.5 * want)).abs() < 1e-6);
        }
        let mut wt = vec![0.0; 15];
        add_delta(&mut wt, &[3, 5], &t, 2.0, &placement(&[5, 3], Layout::Transposed, None));
        for o in 0..5 {
            for i in 0..3 {
                assert!((wt[i * 5 + o] - 2.0 * d[o * 3 + i]).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn packed_columns_interleave_heads() {
        // q of a QKV weight with 2 heads of 2: columns [q0 q1 k0 k1 v0 v1 | q2 q3 k2 k3 v2 v3].
        let t = target(4, 2, &[2, 3]);
        let d = delta(&t);
        let mut w = vec![0.0; 3 * 12];
        let columns = Columns { run: 2, stride: 6, offset: 2 }; // k
        add_delta(&mut w, &[3, 12], &t, 1.0, &placement(&[4, 3], Layout::Transposed, Some(columns)));
        for i in 0..3 {
            for (o, col) in [(0, 2), (1, 3), (2, 8), (3, 9)] {
                assert!((w[i * 12 + col] - d[o * 3 + i]).abs() < 1e-6);
            }
            for untouched in [0, 1, 4, 5, 6, 7, 10, 11] {
                assert_eq!(w[i * 12 + untouched], 0.0);
            }
        }
    }

    #[test]
    fn nhwc_convolution() {
        let (out, cin, kh, kw) = (3, 2, 3, 3);
        let t = target(out, 2, &[2, cin, kh, kw]);
        let d = delta(&t); // [o, c, y, x]
        let mut w = vec![0.0; out * kh * kw * cin];
        add_delta(&mut w, &[out, kh, kw, cin], &t, 1.0, &placement(&[out, cin, kh, kw], Layout::Nhwc, None));
        for o in 0..out {
            for c in 0..cin {
                for y in 0..kh {
                    for x in 0..kw {
                        let want = d[((o * cin + c) * kh + y) * kw + x];
                        let got = w[((o * kh + y) * kw + x) * cin + c];
                        assert!((got - want).abs() < 1e-6);
                    }
                }
            }
        }
    }
}
