"""Merges one GPU lease's results into one table (markdown and JSON).

    python3 deploy/gpu/report.py RESULTS_DIR [--md report.md] [--json report.json]

RESULTS_DIR is /root/results on the GPU machine, or here the folder where a call's files (or
results.tar.gz, unpacked) landed. It reads what is there, all optional:
  diffusers.json  onnx/bench_diffusers.py (cells: mode x batch)
  fleet.json      deploy/gpu/fleet.sh: {"runs": [{label, batch, workers, images, wall_s, images_per_s,
                  warmup_s, peak_vram_gib, nvml_used_peak_gib, busy_fraction, note}]} (or one such run)
  unet.json       onnx/bench_unet.py (variants)
  stages.jsonl    deploy/gpu/lease.sh (seconds per stage)
Ratios: images/s over diffusers eager, and over diffusers compiled, at the same images per call
(batch 1 when the batch was not measured there). Standard library only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def num(v, fmt: str, dash: str = "-") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else dash


def image_rows(diff: dict | None, fleet) -> list[dict]:
    rows = []
    for c in (diff or {}).get("cells", []):
        row = {
            "system": f"diffusers {c['mode']}",
            "mode": c["mode"],
            "batch": c.get("batch"),
            "status": c.get("status"),
        }
        if c.get("status") == "ok":
            row.update(
                images=c.get("images"),
                images_per_s=c.get("images_per_s"),
                s_per_image=c.get("s_per_image"),
                peak_vram_gib=c.get("peak_alloc_gib"),
                peak_reserved_gib=c.get("peak_reserved_gib"),
                nvml_used_peak_gib=c.get("nvml_used_peak_gib"),
                warmup_s=c.get("warmup_s"),
                busy_fraction=c.get("busy_fraction"),
            )
        else:
            row["note"] = c.get("error", "")
        rows.append(row)
    runs = []
    if isinstance(fleet, dict):
        runs = fleet.get("runs", [fleet])
    elif isinstance(fleet, list):
        runs = fleet
    for r in runs:
        ips = r.get("images_per_s")
        if ips is None and r.get("images") and r.get("wall_s"):
            ips = r["images"] / r["wall_s"]
        rows.append({
            "system": "shotfleet " + str(r.get("label", "fleet")),
            "mode": "fleet",
            "batch": r.get("batch"),
            "workers": r.get("workers"),
            "status": r.get("status", "ok" if ips else "no figure"),
            "images": r.get("images"),
            "images_per_s": ips,
            "s_per_image": (1 / ips) if ips else None,
            "peak_vram_gib": r.get("peak_vram_gib"),
            "nvml_used_peak_gib": r.get("nvml_used_peak_gib"),
            "warmup_s": r.get("warmup_s"),
            "busy_fraction": r.get("busy_fraction"),
            "note": r.get("note", ""),
        })
    ref = {}
    for row in rows:
        if row["mode"] in ("eager", "compiled") and row.get("images_per_s"):
            ref[(row["mode"], row["batch"])] = row["images_per_s"]
    for row in rows:
        ips = row.get("images_per_s")
        for mode in ("eager", "compiled"):
            base = ref.get((mode, row.get("batch"))) or ref.get((mode, 1))
            row[f"x_{mode}"] = (ips / base) if ips and base else None
    return rows


def images_md(rows: list[dict], diff: dict | None) -> list[str]:
    d = diff or {}
    title = (f"## Images per second: SDXL {d.get('size', 1024)}x{d.get('size', 1024)}, {d.get('steps', 30)} steps, "
             f"guidance {d.get('guidance', 5.0)}, random weights")
    out = [title, ""]
    if d.get("versions"):
        v = d["versions"]
        out.append(f"{v.get('gpu', '?')}; torch {v.get('torch')}, diffusers {v.get('diffusers')}, "
                   f"transformers {v.get('transformers')}. {d.get('note') or ''}".rstrip())
        out.append("")
    out += [
        "| system | images/call | images/s | s/image | x eager | x compiled | peak VRAM GiB | NVML used peak GiB "
        "| warm-up s | GPU busy | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r.get("status") != "ok" and not r.get("images_per_s"):
            out.append(f"| {r['system']} | {num(r.get('batch'), 'd')} | {r.get('status')} | | | | | | | | "
                       f"{str(r.get('note', ''))[:400]} |")
            continue
        busy = f"{r['busy_fraction'] * 100:.0f}%" if isinstance(r.get("busy_fraction"), (int, float)) else "-"
        batch = num(r.get("batch"), "d")
        if r.get("workers"):
            batch += f" ({r['workers']} workers)"
        out.append(
            f"| {r['system']} | {batch} | {num(r.get('images_per_s'), '.3f')} | {num(r.get('s_per_image'), '.2f')} "
            f"| {num(r.get('x_eager'), '.2f')} | {num(r.get('x_compiled'), '.2f')} "
            f"| {num(r.get('peak_vram_gib'), '.2f')} | {num(r.get('nvml_used_peak_gib'), '.2f')} "
            f"| {num(r.get('warmup_s'), '.1f')} | {busy} | {str(r.get('note', ''))[:100]} |")
    out += ["",
            "Peak VRAM: diffusers rows give torch.cuda.max_memory_allocated over the timed calls; fleet rows what "
            "fleet.sh reports for the worker. NVML used is device-wide. Warm-up: the first call (eager: CUDA and "
            "cuDNN start; compiled: compilation; fleet: worker start to /readyz 200, i.e. load, sessions and probe "
            "renders). Fleet images/s: submit to the last result of the set (fleet.json also has the steady rate, "
            "first job excluded). GPU busy: mean NVML utilization "
            "over the timed part (share of time with a kernel running, not SM occupancy).", ""]
    return out


def unet_md(unet: dict | None, steps: int) -> list[str]:
    if not unet:
        return []
    res = unet.get("results", [])
    stock = next((r.get("median_ms") for r in res if r.get("name") == "stock" and r.get("status") == "ok"), None)
    out = [f"## UNet alone: ORT CUDA provider, IoBinding, batch {unet.get('batch')}, {unet.get('size')} px "
           f"(median of {unet.get('iters')} calls)", "",
           "| variant | ms | x stock | TFLOP/s | rel. err vs stock | session load s | note |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res:
        if r.get("status") != "ok":
            out.append(f"| {r['name']} | {r.get('status')} | | | | | {str(r.get('error', ''))[:140]} |")
            continue
        if r.get("median_ms") is None:
            kinds = r.get("attention_kernels") or {}
            out.append(f"| {r['name']} | (one run) | | | | {num(r.get('load_s'), '.1f')} | "
                       f"{len(kinds)} attention kernel choices, below |")
            continue
        out.append(f"| {r['name']} | {r['median_ms']:.2f} | {num(stock / r['median_ms'] if stock else None, '.2f')} "
                   f"| {num(r.get('tflops'), '.0f')} | {num(r.get('rel_err_vs_stock'), '.1e')} "
                   f"| {num(r.get('load_s'), '.1f')} | {r.get('note', '')} |")
    out.append("")
    if unet.get("stock_spread") is not None:
        out.append(f"Stock timed twice: {unet['stock_spread'] * 100:.1f}% apart; smaller differences are noise.")
    best = unet.get("best")
    if best:
        floor = steps * best["median_ms"] / 1000
        out.append(f"Best: {best['name']} at {best['median_ms']:.2f} ms (cuda {best.get('cuda')}, "
                   f"env {best.get('env')}); {steps} steps of it take {floor:.2f} s per image, the UNet-only "
                   f"floor of an ORT pipeline (text encoders and VAE not included).")
    for r in res:
        if r.get("attention_kernels"):
            out += ["", "Attention kernels chosen (stock, one call):", ""]
            out += [f"- {n} x `{k}`" for k, n in r["attention_kernels"].items()]
    out.append("")
    return out


def stages_md(stages: list[dict]) -> list[str]:
    if not stages:
        return []
    out = ["## Stages", "", "| stage | seconds | exit |", "| --- | ---: | ---: |"]
    for s in stages:
        out.append(f"| {s.get('stage')} | {s.get('seconds')} | {s.get('rc')} |")
    out.append("")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    d = args.results
    diff = load(d / "diffusers.json")
    fleet = load(d / "fleet.json")
    unet = load(d / "unet.json")
    stages = []
    if (d / "stages.jsonl").exists():
        for line in (d / "stages.jsonl").read_text().splitlines():
            try:
                stages.append(json.loads(line))
            except ValueError:
                pass
    rows = image_rows(diff, fleet)
    steps = (diff or {}).get("steps", 30)
    md = ["# GPU lease report (issue gpu-speed)", ""]
    md += images_md(rows, diff) if rows else ["No images/s figures (diffusers.json, fleet.json) found.", ""]
    md += unet_md(unet, steps)
    md += stages_md(stages)
    text = "\n".join(md) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"images": rows, "unet_best": (unet or {}).get("best"),
                                         "unet_stock_spread": (unet or {}).get("stock_spread"),
                                         "unet": (unet or {}).get("results"), "stages": stages}, indent=2) + "\n")


if __name__ == "__main__":
    main()
