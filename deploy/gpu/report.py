"""Merges one GPU lease's results into one report (markdown and JSON).

    python3 deploy/gpu/report.py RESULTS_DIR [--md report.md] [--json report.json]

RESULTS_DIR is /root/results on the GPU machine, or here the folder where a call's files (or
results.tar.gz, unpacked) landed. It reads what is there, all optional:
  diffusers.json        onnx/bench_diffusers.py (cells: mode x batch; the compiled cells in this plan)
  diffusers-eager.json  the same, eager cells only, timed when nothing else ran: its cells replace
                        diffusers.json's eager ones
  fleet-speed.json      deploy/gpu/fleet.sh speed (fleet_summary.py: runs, each with its sets)
  fleet.json            the 2026-11-30 lease's fleet.sh ({"runs": [{label, batch, images_per_s, ...}]})
  budget.json           deploy/gpu/fleet.sh budget: check, mixed, oom
  small.json            deploy/gpu/fleet.sh small: shares of the card, two workers on one, 1,000 jobs (small_report.py)
  box.json              deploy/gpu/fleet.sh box: one worker per GPU on two cards (box_report.py)
  unet.json             onnx/bench_unet.py (variants)
  storyboard.json       deploy/gpu/fleet.sh storyboard: the mixed storyboard from a cold worker
  diffusers-storyboard.json  onnx/bench_storyboard.py: the same shots through diffusers (eager, static, dynamic)
  stages.jsonl          deploy/gpu/lease.sh (seconds per stage)
Ratios: a fleet set's images/s (and steady images/s) over diffusers eager, and over compiled, at
the same images per job/call (batch 1 when that batch was not measured). Standard library only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from box_report import box_md
from fleet_summary import busy_cell
from small_report import small_md
from storyboard_summary import storyboard_md

STAGE_KEYS = ("text_ms", "unet_ms", "vae_ms", "png_ms", "upload_ms", "render_ms")


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def num(v, fmt: str, dash: str = "-") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else dash


def arenas(by_graph) -> str:
    """`--check-budget`'s arenas_mib: each graph's arena after the first render, and their sum."""
    if not isinstance(by_graph, dict) or not by_graph:
        return "-"
    graphs = ("text_encoder", "text_encoder_2", "unet", "vae_decoder")
    parts = [num(by_graph.get(g), ".0f") for g in graphs]
    return f"{', '.join(parts)} ({num(sum(v for v in by_graph.values() if isinstance(v, (int, float))), '.0f')})"


def pct(v) -> str:
    return f"{v * 100:.0f}%" if isinstance(v, (int, float)) else "-"


def merge_diffusers(diff: dict | None, eager: dict | None) -> dict | None:
    """diffusers.json's cells, its eager ones replaced by diffusers-eager.json's where that has them."""
    if not eager:
        return diff
    if not diff:
        return eager
    eager_cells = [c for c in eager.get("cells", []) if c.get("mode") == "eager"]
    keep = [c for c in diff.get("cells", []) if not (c.get("mode") == "eager" and eager_cells)]
    for c in eager_cells:
        c = dict(c)
        c["source"] = "diffusers-eager.json"
        if eager.get("note"):
            c["note"] = eager["note"]
        keep.append(c)
    out = dict(diff)
    out["cells"] = sorted(keep, key=lambda c: (c.get("mode") != "eager", c.get("batch") or 0))
    out["eager_note"] = eager.get("note") or "timed alone (after the optimizer finished)"
    return out


def diffusers_rows(diff: dict | None) -> list[dict]:
    rows = []
    for c in (diff or {}).get("cells", []):
        row = {"system": f"diffusers {c['mode']}", "mode": c["mode"], "batch": c.get("batch"), "status": c.get("status")}
        if c.get("status") == "ok":
            row.update(images=c.get("images"), images_per_s=c.get("images_per_s"), s_per_image=c.get("s_per_image"),
                       peak_vram_gib=c.get("peak_alloc_gib"), nvml_used_peak_gib=c.get("nvml_used_peak_gib"),
                       warmup_s=c.get("warmup_s"), busy_fraction=c.get("busy_fraction"),
                       note=c.get("source", ""))
        else:
            row["note"] = c.get("error", "")
        rows.append(row)
    return rows


def fleet_rows(speed: dict | None, old: dict | list | None) -> list[dict]:
    """One row per fleet set: fleet-speed.json's runs x sets, or the old fleet.json's runs."""
    rows = []
    for run in (speed or {}).get("runs", []):
        base = {"mode": "fleet", "run": run.get("name"), "concurrency": run.get("concurrency"),
                "batch_jobs": run.get("batch_jobs"), "warmup_s": run.get("warmup_s")}
        if run.get("status") in ("skipped", "failed") and not any(s.get("images") for s in run.get("sets", [])):
            rows.append(base | {"system": f"shotfleet {run.get('label')}", "status": run.get("status"),
                                "note": run.get("error") or run.get("note") or ""})
            continue
        for s in run.get("sets", []):
            ips = s.get("images_per_s")
            rows.append(base | {
                "system": f"shotfleet {run.get('label')}, {s.get('label')}",
                "batch": s.get("images_per_job"), "status": s.get("status"), "images": s.get("images"),
                "images_per_s": ips, "images_per_s_steady": s.get("images_per_s_steady"),
                "s_per_image": (1 / ips) if ips else None, "peak_vram_gib": s.get("peak_vram_gib"),
                "nvml_used_peak_gib": s.get("nvml_used_peak_gib"), "busy_fraction": s.get("busy_fraction"),
                "busy_backlog": s.get("busy_backlog"),
                "stage_ms_median": s.get("stage_ms_median") or {},
                "note": "; ".join(x for x in (s.get("note"), run.get("error")) if x)})
    runs = old.get("runs", [old]) if isinstance(old, dict) else (old or [])
    for r in runs if not rows else []:
        ips = r.get("images_per_s")
        rows.append({"system": "shotfleet " + str(r.get("label", "fleet")), "mode": "fleet", "batch": r.get("batch"),
                     "concurrency": r.get("workers"), "status": r.get("status", "ok" if ips else "no figure"),
                     "images": r.get("images"), "images_per_s": ips, "images_per_s_steady": r.get("images_per_s_steady"),
                     "s_per_image": (1 / ips) if ips else None, "peak_vram_gib": r.get("peak_vram_gib"),
                     "nvml_used_peak_gib": r.get("nvml_used_peak_gib"), "warmup_s": r.get("warmup_s"),
                     "busy_fraction": r.get("busy_fraction"), "stage_ms_median": {}, "note": r.get("note", "")})
    return rows


def add_ratios(rows: list[dict]) -> None:
    ref = {(r["mode"], r["batch"]): r["images_per_s"] for r in rows
           if r["mode"] in ("eager", "compiled") and r.get("images_per_s")}
    for row in rows:
        for mode in ("eager", "compiled"):
            base = ref.get((mode, row.get("batch"))) or ref.get((mode, 1))
            for key, suffix in (("images_per_s", ""), ("images_per_s_steady", "_steady")):
                v = row.get(key)
                row[f"x_{mode}{suffix}"] = (v / base) if v and base else None


def images_md(rows: list[dict], diff: dict | None) -> list[str]:
    d = diff or {}
    out = [f"## Images per second: SDXL {d.get('size', 1024)}x{d.get('size', 1024)}, {d.get('steps', 30)} steps, "
           f"guidance {d.get('guidance', 5.0)}, random weights", ""]
    if d.get("versions"):
        v = d["versions"]
        out.append(f"{v.get('gpu', '?')}; torch {v.get('torch')}, diffusers {v.get('diffusers')}, "
                   f"transformers {v.get('transformers')}.")
        if d.get("eager_note"):
            notes = [f"Compiled cells: {d['note']}." if d.get("note") else "", f"Eager cells: {d['eager_note']}."]
        else:
            notes = [d.get("note") or ""]
        out += [" ".join(n for n in notes if n), ""]
    out += ["| system | images/job | images/s | steady | s/image | x eager | x compiled | x eager (steady) "
            "| x compiled (steady) | warm-up s | peak VRAM GiB | GPU busy (set / backlog) | text / unet / vae / png / upload / render ms | note |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        if not r.get("images_per_s") and not r.get("images_per_s_steady"):
            out.append(f"| {r['system']} | {num(r.get('batch'), 'd')} | {r.get('status')} | | | | | | | "
                       f"{num(r.get('warmup_s'), '.1f')} | | | | {str(r.get('note', ''))[:300]} |")
            continue
        med = r.get("stage_ms_median") or {}
        stages = " / ".join(num(med.get(k), ".0f") for k in STAGE_KEYS) if med else ""
        out.append(
            f"| {r['system']} | {num(r.get('batch'), 'd')} | {num(r.get('images_per_s'), '.3f')} "
            f"| {num(r.get('images_per_s_steady'), '.3f')} | {num(r.get('s_per_image'), '.2f')} "
            f"| {num(r.get('x_eager'), '.2f')} | {num(r.get('x_compiled'), '.2f')} "
            f"| {num(r.get('x_eager_steady'), '.2f')} | {num(r.get('x_compiled_steady'), '.2f')} "
            f"| {num(r.get('warmup_s'), '.1f')} | {num(r.get('peak_vram_gib'), '.2f')} | {busy_cell(r)} "
            f"| {stages} | {str(r.get('note', ''))[:120]} |")
    out += ["",
            "images/s: diffusers, images over the timed calls; fleet, images over submit to the last result of the set "
            "(`shotfleet submit --wait`, all jobs at once). steady: images finished after the first finish over first "
            "to last finish (the worker's `job done` lines). Ratios at the same images per job/call. Peak VRAM: "
            "diffusers torch.cuda.max_memory_allocated; fleet the worker process's own (NVML) over the set. Warm-up: "
            "first call (compiled: compilation); fleet: worker start to /readyz 200 (load, sessions, probe renders). "
            "GPU busy: mean NVML utilization over the timed part / from the set's first render start to its last "
            "(the backlog: start-up and tail left out; fleet only). Stage medians from the `job done` lines.", ""]
    return out


def fleet_runs_md(speed: dict | None) -> list[str]:
    if not speed or not speed.get("runs"):
        return []
    out = ["## Fleet runs (one worker process each)", "",
           "| run | status | concurrency | batch_jobs | [cuda] | warm-up s | peak VRAM GiB | OOM / no room | error or note |",
           "| --- | --- | ---: | ---: | --- | ---: | ---: | --- | --- |"]
    for run in speed["runs"]:
        cuda = ", ".join(f"{k}={v}" for k, v in (run.get("cuda") or {}).items()) or ("-" if run.get("status") != "skipped" else "")
        counts = run.get("log_counts") or {}
        out.append(f"| {run.get('label')} | {run.get('status')} | {num(run.get('concurrency'), 'd')} "
                   f"| {num(run.get('batch_jobs'), 'd')} | {cuda} | {num(run.get('warmup_s'), '.1f')} "
                   f"| {num(run.get('peak_vram_gib'), '.2f')} | {counts.get('oom', '-')} / {counts.get('no_room', '-')} "
                   f"| {str(run.get('error') or run.get('note') or '')[:300]} |")
    out += ["", f"Device {speed.get('device')}, {speed.get('size')}x{speed.get('size')}, {speed.get('steps')} steps; "
            f"stage {num(speed.get('seconds'), '.0f')} s of its {num(speed.get('deadline_s'), '.0f')} s.", ""]
    return out


def budget_md(budget: dict | None) -> list[str]:
    if not budget:
        return []
    out = ["## Memory budget", ""]
    for name, check in budget.items():
        if not name.startswith("check") or not isinstance(check, dict):
            continue
        out += [f"### {check.get('label') or name} (`--check-budget`, cold arena, calibration steps): {check.get('status')}, "
                f"exit {check.get('exit_code')}, {num(check.get('seconds'), '.0f')} s", ""]
        if check.get("rows"):
            out += ["| shape | predicted MiB | observed MiB | error | predicted / observed | second cold MiB | first ms "
                    "| again ms | again VAE ms | arenas MiB: text, text 2, UNet, VAE (sum) |",
                    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
            for x in check["rows"]:
                out.append(f"| {x.get('width')}x{x.get('height')} x {x.get('images')} | {num(x.get('predicted_mib'), '.0f')} "
                           f"| {num(x.get('observed_mib'), '.0f')} | {num(x.get('error'), '+.3f', str(x.get('error') or '-'))} "
                           f"| {num(x.get('pred_over_obs'), '.3f')} | {num(x.get('observed_again_mib'), '.0f')} "
                           f"| {num(x.get('first_ms'), '.0f')} "
                           f"| {num(x.get('again_ms'), '.0f')} | {num(x.get('again_vae_ms'), '.0f')} | {arenas(x.get('arenas_mib'))} |")
            out += ["", f"max |error| {num(check.get('max_abs_error'), '.3f')}; under-predicted: "
                        f"{', '.join(check.get('under_predicted') or []) or 'none'}; summary {json.dumps(check.get('summary'))}", ""]
        if check.get("error"):
            out += [f"Error: {check['error'][:600]}", ""]
    mixed = budget.get("mixed")
    if mixed:
        s = (mixed.get("sets") or [{}])[0]
        counts = mixed.get("log_counts") or {}
        hog = mixed.get("hog") or {}
        tally = s.get("tally") or {}
        if hog.get("held_mib"):
            hog_text = (f"{num(hog.get('held_mib'), '.0f')} MiB held, {num(hog.get('free_after_mib'), '.0f')} MiB left free "
                        f"of {num(hog.get('total_mib'), '.0f')} MiB")
        elif mixed.get("simulated_others_used_mib"):
            hog_text = f"none (CPU): simulated others_used_mib = {num(mixed['simulated_others_used_mib'], '.0f')}"
        else:
            hog_text = f"none: {mixed.get('hog_error') or (hog or {}).get('error') or 'not started'}"
        out += [f"### Mixed run under memory pressure: {mixed.get('status')}", "",
                "| what | value |", "| --- | --- |",
                f"| hog (another process holding the card) | {hog_text} |",
                f"| jobs (sizes, images, p0/p1/p2) | {s.get('jobs')} jobs, {s.get('requested_images')} images, {s.get('steps')} steps |",
                f"| submit --wait tally | {tally.get('done', '-')} done, {tally.get('degraded', '-')} degraded, "
                f"{tally.get('failed', '-')} failed (exit {s.get('submit_rc')}) |",
                f"| admission OOMs (`out of memory` lines) | **{counts.get('oom', '-')}** "
                f"({ {True: 'zero: met', False: 'not zero: NOT met'}.get(mixed.get('zero_admission_ooms'), 'no job rendered: not measured')}) |",
                f"| `no room for this job now` (given back) | {counts.get('no_room', '-')} |",
                f"| `job done` lines / jobs_total metrics | {counts.get('job_done', '-')} / {json.dumps(mixed.get('jobs_total'))} |",
                f"| wall, images/s (steady) | {num(s.get('wall_s'), '.1f')} s, {num(s.get('images_per_s'), '.3f')} "
                f"({num(s.get('images_per_s_steady'), '.3f')}) |",
                f"| GPU busy, worker peak VRAM, device peak | {pct(s.get('busy_fraction'))}, {num(s.get('peak_vram_gib'), '.2f')} GiB, "
                f"{num(s.get('nvml_used_peak_gib'), '.2f')} GiB |"]
        if mixed.get("error"):
            out.append(f"| error | {mixed['error'][:400]} |")
        out.append("")
    oom = budget.get("oom")
    if oom:
        counts = oom.get("log_counts") or {}
        cap = f"[faults] arena_limit_mib = {num(oom.get('arena_limit_mib'), '.0f')}" if oom.get("arena_limit_mib") \
            else f"cpu_arena_max_mib = {num(oom.get('cpu_arena_max_mib'), '.0f')}"
        out += [f"### Forced out-of-memory ({cap}): {oom.get('status')}", ""]
        if oom.get("status") == "skipped" or (oom.get("error") and not oom.get("big_job")):
            out += [f"{oom.get('error') or oom.get('note')}", ""]
        else:
            big = oom.get("big_job") or {}
            sets = {s.get("key"): s for s in oom.get("sets", [])}
            detail = (sets.get("big", {}).get("not_done") or {})
            out += [f"1. Big job: {', '.join(f'{k} **{v}**' for k, v in big.items()) or 'no outcome'}"
                    f"{' (' + '; '.join(detail.values())[:300] + ')' if detail else ''}.",
                    f"2. Worker log: {counts.get('oom', 0)} `out of memory`, {counts.get('degrading_in_place', 0)} "
                    f"`degrading in place`, {counts.get('republished_down', 0)} `re-published one rung down`, "
                    f"{counts.get('job_failed', 0)} `job failed`."]
            for x in oom.get("oom_lines", [])[:8]:
                out.append(f"   - out of memory: batch {x.get('batch')}, vae {x.get('vae')}, attempt {x.get('attempt')}: "
                           f"{str(x.get('detail', ''))[:140]}")
            for x in oom.get("degrading_lines", [])[:8]:
                out.append(f"   - degrading in place: batch {x.get('batch')}, vae {x.get('vae')}")
            for x in oom.get("republished_lines", [])[:8]:
                out.append(f"   - re-published: level {x.get('level')}, {x.get('width')}x{x.get('height')}, {x.get('steps')} steps")
            small = oom.get("small_jobs") or {}
            out += [f"3. Then 3 small jobs: {', '.join(f'{k} {v}' for k, v in small.items()) or 'not run'}.",
                    f"4. Same process (pid {oom.get('pid_before')} -> {oom.get('pid_after')}, alive "
                    f"{'yes' if oom.get('alive_after') else 'no'}): kept serving **{'yes' if oom.get('kept_serving') else 'no'}**.", ""]
            if oom.get("error"):
                out += [f"Error: {oom['error'][:400]}", ""]
    return out


def targets_md(rows: list[dict]) -> list[str]:
    """The issue's targets against the best fleet set of each kind."""
    def best(pred):
        cands = [r for r in rows if r["mode"] == "fleet" and r.get("images_per_s") and pred(r)]
        return max(cands, key=lambda r: r["images_per_s"]) if cands else None

    single = best(lambda r: r.get("batch") == 1 and (r.get("batch_jobs") or 1) == 1)
    batched = best(lambda r: (r.get("batch") or 1) > 1 or (r.get("batch_jobs") or 1) > 1)
    if not single and not batched:
        return []
    out = ["## Against the targets (best fleet set of each kind)", "", "| target | measured | verdict |", "| --- | --- | --- |"]

    def line(name, r, key, goal):
        if not r:
            return
        v = r.get(key)
        out.append(f"| {name} | {num(v, '.2f')} ({r['system']}; steady {num(r.get(key + '_steady') if key.startswith('x_') else r.get('images_per_s_steady'), '.2f')}) "
                   f"| {'met' if isinstance(v, (int, float)) and v >= goal else 'not met'} |")

    line("≥ 1.8x diffusers eager, single-image jobs", single, "x_eager", 1.8)
    line("≥ 1.3x diffusers compiled, single-image jobs", single, "x_compiled", 1.3)
    line("≥ 1.0 img/s, single-image jobs", single, "images_per_s", 1.0)
    line("≥ 1.3 img/s, batchable jobs", batched, "images_per_s", 1.3)
    warm = [r.get("warmup_s") for r in rows if r["mode"] == "fleet" and isinstance(r.get("warmup_s"), (int, float))]
    if warm:
        out.append(f"| warm-up < 30 s | {max(warm):.1f} s at most | {'met' if max(warm) < 30 else 'not met'} |")
    for key, what, target in (("busy_fraction", "over the set", 0.95), ("busy_backlog", "with backlog (issue 17)", 0.97)):
        busy_seen = [r.get(key) for r in rows if r["mode"] == "fleet" and isinstance(r.get(key), (int, float))]
        if busy_seen:
            best = max(busy_seen)
            out.append(f"| GPU busy {what} ≥ {target * 100:.0f} % | {best * 100:.0f}% at best | {'met' if best >= target else 'not met'} |")
    out.append("")
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
    diff = merge_diffusers(load(d / "diffusers.json"), load(d / "diffusers-eager.json"))
    speed, budget, unet = load(d / "fleet-speed.json"), load(d / "budget.json"), load(d / "unet.json")
    stages = []
    if (d / "stages.jsonl").exists():
        for line in (d / "stages.jsonl").read_text().splitlines():
            try:
                stages.append(json.loads(line))
            except ValueError:
                pass
    rows = diffusers_rows(diff) + fleet_rows(speed, load(d / "fleet.json"))
    add_ratios(rows)
    steps = (diff or {}).get("steps", 30)
    md = ["# GPU lease report (issue gpu-speed)", ""]
    md += images_md(rows, diff) if rows else ["No images/s figures (diffusers*.json, fleet-speed.json) found.", ""]
    md += targets_md(rows)
    md += fleet_runs_md(speed)
    md += budget_md(budget)
    small = load(d / "small.json")
    md += small_md(small)
    box = load(d / "box.json")
    md += box_md(box)
    md += storyboard_md(load(d / "storyboard.json"), load(d / "diffusers-storyboard.json"))
    md += unet_md(unet, steps)
    md += stages_md(stages)
    text = "\n".join(md) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"images": rows, "fleet_runs": (speed or {}).get("runs"), "budget": budget,
                                         "unet_best": (unet or {}).get("best"),
                                         "unet_stock_spread": (unet or {}).get("stock_spread"),
                                         "unet": (unet or {}).get("results"), "small": small, "box": box, "stages": stages}, indent=2) + "\n")


if __name__ == "__main__":
    main()
