"""Makes the LoRA-targetable weights of an exported SDXL folder overridable, and maps them.

    python onnx/lora_ready.py MODEL_DIR --tiny-config            # the fixture (make_tiny.py calls this)
    python onnx/lora_ready.py MODEL_DIR --random-weights [--seed 0] [--device cuda]
    python onnx/lora_ready.py MODEL_DIR --diffusers-dir /models/stable-diffusion-xl-base-1.0

For the UNet and both text encoders (`--parts`), in place:

1. Rebuilds the torch modules the folder was exported from (same seed or the same diffusers
   folder) and finds, BY CONTENT, the ONNX initializer that holds each `nn.Linear` / `nn.Conv2d`
   weight and how: as torch keeps it (`Gemm` with transB, `Conv`), transposed (`MatMul`), in NHWC
   (ONNX Runtime's fused `NhwcConv`), or as a block of columns of a packed weight (the fused
   UNet's `MatMul_QKV_*` / `MatMul_KV_*`, heads interleaved). torch.onnx renames weights
   (`onnx::MatMul_123`) and the optimizer packs and renames more, so names cannot be trusted.
   float16 graphs are compared after rounding the torch weight to float16.
2. Lists every matched initializer as a graph input of the same name as well: ONNX Runtime then
   uses the initializer when a run binds nothing to that name (a base render pays nothing) and
   the bound tensor when one is bound (a LoRA render binds its merged weights).
3. Writes the matched initializers (and whatever was external before) into `model.onnx_data`, so
   the worker reads a base weight from a known offset without parsing protobuf.
4. Writes `<part>/lora_map.json`:

    {"version": 1, "part": "unet", "data_file": "model.onnx_data",
     "initializers": {"onnx::MatMul_3798": {"dtype": "float32", "shape": [32, 256], "offset": 0, "length": 32768}},
     "modules": {"down_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj":
                     {"initializer": "onnx::MatMul_3798", "kind": "linear", "shape": [256, 32], "layout": "transposed"},
                 "...attn1.to_k": {"initializer": "MatMul_QKV_0_weight", "kind": "linear", "shape": [32, 32],
                                   "layout": "transposed", "columns": {"run": 16, "stride": 48, "offset": 16}}}}

   `shape` is the torch weight's ([out, in] or [out, in, kh, kw]); `layout` says where element
   [o, i(, y, x)] of it sits in the initializer: `as_is` [o, i, y, x], `transposed` [i, o] (linear
   only), `nhwc` [o, y, x, i]; `columns` (transposed linear only): output row o is column
   offset + (o // run) * stride + o % run of the initializer.

Rerunning on a folder it already prepared gives the same folder. Modules without a match are
reported and left out (a LoRA naming one is refused by the worker with that module's name).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

PARTS = ("unet", "text_encoder", "text_encoder_2")
DATA_FILE = "model.onnx_data"
ALIGN = 64
FLOAT, FLOAT16 = 1, 10
NP_DTYPE = {FLOAT: np.float32, FLOAT16: np.float16}
DTYPE_NAME = {FLOAT: "float32", FLOAT16: "float16"}
SAMPLE = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# torch side: the modules a LoRA can target
# ---------------------------------------------------------------------------------------------


def target_modules(module, part: str) -> dict[str, np.ndarray]:
    """Every nn.Linear and nn.Conv2d weight of `module`, float32, by the path checkpoints and LoRA
    files use (diffusers' for the UNet, `text_model.encoder.layers...` for the text encoders:
    transformers 5 builds CLIPTextModel without its `text_model` level)."""
    import torch

    out = {}
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            if part != "unet" and name.startswith(("encoder.", "embeddings.", "final_layer_norm")):
                name = "text_model." + name
            out[name] = m.weight.detach().float().cpu().numpy()
    return out


def torch_parts(args) -> dict[str, object]:
    import torch

    import sdxl_onnx as sx

    torch.set_grad_enabled(False)
    if args.diffusers_dir:
        from export_sdxl import load_diffusers

        models, _, _ = load_diffusers(args.diffusers_dir, torch.float32, args.device)
    else:
        configs = sx.SDXL_TINY if args.tiny_config else sx.SDXL_BASE
        models = sx.build_random_models(configs, args.seed, device=args.device)
    return {"unet": models["unet"], "text_encoder": models["text_encoder"], "text_encoder_2": models["text_encoder_2"]}


# ---------------------------------------------------------------------------------------------
# ONNX side: matching by content
# ---------------------------------------------------------------------------------------------


def array_of(t) -> np.ndarray:
    """An initializer's values (a view over raw_data where possible)."""
    from onnx import numpy_helper

    if t.raw_data:
        return np.frombuffer(t.raw_data, dtype=NP_DTYPE[t.data_type]).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def close(stored: np.ndarray, want: np.ndarray, dtype: int) -> bool:
    """Whether `stored` (an initializer, maybe float16) holds `want` (float32 from torch)."""
    if stored.shape != want.shape:
        return False
    if dtype == FLOAT:
        return bool(np.array_equal(stored, want))
    # float16: the converter rounds and clamps tiny magnitudes, so compare with a tolerance
    # relative to the tensor's scale (a different weight of the same shape is off by its scale).
    a = stored.astype(np.float32)
    tol = 2e-3 * float(np.max(np.abs(want))) + 1e-6
    return bool(np.max(np.abs(a - want)) <= tol)


