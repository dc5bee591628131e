"""Converts an Optimum-layout SDXL ONNX folder to float16.

    python onnx/to_fp16.py IN_DIR OUT_DIR [--cpu-compatible]

Needs only onnx, onnxruntime and numpy (the test venv has them):
    /work/main/.venv/bin/python onnx/to_fp16.py onnx/tiny/model /tmp/tiny-fp16-cpu --cpu-compatible

Default: onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=False,
op_block_list=["RandomNormalLike"]) on every model.onnx (weights, compute and float inputs/outputs
become float16; integer inputs such as input_ids stay int32). This is what a GPU wants; ONNX
Runtime's CPU provider lacks float16 kernels for many of the resulting ops.

--cpu-compatible: weights and compute stay float32, and only the graph's float inputs and outputs
become float16, with one Cast at each edge. CPU tests use it to exercise a consumer's float16
input/output handling. (Putting every op in convert_float_to_float16's op_block_list would also
give float16 edges, but it wraps every node in a Cast pair, rounding each intermediate tensor to
float16; edge-only casts keep the float32 numerics.)

A VAE whose config has `force_upcast` (SDXL's own, and the tiny fixture's) stays float32, as
export_sdxl.py leaves it and as the consumer insists.

Everything that is not a model.onnx (configs, tokenizers, scheduler, model_index.json) is copied,
except LoRA maps (`lora_map.json`): their offsets and dtypes are the source's, so a converted
folder takes LoRAs only after `lora_ready.py` has run on it.
Models whose weights exceed ~2 GB are written with one external data file, model.onnx_data.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, helper

PARTS = ("text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder")
EXTERNAL_DATA_THRESHOLD = 1_900_000_000


def fp16_edges(model: onnx.ModelProto) -> onnx.ModelProto:
    """float32 graph inputs/outputs become float16 with a Cast at each edge; the rest is untouched."""
    g = model.graph
    taken = {n for node in g.node for n in list(node.input) + list(node.output)} | {i.name for i in g.initializer}

    def fresh(base: str) -> str:
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    weights = {t.name for t in g.initializer}
    head, tail = [], []
    for inp in g.input:
        # An input that is also an initializer is an overridable weight (lora_ready.py), not an edge.
        if inp.type.tensor_type.elem_type != TensorProto.FLOAT or inp.name in weights:
            continue
        inner = fresh(inp.name + "_fp32")
        for node in g.node:
            for i, name in enumerate(node.input):
                if name == inp.name:
                    node.input[i] = inner
        for out in g.output:  # an input passed straight through to an output
            if out.name == inp.name:
                raise ValueError(f"graph input {inp.name} is also an output; not supported")
        head.append(helper.make_node("Cast", [inp.name], [inner], to=TensorProto.FLOAT, name=fresh("cast_in_" + inp.name)))
        inp.type.tensor_type.elem_type = TensorProto.FLOAT16
    for out in g.output:
        if out.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        inner = fresh(out.name + "_fp32")
        for node in g.node:
            for i, name in enumerate(node.output):
                if name == out.name:
                    node.output[i] = inner
            for i, name in enumerate(node.input):  # other consumers of the same tensor
                if name == out.name:
                    node.input[i] = inner
        tail.append(helper.make_node("Cast", [inner], [out.name], to=TensorProto.FLOAT16, name=fresh("cast_out_" + out.name)))
        out.type.tensor_type.elem_type = TensorProto.FLOAT16
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    # value_info may describe the renamed tensors with stale names; drop it, ORT re-infers shapes.
    del g.value_info[:]
    return model


def fp16_full(path: Path) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # A path (not a ModelProto) lets the converter run shape inference on models over 2 GB.
    return convert_float_to_float16(str(path), keep_io_types=False, op_block_list=["RandomNormalLike"])


def save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    size = sum(len(t.raw_data) for t in model.graph.initializer)
    if size > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + "_data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def needs_float32(vae_config: Path) -> bool:
    """diffusers' `force_upcast` (true when absent): the VAE overflows in float16 (SDXL's own does)."""
    return bool(json.loads(vae_config.read_text()).get("force_upcast", True)) if vae_config.exists() else True


def copy_beside_models(src: Path, dst: Path) -> None:
    """Everything of the folder but its graphs, their weights and LoRA maps, from src into dst.

    A LoRA map names offsets in the source's data file: rerun lora_ready.py on the result.
    """
    if src.resolve() == dst.resolve():
        raise SystemExit("OUT_DIR must differ from IN_DIR")
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.rglob("*")):
        rel = item.relative_to(src)
        if item.is_dir():
            (dst / rel).mkdir(parents=True, exist_ok=True)
            continue
        if item.name.endswith(".onnx_data") or item.name.endswith(".onnx") or item.name == "lora_map.json":
            continue
        shutil.copy2(item, dst / rel)


def convert_folder(src: Path, dst: Path, cpu_compatible: bool) -> None:
    copy_beside_models(src, dst)
    for part in PARTS:
        model_path = src / part / "model.onnx"
        if not model_path.exists():
            continue
        if part.startswith("vae_") and needs_float32(src / part / "config.json"):
            print(f"{part}: stays float32 (its config has force_upcast)", flush=True)
            save(onnx.load(str(model_path)), dst / part / "model.onnx")
            continue
        print(f"{part}: converting ({'float16 edges only' if cpu_compatible else 'float16'})", flush=True)
        model = fp16_edges(onnx.load(str(model_path))) if cpu_compatible else fp16_full(model_path)
        save(model, dst / part / "model.onnx")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("in_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--cpu-compatible", action="store_true",
                    help="float16 inputs/outputs only; float32 weights and compute (runs on ORT's CPU provider)")
    args = ap.parse_args()
    convert_folder(args.in_dir, args.out_dir, args.cpu_compatible)


if __name__ == "__main__":
    main()
