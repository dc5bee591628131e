"""Exports SDXL to ONNX in Optimum's folder layout (same names as onnx/tiny/model).

Sources (pick one):
  --diffusers-dir DIR   a local diffusers SDXL folder (model_index.json, unet/, vae/, text_encoder*/,
                        tokenizer*/, scheduler/); nothing is downloaded
  --random-weights      the real SDXL-base architecture (configs in sdxl_onnx.py: UNet ~2.6B params,
                        CLIP ViT-L + OpenCLIP bigG text encoders, VAE) with a seeded random init:
                        identical compute to SDXL, for GPU benchmarks
  --tiny-config         the tiny fixture architecture, random init: the same code path at CPU size

Precision:
  (default)             float32
  --fp16                float32 export, then onnxruntime's convert_float_to_float16 (keep_io_types=False,
                        op_block_list=["RandomNormalLike"]) per part: float16 weights, compute and I/O
  --optimize            as --fp16, but the UNet first goes through ONNX Runtime's transformer
                        optimizer (fused attention, GroupNorm, ...; see optimize_unet.py). The
                        result's fused ops are CUDA-only unless --optimize-cpu.

The VAE decoder follows its config: float32 when it has force_upcast (SDXL's own VAE overflows in
float16), float16 with the rest when it does not (the fp16-fix VAE). The consumer reads each
session's dtypes, so mixed folders are fine, and refuses a float16 decoder whose config says
force_upcast. With random weights, --fp16-fix-vae gives the VAE the fp16-fix VAE's config (same
architecture, force_upcast false), as a folder built on that VAE would have.
Models over ~2 GB are written with one external data file, model.onnx_data.

Examples:
  python onnx/export_sdxl.py --tiny-config --out /tmp/tiny-export
  python onnx/export_sdxl.py --diffusers-dir ~/models/stable-diffusion-xl-base-1.0 --out ~/models/sdxl-onnx-fp16 --fp16
  PYTHONPATH=... python onnx/export_sdxl.py --random-weights --out /root/sdxl-opt --optimize \\
      --optimizer-pythonpath /root/np:/root/site
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sdxl_onnx as sx  # noqa: E402

PARTS = ("text_encoder", "text_encoder_2", "unet", "vae_decoder")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_diffusers(folder: Path, dtype, device: str):
    import torch
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(
        str(folder), torch_dtype=dtype, local_files_only=True, use_safetensors=None, add_watermarker=False
    )
    models = {
        "text_encoder": pipe.text_encoder,
        "text_encoder_2": pipe.text_encoder_2,
        "unet": pipe.unet,
        "vae": pipe.vae,
    }
    for m in models.values():
        m.to(device).eval().requires_grad_(False)
    sched = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    force_zeros = bool(pipe.config.get("force_zeros_for_empty_prompt", True))
    del pipe
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return models, sched, force_zeros


def copy_tokenizers(src: Path, out: Path) -> None:
    for name in ("tokenizer", "tokenizer_2"):
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        sx.copy_tree_files(src / name, d)


def run_optimizer(fp32_unet: Path, dst: Path, cpu: bool, pythonpath: str | None) -> None:
    """Runs optimize_unet.py in its own process so it can have its own numpy (see its docstring)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, str(HERE / "optimize_unet.py"), str(fp32_unet), str(dst)] + (["--cpu"] if cpu else [])
    log("optimizing unet: " + " ".join(cmd))
    subprocess.run(cmd, env=env, check=True)


def convert_fp16(src: Path, dst: Path) -> None:
    import to_fp16

    to_fp16.save(to_fp16.fp16_full(src), dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--diffusers-dir", type=Path)
    src.add_argument("--random-weights", action="store_true")
    src.add_argument("--tiny-config", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--optimize", action="store_true")
    ap.add_argument("--optimize-cpu", action="store_true",
                    help="with --optimize: use_gpu=False, so the result runs on ORT's CPU provider (for tests)")
    ap.add_argument("--optimizer-pythonpath", default=None,
                    help="prepended to PYTHONPATH for the optimizer process (put numpy 2.2.6 first)")
    ap.add_argument("--fp16-fix-vae", action="store_true",
                    help="with --random-weights/--tiny-config: the VAE config of the fp16-fix VAE (force_upcast false)")
    ap.add_argument("--device", default=None, help="torch device for building/exporting (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of parts to export")
    args = ap.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    fp16 = args.fp16 or args.optimize
    parts = [p for p in args.parts.split(",") if p]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    t0 = time.time()

    # Always built and exported in float32; float16 comes from ONNX Runtime's converter afterwards.
    # (torch's TorchScript exporter, fed a half-precision CLIP, produced float32 outputs for most
    # layers, so a direct half export would give mixed dtypes.)
    log(f"building models on {device} (float32)")
    if args.diffusers_dir:
        models, sched, force_zeros = load_diffusers(args.diffusers_dir, torch.float32, device)
        copy_tokenizers(args.diffusers_dir, out)
    else:
        configs = sx.SDXL_TINY if args.tiny_config else sx.SDXL_BASE
        if args.fp16_fix_vae:
            configs = {**configs, "vae": {**configs["vae"], "force_upcast": False}}
        models = sx.build_random_models(configs, args.seed, device=device)
        sched, force_zeros = sx.SDXL_SCHEDULER, True
        sx.write_tokenizers(out)
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    log(f"parameters: {params}")
    sx.write_configs(out, models, sched, force_zeros)
    if args.fp16_fix_vae and args.diffusers_dir:
        ap.error("--fp16-fix-vae is for random weights: a diffusers folder's VAE config says it itself")
    vae_fp32 = models["vae"].config.force_upcast

    if not fp16:
        for part in parts:
            log(f"exporting {part}")
            sx.export_all(models, out, device=device, parts=(part,))
    else:
        # float32 export into a scratch folder next to OUT, then fuse and/or convert into OUT.
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fp32-") as tmp:
            stage = Path(tmp)
            for part in parts:
                log(f"exporting {part} (float32)")
                sx.export_all(models, stage, device=device, parts=(part,))
                if part == "unet":
                    del models["unet"]
                    torch.cuda.empty_cache() if torch.cuda.is_available() else None
                if part == "unet" and args.optimize:
                    run_optimizer(stage / "unet" / "model.onnx", out / "unet" / "model.onnx",
                                  args.optimize_cpu, args.optimizer_pythonpath)
                elif part == "vae_decoder" and vae_fp32:
                    log("vae_decoder stays float32 (force_upcast)")
                    sx.copy_tree_files(stage / part, out / part)
                else:
                    log(f"converting {part} to float16")
                    convert_fp16(stage / part / "model.onnx", out / part / "model.onnx")
                shutil.rmtree(stage / part, ignore_errors=True)

    for part in parts:
        log(f"{part}: " + "; ".join(sx.describe_onnx(out / part / "model.onnx")[:3]) + " ...")
    sizes = {p: sx.folder_size(out / p) for p in parts}
    log(f"done in {time.time() - t0:.0f} s; bytes per part: {sizes}")


if __name__ == "__main__":
    main()
