"""Rewrites a UNet graph with onnx/graph_passes.py, and times the rewrites against the original.

    python onnx/tune_unet.py rewrite SRC.onnx DST.onnx [--passes shapes,sink,cancel,dedupe]
    python onnx/tune_unet.py time --model /root/sdxl/unet/model.onnx --out /root/results/tune.json \\
        [--variants shapes,all] [--batch 2] [--size 1024] [--cuda-option KEY=VALUE ...]
    python onnx/tune_unet.py streams --model /root/sdxl/unet/model.onnx --out /root/results/streams.json \\
        [--batch 2] [--size 1024] [--calls 40] [--cuda-option KEY=VALUE ...]
    python onnx/tune_unet.py selftest

rewrite: the graph only; DST beside SRC keeps pointing at SRC's external weights file (the fused
SDXL UNet's 5 GB stay where they are), DST elsewhere gets the weights inline or, over 2 GB, in
its own model.onnx_data.

time: each variant (default conv_bias) is written beside the model as model-tune-VARIANT.onnx, loaded in a session of
its own next to the original's, and the two are called in alternation (ten rounds of --iters
calls each, so drift hits both alike) on the same inputs; reported: each one's median, the ratio,
and how far the outputs are apart (max |a - b| and ||a - b|| / ||a||: an exact rewrite gives 0, or
a rounding's worth where a kernel sums in another order). Variants: a pass name, `all` (every
pass), or `none` (the graph saved again untouched: its ratio is the two identical sessions'
spread). A variant is worth keeping where it is faster by more than that spread and the outputs
agree. A variant `opt:KEY=VALUE[;KEY=VALUE]` is the same graph in a session with those CUDA
provider options added to --cuda-option's, e.g. `opt:sdpa_kernel=1`: the attention on ONNX
Runtime's own flash kernel instead of the one it picks (the profile's is cuDNN's; the bits are
AttentionBackend's in onnxruntime/contrib_ops/cpu/bert/attention_common.h: 1 flash, 2 memory
efficient, 4 TensorRT fused, 8 cuDNN flash, 16 unfused).

streams: whether two UNet calls in flight at once keep the card busier than one (issue 17, point
2). The worker's two render slots hold one UNet session's lock for a whole schedule, so their UNet
calls run one after the other and the card idles in each call's gaps between kernels (3.2 of 34.3
ms in the profile). Three ways, each --calls calls of the same inputs, with NVML's busy share
(deploy/gpu/gpu_sampler.py) over each: one thread on one session (the worker today); two threads
on one session (ONNX Runtime's C API allows concurrent runs; the Rust binding takes `&mut` for
the allocators it does not trust, hence the worker's lock); two threads on two sessions (the
weights twice on the card). Reported: calls/s, the ratio to one thread, the busy share, and
whether the outputs of every way agree with the first's.

selftest: a graph of standard ops with the fused UNet's layout borders (Transposes around Add,
Concat, Resize and Shape) is rewritten and run on the CPU before and after: the outputs must be
equal and the Transposes fewer; and a graph of NhwcConvs feeding a SkipGroupNorm (CUDA-only ops,
checked by structure) has the convolutions' biases summed into the group norm's; and a packed
self and cross attention, unpacked, match numpy's attention on the packed layout. The Rust test consumer/tests/pipeline_rewritten.rs runs it, and
renders the tiny fixture through a rewritten UNet.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import graph_passes  # noqa: E402

ALL = ["shapes", "sink", "cancel", "dedupe"]
EXTERNAL_DATA_THRESHOLD = 1_900_000_000


def passes_of(variant: str) -> list[str]:
    # "none": the graph saved again untouched, timed like any variant: its speedup is the spread
    # between two identical sessions, the noise the other rows are read against.
    if variant == "none":
        return []
    names = ALL if variant == "all" else variant.split("+")
    unknown = [n for n in names if n not in graph_passes.PASSES]
    if unknown:
        raise SystemExit(f"unknown pass {unknown}; passes: {', '.join(graph_passes.PASSES)} or all")
    return names


def rewrite(src: Path, dst: Path, passes: list[str]) -> dict:
    beside = src.resolve().parent == dst.resolve().parent
    model = onnx.load(str(src), load_external_data=not beside)
    t = time.time()
    report = graph_passes.optimize(model, passes, str(src.resolve().parent))
    report["seconds"] = round(time.time() - t, 2)
    dst.parent.mkdir(parents=True, exist_ok=True)
    size = sum(len(x.raw_data) for x in model.graph.initializer)
    if not beside and size > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + "_data", size_threshold=1024)
    else:
        onnx.save_model(model, str(dst))
    return report


# ---------------------------------------------------------------------------------------------
# Timing on the GPU
# ---------------------------------------------------------------------------------------------

def time_variants(args) -> dict:
    from profile_unet import bind, session

    cuda_options = dict(kv.split("=", 1) for kv in args.cuda_option)
    model = Path(args.model)
    doc = {"model": str(model), "batch": args.batch, "size": args.size, "cuda_options": cuda_options, "variants": []}
    base = session(str(model), args.device, cuda_options, None)
    base_call, base_keep = bind(base, args.batch, args.size, args.device)
    for _ in range(args.warmup):
        base_call()
    reference = [o.numpy() for o in base_keep if o.is_tensor()][-1].astype(np.float32)
    for variant in args.variants.split(","):
        row: dict = {"variant": variant, "status": "error"}
        doc["variants"].append(row)
        try:
            if variant.startswith("opt:"):
                # The same graph; only the provider's options differ.
                path, options = model, cuda_options | dict(kv.split("=", 1) for kv in variant[4:].split(";"))
                row["cuda_options"] = options
            else:
                path, options = model.with_name(f"model-tune-{variant.replace('+', '_')}.onnx"), cuda_options
                row["rewrite"] = rewrite(model, path, passes_of(variant))
            sess = session(str(path), args.device, options, None)
            call, keep = bind(sess, args.batch, args.size, args.device)
            for _ in range(args.warmup):
                call()
            out = [o.numpy() for o in keep if o.is_tensor()][-1].astype(np.float32)
            diff = np.abs(out - reference)
            row["max_abs_diff"] = float(diff.max())
            row["rel_l2_diff"] = float(np.linalg.norm(out - reference) / max(np.linalg.norm(reference), 1e-12))
            row["finite"] = bool(np.isfinite(out).all())
            times = {"original": [], "variant": []}
            for _ in range(args.rounds):
                times["original"] += [base_call() for _ in range(args.iters)]
                times["variant"] += [call() for _ in range(args.iters)]
            row["original_ms"] = round(statistics.median(times["original"]), 3)
            row["variant_ms"] = round(statistics.median(times["variant"]), 3)
            row["speedup"] = round(row["original_ms"] / row["variant_ms"], 4)
            row["status"] = "ok"
            del sess, keep
            if path != model:
                path.unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - one variant's failure is its row, the next one runs
            row["error"] = f"{type(e).__name__}: {e}"[:800]
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


def time_streams(args) -> dict:
    import threading

    from profile_unet import bind, session

    sys.path.insert(0, str(HERE.parent / "deploy" / "gpu"))
    from gpu_sampler import GpuSampler

    cuda_options = dict(kv.split("=", 1) for kv in args.cuda_option)
    doc = {"model": args.model, "batch": args.batch, "size": args.size, "calls": args.calls, "cuda_options": cuda_options, "ways": []}
    first = session(args.model, args.device, cuda_options, None)
    second = None
    reference = None
    ways = [("one thread, one session", 1, False), ("two threads, one session", 2, False), ("two threads, two sessions", 2, True)]
    for name, threads, own_sessions in ways:
        row: dict = {"way": name, "threads": threads, "status": "error"}
        doc["ways"].append(row)
        try:
            if own_sessions and second is None:
                second = session(args.model, args.device, cuda_options, None)
            sessions = [first, second if own_sessions else first][:threads]
            # Each thread its own binding and buffers: two runs never write one output.
            bound = [bind(s, args.batch, args.size, args.device) for s in sessions]
            for call, _ in bound:
                for _ in range(args.warmup):
                    call()
            outs = [[o.numpy() for o in keep if o.is_tensor()][-1].astype(np.float32) for _, keep in bound]
            reference = outs[0] if reference is None else reference
            row["max_abs_diff"] = float(max(np.abs(o - reference).max() for o in outs))
            share = [args.calls // threads + (i < args.calls % threads) for i in range(threads)]
            errors: list[str] = []

            def work(call, n: int) -> None:
                try:
                    for _ in range(n):
                        call()
                except Exception as e:  # noqa: BLE001 - reported in the row
                    errors.append(f"{type(e).__name__}: {e}"[:400])

            sampler = GpuSampler(interval=0.05) if args.device == "cuda" else None
            if sampler:
                sampler.start()
            t = time.perf_counter()
            workers = [threading.Thread(target=work, args=(call, n)) for (call, _), n in zip(bound, share)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            seconds = time.perf_counter() - t
            gpu = sampler.stop() if sampler else {}
            if errors:
                raise RuntimeError("; ".join(errors))
            row.update(seconds=round(seconds, 3), calls_per_s=round(args.calls / seconds, 3),
                       busy_fraction=gpu.get("busy_fraction"), status="ok")
            row["x_one_thread"] = round(row["calls_per_s"] / doc["ways"][0]["calls_per_s"], 4) if doc["ways"][0].get("calls_per_s") else None
            del bound
        except Exception as e:  # noqa: BLE001 - one way's failure is its row, the next one runs
            row["error"] = f"{type(e).__name__}: {e}"[:800]
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


# ---------------------------------------------------------------------------------------------
# Self-test on the CPU
# ---------------------------------------------------------------------------------------------

def border_graph() -> onnx.ModelProto:
    """NCHW input -> an 'NHWC op' (Sigmoid standing in for GroupNorm/NhwcConv) between Transposes,
    as the fused UNet has them: a residual Add of two transposed results, a Concat of transposed
    tensors feeding two NHWC consumers, an upsampling Resize whose scales come through a Cast, a
    Shape of a transposed tensor used for a Reshape."""
    to_nhwc, to_nchw = [0, 2, 3, 1], [0, 3, 1, 2]
    n = []

    def t(src, dst, perm):
        n.append(helper.make_node("Transpose", [src], [dst], perm=perm))

    t("x", "x_h", to_nhwc)
    n.append(helper.make_node("Sigmoid", ["x_h"], ["a_h"]))          # NHWC op
    n.append(helper.make_node("Tanh", ["x_h"], ["b_h"]))             # another
    t("a_h", "a", to_nchw)
    t("b_h", "b", to_nchw)
    n.append(helper.make_node("Add", ["a", "b"], ["res"]))          # residual in NCHW
    t("res", "res_s", [0, 1, 2, 3])                                  # identity perm: left alone
    n.append(helper.make_node("Shape", ["a"], ["shape_a"]))          # size of a transposed tensor
    n.append(helper.make_node("Concat", ["res", "a"], ["cat"], axis=1))
    t("cat", "cat_h1", to_nhwc)
    t("cat", "cat_h2", to_nhwc)
    n.append(helper.make_node("Sigmoid", ["cat_h1"], ["c1_h"]))
    n.append(helper.make_node("Neg", ["cat_h2"], ["c2_h"]))
    n.append(helper.make_node("Add", ["c1_h", "c2_h"], ["c_h"]))
    t("c_h", "c", to_nchw)
    n.append(helper.make_node("Constant", [], ["scales16"], value=numpy_helper.from_array(
        np.array([1, 1, 2, 2], dtype=np.float16))))
    n.append(helper.make_node("Cast", ["scales16"], ["scales"], to=TensorProto.FLOAT))
    n.append(helper.make_node("Resize", ["c", "", "scales"], ["up"], mode="nearest"))
    t("up", "up_h", to_nhwc)
    n.append(helper.make_node("Sigmoid", ["up_h"], ["y_h"]))
    t("y_h", "y", to_nchw)
    n.append(helper.make_node("Reshape", ["res_s", "shape_a"], ["z"]))
    graph = helper.make_graph(
        n, "borders",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "h", "w"]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8, 4, 6])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def conv_bias_graph() -> onnx.ModelProto:
    """Two NhwcConvs (contrib ops, CUDA only: checked by structure, not run) whose outputs are a
    SkipGroupNorm's X and skip, the group norm already with a bias; a third conv also feeds a
    Transpose, so it keeps its bias."""
    c = 4

    def init(name, values):
        return numpy_helper.from_array(np.asarray(values, dtype=np.float16), name)

    inits = [init("w", np.ones((c, 1, 1, c))), init("b1", [1, 2, 3, 4]), init("b2", [10, 20, 30, 40]),
             init("b3", [5, 5, 5, 5]), init("gamma", np.ones(c)), init("beta", np.zeros(c)), init("sgn_bias", [100] * c)]
    ms = "com.microsoft"
    n = [helper.make_node("NhwcConv", ["x", "w", "b1"], ["c1"], domain=ms),
         helper.make_node("NhwcConv", ["x", "w", "b2"], ["c2"], domain=ms),
         helper.make_node("NhwcConv", ["x", "w", "b3"], ["c3"], domain=ms),
         helper.make_node("SkipGroupNorm", ["c1", "gamma", "beta", "c2", "sgn_bias"], ["y"], domain=ms, groups=2,
                          activation=0, epsilon=1e-5, channels_last=1),
         helper.make_node("SkipGroupNorm", ["c3", "gamma", "beta", "c3"], ["y3"], domain=ms, groups=2, activation=0,
                          epsilon=1e-5, channels_last=1),
         helper.make_node("Transpose", ["c3"], ["c3_t"], perm=[0, 3, 1, 2])]
    vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT16, [1, 2, 2, c])  # noqa: E731
    graph = helper.make_graph(n, "conv_bias", [vi("x")], [vi("y"), vi("y3"), vi("c3_t")], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)], ir_version=8)


def check_conv_bias_fold() -> dict:
    model = conv_bias_graph()
    report = graph_passes.optimize(model, ["conv_bias"])
    nodes = {n.output[0]: n for n in model.graph.node}
    values = {t.name: numpy_helper.to_array(t).astype(np.float32).tolist() for t in model.graph.initializer}
    problems = []
    if len(nodes["c1"].input) != 2 or len(nodes["c2"].input) != 2:
        problems.append("the convs feeding only the group norm kept their bias")
    if values.get(nodes["y"].input[4]) != [111.0, 122.0, 133.0, 144.0]:
        problems.append(f"the group norm's bias is {values.get(nodes['y'].input[4])}, not b1 + b2 + its own")
    if len(nodes["c3"].input) != 3 or len(nodes["y3"].input) > 4:
        problems.append("a conv whose output another op reads lost its bias")
    if problems or report.get("conv_bias") != 2:
        raise SystemExit(f"selftest (conv bias): {problems} {report}")
    return report


def check_unpack_qkv() -> dict:
    """A self attention fed one packed projection and a cross attention fed a packed key and value
    (the fused UNet's two kinds), unpacked and run on the CPU (which cannot run the packed form),
    against attention computed in numpy from the packed layout's definition."""
    import onnxruntime as ort

    b, s, heads, size, c, s_kv, c_kv = 2, 16, 2, 8, 12, 5, 10
    rng = np.random.default_rng(1)
    w_qkv, w_q, w_kv = (rng.standard_normal(shape).astype(np.float32) * 0.3
                        for shape in ((c, heads * 3 * size), (heads * size, heads * size), (c_kv, heads * 2 * size)))
    ms = "com.microsoft"
    inits = [numpy_helper.from_array(w_qkv, "w_qkv"), numpy_helper.from_array(w_q, "w_q"), numpy_helper.from_array(w_kv, "w_kv"),
             numpy_helper.from_array(np.array([0, 0, heads, 3, size], dtype=np.int64), "s3"),
             numpy_helper.from_array(np.array([0, 0, heads, 2, size], dtype=np.int64), "s2")]
    n = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"]), helper.make_node("Reshape", ["qkv", "s3"], ["qkv5"]),
         helper.make_node("MultiHeadAttention", ["qkv5"], ["a"], domain=ms, num_heads=heads),
         helper.make_node("MatMul", ["a", "w_q"], ["q"]),
         helper.make_node("MatMul", ["e", "w_kv"], ["kv"]), helper.make_node("Reshape", ["kv", "s2"], ["kv5"]),
         helper.make_node("MultiHeadAttention", ["q", "kv5"], ["y"], domain=ms, num_heads=heads)]
    graph = helper.make_graph(n, "packed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, c]),
                                            helper.make_tensor_value_info("e", TensorProto.FLOAT, [b, s_kv, c_kv])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, heads * size])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)], ir_version=8)
    report = graph_passes.optimize(model, ["unpack_qkv"])
    onnx.checker.check_model(model)
    x, e = rng.standard_normal((b, s, c)).astype(np.float32), rng.standard_normal((b, s_kv, c_kv)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "e": e})[0]

    def attention(q, k, v):
        q, k, v = (t.reshape(b, -1, heads, size).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(size)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return (weights / weights.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(b, -1, heads * size)

    packed = (x @ w_qkv).reshape(b, s, heads, 3, size)
    a = attention(*(packed[..., i, :].reshape(b, s, -1) for i in range(3)))
    kv = (e @ w_kv).reshape(b, s_kv, heads, 2, size)
    want = attention(a @ w_q, *(kv[..., i, :].reshape(b, s_kv, -1) for i in range(2)))
    ops = [node.op_type for node in model.graph.node]
    if report.get("unpack_qkv") != 2 or "Reshape" in ops or ops.count("MatMul") != 6 or len(model.graph.initializer) != 6:
        raise SystemExit(f"selftest (unpack qkv): {report} {ops} {[t.name for t in model.graph.initializer]}")
    if np.abs(got - want).max() > 1e-5:
        raise SystemExit(f"selftest (unpack qkv): {np.abs(got - want).max()} from numpy's attention")
    return report


def selftest() -> None:
    import onnxruntime as ort

    model = border_graph()
    onnx.checker.check_model(model)
    x = np.random.default_rng(0).standard_normal((2, 8, 4, 6)).astype(np.float32)

    def run(m):
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, {"x": x})

    before = run(model)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    report = graph_passes.optimize(rewritten, ALL)
    onnx.checker.check_model(rewritten)
    after = run(rewritten)
    for name, a, b in zip(("y", "z"), before, after):
        if a.shape != b.shape or not np.array_equal(a, b):
            raise SystemExit(f"selftest: output {name} changed: {a.shape} vs {b.shape}, max diff "
                             f"{np.abs(a - b).max() if a.shape == b.shape else 'n/a'}")
    # Left: the input's and the output's Transposes, the identity one and the one z needs in NCHW.
    if report["transposes_after"] > 4 or report["transposes_after"] >= report["transposes_before"]:
        raise SystemExit(f"selftest: Transposes {report['transposes_before']} -> {report['transposes_after']}: {report}")
    print(json.dumps({"selftest": "ok", **report, "conv_bias": check_conv_bias_fold(), "unpack_qkv": check_unpack_qkv()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rw = sub.add_parser("rewrite")
    rw.add_argument("src", type=Path)
    rw.add_argument("dst", type=Path)
    rw.add_argument("--passes", default="all", help="comma list of passes, or all")
    tm = sub.add_parser("time")
    tm.add_argument("--model", required=True)
    tm.add_argument("--out", required=True)
    tm.add_argument("--variants", default="conv_bias")
    tm.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    tm.add_argument("--batch", type=int, default=2)
    tm.add_argument("--size", type=int, default=1024)
    tm.add_argument("--warmup", type=int, default=5)
    tm.add_argument("--iters", type=int, default=5)
    tm.add_argument("--rounds", type=int, default=10)
    tm.add_argument("--cuda-option", action="append", default=[], metavar="KEY=VALUE")
    st = sub.add_parser("streams")
    st.add_argument("--model", required=True)
    st.add_argument("--out", required=True)
    st.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    st.add_argument("--batch", type=int, default=2)
    st.add_argument("--size", type=int, default=1024)
    st.add_argument("--warmup", type=int, default=3)
    st.add_argument("--calls", type=int, default=40)
    st.add_argument("--cuda-option", action="append", default=[], metavar="KEY=VALUE")
    sub.add_parser("selftest")
    args = ap.parse_args()
    if args.command == "rewrite":
        passes = ALL if args.passes == "all" else [p for p in args.passes.split(",") if p]
        for p in passes:
            passes_of(p)
        if args.src.resolve() == args.dst.resolve():
            tmp = args.dst.with_name(args.dst.name + ".tmp")
            report = rewrite(args.src, tmp, passes)
            shutil.move(tmp, args.dst)
        else:
            report = rewrite(args.src, args.dst, passes)
        print(json.dumps(report))
    elif args.command == "time":
        time_variants(args)
    elif args.command == "streams":
        time_streams(args)
    else:
        selftest()


if __name__ == "__main__":
    main()
