//! LoRA costs: merge, placement, switches (resident, from host memory, from the store), render
//! time with and without a set, and device memory per set against its computed bytes.
//!
//! ```sh
//! source scripts/env.sh
//! # the tiny model on the CPU, with the fixture LoRAs and random ones
//! cargo run --release -p shotfleet-consumer --example lora_bench -- --model onnx/tiny/model
//! # the merge on SDXL's shapes (random base weights, 1/10 of the usual layers), no model needed
//! cargo run --release -p shotfleet-consumer --example lora_bench -- --synthetic-sdxl 0.1
//! # the GPU lease (deploy/gpu/lease.sh stage lora): full-size SDXL prepared with onnx/lora_ready.py,
//! # today's graph beside it for the base job's time
//! lora_bench --model /root/sdxl-lora --base-model /root/sdxl --device cuda --size 1024 --steps 8
//! # --cuda-graph: base renders replay CUDA graphs as a `graph = true` worker's do (the fused UNet
//! # captures; the plain fp16 export does not, so it is off unless asked for)
//! # random LoRAs to push with `shotfleet lora push` (the lease's storyboard stage): kohya files
//! # of the first of --ranks over the usual layers of the model's maps, char-1..N.safetensors
//! lora_bench --model /root/sdxl-lora --write-loras /root/board-loras --count 4 --ranks 32
//! ```
//!
//! Random LoRAs cover the usual layers (kohya's default: every linear of the UNet's attention
//! blocks and of both text encoders' attention and MLP) at ranks `--ranks` (32,128). Prints one
//! JSON object per measurement on stdout and a summary on stderr.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use shotfleet_consumer::library::{LibraryConfig, LoraLibrary};
use shotfleet_consumer::pipeline::lora::{Adapter, LoraPool, PoolLimits, SetKey, WeightMaps};
use shotfleet_consumer::pipeline::{CudaConfig, CudaTuning, Device, Pipeline, PipelineOptions, RenderControl, RenderRequest};
use shotfleet_consumer::store::StoreConfig;
use shotfleet_schema::lora::library::LoraEntry;
use shotfleet_schema::lora::{Format, LoraFile, Part, Target, Tensor};

struct Args {
    model: Option<PathBuf>,
    base_model: Option<PathBuf>,
    synthetic: Option<f64>,
    cuda: bool,
    /// Replay the UNet as CUDA graphs (`[cuda.unet] graph`); LoRA renders run uncaptured anyway.
    cuda_graph: bool,
    gpu: u32,
    ranks: Vec<usize>,
    size: u32,
    steps: u32,
    runs: usize,
    /// Write `count` random LoRA files here and stop.
    write_loras: Option<PathBuf>,
    count: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { model: None, base_model: None, synthetic: None, cuda: false, cuda_graph: false, gpu: 0, ranks: vec![32, 128], size: 64, steps: 8, runs: 3, write_loras: None, count: 4 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = Some(value()?.into()),
            "--base-model" => args.base_model = Some(value()?.into()),
            "--synthetic-sdxl" => args.synthetic = Some(value()?.parse().map_err(|e| format!("--synthetic-sdxl: {e}"))?),
            "--device" => args.cuda = value()? == "cuda",
            "--cuda-graph" => args.cuda_graph = true,
            "--gpu" => args.gpu = value()?.parse().map_err(|e| format!("--gpu: {e}"))?,
            "--ranks" => args.ranks = value()?.split(',').map(|r| r.parse().map_err(|e| format!("--ranks: {e}"))).collect::<Result<_, _>>()?,
            "--size" => args.size = value()?.parse().map_err(|e| format!("--size: {e}"))?,
            "--steps" => args.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--runs" => args.runs = value()?.parse().map_err(|e| format!("--runs: {e}"))?,
            "--write-loras" => args.write_loras = Some(value()?.into()),
            "--count" => args.count = value()?.parse().map_err(|e| format!("--count: {e}"))?,
            other => return Err(format!("unknown argument {other} (see the example's header)")),
        }
    }
    Ok(args)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    if let Some(fraction) = args.synthetic {
        return synthetic_sdxl(fraction, &args.ranks);
    }
    let model = args.model.clone().unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/model"));
    if let Some(dir) = &args.write_loras {
        return write_loras(&model, dir, &args);
    }
    real_model(&model, &args)
}

