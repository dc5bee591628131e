"""Where a UNet call's time goes: per ONNX node and per op type, each against its own roofline.

    PYTHONPATH=/root/site python3 onnx/profile_unet.py --model /root/sdxl/unet/model.onnx \\
        --batches 2,8 --size 1024 --out /root/results/profile.json --md /root/results/profile.md

ONNX Runtime's own profiler records, per node, the host-side time of its Compute() and the shapes
of its inputs and outputs; on the CUDA provider that time is the kernels' launch, not their run.
The GPU side comes from CUPTI through torch.profiler in the same process (it sees every kernel of
the process, ONNX Runtime's included). Each kernel is joined to its launch (correlation id), and
each launch to the node whose host interval holds it, after aligning the two clocks (both are
wall-clock based; the offset is refined by maximising the launches that land inside a node).
So every node gets the GPU time of the kernels it launched, and every op type the sum.

Each node's floor is its roofline: max(FLOPs / matrix rate, bytes moved / memory bandwidth), both
rates measured on this GPU in the same run (a large fp16 matmul, a device-to-device copy). FLOPs
are counted for the ops that do matrix work (MatMul, Gemm, Conv, NhwcConv, FusedConv,
MultiHeadAttention, Attention); bytes are every input and output once (weights included), the
least any kernel must move. "efficiency" is floor / measured: 1.0 is at the roof.

Timings without any profiler attached (median of --iters calls, IoBinding, synchronised) are
reported beside the profiled figures: the profilers slow the host, not the kernels.

CPU check of the code path (the committed tiny fixture; no CUPTI, so the host times are the node
times): .venv/bin/python onnx/profile_unet.py --device cpu --size 64 --batches 2 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_unet import NP_TYPES, TINY_UNET, make_feeds, output_shape  # noqa: E402

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float": 4, "float32": 4, "double": 8, "int64": 8, "int32": 4,
               "int8": 1, "uint8": 1, "bool": 1}
MATRIX_OPS = {"MatMul", "Gemm", "FusedMatMul", "Conv", "NhwcConv", "FusedConv", "MultiHeadAttention", "Attention"}


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------

def _tensors(shapes: list) -> list[tuple[str, list[int]]]:
    """ONNX Runtime's input_type_shape / output_type_shape: [{"float16": [2, 4, 128, 128]}, ...]."""
    out = []
    for entry in shapes or []:
        for dtype, dims in entry.items():
            out.append((dtype, [int(d) for d in dims]))
    return out


def _numel(dims: list[int]) -> int:
    return math.prod(dims) if dims else 1


def node_flops(op: str, inputs: list, outputs: list) -> float:
    """Multiply-adds x 2 of the matrix work; 0 for the ops that do none worth counting."""
    if not inputs or not outputs:
        return 0.0
    if op in ("MatMul", "FusedMatMul"):
        a, b = inputs[0][1], inputs[1][1]
        if len(a) < 2 or len(b) < 1:
            return 0.0
        m, k = a[-2], a[-1]
        n = b[-1] if len(b) >= 2 else 1
        batch = _numel(outputs[0][1]) / max(1, m * n)
        return 2.0 * batch * m * n * k
    if op == "Gemm":
        a, b = inputs[0][1], inputs[1][1]
        out = outputs[0][1]
        k = a[-1] if a[-1] in b else a[0]
        return 2.0 * _numel(out) * k
    if op in ("Conv", "NhwcConv", "FusedConv"):
        w = inputs[1][1]
        if not w:
            return 0.0
        return 2.0 * _numel(outputs[0][1]) * (_numel(w) / w[0])
    if op in ("MultiHeadAttention", "Attention"):
        q = inputs[0][1]
        if len(q) == 5:  # packed QKV: [B, S, heads, 3, head_size]
            b, s, hidden, length = q[0], q[1], q[2] * q[4], q[1]
        elif len(q) == 3:
            b, s, hidden = q
            length = s
            if len(inputs) > 1 and inputs[1][1]:
                k = inputs[1][1]
                length = k[1] if len(k) in (3, 5) else k[2]  # [B, L, hidden] or packed KV [B, L, N, 2, H]
        else:
            return 0.0
        return 4.0 * b * s * length * hidden
    return 0.0


