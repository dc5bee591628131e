"""Times one SDXL UNet ONNX model under many ONNX Runtime CUDA-provider settings.

    PYTHONPATH=/root/site python3 onnx/bench_unet.py --model /root/sdxl/unet/model.onnx \\
        --unfused /root/sdxl-unfused/unet/model.onnx --out /root/results/unet.json --budget-s 480

Each variant is a set of CUDA execution provider options, environment variables read by the
provider (attention kernels) and session options. For each one: a fresh session, inputs and the
output bound on the device with IoBinding (preallocated, so CUDA graphs can replay), a few warm-up
calls, then N timed calls; the median is reported with the ratio to "stock" (no options at all).
One line per variant is printed and the JSON is rewritten after every variant, so a run cut short
keeps what it measured. A variant that fails prints its error and the run goes on.

By default each variant runs in its own child process: environment variables then apply cleanly,
a CUDA error in one variant cannot poison the next, and a hung variant is killed after
--variant-timeout-s. After the single settings, combinations of the winners are built
("combo:" names), stock is timed again (the spread between the two stock runs is the noise), and
one stock run with ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 records which attention kernel each
MultiHeadAttention node chose.

Shapes and dtypes come from the session: batch 2 (classifier-free guidance), latent
height x width = size / 8, text length 77; widths such as 2048 and 1280 are read from the graph.
timestep is a 0-d scalar of the model's float type; time_ids rows are [h, w, 0, 0, h, w].

CPU check of the same code path (the committed tiny fixture, CUDA options ignored):
    .venv/bin/python onnx/bench_unet.py --tiny --out /tmp/unet-tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TINY_UNET = HERE / "tiny" / "model" / "unet" / "model.onnx"

# Dense FLOPs of one SDXL-base UNet call at batch 2, 1024x1024 (shared/gpu/README.md: 13.52 TFLOP).
SDXL_FLOP_B2_1024 = 13.52e12

# sdpa_kernel bit flags (AttentionBackend in onnxruntime contrib_ops/cpu/bert/attention_common.h).
SDPA = {
    "flash": 1,
    "efficient": 2,
    "trt_fused": 4,
    "cudnn_flash": 8,
    "math": 16,
    "trt_flash": 32,
    "trt_cross": 64,
    "trt_causal": 128,
    "lean": 256,
}


@dataclass
class Variant:
    name: str
    group: str  # combos take at most one winner per group
    cuda: dict = field(default_factory=dict)  # CUDA provider options (strings)
    env: dict = field(default_factory=dict)  # environment of the child process
    session: dict = field(default_factory=dict)  # SessionOptions attributes, or "config:KEY" entries
    model: str = "fused"  # "fused" (--model) or "unfused" (--unfused)
    timed: bool = True  # False: one run only, to record the attention kernel debug lines
    note: str = ""
    extra: bool = False  # not in the default list
    late: bool = False  # run after the first round of combinations


def single_variants() -> list[Variant]:
    """The settings tried one at a time against stock (ONNX Runtime 1.31.1 CUDA provider names), in order
    of interest: when the budget runs out, the last ones are skipped. `late` ones run after the first
    combinations of winners; `extra` ones run only when named (or with --variants every): they repeat a
    default or overlap another variant."""
    return [
        Variant("stock", "stock", note="no provider options: ORT defaults"),
        Variant("cuda_graph", "graph", {"enable_cuda_graph": "1"}),
        Variant("prefer_nhwc", "layout", {"prefer_nhwc": "1"}),
        Variant("conv_heuristic", "conv_search", {"cudnn_conv_algo_search": "HEURISTIC"}),
        Variant("sdpa_flash", "attention", {"sdpa_kernel": str(SDPA["flash"])}),
        Variant("sdpa_efficient", "attention", {"sdpa_kernel": str(SDPA["efficient"])}),
        Variant("sdpa_trt", "attention",
                {"sdpa_kernel": str(SDPA["trt_fused"] | SDPA["trt_flash"] | SDPA["trt_cross"])},
                note="TensorRT fused/flash self attention + fused cross attention"),
        Variant("sdpa_cudnn", "attention", {"sdpa_kernel": str(SDPA["cudnn_flash"])}),
        Variant("sdpa_math", "attention", {"sdpa_kernel": str(SDPA["math"])}, note="unfused attention kernel"),
        Variant("env_no_flash", "attention", env={"ORT_DISABLE_FLASH_ATTENTION": "1"}),
        Variant("env_no_trt", "attention", env={
            "ORT_DISABLE_TRT_FLASH_ATTENTION": "1",
            "ORT_DISABLE_FUSED_ATTENTION": "1",
            "ORT_DISABLE_FUSED_CROSS_ATTENTION": "1",
        }),
        Variant("env_cudnn_flash", "attention", env={"ORT_ENABLE_CUDNN_FLASH_ATTENTION": "1"}),
        Variant("max_workspace_0", "workspace", {"cudnn_conv_use_max_workspace": "0"},
                note="default is 1 since ORT 1.14", late=True),
        Variant("conv_default", "conv_search", {"cudnn_conv_algo_search": "DEFAULT"}, late=True),
        Variant("tf32_0", "tf32", {"use_tf32": "0"}, note="default is 1; fp16 models barely use fp32 math", late=True),
        Variant("tunable_op", "tunable", {"tunable_op_enable": "1", "tunable_op_tuning_enable": "1"},
                note="tuning happens during warm-up", late=True),
        Variant("fuse_conv_bias", "conv_bias", {"fuse_conv_bias": "1"}, late=True),
        # extras
        Variant("conv_exhaustive", "conv_search", {"cudnn_conv_algo_search": "EXHAUSTIVE"},
                note="ORT's default; should match stock", extra=True),
        Variant("max_workspace_1", "workspace", {"cudnn_conv_use_max_workspace": "1"}, note="the default",
                extra=True),
        Variant("tf32_1", "tf32", {"use_tf32": "1"}, note="the default", extra=True),
        Variant("sdpa_flash_trtcross", "attention", {"sdpa_kernel": str(SDPA["flash"] | SDPA["trt_cross"])},
                extra=True),
        Variant("env_no_mem_efficient", "attention", env={"ORT_DISABLE_MEMORY_EFFICIENT_ATTENTION": "1"},
                extra=True),
        Variant("opt_basic", "session", session={"graph_optimization_level": "ORT_ENABLE_BASIC"},
                note="ORT's own graph optimizations at BASIC instead of ALL", extra=True),
    ]


def tail_variants(unfused: bool) -> list[Variant]:
    v = [
        Variant("stock_again", "stock", note="stock once more: the spread between the two is the noise"),
        Variant("kernel_debug", "debug", env={"ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO": "1"}, timed=False,
                note="stock, one run, prints the attention kernel of each node"),
    ]
    if unfused:
        v += [
            Variant("unfused_stock", "unfused", model="unfused", note="plain fp16 export, no ORT fusion"),
            Variant("unfused_cuda_graph", "unfused", {"enable_cuda_graph": "1"}, model="unfused"),
        ]
    return v


def combos(results: list[dict], singles: list[Variant], noise: float, limit: int) -> list[Variant]:
    """Combinations of the per-group winners (faster than stock by more than `noise`)."""
    by_name = {r["name"]: r for r in results}
    stock = by_name.get("stock", {}).get("median_ms")
    if not stock:
        return []
    winners: dict[str, Variant] = {}
    for v in singles:
        r = by_name.get(v.name)
        if v.group in ("stock",) or not r or r.get("status") != "ok" or not r.get("median_ms"):
            continue
        if r["median_ms"] < stock * (1 - noise):
            best = winners.get(v.group)
            if best is None or r["median_ms"] < by_name[best.name]["median_ms"]:
                winners[v.group] = v
    ranked = sorted(winners.values(), key=lambda v: by_name[v.name]["median_ms"])
    out: list[Variant] = []

    def merge(parts: list[Variant]) -> Variant:
        cuda, env, session = {}, {}, {}
        for p in parts:
            cuda.update(p.cuda)
            env.update(p.env)
            session.update(p.session)
        return Variant("combo:" + "+".join(p.name for p in parts), "combo", cuda, env, session)

    if len(ranked) >= 2:
        out.append(merge(ranked))
        if "graph" in winners:
            others = [v for v in ranked if v.group != "graph"]
            if len(others) >= 2:
                out.append(merge(others))  # in case the graph refuses one of the others
            for o in others:
                out.append(merge([winners["graph"], o]))
        else:
            for i in range(len(ranked)):
                for j in range(i + 1, len(ranked)):
                    out.append(merge([ranked[i], ranked[j]]))
    seen, unique = set(), []
    for c in out:
        if c.name not in seen:
            seen.add(c.name)
            unique.append(c)
    return unique[:limit]


# ---------------------------------------------------------------------------------------------
# One variant (runs in the child process, or in-process with --no-isolate)
# ---------------------------------------------------------------------------------------------

NP_TYPES = {
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
}


def make_feeds(sess, batch: int, size_px: int, seq: int, seed: int) -> tuple[dict, dict]:
    """Random inputs shaped from the session's metadata; returns (feeds, symbolic dim values)."""
    import numpy as np

    lat = size_px // 8
    rng = np.random.default_rng(seed)
    feeds, dims = {}, {}
    for meta in sess.get_inputs():
        dtype = np.dtype(NP_TYPES[meta.type])
        shape = []
        for pos, d in enumerate(meta.shape):
            if isinstance(d, int) and d > 0:
                shape.append(d)
                continue
            if pos == 0:
                value = batch
            elif meta.name == "sample" and pos in (2, 3):
                value = lat
            elif meta.name == "encoder_hidden_states" and pos == 1:
                value = seq
            else:
                raise ValueError(f"input {meta.name}: cannot size dynamic axis {pos} ({d!r})")
            if isinstance(d, str):
                dims[d] = value
            shape.append(value)
        if meta.name == "timestep":
            arr = np.full(shape, 801.0, dtype=dtype)
        elif meta.name == "time_ids":
            arr = np.tile(np.array([size_px, size_px, 0, 0, size_px, size_px], dtype=dtype), (shape[0], 1))
        elif dtype.kind == "f":
            arr = rng.standard_normal(shape).astype(dtype)
        else:
            arr = rng.integers(0, 1000, size=shape).astype(dtype)
        feeds[meta.name] = arr
    return feeds, dims


