"""Fuses a float32 SDXL UNet export with ONNX Runtime's transformer optimizer, then converts it to float16.

    python onnx/optimize_unet.py IN_FP32_MODEL.onnx OUT_MODEL.onnx [--cpu] [--keep-conv-bias] [--keep-packed-qkv]

The recipe measured on the H200 (see shared/gpu/README.md): optimize_model(model_type="unet",
opt_level=0, FusionOptions("unet"), use_gpu=True) gives MultiHeadAttention, BiasSplitGelu,
GroupNorm/SkipGroupNorm, SkipLayerNormalization and NhwcConv nodes (CUDA-only contrib ops), then
convert_float_to_float16(keep_io_types=False, op_block_list=["RandomNormalLike"]), saved with one
external data file. --cpu passes use_gpu=False and turns off the CUDA-only fusions (NhwcConv,
GroupNorm, SkipGroupNorm, BiasSplitGelu, packed QKV/KV, BiasAdd), so the result runs on ONNX
Runtime's CPU provider (MultiHeadAttention, SkipLayerNormalization remain); for testing here.

Then two rewrites of graph_passes.py that ONNX Runtime's fusion leaves undone, each kept because
a lease timed it faster than the graph without it (deploy/gpu/RESULTS.md; batch 2, 1024²,
outputs as far apart as two sessions of the same graph are, ~1.2e-3 relative):
- `conv_bias`: the bias of every NhwcConv that feeds only SkipGroupNorms summed into theirs (39 of
  the 51 convolutions), which spares cuDNN's separate bias pass over each output: 34.53 -> 33.97
  ms a UNet call on the H200 (1.017x, 2026-12-02 second lease). --keep-conv-bias leaves it out.
- `unpack_qkv`: the 140 packed attention projections as separate query, key and value MatMuls, so
  ONNX Runtime no longer copies them apart (AddBiasUnpack) before cuDNN's attention: 1.015x on the
  2026-12-04 third lease, 1.009x on the 2026-12-06 fifth-session H100 against 0.997x and 1.000x for
  two stock sessions timed beside it. --keep-packed-qkv leaves it out.
Both flags give the graph as ORT writes it, to time against. Without the CUDA fusions (--cpu)
there is nothing to rewrite.

Two traps:
- Give it the float32 export. Optimizing a float16 export fails ("Raw data size does not match
  tensor's size").
- onnxruntime 1.31.1's fusion_attention_unet.py calls int() on a 1-element array, an error under
  numpy >= 2.3 ("only 0-dimensional arrays can be converted to Python scalars"). Run this script
  with numpy 2.2.6 first on PYTHONPATH, e.g. `pip install --target /root/np numpy==2.2.6` and
  `PYTHONPATH=/root/np python onnx/optimize_unet.py ...`. export_sdxl.py runs it in a subprocess
  for that reason (--optimizer-pythonpath).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

EXTERNAL_DATA_THRESHOLD = 1_900_000_000


def optimize(src: Path, dst: Path, use_gpu: bool, rewrites: tuple[str, ...] = ("conv_bias", "unpack_qkv")) -> collections.Counter:
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    t0 = time.time()
    options = FusionOptions("unet")
    if not use_gpu:
        # These fusions produce contrib ops that only the CUDA provider implements.
        options.enable_nhwc_conv = False
        options.enable_group_norm = False
        options.enable_skip_group_norm = False
        options.enable_bias_splitgelu = False
        options.enable_packed_qkv = False
        options.enable_packed_kv = False
        options.enable_bias_add = False
    model = optimize_model(
        str(src),
        model_type="unet",
        opt_level=0,
        optimization_options=options,
        use_gpu=use_gpu,
    )
    print(f"fused in {time.time() - t0:.0f} s", flush=True)
    model.convert_float_to_float16(keep_io_types=False, op_block_list=["RandomNormalLike"])
    if rewrites:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import graph_passes

        changed = graph_passes.optimize(model.model, list(rewrites))
        print("rewrites: " + ", ".join(f"{name} changed {changed[name]} nodes" for name in rewrites), flush=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    for stale in (dst, dst.with_name(dst.name + "_data")):
        if stale.exists():
            stale.unlink()
    model.topological_sort()
    size = sum(len(t.raw_data) for t in model.model.graph.initializer)
    if size > EXTERNAL_DATA_THRESHOLD:
        # Optimum's name for the weights file (onnxruntime's own save would call it model.onnx.data).
        onnx.save_model(model.model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + "_data", size_threshold=1024)
        print(f"saved with external data ({size / 1e9:.1f} GB)", flush=True)
    else:
        onnx.save_model(model.model, str(dst))
    ops = collections.Counter(n.op_type for n in model.model.graph.node)
    print(f"optimized in {time.time() - t0:.0f} s; nodes: {dict(ops.most_common(12))}", flush=True)
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--cpu", action="store_true", help="use_gpu=False (CPU-runnable fusions)")
    ap.add_argument("--keep-conv-bias", action="store_true", help="leave the convolutions' biases where ORT puts them")
    ap.add_argument("--keep-packed-qkv", action="store_true", help="leave the attention projections packed, as ORT fuses them")
    args = ap.parse_args()
    import numpy

    print(f"numpy {numpy.__version__} from {numpy.__file__}", file=sys.stderr)
    rewrites = tuple(name for name, kept in (("conv_bias", args.keep_conv_bias), ("unpack_qkv", args.keep_packed_qkv)) if not kept)
    optimize(args.src, args.dst, use_gpu=not args.cpu, rewrites=rewrites)


if __name__ == "__main__":
    main()