def node_bytes(inputs: list, outputs: list) -> float:
    return float(sum(_numel(d) * DTYPE_BYTES.get(t, 2) for t, d in inputs + outputs))


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------

def measure_roofs() -> dict:
    """This GPU's fp16 matrix rate and memory bandwidth, measured with torch."""
    import torch

    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.float16)
    b = torch.randn(n, n, device=dev, dtype=torch.float16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    tflops = 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
    src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    gbps = 2 * src.numel() * reps / (time.perf_counter() - t) / 1e9  # read + write
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {"fp16_tflops": round(tflops, 1), "copy_gbps": round(gbps, 1),
            "how": f"torch fp16 matmul {n}^3 x {reps}; device copy of 1 GiB x {reps} (read + write)"}


def session(model: str, device: str, cuda_options: dict, profile_dir: str | None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if profile_dir:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(profile_dir, "ort")
    providers = [("CUDAExecutionProvider", {"device_id": "0", **cuda_options})] if device == "cuda" \
        else ["CPUExecutionProvider"]
    return ort.InferenceSession(model, so, providers=providers)


def bind(sess, batch: int, size: int, device: str):
    import numpy as np
    import onnxruntime as ort

    feeds, dims = make_feeds(sess, batch, size, 77, 0)
    dev = "cuda" if device == "cuda" else "cpu"
    io = sess.io_binding()
    keep = []
    for name, arr in feeds.items():
        ov = ort.OrtValue.ortvalue_from_numpy(arr, dev, 0)
        keep.append(ov)
        io.bind_ortvalue_input(name, ov)
    for meta in sess.get_outputs():
        ov = ort.OrtValue.ortvalue_from_shape_and_type(output_shape(meta, dims, feeds), np.dtype(NP_TYPES[meta.type]), dev, 0)
        keep.append(ov)
        io.bind_ortvalue_output(meta.name, ov)

    def call() -> float:
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        io.synchronize_outputs()
        return (time.perf_counter() - t) * 1e3

    return call, keep


def plain_timing(model: str, batch: int, size: int, device: str, cuda_options: dict, warmup: int, iters: int) -> dict:
    sess = session(model, device, cuda_options, None)
    call, _keep = bind(sess, batch, size, device)
    for _ in range(warmup):
        call()
    times = [call() for _ in range(iters)]
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3), "iters": iters}


