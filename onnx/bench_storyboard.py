"""Issue 17's mixed storyboard through diffusers: eager, compiled for static shapes, compiled for
dynamic shapes, each from a cold process.

    PYTHONPATH=/root/site python3 onnx/bench_storyboard.py --modes eager,static,dynamic \\
        --out /root/results/diffusers-storyboard.json --budget-s 540

The shots are deploy/gpu/storyboards.py's (`storyboard_shots`: 60 single-image shots over SDXL's
five usual sizes, interleaved in a fixed shuffle), 30 steps, guidance 5, the same seeded
random-weight SDXL-base as bench_diffusers.py (its `build_pipeline`), rendered one after another
in storyboard order, as a user's script would render them.

Modes, each in a process of its own with an empty inductor cache folder (so each compiles from
nothing, as a fresh worker process does):
  eager    as diffusers ships it
  static   bench_diffusers.py's compiled setup (fused QKV, channels_last, torch.compile of the UNet
           and the VAE decoder, fullgraph) with dynamic shapes off: every new size compiles anew
  dynamic  the same with torch.compile(dynamic=True): one compilation for every size

Per mode: the seconds from the process's start (the interpreter, imports and the model's build
included) to each image; images/s from the start to the last image; images/s in steady state
(the shots after every size has been rendered once); per size, its first shot's seconds (the
compilation of that size included) against the median of its later shots. The JSON is rewritten
after each shot and each mode, so a mode cut at the deadline keeps what it rendered.

CPU check of the code path (tiny architecture, every side divided by 8, 3 steps, 6 shots):
    /work/venv-onnx/bin/python onnx/bench_storyboard.py --tiny --modes eager,dynamic --out /tmp/sb.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "deploy" / "gpu"))

from storyboards import PROMPTS, firsts_of_sizes, storyboard_shots  # noqa: E402

MODES = ("eager", "static", "dynamic")


def render_shots(args) -> None:
    """The child: build, set the mode up, render the shots in order until the deadline."""
    started = args.started_at
    doc = {"mode": args.child, "status": "running", "shots": [], "steps": args.steps, "scale": args.scale}

    def save() -> None:
        Path(args.child_out).write_text(json.dumps(doc, indent=1))

    import torch

    from bench_diffusers import build_pipeline, make_compiled, sync

    torch.set_grad_enabled(False)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    pipe = build_pipeline(argparse.Namespace(tiny=args.tiny, dtype="fp16" if device == "cuda" else "fp32", seed=0,
                                             device=device, tokenizers=args.tokenizers))
    doc["built_at_s"] = time.time() - started
    if args.child != "eager":
        doc["compiled"] = make_compiled(pipe, argparse.Namespace(
            compile_mode="default", no_fullgraph=False, no_fuse_qkv=False, no_channels_last=False,
            no_compile_vae=False), dynamic=args.child == "dynamic")
    save()
    for i, (width, height, seed) in enumerate(storyboard_shots(args.shots)):
        width, height = width // args.scale, height // args.scale
        if time.time() > args.deadline:
            doc["status"] = f"cut at the deadline after {i} shots"
            break
        gen = torch.Generator(device=device).manual_seed(seed)
        sync(device)
        t = time.time()
        pipe(prompt=PROMPTS[i % len(PROMPTS)], negative_prompt=None, num_images_per_prompt=1, height=height,
             width=width, num_inference_steps=args.steps, guidance_scale=5.0, generator=gen, output_type="pil")
        sync(device)
        done = time.time()
        doc["shots"].append({"i": i, "size": f"{width}x{height}", "s": round(done - t, 3), "done_at_s": round(done - started, 3)})
        save()
    else:
        doc["status"] = "ok"
    save()


def summarise(doc: dict) -> dict:
    shots = doc.get("shots") or []
    out = {"mode": doc.get("mode"), "status": doc.get("status"), "shots": len(shots), "built_at_s": doc.get("built_at_s")}
    if not shots:
        return out
    first, last_first = firsts_of_sizes([x["size"] for x in shots])
    end = shots[-1]["done_at_s"]
    steady = shots[last_first + 1:]
    steady_s = end - shots[last_first]["done_at_s"]
    out.update(
        to_last_image_s=end,
        images_per_s=round(len(shots) / end, 4),
        steady_images=len(steady),
        images_per_s_steady=round(len(steady) / steady_s, 4) if steady and steady_s > 0 else None,
        first_image_s=shots[0]["done_at_s"],
        per_size={size: {"first_s": shots[k]["s"],
                         "later_median_s": (round(statistics.median(later), 3) if (later := [x["s"] for x in shots if x["size"] == size][1:]) else None)}
                  for size, k in first.items()},
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, required=False)
    ap.add_argument("--shots", type=int, default=60)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=540, help="all modes end within this (each gets what is left, split evenly)")
    ap.add_argument("--tiny", action="store_true", help="tiny architecture on the CPU, sides / 8, 3 steps, 6 shots")
    ap.add_argument("--tokenizers", default=str(HERE / "tiny" / "model"))
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--started-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.scale, args.steps = 8, min(args.steps, 3)
        args.shots = min(args.shots, 6)
    if args.child:
        render_shots(args)
        return

    start = time.time()
    modes = [m for m in args.modes.split(",") if m]
    doc = {"what": "diffusers on issue 17's mixed storyboard, each mode from a cold process", "shots": args.shots,
           "steps": args.steps, "tiny": args.tiny, "modes": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for k, mode in enumerate(modes):
        left = args.budget_s - (time.time() - start)
        share = left / (len(modes) - k)
        if share < 30:
            doc["modes"][mode] = {"mode": mode, "status": f"skipped: {left:.0f} s of the budget left"}
            continue
        with tempfile.TemporaryDirectory(prefix=f"inductor-{mode}-") as cache, tempfile.NamedTemporaryFile(suffix=".json") as child_out:
            spawned = time.time()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--child-out", child_out.name,
                   "--started-at", str(spawned), "--deadline", str(spawned + share - 20), "--shots", str(args.shots),
                   "--steps", str(args.steps), "--scale", str(args.scale), "--tokenizers", args.tokenizers]
            if args.tiny:
                cmd.append("--tiny")
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
            print(f"[{time.strftime('%H:%M:%S')}] {mode}: {share:.0f} s", flush=True)
            try:
                # The child is stopped 10 s after its share (a compilation started before its deadline
                # runs past it), so this process still reads and writes what it rendered before the
                # stage's own timeout (the budget + 30 s) ends it.
                rc = subprocess.run(cmd, env=env, timeout=share + 10).returncode
            except subprocess.TimeoutExpired:
                rc = "killed at the deadline"
            try:
                child = json.loads(Path(child_out.name).read_text() or "{}")
            except (OSError, ValueError):
                child = {}
            row = summarise(child) | {"rc": rc}
            doc["modes"][mode] = row | {"raw": child.get("shots", [])}
            print(json.dumps(row), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1))
    if args.out:
        print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