/// `--write-loras DIR`: `--count` random kohya LoRA files of the first rank of `--ranks` over the
/// usual layers of `model`'s maps (no session loaded), `char-1.safetensors`.. with seeds 1..
fn write_loras(model: &Path, dir: &Path, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let maps = WeightMaps::load(model)?;
    let modules = all_modules(&maps);
    let rank = *args.ranks.first().ok_or("--ranks is empty")?;
    std::fs::create_dir_all(dir)?;
    for seed in 1..=args.count {
        let bytes = kohya_bytes(&random_lora(&modules, rank, seed))?;
        let path = dir.join(format!("char-{seed}.safetensors"));
        std::fs::write(&path, &bytes)?;
        emit(json!({"what": "lora_file", "path": path, "rank": rank, "bytes": bytes.len()}));
    }
    Ok(())
}

fn emit(value: serde_json::Value) {
    println!("{value}");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The usual layers: every linear of the UNet's attention blocks, and the text encoders'
/// attention and MLP linears (kohya's default network).
fn usual(part: Part, module: &str) -> bool {
    match part {
        Part::Unet => module.contains(".attentions."),
        _ => module.contains(".self_attn.") || module.contains(".mlp."),
    }
}

/// A random LoRA of `rank` over the usual layers of `modules`, scaled so its delta is small.
fn random_lora(modules: &[(Part, String, Vec<usize>)], rank: usize, seed: u64) -> LoraFile {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let targets = modules
        .iter()
        .filter(|(part, module, shape)| usual(*part, module) && shape.len() == 2)
        .map(|(part, module, shape)| {
            let (out, inputs) = (shape[0], shape[1]);
            Target {
                part: *part,
                module: module.clone(),
                down: Tensor { shape: vec![rank, inputs], data: (0..rank * inputs).map(|_| next() * 0.02).collect() },
                up: Tensor { shape: vec![out, rank], data: (0..out * rank).map(|_| next() * 0.02).collect() },
                scale: 1.0,
            }
        })
        .collect();
    LoraFile { format: Format::Kohya, targets }
}

fn all_modules(maps: &WeightMaps) -> Vec<(Part, String, Vec<usize>)> {
    Part::ALL.iter().flat_map(|&p| maps.modules(p).into_iter().map(move |(m, s)| (p, m, s))).collect()
}

fn options(args: &Args) -> PipelineOptions {
    let device = if args.cuda {
        // The fleet's tuned UNet options (deploy/gpu/fleet.toml); with --cuda-graph base renders
        // replay CUDA graphs and LoRA renders run uncaptured.
        let unet = CudaTuning { graph: args.cuda_graph, ..CudaTuning::default() };
        Device::Cuda { gpu: args.gpu, mem_limit_bytes: None, cuda: CudaConfig { unet, ..CudaConfig::default() } }
    } else {
        Device::Cpu
    };
    PipelineOptions { device, ..PipelineOptions::default() }
}

/// Milliseconds per UNet step of one guided image, median of `runs` renders after a warm-up.
fn step_ms(pipeline: &Pipeline, args: &Args, set: Option<&shotfleet_consumer::pipeline::lora::ResidentSet>) -> Result<f64, Box<dyn std::error::Error>> {
    let request = RenderRequest {
        prompt: "a lighthouse keeper at dawn, ink wash".into(),
        negative_prompt: None,
        width: args.size,
        height: args.size,
        steps: args.steps,
        guidance: 5.0,
        seed: 7,
        image_indices: vec![0],
        max_batch: 1,
    };
    let render = || pipeline.render_with_loras(std::slice::from_ref(&request), set, &RenderControl::default(), &mut |_| ControlFlow::Continue(()));
    render()?;
    let mut samples: Vec<f64> = (0..args.runs).map(|_| render().map(|o| ms(o[0].timings.unet) / args.steps as f64)).collect::<Result<_, _>>()?;
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

/// Device memory in use on the GPU (NVML), for the memory a placed set takes.
#[cfg(feature = "cuda")]
fn device_used(gpu: u32) -> Option<u64> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    nvml.device_by_index(gpu).ok()?.memory_info().ok().map(|m| m.used)
}

#[cfg(not(feature = "cuda"))]
fn device_used(_gpu: u32) -> Option<u64> {
    None
}

/// Bytes live tensors hold in every graph's arena (on the CPU with a capped arena, the one
/// shared arena counted once per graph: differences only).
fn arenas_in_use(pipeline: &Pipeline) -> u64 {
    pipeline.arena_stats().iter().filter_map(|(_, stats)| stats.map(|s| s.in_use)).sum()
}

fn real_model(model: &Path, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let pipeline = Pipeline::load(model, &options(args))?;
    eprintln!("loaded {} in {:.1} s (LoRA maps: {})", model.display(), started.elapsed().as_secs_f64(), pipeline.takes_loras());
    let modules = all_modules(pipeline.lora_maps());
    let mut summary = Vec::new();

    // Base renders: this graph, and today's graph without overridable weights when given.
    let base = step_ms(&pipeline, args, None)?;
    emit(json!({"what": "unet_step_base", "model": model, "ms": base, "size": args.size, "steps": args.steps}));
    summary.push(format!("UNet step, base job, LoRA-ready graph: {base:.2} ms"));
    if let Some(today) = &args.base_model {
        let reference = Pipeline::load(today, &options(args))?;
        let mut pairs = Vec::new();
        for _ in 0..3 {
            pairs.push((step_ms(&reference, args, None)?, step_ms(&pipeline, args, None)?));
        }
        let (old, new) = pairs.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
        emit(json!({"what": "unet_step_base_vs_today", "today_ms": old / 3.0, "lora_ready_ms": new / 3.0, "ratio": new / old}));
        summary.push(format!("UNet step, base job: today's graph {:.2} ms, LoRA-ready graph {:.2} ms ({:+.2}%)", old / 3.0, new / 3.0, (new / old - 1.0) * 100.0));
    }

    // The fixture LoRAs, where the model is the tiny one.
    let fixtures = model.join("../lora");
    let mut sets: Vec<(String, Vec<Adapter>)> = Vec::new();
    for file in ["kohya_sgm.safetensors", "peft.safetensors"] {
        if let Ok(bytes) = std::fs::read(fixtures.join(file)) {
            let lora = LoraFile::parse(&bytes, &Default::default())?;
            sets.push((file.into(), vec![Adapter { name: file.into(), file: Arc::new(lora), weight: 1.0 }]));
        }
    }
    for &rank in &args.ranks {
        let lora = random_lora(&modules, rank, rank as u64);
        sets.push((format!("random rank {rank}"), vec![Adapter { name: format!("rank{rank}"), file: Arc::new(lora), weight: 0.8 }]));
    }

    for (label, adapters) in &sets {
        let targets: usize = adapters.iter().map(|a| a.file.targets.len()).sum();
        let bytes = pipeline.lora_set_bytes(adapters)?;
        let t = Instant::now();
        let merged = pipeline.merge_loras(adapters)?;
        let merge = t.elapsed();
        let (before, arenas_before) = (device_used(args.gpu), arenas_in_use(&pipeline));
        let t = Instant::now();
        let placed = pipeline.place_loras(&merged)?;
        let place = t.elapsed();
        let (after, arenas_after) = (device_used(args.gpu), arenas_in_use(&pipeline));
        // NVML sees only what the arenas take from the device: a set placed into room an
        // earlier (dropped) set left in them grows nothing there. The arenas' bytes in use are
        // what the set holds.
        let measured = before.zip(after).map(|(b, a)| a.saturating_sub(b));
        let held = arenas_after.saturating_sub(arenas_before);
        // Alternating base and styled renders, so both see the same machine.
        let (mut base_samples, mut styled_samples) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            base_samples.push(step_ms(&pipeline, args, None)?);
            styled_samples.push(step_ms(&pipeline, args, Some(&placed))?);
        }
        let (base, styled) = (median(base_samples), median(styled_samples));
        emit(json!({
            "what": "set", "set": label, "targets": targets, "initializers": merged.len(), "bytes": bytes,
            "device_bytes_measured": measured, "arena_bytes_held": held, "held_vs_bytes": held as f64 / bytes as f64, "merge_ms": ms(merge), "place_ms": ms(place),
            "unet_step_ms": styled, "unet_step_base_ms": base, "speed_vs_base": base / styled,
        }));
        summary.push(format!(
            "{label}: {targets} layers in {} weights, {:.1} MiB, held in the arenas {:.1} MiB ({:+.2}%){}; merge {:.0} ms, place {:.0} ms; UNet step {styled:.2} ms ({:.3}x base speed)",
            merged.len(),
            bytes as f64 / (1 << 20) as f64,
            held as f64 / (1 << 20) as f64,
            (held as f64 / bytes as f64 - 1.0) * 100.0,
            measured.map(|m| format!(" (device grew {:.1} MiB)", m as f64 / (1 << 20) as f64)).unwrap_or_default(),
            ms(merge),
            ms(place),
            base / styled
        ));
    }

    // Switches through the pool: two sets resident, one on the host, one from the store.
    let dir = tempfile::tempdir()?;
    let library = library_with(dir.path(), &sets)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let pool = LoraPool::new(PoolLimits { device_bytes: u64::MAX, host_bytes: u64::MAX });
    let keys: Vec<SetKey> = sets.iter().map(|(label, _)| SetKey::new([(label.clone(), 1.0)])).collect();
    let fetch_and_merge = |label: &str| -> Result<Vec<Adapter>, Box<dyn std::error::Error>> {
        let fetched = runtime.block_on(library.fetch(&name_of(label)))?;
        Ok(vec![Adapter { name: label.into(), file: fetched.file, weight: 0.8 }])
    };
    for (key, (label, _)) in keys.iter().zip(&sets) {
        let acquired = pool.acquire(&pipeline, key, || fetch_and_merge(label))?.expect("a set");
        emit(json!({"what": "switch", "set": label, "from": "store", "ms": ms(acquired.elapsed)}));
        summary.push(format!("switch to {label} from the store (fetch, read, merge, place): {:.0} ms", ms(acquired.elapsed)));
    }
    let mut resident = Vec::new();
    for round in 0..3 {
        for key in &keys {
            let acquired = pool.acquire(&pipeline, key, || fetch_and_merge("unused"))?.expect("a set");
            resident.push(acquired.elapsed);
            let _ = round;
        }
    }
    resident.sort();
    let median = resident[resident.len() / 2];
    emit(json!({"what": "switch", "from": "resident", "ms_median": ms(median), "ms_max": ms(*resident.last().unwrap())}));
    summary.push(format!("switch between resident sets: median {:.3} ms, max {:.3} ms", ms(median), ms(*resident.last().unwrap())));
    for (key, (label, _)) in keys.iter().zip(&sets) {
        pool.shrink_device_to(0);
        let acquired = pool.acquire(&pipeline, key, || fetch_and_merge(label))?.expect("a set");
        emit(json!({"what": "switch", "set": label, "from": "host", "ms": ms(acquired.elapsed)}));
        summary.push(format!("switch to {label} from host memory (place): {:.0} ms", ms(acquired.elapsed)));
    }
    for line in summary {
        eprintln!("{line}");
    }
    Ok(())
}