def profiled_run(model: str, batch: int, size: int, device: str, cuda_options: dict, warmup: int, iters: int,
                 work: Path) -> tuple[list, list, int]:
    """ORT's node events of the last `iters` calls, CUPTI's kernels with their launches' host times
    (empty on the CPU), and how many calls were profiled."""
    sess = session(model, device, cuda_options, str(work))
    call, _keep = bind(sess, batch, size, device)
    for _ in range(warmup):
        call()
    kernels: list = []
    if device == "cuda":
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(iters):
                    call()
            trace = work / "kineto.json"
            prof.export_chrome_trace(str(trace))
            kernels = kineto_kernels(json.loads(trace.read_text()))
        except Exception as e:  # noqa: BLE001 - without CUPTI the host times still say something
            print(f"no CUPTI kernels ({type(e).__name__}: {e}); the calls run without torch's profiler", flush=True)
            for _ in range(iters):
                call()
    else:
        for _ in range(iters):
            call()
    start_ns = sess.get_profiling_start_time_ns()
    path = sess.end_profiling()
    events = json.loads(Path(path).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    keep_from = runs[-iters]["ts"] if len(runs) >= iters else 0
    nodes = []
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < keep_from:
            continue
        a = e.get("args", {})
        nodes.append({"name": e["name"][: -len("_kernel_time")], "op": a.get("op_name", "?"),
                      "provider": a.get("provider", ""), "ts_us": start_ns / 1e3 + e["ts"], "dur_us": e["dur"],
                      "inputs": _tensors(a.get("input_type_shape")), "outputs": _tensors(a.get("output_type_shape"))})
    nodes.sort(key=lambda n: n["ts_us"])
    return nodes, kernels, iters


def kineto_kernels(trace: dict) -> list[dict]:
    """GPU kernels (and memcpy/memset) with the host time of the API call that launched them."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    base = float(trace.get("baseTimeNanoseconds", 0)) / 1e3 if isinstance(trace, dict) else 0.0
    launches = {}
    gpu = []
    for e in events:
        cat = e.get("cat", "")
        corr = (e.get("args") or {}).get("correlation")
        if corr is None:
            continue
        if cat in ("cuda_runtime", "cuda_driver"):
            launches[corr] = float(e["ts"])
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append({"name": e.get("name", "?"), "cat": cat, "ts_us": float(e["ts"]), "dur_us": float(e.get("dur", 0)),
                        "corr": corr})
    out = []
    for k in gpu:
        if k["corr"] in launches:
            k["launch_us"] = launches[k["corr"]]
            out.append(k)
    # Chrome traces of older torch versions carry times relative to baseTimeNanoseconds.
    if out and out[0]["launch_us"] < 1e14 and base:
        for k in out:
            k["launch_us"] += base
            k["ts_us"] += base
    out.sort(key=lambda k: k["launch_us"])
    return out


def align(nodes: list, kernels: list) -> tuple[float, float]:
    """The offset (us) to add to launch times so that most land inside a node's host interval, and
    the share that does. Both clocks are wall-clock based, so the offset is near 0: the search
    stays within 200 us of it and, among offsets within 0.5% of the best count, takes the one
    nearest 0 (intervals nearly tile the host's time, so far offsets can score as well by chance).
    Only where almost nothing lands near 0 does it fall back to lining up the first launch."""
    if not nodes or not kernels:
        return 0.0, 0.0
    starts = [n["ts_us"] for n in nodes]
    ends = [n["ts_us"] + n["dur_us"] for n in nodes]

    def inside(offset: float) -> int:
        hits = 0
        for k in kernels:
            t = k["launch_us"] + offset
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= ends[i]:
                hits += 1
        return hits

    def search(centre: float, span: float, step: float) -> list[tuple[float, int]]:
        n = int(span / step)
        return [(centre + i * step, inside(centre + i * step)) for i in range(-n, n + 1)]

    scored = search(0.0, 200.0, 1.0)
    if max(h for _, h in scored) < 0.5 * len(kernels):
        scored = search(starts[0] - kernels[0]["launch_us"], 200.0, 1.0)
    best = max(h for _, h in scored)
    offset = min((o for o, h in scored if h >= 0.995 * best), key=abs)
    return offset, inside(offset) / len(kernels)


def attribute(nodes: list, kernels: list, offset: float) -> None:
    """Adds gpu_us and kernels to each node: the kernels launched inside its host interval (or,
    between intervals, by the node before)."""
    starts = [n["ts_us"] for n in nodes]
    for n in nodes:
        n["gpu_us"], n["kernels"] = 0.0, collections.Counter()
    for k in kernels:
        i = bisect.bisect_right(starts, k["launch_us"] + offset) - 1
        if i < 0:
            continue
        nodes[i]["gpu_us"] += k["dur_us"]
        nodes[i]["kernels"][k["name"][:80]] += 1


def kernel_table(kernels: list, calls: int, top: int = 25) -> list[dict]:
    """GPU time per call by kernel name (CUPTI's own view, no join to nodes needed)."""
    by = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        row = by[k["name"][:120]]
        row[0] += 1
        row[1] += k["dur_us"]
    total = sum(v[1] for v in by.values()) or 1.0
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": name, "launches_per_call": n / calls, "us_per_call": us / calls, "share": us / total}
            for name, (n, us) in rows]


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

def summarise(nodes: list, calls: int, roofs: dict | None, use_gpu_time: bool) -> dict:
    tflops = (roofs or {}).get("fp16_tflops") or 0
    gbps = (roofs or {}).get("copy_gbps") or 0
    per_node: dict[str, dict] = {}
    for n in nodes:
        row = per_node.setdefault(n["name"], {"name": n["name"], "op": n["op"], "provider": n["provider"], "us": 0.0,
                                              "host_us": 0.0, "flops": node_flops(n["op"], n["inputs"], n["outputs"]),
                                              "bytes": node_bytes(n["inputs"], n["outputs"]),
                                              "shapes": [d for _, d in n["inputs"]][:3], "kernels": collections.Counter()})
        row["us"] += n["gpu_us"] if use_gpu_time else n["dur_us"]
        row["host_us"] += n["dur_us"]
        row["kernels"].update(n.get("kernels", {}))
    rows = list(per_node.values())
    for r in rows:
        r["us"] /= calls
        r["host_us"] /= calls
        floor_s = max(r["flops"] / (tflops * 1e12) if tflops else 0.0, r["bytes"] / (gbps * 1e9) if gbps else 0.0)
        r["floor_us"] = floor_s * 1e6
        r["bound"] = "matrix" if tflops and gbps and r["flops"] / (tflops * 1e12) >= r["bytes"] / (gbps * 1e9) else "memory"
        r["efficiency"] = (r["floor_us"] / r["us"]) if r["us"] > 0 and (tflops or gbps) else None
        r["kernels"] = dict(r["kernels"].most_common(3))
    total = sum(r["us"] for r in rows)
    by_op: dict[str, dict] = {}
    for r in rows:
        o = by_op.setdefault(r["op"], {"op": r["op"], "nodes": 0, "us": 0.0, "floor_us": 0.0, "flops": 0.0, "bytes": 0.0})
        o["nodes"] += 1
        for key in ("us", "floor_us", "flops", "bytes"):
            o[key] += r[key]
    ops = sorted(by_op.values(), key=lambda o: -o["us"])
    for o in ops:
        o["share"] = o["us"] / total if total else 0.0
        o["efficiency"] = o["floor_us"] / o["us"] if o["us"] > 0 and (tflops or gbps) else None
        o["tflops_achieved"] = o["flops"] / (o["us"] * 1e-6) / 1e12 if o["us"] > 0 else 0.0
    rows.sort(key=lambda r: -r["us"])
    floor_total = sum(r["floor_us"] for r in rows)
    return {"node_us_total": total, "floor_us_total": floor_total, "by_op": ops, "top_nodes": rows[:40],
            "nodes": len(rows), "flops_total": sum(r["flops"] for r in rows)}


def markdown(doc: dict) -> str:
    lines = ["# UNet profile", ""]
    roofs = doc.get("roofs") or {}
    if roofs:
        lines += [f"Roofs measured in this run: fp16 matrix {roofs['fp16_tflops']} TFLOP/s, memory {roofs['copy_gbps']} GB/s "
                  f"({roofs['how']}).", ""]
    for b in doc["batches"]:
        s = b["summary"]
        lines += [f"## Batch {b['batch']}, {doc['size']}x{doc['size']}", "",
                  f"Call without profilers: {b['plain']['median_ms']} ms median ({b['plain']['iters']} calls). "
                  f"Kernel time per call: {s['node_us_total'] / 1e3:.2f} ms over {s['nodes']} nodes "
                  f"({b['time_source']}); sum of the nodes' rooflines {s['floor_us_total'] / 1e3:.2f} ms; "
                  f"{s['flops_total'] / 1e12:.2f} TFLOP counted.", ""]
        if b.get("alignment") is not None:
            lines += [f"Kernels joined to nodes: {b['alignment'] * 100:.1f}% of launches inside a node's host interval; "
                      f"{b['kernels']} kernels per {b['calls']} calls.", ""]
        lines += ["| op type | nodes | ms per call | share | TFLOP/s | roofline ms | efficiency |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for o in s["by_op"][:20]:
            eff = f"{o['efficiency']:.2f}" if o["efficiency"] is not None else "-"
            lines.append(f"| {o['op']} | {o['nodes']} | {o['us'] / 1e3:.3f} | {o['share'] * 100:.1f}% | "
                         f"{o['tflops_achieved']:.0f} | {o['floor_us'] / 1e3:.3f} | {eff} |")
        lines += ["", "| node | op | us per call | roofline us | bound | efficiency | first inputs |",
                  "| --- | --- | ---: | ---: | --- | ---: | --- |"]
        for r in s["top_nodes"][:25]:
            eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
            lines.append(f"| {r['name'][:60]} | {r['op']} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['bound']} | {eff} | "
                         f"{r['shapes']} |")
        if b.get("by_kernel"):
            lines += ["", "| kernel | launches per call | us per call | share |", "| --- | ---: | ---: | ---: |"]
            for k in b["by_kernel"][:15]:
                lines.append(f"| `{k['kernel'][:90]}` | {k['launches_per_call']:.0f} | {k['us_per_call']:.0f} | {k['share'] * 100:.1f}% |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(TINY_UNET))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batches", default="2,8", help="UNet batches (2 = one image with guidance)")
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5, help="profiled calls per batch")
    ap.add_argument("--plain-iters", type=int, default=20, help="calls timed without profilers")
    ap.add_argument("--cuda-option", action="append", default=[], metavar="KEY=VALUE",
                    help="CUDA provider option, as the worker's [cuda.unet] sets it (e.g. cudnn_conv_algo_search=HEURISTIC)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args()
    cuda_options = dict(kv.split("=", 1) for kv in args.cuda_option)

    doc: dict = {"model": args.model, "size": args.size, "device": args.device, "cuda_options": cuda_options, "batches": []}
    if args.device == "cuda":
        doc["roofs"] = measure_roofs()
        print(f"roofs: {doc['roofs']}", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        plain = plain_timing(args.model, batch, args.size, args.device, cuda_options, args.warmup, args.plain_iters)
        print(f"batch {batch}: {plain['median_ms']} ms per call without profilers", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            nodes, kernels, calls = profiled_run(args.model, batch, args.size, args.device, cuda_options, args.warmup,
                                                 args.iters, Path(tmp))
        entry = {"batch": batch, "plain": plain, "calls": calls, "kernels": len(kernels)}
        if kernels:
            offset, share = align(nodes, kernels)
            attribute(nodes, kernels, offset)
            entry.update(alignment=round(share, 4), offset_us=round(offset, 1), time_source="GPU kernel time (CUPTI)",
                         gpu_kernel_us_per_call=round(sum(k["dur_us"] for k in kernels) / calls, 1),
                         by_kernel=kernel_table(kernels, calls))
            print(f"batch {batch}: {len(kernels)} kernels, {share * 100:.1f}% of launches inside a node", flush=True)
        else:
            entry.update(alignment=None, time_source="host time of each node (no CUPTI kernels)")
        entry["summary"] = summarise(nodes, calls, doc.get("roofs"), use_gpu_time=bool(kernels))
        doc["batches"].append(entry)
        top = ", ".join(f"{o['op']} {o['share'] * 100:.0f}%" for o in entry["summary"]["by_op"][:6])
        print(f"batch {batch}: {entry['summary']['node_us_total'] / 1e3 / 1:.2f} ms per call in nodes; {top}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1, default=str))
    if args.md:
        args.md.write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
