"""Packs an SDXL ONNX folder's UNet weights into 4 (or 8) bits, for cards with little memory.

    python onnx/quantize_unet.py IN_DIR OUT_DIR [--bits 4] [--block-size 64] [--symmetric]

Why: SDXL's UNet holds 2.6 billion weights, 4.9 GiB in float16, and on an 8 GiB card that, the
CUDA context and the workspaces leave no room for a single 512x512 render. About 86% of those
weights sit in the transformer blocks' linear layers (attention projections and feed-forwards,
MatMul nodes in the graph). ONNX Runtime's MatMulNBits packs each such weight in blocks of
`--block-size` values along its input dimension, each block with its own float scale (and, unless
`--symmetric`, a zero point), and its CUDA kernel unpacks them at the call: the UNet's weights
shrink to 1.8 GiB at 4 bits and 2.8 GiB at 8 (measured: onnx/README.md), activations and compute
stay in the graph's type. Convolutions, norms and the attention's activation-by-activation
MatMuls are left as they are.

Quantization is round-to-nearest per block (ONNX Runtime's `MatMulNBitsQuantizer`, its default
algorithm): no calibration data, under 20 s on a CPU for the full UNet. Smaller blocks follow the
weights more closely at a little more memory (a float16 scale per block: 0.25 bit per weight at
64). What it costs in image quality depends on the checkpoint: compare a few prompts against the
float16 folder before serving from it.

The other parts (text encoders, VAE decoder, tokenizers, scheduler, configs) are copied as they
are. The quantized folder takes no LoRAs: their deltas merge into float weights,
and the packed ones are not: LoRA maps are not carried over, and a LoRA-ready source's overridable
weights (graph inputs beside their initializers, lora_ready.py's) become fixed ones.
`unet/quantization.json` records what was done; the worker logs it at start.

Needs onnx, onnxruntime 1.31.1 and onnx-ir (the test venv has them):
    /work/main/.venv/bin/python onnx/quantize_unet.py onnx/tiny/model /tmp/tiny-q4
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import onnx

from to_fp16 import PARTS, copy_beside_models, save

RECORD = "quantization.json"


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def count(model: onnx.ModelProto, op: str) -> int:
    return sum(1 for n in model.graph.node if n.op_type == op)


def fix_overridable_weights(model: onnx.ModelProto) -> int:
    """Drops the graph inputs that shadow initializers (lora_ready.py's overridable weights).

    The quantizer packs initializers only; one that is also an input could still be fed at run
    time, which a packed weight cannot be. Returns how many there were.
    """
    weights = {t.name for t in model.graph.initializer}
    kept = [i for i in model.graph.input if i.name not in weights]
    dropped = len(model.graph.input) - len(kept)
    if dropped:
        del model.graph.input[:]
        model.graph.input.extend(kept)
    return dropped


def quantize_unet(src: Path, dst: Path, bits: int, block_size: int, symmetric: bool) -> dict:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # The quantizer logs a line for every node it leaves alone (thousands in the UNet).
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    started = time.monotonic()
    model = onnx.load(str(src))
    fixed = fix_overridable_weights(model)
    if fixed:
        print(f"unet: {fixed} overridable weights (lora_ready.py's graph inputs) made fixed", flush=True)
    before = weight_bytes(model)
    matmuls = count(model, "MatMul")
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric)
    quantizer.process()
    out = quantizer.model.model
    packed = count(out, "MatMulNBits")
    if packed == 0:
        raise SystemExit(f"{src}: no MatMul weight could be packed (block size {block_size} too large for the model?)")
    after = weight_bytes(out)  # before saving: external data leaves the initializers empty
    save(out, dst)
    record = {
        "format": "MatMulNBits",
        "bits": bits,
        "block_size": block_size,
        "symmetric": symmetric,
        "matmuls_packed": packed,
        "matmuls_left": count(out, "MatMul"),
        "matmuls_before": matmuls,
        "weight_bytes_before": before,
        "weight_bytes_after": after,
        "seconds": round(time.monotonic() - started, 1),
    }
    (dst.parent / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def quantize_folder(src: Path, dst: Path, bits: int, block_size: int, symmetric: bool) -> dict:
    unet = src / "unet" / "model.onnx"
    if not unet.is_file():
        raise SystemExit(f"{unet}: no UNet graph there; IN_DIR must be a model folder (export_sdxl.py's layout)")
    if (src / "unet" / "lora_map.json").exists():
        print("LoRA maps are not carried over: the quantized folder takes no LoRAs", flush=True)
    copy_beside_models(src, dst)
    for part in PARTS:
        part_dir = src / part
        if part == "unet" or not (part_dir / "model.onnx").exists():
            continue
        for graph_file in sorted(part_dir.glob("*.onnx*")):
            # Copies, not hard links: onnx refuses to load external data with more than one link.
            shutil.copy2(graph_file, dst / part / graph_file.name)
        print(f"{part}: as it is", flush=True)
    print(f"unet: packing MatMul weights into {bits} bits, blocks of {block_size}", flush=True)
    return quantize_unet(unet, dst / "unet" / "model.onnx", bits, block_size, symmetric)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("in_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--block-size", type=int, choices=(16, 32, 64, 128, 256), default=64)
    ap.add_argument("--symmetric", action="store_true", help="no zero points (slightly smaller, less close)")
    args = ap.parse_args()
    record = quantize_folder(args.in_dir, args.out_dir, args.bits, args.block_size, args.symmetric)
    before, after = record["weight_bytes_before"], record["weight_bytes_after"]
    print(f"unet: {record['matmuls_packed']} of {record['matmuls_before']} MatMuls packed; weights "
          f"{before / 2**20:,.1f} -> {after / 2**20:,.1f} MiB ({after / before:.0%}) in {record['seconds']} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