def output_shape(meta, dims: dict, feeds: dict) -> list[int]:
    shape = []
    for pos, d in enumerate(meta.shape):
        if isinstance(d, int) and d > 0:
            shape.append(d)
        elif isinstance(d, str) and d in dims:
            shape.append(dims[d])
        elif "sample" in feeds and len(meta.shape) == feeds["sample"].ndim:
            shape.append(feeds["sample"].shape[pos])  # a UNet's output has its sample's shape
        else:
            raise ValueError(f"output {meta.name}: cannot size axis {pos} ({d!r})")
    return shape


def gpu_memory(pid: int) -> dict:
    """Device memory in use (MiB): by this process if NVML lists it, and on the whole device."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = {"device_used_mib": pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20}
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid and p.usedGpuMemory:
                info["process_used_mib"] = p.usedGpuMemory / 2**20
        pynvml.nvmlShutdown()
        return info
    except Exception as e:  # noqa: BLE001 - memory figures are optional
        return {"nvml_error": str(e)}


def run_variant(v: Variant, model: str, args, ref_out: Path | None, save_out: Path | None) -> dict:
    import numpy as np
    import onnxruntime as ort

    res: dict = {"status": "error"}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    for key, value in v.session.items():
        if key.startswith("config:"):
            so.add_session_config_entry(key[len("config:"):], str(value))
        elif key == "graph_optimization_level":
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, value)
        else:
            setattr(so, key, value)
    if args.device == "cuda":
        providers = [("CUDAExecutionProvider", {"device_id": "0", **v.cuda})]
    else:
        providers = ["CPUExecutionProvider"]

    t0 = time.perf_counter()
    sess = ort.InferenceSession(model, so, providers=providers)
    res["load_s"] = time.perf_counter() - t0
    active = sess.get_providers()
    res["providers"] = active
    if args.device == "cuda":
        if not active or active[0] != "CUDAExecutionProvider":
            raise RuntimeError(f"CUDA provider not active (session has {active})")
        res["provider_options"] = sess.get_provider_options().get("CUDAExecutionProvider", {})

    feeds, dims = make_feeds(sess, args.batch, args.size, args.seq, args.seed)
    res["inputs"] = {k: [list(a.shape), str(a.dtype)] for k, a in feeds.items()}
    dev = "cuda" if args.device == "cuda" else "cpu"
    io = sess.io_binding()
    keep = []  # the OrtValues must outlive the binding
    for name, arr in feeds.items():
        ov = ort.OrtValue.ortvalue_from_numpy(arr, dev, 0)
        keep.append(ov)
        io.bind_ortvalue_input(name, ov)
    outs = []
    for meta in sess.get_outputs():
        shape = output_shape(meta, dims, feeds)
        ov = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(NP_TYPES[meta.type]), dev, 0)
        outs.append(ov)
        io.bind_ortvalue_output(meta.name, ov)

    def call() -> float:
        t = time.perf_counter()
        sess.run_with_iobinding(io)  # the CUDA provider synchronizes its stream at the end of Run
        io.synchronize_outputs()
        return time.perf_counter() - t

    res["first_run_s"] = call()
    if v.timed:
        t = time.perf_counter()
        for _ in range(max(0, args.warmup - 1)):
            call()
        res["warmup_s"] = time.perf_counter() - t
        times = [call() * 1e3 for _ in range(args.iters)]
        times_sorted = sorted(times)
        res.update(
            iters=len(times),
            median_ms=statistics.median(times),
            mean_ms=statistics.fmean(times),
            min_ms=times_sorted[0],
            p90_ms=times_sorted[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))],
            max_ms=times_sorted[-1],
            stdev_ms=statistics.pstdev(times),
        )
    out = outs[0].numpy().astype(np.float64)
    res["out_finite_frac"] = float(np.isfinite(out).mean())
    res["out_abs_mean"] = float(np.nanmean(np.abs(out)))
    if save_out is not None:
        np.save(save_out, out)
    if ref_out is not None and ref_out.exists():
        ref = np.load(ref_out)
        if ref.shape == out.shape:
            d = out - ref
            res["rel_err_vs_stock"] = float(np.linalg.norm(d) / max(np.linalg.norm(ref), 1e-30))
            res["max_abs_vs_stock"] = float(np.nanmax(np.abs(d)))
    if args.device == "cuda":
        res.update(gpu_memory(os.getpid()))
    res["status"] = "ok"
    return res


def child_main(args) -> None:
    v = Variant(**json.loads(args.child_variant))
    model = args.unfused if v.model == "unfused" else args.model
    ref = Path(args.child_ref) if args.child_ref else None
    save = Path(args.child_save) if args.child_save else None
    try:
        res = run_variant(v, model, args, ref, save)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on
        res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    Path(args.child_result).write_text(json.dumps(res))


# ---------------------------------------------------------------------------------------------
# Parent: schedule, isolate, summarise
# ---------------------------------------------------------------------------------------------


def attention_lines(lines: list[str]) -> dict:
    """Counts ORT's attention debug lines per kernel choice (node names dropped)."""
    counts: dict[str, int] = {}
    for line in lines:
        line = line.strip()
        if not line.startswith("Operator="):
            continue
        key = " ".join(tok for tok in line.split() if not tok.startswith("Node="))
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def run_child(v: Variant, args, work: Path, timeout_s: float) -> tuple[dict, list[str]]:
    result = work / f"{safe(v.name)}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-variant", json.dumps(asdict(v)),
           "--child-result", str(result), "--model", args.model, "--device", args.device,
           "--batch", str(args.batch), "--size", str(args.size), "--seq", str(args.seq),
           "--seed", str(args.seed), "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.unfused:
        cmd += ["--unfused", args.unfused]
    stock_out = work / "stock_out.npy"
    if v.name == "stock":
        cmd += ["--child-save", str(stock_out)]
    elif v.model == "fused":
        cmd += ["--child-ref", str(stock_out)]
    env = dict(os.environ)
    env.update(v.env)
    lines: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not line.startswith("Operator="):  # the debug variant prints one per node and call
                print("    | " + line.rstrip(), flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5)
        return {"status": "timeout", "error": f"killed after {timeout_s:.0f} s"}, lines
    reader.join(5)
    if result.exists():
        res = json.loads(result.read_text())
    else:
        tail = "".join(lines[-8:]).strip()
        res = {"status": "error", "error": f"child exited {rc} without a result: {tail[-800:]}"}
    return res, lines


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def fmt_line(r: dict, stock: float | None) -> str:
    name = r["name"]
    if r.get("status") != "ok":
        return f"{name:44} {r.get('status', '?'):>9}  {r.get('error', '')[:160]}"
    if r.get("median_ms") is None:
        extra = f"attention kernels: {len(r.get('attention_kernels', {}))} kinds" if "attention_kernels" in r else ""
        return f"{name:44} {'(1 run)':>9}  first run {r['first_run_s'] * 1e3:.0f} ms {extra}"
    ms = r["median_ms"]
    vs = f"{stock / ms:5.2f}x" if stock else "   - "
    err = r.get("rel_err_vs_stock")
    err_s = f" rel.err {err:.1e}" if err is not None else ""
    tf = f" {r['tflops']:.0f} TFLOP/s" if r.get("tflops") else ""
    return (f"{name:44} {ms:8.2f} ms {vs} vs stock  (min {r['min_ms']:.2f}, p90 {r['p90_ms']:.2f}; "
            f"load {r['load_s']:.1f} s, first {r['first_run_s']:.1f} s){tf}{err_s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/root/sdxl/unet/model.onnx", help="fused fp16 UNet (model.onnx)")
    ap.add_argument("--unfused", default=None, help="optional plain fp16 UNet; skipped if the file is missing")
    ap.add_argument("--out", default=None, help="JSON results (rewritten after each variant)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="the committed tiny fp32 UNet on the CPU at 64x64 (checks the code path here)")
    ap.add_argument("--batch", type=int, default=2, help="UNet batch (2 = one image with guidance)")
    ap.add_argument("--size", type=int, default=1024, help="image size in pixels (latent = size / 8)")
    ap.add_argument("--seq", type=int, default=77)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="calls before timing (the first one included)")
    ap.add_argument("--variants", default="all",
                    help="comma list of single variant names, 'all' (the default list) or 'every' (with the "
                         "extras); see --list. stock and the tail variants always run")
    ap.add_argument("--no-combos", action="store_true")
    ap.add_argument("--max-combos", type=int, default=5)
    ap.add_argument("--noise", type=float, default=0.01, help="a winner must beat stock by this fraction")
    ap.add_argument("--budget-s", type=float, default=480, help="start no variant after this many seconds")
    ap.add_argument("--tail-reserve-s", type=float, default=35,
                    help="per tail variant (stock_again, kernel_debug, unfused): budget kept back for them")
    ap.add_argument("--variant-timeout-s", type=float, default=180)
    ap.add_argument("--no-isolate", action="store_true", help="run variants in this process")
    ap.add_argument("--flop-per-call", type=float, default=None,
                    help="for TFLOP/s; default 13.52e12 at batch 2 and 1024 px, else none")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--child-variant", help=argparse.SUPPRESS)
    ap.add_argument("--child-result", help=argparse.SUPPRESS)
    ap.add_argument("--child-ref", help=argparse.SUPPRESS)
    ap.add_argument("--child-save", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.tiny:
        args.model = str(TINY_UNET)
        args.device = "cpu"
        if args.size == 1024:
            args.size = 64
        args.iters = min(args.iters, 10)
    if args.child_variant:
        child_main(args)
        return

    singles = single_variants()
    if args.variants == "all":
        singles = [v for v in singles if not v.extra]
    elif args.variants != "every":
        wanted = [n for n in args.variants.split(",") if n]
        known = {v.name: v for v in singles}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {sorted(known)}")
        singles = [known["stock"]] + [known[n] for n in wanted if n != "stock"]
    have_unfused = bool(args.unfused) and Path(args.unfused).exists()
    if args.unfused and not have_unfused:
        print(f"unfused model {args.unfused} not found: its variants are skipped", flush=True)
    tails = tail_variants(have_unfused)
    if args.list:
        for v in single_variants() + tails:
            print(f"{v.name:22} {v.group:12} {'extra' if v.extra else '     '} cuda={v.cuda} env={v.env} "
                  f"session={v.session} {v.note}")
        return
    if not Path(args.model).exists():
        raise SystemExit(f"model not found: {args.model}")
    if args.flop_per_call is None and args.batch == 2 and args.size == 1024 and not args.tiny:
        args.flop_per_call = SDXL_FLOP_B2_1024

    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench_unet_"))
    doc = {
        "model": args.model,
        "unfused": args.unfused if have_unfused else None,
        "device": args.device,
        "batch": args.batch,
        "size": args.size,
        "iters": args.iters,
        "warmup": args.warmup,
        "isolated": not args.no_isolate,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "versions": versions(),
        "results": [],
    }
    baseline = gpu_memory(-1) if args.device == "cuda" else {}
    doc["device_used_mib_before"] = baseline.get("device_used_mib")
    results: list[dict] = doc["results"]

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            tmp.replace(args.out)

    def stock_ms() -> float | None:
        for r in results:
            if r["name"] == "stock" and r.get("status") == "ok":
                return r.get("median_ms")
        return None

    reserve = args.tail_reserve_s * len(tails)

    def run(v: Variant, budget: float) -> None:
        elapsed = time.monotonic() - start
        left = budget - elapsed
        entry = {"name": v.name, "group": v.group, "cuda": v.cuda, "env": v.env, "session": v.session,
                 "model": v.model, "note": v.note}
        if left <= 0:
            entry.update(status="skipped", error=f"budget of {budget:.0f} s spent")
        else:
            print(f"[{elapsed:6.0f} s] {v.name} cuda={v.cuda} env={v.env}", flush=True)
            lines: list[str] = []
            if args.no_isolate:
                saved = {k: os.environ.get(k) for k in v.env}
                os.environ.update(v.env)
                model = args.unfused if v.model == "unfused" else args.model
                stock_out = work / "stock_out.npy"
                try:
                    res = run_variant(v, model, args, None if v.name == "stock" or v.model != "fused" else stock_out,
                                      stock_out if v.name == "stock" else None)
                except Exception as e:  # noqa: BLE001 - print and go on
                    res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
                for k, old in saved.items():
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old
            else:
                res, lines = run_child(v, args, work, min(args.variant_timeout_s, left + 60))
            entry.update(res)
            if not v.timed:
                entry["attention_kernels"] = attention_lines(lines)
            if entry.get("median_ms") and args.flop_per_call:
                entry["tflops"] = args.flop_per_call / (entry["median_ms"] * 1e-3) / 1e12
        st = stock_ms()
        if st and entry.get("median_ms"):
            entry["vs_stock"] = st / entry["median_ms"]
        results.append(entry)
        print(fmt_line(entry, st), flush=True)
        save()

    done: set[str] = set()
    for v in [v for v in singles if not v.late and not v.extra]:
        run(v, args.budget_s if v.name == "stock" else args.budget_s - reserve)
    if not args.no_combos:  # first round: the winners so far
        for c in combos(results, singles, args.noise, args.max_combos):
            run(c, args.budget_s - reserve)
            done.add(c.name)
    for v in [v for v in singles if v.late or v.extra]:
        run(v, args.budget_s - reserve)
    if not args.no_combos:  # second round: with the late winners, what the first round did not try
        for c in combos(results, singles, args.noise, args.max_combos):
            if c.name not in done and len(done) < args.max_combos:
                run(c, args.budget_s - reserve)
                done.add(c.name)
    for v in tails:
        run(v, args.budget_s)

    st = stock_ms()
    again = next((r.get("median_ms") for r in results if r["name"] == "stock_again" and r.get("status") == "ok"), None)
    if st and again:
        doc["stock_spread"] = abs(again - st) / st
    ok = [r for r in results if r.get("status") == "ok" and r.get("median_ms") and r.get("model") == "fused"]
    if ok:
        best = min(ok, key=lambda r: r["median_ms"])
        doc["best"] = {"name": best["name"], "median_ms": best["median_ms"], "cuda": best["cuda"], "env": best["env"],
                       "vs_stock": (st / best["median_ms"]) if st else None}
    doc["elapsed_s"] = time.monotonic() - start
    save()

    print(f"\n== UNet variants: median ms per call (batch {args.batch}, {args.size} px), "
          "ratio = stock / variant ==")
    for r in results:
        print(fmt_line(r, st))
    if "stock_spread" in doc:
        print(f"stock vs stock_again spread: {doc['stock_spread'] * 100:.1f}% (differences below this are noise)")
    if "best" in doc:
        b = doc["best"]
        vs = f" ({b['vs_stock']:.2f}x stock)" if b["vs_stock"] else ""
        print(f"best: {b['name']} {b['median_ms']:.2f} ms{vs}")
    for r in results:
        if r.get("attention_kernels"):
            print("attention kernels (stock):")
            for k, n in r["attention_kernels"].items():
                print(f"  {n:4d} x {k}")
    print(f"elapsed {doc['elapsed_s']:.0f} s" + (f"; JSON: {args.out}" if args.out else ""))


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("onnxruntime", "numpy"):
        try:
            m = __import__(mod)
            out[mod] = m.__version__
            if mod == "onnxruntime":
                out["onnxruntime_providers"] = m.get_available_providers()
                out["onnxruntime_file"] = m.__file__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"unavailable: {e}"
    return out


if __name__ == "__main__":
    main()