fn name_of(label: &str) -> String {
    label.replace(' ', "-").replace(".safetensors", "")
}

/// A local-folder library holding `sets`' LoRA files, written as `lora push` would.
fn library_with(dir: &Path, sets: &[(String, Vec<Adapter>)]) -> Result<LoraLibrary, Box<dyn std::error::Error>> {
    let root = dir.join("store");
    let folder = root.join(shotfleet_schema::lora::library::DEFAULT_PREFIX);
    std::fs::create_dir_all(&folder)?;
    for (label, adapters) in sets {
        let name = name_of(label);
        let bytes = kohya_bytes(&adapters[0].file)?;
        let file = LoraFile::parse(&bytes, &Default::default())?;
        let entry = LoraEntry::describe(&name, &bytes, &file, 0);
        std::fs::write(folder.join(format!("{name}.safetensors")), &bytes)?;
        std::fs::write(folder.join(format!("{name}.json")), serde_json::to_vec(&entry)?)?;
    }
    let store = StoreConfig { url: format!("file://{}", root.display()), ..StoreConfig::default() };
    let config = LibraryConfig { cache_dir: dir.join("cache"), ..LibraryConfig::default() };
    Ok(LoraLibrary::open(&store, &config, Vec::<(String, String)>::new())?)
}

/// `file` as a kohya-named float16 safetensors file (alpha = rank x scale).
fn kohya_bytes(file: &LoraFile) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut tensors: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
    for t in &file.targets {
        let prefix = match t.part {
            Part::Unet => "lora_unet_",
            Part::TextEncoder => "lora_te1_",
            Part::TextEncoder2 => "lora_te2_",
        };
        let key = format!("{prefix}{}", t.module.replace('.', "_"));
        let half = |v: &[f32]| v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect::<Vec<u8>>();
        tensors.push((format!("{key}.lora_down.weight"), half(&t.down.data), t.down.shape.clone()));
        tensors.push((format!("{key}.lora_up.weight"), half(&t.up.data), t.up.shape.clone()));
        tensors.push((format!("{key}.alpha"), half(&[t.scale * t.rank() as f32]), vec![]));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, b, s)| Ok((k.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F16, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    Ok(safetensors::serialize(views, None)?)
}

/// SDXL-base's adaptable linear layers (the usual ones): `(part, module, [out, in])`.
fn sdxl_usual_layers() -> Vec<(Part, String, Vec<usize>)> {
    let mut layers = Vec::new();
    // (block path, channels, attentions, transformer depth)
    let blocks = [
        ("down_blocks.1", 640, 2, 2),
        ("down_blocks.2", 1280, 2, 10),
        ("mid_block", 1280, 1, 10),
        ("up_blocks.0", 1280, 3, 10),
        ("up_blocks.1", 640, 3, 2),
    ];
    for (block, c, attentions, depth) in blocks {
        for a in 0..attentions {
            let base = format!("{block}.attentions.{a}");
            layers.push((Part::Unet, format!("{base}.proj_in"), vec![c, c]));
            layers.push((Part::Unet, format!("{base}.proj_out"), vec![c, c]));
            for t in 0..depth {
                let tb = format!("{base}.transformer_blocks.{t}");
                for (m, shape) in [
                    ("attn1.to_q", [c, c]),
                    ("attn1.to_k", [c, c]),
                    ("attn1.to_v", [c, c]),
                    ("attn1.to_out.0", [c, c]),
                    ("attn2.to_q", [c, c]),
                    ("attn2.to_k", [c, 2048]),
                    ("attn2.to_v", [c, 2048]),
                    ("attn2.to_out.0", [c, c]),
                    ("ff.net.0.proj", [8 * c, c]),
                    ("ff.net.2", [c, 4 * c]),
                ] {
                    layers.push((Part::Unet, format!("{tb}.{m}"), shape.to_vec()));
                }
            }
        }
    }
    for (part, hidden, count) in [(Part::TextEncoder, 768, 12), (Part::TextEncoder2, 1280, 32)] {
        for l in 0..count {
            let layer = format!("text_model.encoder.layers.{l}");
            for (m, shape) in [
                ("self_attn.q_proj", [hidden, hidden]),
                ("self_attn.k_proj", [hidden, hidden]),
                ("self_attn.v_proj", [hidden, hidden]),
                ("self_attn.out_proj", [hidden, hidden]),
                ("mlp.fc1", [4 * hidden, hidden]),
                ("mlp.fc2", [hidden, 4 * hidden]),
            ] {
                layers.push((part, format!("{layer}.{m}"), shape.to_vec()));
            }
        }
    }
    layers
}

/// The merge alone on SDXL's shapes: a model folder of maps and float16 random base weights
/// (the plain fp16 export's layout, MatMul weights transposed) for `fraction` of the usual layers.
fn synthetic_sdxl(fraction: f64, ranks: &[usize]) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::Write;
    let all = sdxl_usual_layers();
    let every = (1.0 / fraction).round().max(1.0) as usize;
    let layers: Vec<_> = all.iter().enumerate().filter(|(i, _)| i % every == 0).map(|(_, l)| l.clone()).collect();
    let params: usize = layers.iter().map(|(_, _, s)| s[0] * s[1]).sum();
    let full_params: usize = all.iter().map(|(_, _, s)| s[0] * s[1]).sum();
    eprintln!("SDXL usual layers: {} ({:.2}e9 weights, {:.2} GiB in float16); here every {every}th: {} layers, {:.2}e9 weights", all.len(), full_params as f64 / 1e9, (2 * full_params) as f64 / (1u64 << 30) as f64, layers.len(), params as f64 / 1e9);
    let dir = tempfile::tempdir()?;
    for part in Part::ALL {
        let folder = dir.path().join(part.as_str());
        std::fs::create_dir_all(&folder)?;
        let mut data = std::io::BufWriter::new(std::fs::File::create(folder.join("model.onnx_data"))?);
        let (mut initializers, mut modules, mut offset) = (serde_json::Map::new(), serde_json::Map::new(), 0u64);
        let mut value = 0x1234_5678u32;
        for (p, module, shape) in layers.iter().filter(|(p, _, _)| *p == part) {
            let _ = p;
            let name = format!("w:{module}");
            let n = shape[0] * shape[1];
            let mut bytes = Vec::with_capacity(2 * n);
            for _ in 0..n {
                value = value.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                bytes.extend_from_slice(&half::f16::from_f32(((value >> 9) as f32 / (1u32 << 23) as f32 - 0.5) * 0.05).to_le_bytes());
            }
            data.write_all(&bytes)?;
            initializers.insert(name.clone(), json!({"dtype": "float16", "shape": [shape[1], shape[0]], "offset": offset, "length": bytes.len()}));
            modules.insert(module.clone(), json!({"initializer": name, "kind": "linear", "shape": shape, "layout": "transposed"}));
            offset += bytes.len() as u64;
        }
        data.flush()?;
        let map = json!({"version": 1, "part": part.as_str(), "data_file": "model.onnx_data", "initializers": initializers, "modules": modules});
        std::fs::write(folder.join("lora_map.json"), serde_json::to_vec(&map)?)?;
    }
    let maps = WeightMaps::load(dir.path())?;
    let modules = all_modules(&maps);
    for &rank in ranks {
        let file = random_lora(&modules, rank, rank as u64);
        let adapters = [Adapter { name: format!("rank{rank}"), file: Arc::new(file), weight: 0.8 }];
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..3 {
            let t = Instant::now();
            let merged = maps.merge(&adapters)?;
            times.push(t.elapsed());
            bytes = merged.bytes();
        }
        times.sort();
        let best = times[0];
        let per_weight_ns = best.as_secs_f64() * 1e9 / params as f64;
        let full_s = per_weight_ns * full_params as f64 / 1e9;
        emit(json!({"what": "merge_synthetic_sdxl", "rank": rank, "layers": layers.len(), "weights": params, "bytes": bytes,
            "ms_best_of_3": ms(best), "ns_per_weight": per_weight_ns, "full_sdxl_s_estimate": full_s, "threads": rayon::current_num_threads()}));
        eprintln!("rank {rank}: merge of {} layers ({:.1} MiB) {:.0} ms (best of 3, {} threads): {per_weight_ns:.2} ns per weight, so {full_s:.1} s for all SDXL usual layers", layers.len(), bytes as f64 / (1 << 20) as f64, ms(best), rayon::current_num_threads());
    }
    Ok(())
}