def layouts(kind: str, w: np.ndarray):
    """(layout, the weight as that layout stores it) for every layout a weight may take."""
    if kind == "linear":
        yield "transposed", w.T
        yield "as_is", w
    else:
        yield "as_is", w
        yield "nhwc", w.transpose(0, 2, 3, 1)


def find_columns(stored: np.ndarray, wt: np.ndarray, dtype: int):
    """Where the columns of `wt` ([in, out]) sit among the columns of a packed `stored` ([in, M]):
    {run, stride, offset} or None."""
    rows = min(SAMPLE, wt.shape[0])
    head = stored[:rows].astype(np.float32)
    tol = 2e-3 * float(np.max(np.abs(wt))) + 1e-6 if dtype == FLOAT16 else 0.0

    def where(col: int) -> list[int]:
        diff = np.max(np.abs(head - wt[:rows, col : col + 1]), axis=0)
        return [int(j) for j in np.nonzero(diff <= tol)[0]]

    out = wt.shape[1]
    for offset in where(0):
        run = 1
        while run < out and offset + run < stored.shape[1] and close(stored[:, offset + run], wt[:, run], dtype):
            run += 1
        if run == out:
            cols = {"run": out, "stride": out, "offset": offset}
        else:
            nexts = [j for j in where(run) if j > offset]
            if not nexts:
                continue
            cols = {"run": run, "stride": nexts[0] - offset, "offset": offset}
        index = column_index(cols, out)
        if index[-1] < stored.shape[1] and close(stored[:, index], wt, dtype):
            return cols
    return None


def column_index(cols: dict, out: int) -> np.ndarray:
    o = np.arange(out)
    return cols["offset"] + (o // cols["run"]) * cols["stride"] + o % cols["run"]


def match_part(model, weights: dict[str, np.ndarray]) -> tuple[dict, list[str]]:
    """module path -> placement, and the modules with no initializer found."""
    inits = [t for t in model.graph.initializer if t.data_type in NP_DTYPE and len(t.dims) in (2, 4)]
    by_shape: dict[tuple, list] = {}
    for t in inits:
        by_shape.setdefault(tuple(t.dims), []).append(t)
    arrays = {}

    def arr(t):
        if t.name not in arrays:
            arrays[t.name] = array_of(t)
        return arrays[t.name]

    placed, missing = {}, []
    for path, w in weights.items():
        kind = "conv" if w.ndim == 4 else "linear"
        found = None
        candidates = list(layouts(kind, w))
        if kind == "conv" and w.shape[2:] == (1, 1):  # a 1x1 convolution may be exported as a MatMul
            candidates += [(f"{lay}:1x1", v) for lay, v in layouts("linear", w[:, :, 0, 0])]
        for layout, view in candidates:
            for t in by_shape.get(view.shape, []):
                a = arr(t)
                sample = tuple(slice(0, min(4, n)) for n in view.shape)
                if not close(a[sample], np.ascontiguousarray(view[sample]), t.data_type):
                    continue
                if close(a, np.ascontiguousarray(view), t.data_type):
                    found = {"initializer": t.name, "kind": kind, "shape": list(w.shape), "layout": layout.split(":")[0]}
                    break
            if found:
                break
        if not found and kind == "linear":
            wt = np.ascontiguousarray(w.T)
            for t in inits:
                if len(t.dims) == 2 and t.dims[0] == w.shape[1] and t.dims[1] > w.shape[0]:
                    cols = find_columns(arr(t), wt, t.data_type)
                    if cols:
                        found = {"initializer": t.name, "kind": kind, "shape": list(w.shape), "layout": "transposed",
                                 "columns": cols}
                        break
        if found:
            placed[path] = found
        else:
            missing.append(path)
    return drop_shared(placed), missing


def drop_shared(placed: dict) -> dict:
    """Two modules found whole in one initializer had identical weights the exporter stored once:
    a LoRA on one would change both, so neither is overridable."""
    whole: dict[str, list[str]] = {}
    for path, p in placed.items():
        if "columns" not in p:
            whole.setdefault(p["initializer"], []).append(path)
    for name, paths in whole.items():
        if len(paths) > 1:
            log(f"  {', '.join(paths)} share initializer {name}: left out")
            for path in paths:
                del placed[path]
    return placed


# ---------------------------------------------------------------------------------------------
# rewriting the graph
# ---------------------------------------------------------------------------------------------


def make_overridable(model, names: set[str]) -> None:
    from onnx import helper

    listed = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        if t.name in names and t.name not in listed:
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))


