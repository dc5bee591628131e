"""diffusers' own SDXL pipeline as the reference for the fleet: eager and torch.compile, images/s.

    PYTHONPATH=/root/site python3 onnx/bench_diffusers.py --out /root/results/diffusers.json

Builds diffusers 0.42.1's StableDiffusionXLPipeline from the SDXL-base configs in sdxl_onnx.py with
the same seeded random init as export_sdxl.py --random-weights (identical compute to SDXL; the
images are noise), float16 on CUDA, the real CLIP tokenizer files of the committed fixture, and
SDXL's Euler scheduler. Then, per mode and batch ("cell"): one warm-up call (its time is the
warm-up before the first image: CUDA/cuDNN start for eager, compilation for compiled), then timed
calls of 1024x1024, 30 steps, guidance 5.0, empty negative prompt (zeros, as SDXL does), PIL output.

Modes:
  eager     as diffusers ships it (SDPA attention; the VAE upcast to float32 for decoding, because
            SDXL's VAE config has force_upcast)
  compiled  pipe.fuse_qkv_projections(), channels_last on unet and vae, torch.compile(unet) and
            torch.compile(vae.decode), inductor default mode, fullgraph; static shapes
            (automatic_dynamic_shapes off) so batch 4 gets its own compiled graph

Per cell: images/s, seconds per call, peak VRAM (torch.cuda.max_memory_allocated and _reserved over
the timed calls, and over the warm-up; NVML device memory used, sampled), GPU busy fraction (NVML
utilization.gpu every 100 ms over the timed calls, see deploy/gpu/gpu_sampler.py). The JSON is
rewritten after each cell; --budget-s skips cells that would not finish in time.

CPU check of the same code path here (tiny architecture, float32, 64x64, 3 steps):
    /work/venv-onnx/bin/python onnx/bench_diffusers.py --tiny --out /tmp/diffusers-tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "deploy" / "gpu"))

PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed, sharp focus"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gib(n: float | None) -> float | None:
    return None if n is None else n / 2**30


def build_pipeline(args):
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    import sdxl_onnx as sx

    configs = sx.SDXL_TINY if args.tiny else sx.SDXL_BASE
    dtype = torch.float16 if args.dtype == "fp16" else torch.float32
    models = sx.build_random_models(configs, args.seed, device=args.device, dtype=dtype)
    tok = Path(args.tokenizers)
    pipe = StableDiffusionXLPipeline(
        vae=models["vae"],
        text_encoder=models["text_encoder"],
        text_encoder_2=models["text_encoder_2"],
        tokenizer=CLIPTokenizer.from_pretrained(str(tok / "tokenizer")),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(tok / "tokenizer_2")),
        unet=models["unet"],
        scheduler=EulerDiscreteScheduler.from_config(sx.SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_compiled(pipe, args, dynamic: bool = False) -> dict:
    """Applies the compiled-mode changes in place; returns what was done. Static shapes unless
    `dynamic` (torch.compile(dynamic=True): one graph for every size, onnx/bench_storyboard.py)."""
    import torch

    done = {"compile_mode": args.compile_mode, "fullgraph": not args.no_fullgraph, "dynamic": dynamic}
    if not dynamic:
        torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    if not args.no_fuse_qkv:
        pipe.fuse_qkv_projections()
        done["fuse_qkv_projections"] = True
    if not args.no_channels_last:
        pipe.unet.to(memory_format=torch.channels_last)
        pipe.vae.to(memory_format=torch.channels_last)
        done["channels_last"] = True
    kw = {"mode": None if args.compile_mode == "default" else args.compile_mode, "fullgraph": not args.no_fullgraph}
    if dynamic:
        kw["dynamic"] = True
    pipe.unet = torch.compile(pipe.unet, **kw)
    if not args.no_compile_vae:
        pipe.vae.decode = torch.compile(pipe.vae.decode, **kw)
        done["compiled_vae_decode"] = True
    return done


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def one_call(pipe, args, batch: int, call_index: int) -> tuple[float, object]:
    import torch

    gen = torch.Generator(device=args.device).manual_seed(args.seed + call_index)
    sync(args.device)
    t = time.perf_counter()
    out = pipe(
        prompt=PROMPT,
        negative_prompt=None,
        num_images_per_prompt=batch,
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=gen,
        output_type="pil",
    )
    sync(args.device)
    return time.perf_counter() - t, out


def run_cell(pipe, args, mode: str, batch: int, calls: int) -> dict:
    import numpy as np
    import torch

    from gpu_sampler import GpuSampler

    cuda = args.device == "cuda"
    cell: dict = {"mode": mode, "batch": batch, "calls": calls, "images": calls * batch, "status": "error"}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    log(f"{mode} batch {batch}: warm-up call")
    warm, _ = one_call(pipe, args, batch, 0)
    cell["warmup_s"] = warm
    if cuda:
        cell["warmup_peak_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
        cell["warmup_peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
    log(f"{mode} batch {batch}: warm-up {warm:.1f} s; {calls} timed calls")
    sampler = GpuSampler(interval=0.1).start() if cuda else None
    load0 = os.getloadavg()[0]
    times = []
    out = None
    for i in range(calls):
        dt, out = one_call(pipe, args, batch, i + 1)
        times.append(dt)
    gpu = sampler.stop() if sampler else {}
    total = sum(times)
    cell.update(
        call_s=times,
        s_per_call_median=statistics.median(times),
        total_s=total,
        images_per_s=calls * batch / total,
        s_per_image=total / (calls * batch),
        loadavg_1m=[load0, os.getloadavg()[0]],
        gpu=gpu,
    )
    if cuda:
        cell["peak_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
        cell["peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
    if "busy_fraction" in gpu:
        cell["busy_fraction"] = gpu["busy_fraction"]
    if "mem_used_peak_mib" in gpu:
        cell["nvml_used_peak_gib"] = gpu["mem_used_peak_mib"] / 1024
    img = np.asarray(out.images[0]) if out is not None else None
    if img is not None:
        cell["image_shape"] = list(img.shape)
        cell["image_mean"] = float(img.mean())
    cell["status"] = "ok"
    log(f"{mode} batch {batch}: {cell['images_per_s']:.3f} images/s, {cell['s_per_call_median']:.2f} s per call"
        + (f", peak {cell['peak_alloc_gib']:.2f} GiB" if cuda else "")
        + (f", busy {cell['busy_fraction'] * 100:.0f}%" if "busy_fraction" in cell else ""))
    return cell


def nvml_used_gib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        used = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
        pynvml.nvmlShutdown()
        return used / 2**30
    except Exception:  # noqa: BLE001 - optional figure
        return None


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "diffusers", "transformers", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"unavailable: {e}"
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["cuda"] = torch.version.cuda
            out["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON results (rewritten after each cell)")
    ap.add_argument("--modes", default="eager,compiled", help="comma list: eager, compiled")
    ap.add_argument("--eager-only", action="store_true")
    ap.add_argument("--compiled-only", action="store_true")
    ap.add_argument("--batches", default="1,4", help="images per pipeline call, comma list")
    ap.add_argument("--images", type=int, default=8,
                    help="timed images per cell (calls = max(1, images // batch))")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", choices=("fp16", "fp32"), default=None, help="default fp16 on cuda, fp32 on cpu")
    ap.add_argument("--tokenizers", default=str(HERE / "tiny" / "model"),
                    help="folder with tokenizer/ and tokenizer_2/ (the fixture's are the real CLIP BPE files)")
    ap.add_argument("--tiny", action="store_true", help="tiny architecture, CPU, 64x64, 3 steps, batches 1,2, 2 images")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode (default, max-autotune, ...)")
    ap.add_argument("--no-fuse-qkv", action="store_true")
    ap.add_argument("--no-channels-last", action="store_true")
    ap.add_argument("--no-compile-vae", action="store_true")
    ap.add_argument("--no-fullgraph", action="store_true")
    ap.add_argument("--budget-s", type=float, default=540, help="skip a cell that would end after this")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. what else ran on the machine)")
    args = ap.parse_args()

    import torch

    if args.tiny:
        args.device = args.device or "cpu"
        if args.size == 1024:
            args.size = 64
        if args.steps == 30:
            args.steps = 3
        if args.batches == "1,4":
            args.batches = "1,2"
        if args.images == 8:
            args.images = 2
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    modes = [m for m in args.modes.split(",") if m]
    if args.eager_only:
        modes = ["eager"]
    if args.compiled_only:
        modes = ["compiled"]
    batches = [int(b) for b in args.batches.split(",") if b]
    torch.set_grad_enabled(False)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/root/inductor-cache" if os.access("/root", os.W_OK)
                          else str(Path.home() / ".cache" / "inductor"))
    cache_dir = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])

    start = time.monotonic()
    doc: dict = {
        "what": "diffusers StableDiffusionXLPipeline, random-weight SDXL-base",
        "size": args.size, "steps": args.steps, "guidance": args.guidance, "dtype": args.dtype,
        "device": args.device, "tiny": args.tiny, "modes": modes, "batches": batches, "images_per_cell": args.images,
        "note": args.note, "versions": versions(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "inductor_cache_dir": str(cache_dir),
        "inductor_cache_was_warm": cache_dir.exists() and any(cache_dir.iterdir()),
        "cells": [],
    }
    if args.device == "cuda":
        doc["nvml_used_before_gib"] = nvml_used_gib()

    def save() -> None:
        doc["elapsed_s"] = time.monotonic() - start
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            tmp.replace(args.out)

    log(f"building the pipeline on {args.device} ({args.dtype})")
    t = time.perf_counter()
    pipe = build_pipeline(args)
    doc["build_s"] = time.perf_counter() - t
    doc["vae_force_upcast"] = bool(pipe.vae.config.force_upcast)
    log(f"built in {doc['build_s']:.1f} s")
    save()

    compiled_info = None
    for mode in modes:
        if mode == "compiled" and compiled_info is None:
            compiled_info = make_compiled(pipe, args)
            doc["compiled"] = compiled_info
        for batch in batches:
            calls = max(1, args.images // batch)
            left = args.budget_s - (time.monotonic() - start)
            need = estimate(doc["cells"], mode, batch, calls)
            if need is not None and need > left:
                cell = {"mode": mode, "batch": batch, "calls": calls, "status": "skipped",
                        "error": f"needs about {need:.0f} s, {left:.0f} s of the budget left"}
                log(f"{mode} batch {batch}: skipped ({cell['error']})")
            else:
                try:
                    cell = run_cell(pipe, args, mode, batch, calls)
                except Exception as e:  # noqa: BLE001 - record and go on
                    cell = {"mode": mode, "batch": batch, "calls": calls, "status": "error",
                            "error": f"{type(e).__name__}: {e}"[:2000]}
                    log(f"{mode} batch {batch}: FAILED {cell['error'][:300]}")
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
            doc["cells"].append(cell)
            save()

    print_table(doc)
    save()
    if args.out:
        print(f"JSON: {args.out}")


def estimate(cells: list[dict], mode: str, batch: int, calls: int) -> float | None:
    """Seconds a cell should take, from the cells already run (None: no idea, run it)."""
    ok = [c for c in cells if c.get("status") == "ok"]
    same_mode = [c for c in ok if c["mode"] == mode]
    per_image = None
    for c in ok:
        if c["batch"] == batch:
            per_image = c["s_per_image"] if per_image is None else min(per_image, c["s_per_image"])
    if per_image is None and ok:
        per_image = min(c["s_per_image"] for c in ok)
    if per_image is None:
        return None
    timed = 1.1 * per_image * batch * calls
    if mode == "compiled":
        # a new shape compiles again: assume it costs what the first compile did
        warm = max((c["warmup_s"] for c in same_mode), default=None)
        if warm is None:
            return None  # the first compiled cell always runs: its compile time is the figure wanted
        return warm + timed + per_image * batch
    return timed + 2 * per_image * batch


def print_table(doc: dict) -> None:
    print(f"\n== diffusers SDXL {doc['size']}x{doc['size']}, {doc['steps']} steps, {doc['dtype']} "
          f"on {doc['device']} ==")
    print(f"{'mode':9} {'batch':>5} {'images/s':>9} {'s/call':>7} {'warm-up s':>9} {'peak alloc GiB':>14} "
          f"{'NVML peak GiB':>13} {'busy':>5}")
    for c in doc["cells"]:
        if c.get("status") != "ok":
            print(f"{c['mode']:9} {c['batch']:5d}  {c.get('status')}: {c.get('error', '')[:120]}")
            continue

        def f(key, fmt, c=c):
            v = c.get(key)
            width = int(fmt.split(".")[0])
            return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)

        busy = f"{c['busy_fraction'] * 100:.0f}%" if "busy_fraction" in c else "-"
        print(f"{c['mode']:9} {c['batch']:5d} {c['images_per_s']:9.3f} {c['s_per_call_median']:7.2f} "
              f"{c['warmup_s']:9.1f} {f('peak_alloc_gib', '14.2f')} {f('nvml_used_peak_gib', '13.2f')} {busy:>5}")


if __name__ == "__main__":
    main()