def externalize(model, part_dir: Path, names: set[str], external: set[str]) -> tuple[dict, Path]:
    """Writes `names` and `external` to a new DATA_FILE (returned, to be renamed into place once the
    graph is saved) and points the graph at it; returns the placements of `names`."""
    from onnx import TensorProto, numpy_helper

    tmp = part_dir / (DATA_FILE + ".tmp")
    placements, offset = {}, 0
    with open(tmp, "wb") as f:
        for t in model.graph.initializer:
            if t.name not in names and t.name not in external:
                continue
            values = numpy_helper.to_array(t)
            data = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes()
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(data)
            del t.external_data[:]
            t.ClearField("raw_data")
            t.ClearField("float_data")
            t.ClearField("int32_data")
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(len(data)))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            if t.name in names:
                placements[t.name] = {"dtype": DTYPE_NAME[t.data_type], "shape": list(t.dims), "offset": offset,
                                      "length": len(data)}
            offset += len(data)
    return placements, tmp


def prepare_part(part_dir: Path, weights: dict[str, np.ndarray], part: str) -> dict:
    import onnx

    from onnx import TensorProto
    from onnx.external_data_helper import load_external_data_for_model

    path = part_dir / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    external = {t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    load_external_data_for_model(model, str(part_dir))
    placed, missing = match_part(model, weights)
    names = {p["initializer"] for p in placed.values()}
    make_overridable(model, names)
    placements, data_tmp = externalize(model, part_dir, names, external)
    model_tmp = part_dir / "model.onnx.tmp"
    onnx.save_model(model, str(model_tmp))
    os.replace(data_tmp, part_dir / DATA_FILE)
    os.replace(model_tmp, path)
    layout_counts: dict[str, int] = {}
    for p in placed.values():
        key = p["layout"] + ("+columns" if "columns" in p else "")
        layout_counts[key] = layout_counts.get(key, 0) + 1
    lora_map = {"version": 1, "part": part, "data_file": DATA_FILE, "initializers": placements,
                "modules": dict(sorted(placed.items()))}
    (part_dir / "lora_map.json").write_text(dumps_map(lora_map))
    log(f"{part}: {len(placed)} of {len(weights)} modules in {len(names)} initializers {layout_counts}; "
        f"{sum(p['length'] for p in placements.values()) / 1e6:.1f} MB overridable")
    for path_ in missing:
        log(f"  {part}: no initializer holds {path_}: left out")
    return {"modules": len(placed), "missing": missing, "initializers": len(names)}


def dumps_map(lora_map: dict) -> str:
    """JSON with one initializer or module per line: readable, and small diffs when regenerated."""
    lines = ["{"]
    for key, value in lora_map.items():
        if isinstance(value, dict):
            lines.append(f" {json.dumps(key)}: {{")
            items = list(value.items())
            for k, (name, entry) in enumerate(items):
                comma = "," if k + 1 < len(items) else ""
                lines.append(f"  {json.dumps(name)}: {json.dumps(entry, separators=(', ', ': '))}{comma}")
            lines.append(" }" + ("," if key != list(lora_map)[-1] else ""))
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def prepare(model_dir: Path, torch_models: dict, parts=PARTS) -> dict:
    """Prepares `parts` of `model_dir` in place from the torch modules they were exported from."""
    report = {}
    for part in parts:
        report[part] = prepare_part(model_dir / part, target_modules(torch_models[part], part), part)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--diffusers-dir", type=Path)
    src.add_argument("--random-weights", action="store_true", help="SDXL-base architecture, seeded (export_sdxl.py's)")
    src.add_argument("--tiny-config", action="store_true", help="the tiny fixture architecture, seeded")
    ap.add_argument("--seed", type=int, default=0, help="the seed the folder was exported with")
    ap.add_argument("--device", default="cpu", help="torch device to rebuild the modules on")
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args()
    t0 = time.time()
    models = torch_parts(args)
    parts = [p for p in args.parts.split(",") if p]
    report = prepare(args.model_dir, models, parts)
    log(f"done in {time.time() - t0:.0f} s: {json.dumps({p: {k: v for k, v in r.items() if k != 'missing'} for p, r in report.items()})}")
    if any(r["missing"] for r in report.values()):
        log("some modules have no overridable weight (listed above); LoRAs naming them will be refused")


if __name__ == "__main__":
    main()
