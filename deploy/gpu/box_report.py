"""report.py's section for box.json (deploy/gpu/fleet-box.sh, issue 18: one supervised worker per
GPU on two cards): the tables that go to deploy/gpu/RESULTS.md as they are. Standard library only.
"""

from __future__ import annotations

import json

from small_report import _num

GPUS = ("gpu0", "gpu1")


def _pct(v) -> str:
    return f"{v * 100:.0f}%" if isinstance(v, (int, float)) else "-"


def _busy(run: dict) -> str:
    busy = run.get("busy") or {}
    return " / ".join(_pct((busy.get(gpu) or {}).get("busy_fraction")) for gpu in GPUS)


def _per_gpu(run: dict, key: str) -> str:
    per = run.get("per_gpu") or {}
    return " / ".join(str((per.get(gpu) or {}).get(key, "-")) for gpu in GPUS) if per else "-"


def _restarts(run: dict) -> str:
    restarts = run.get("restarts") or {}
    return " / ".join(str((restarts.get(gpu) or {}).get("restarts", "-")) for gpu in GPUS) if restarts else "-"


def speed_md(speed: dict) -> list[str]:
    one, two = speed.get("one") or {}, speed.get("two") or {}
    out = ["### Two cards, one worker each (`shotfleet-consumer --gpus all`), against one worker on one card", "",
           "| run | status | jobs x images | images/s | steady | wall s | jobs per card (gpu0 / gpu1) | busy (gpu0 / gpu1) "
           "| restarts | warm-up s (first / both) |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for name, run in (("one worker on GPU 0", one), (f"box, `--gpus {two.get('gpus') or 'all'}`", two)):
        if run.get("status") in ("skipped", "not run"):
            out.append(f"| {name} | {run.get('status')}: {run.get('note') or ''} | | | | | | | | |")
            continue
        jobs = _per_gpu(run, "job_done") if run.get("per_gpu") else str((run.get("tally") or {}).get("done", "-")) + " / -"
        out.append(f"| {name} | {run.get('status')} | {_num(run.get('jobs'), 'd')} x 1 | {_num(run.get('images_per_s'), '.3f')} "
                   f"| {_num(run.get('images_per_s_steady'), '.3f')} | {_num(run.get('wall_s'), '.1f')} | {jobs} | {_busy(run)} "
                   f"| {_restarts(run)} | {_num(run.get('warmup_s'), '.1f')} / {_num(run.get('warmup_both_s'), '.1f')} |")
    ratio, steady = speed.get("ratio"), speed.get("ratio_steady")
    verdict = "not measured" if speed.get("meets_target") is None else ("**met**" if speed["meets_target"] else "**not met**")
    out += ["", f"Two workers: **{_num(ratio, '.2f')}x** one worker's images/s (steady {_num(steady, '.2f')}x); "
                f"target ≥ {speed.get('target')}x: {verdict}.", ""]
    for name, run in (("one", one), ("two", two)):
        if run.get("error"):
            out += [f"{name}: {str(run['error'])[:500]}", ""]
    return out


def mixed_md(mixed: dict) -> list[str]:
    if mixed.get("status") in ("skipped", "not run"):
        return ["### The box under memory pressure: " + str(mixed.get("status")), "", str(mixed.get("note") or ""), ""]
    hogs = mixed.get("hogs") or {}

    def hog(gpu):
        h = hogs.get(gpu) or {}
        if h.get("held_mib"):
            return f"{gpu} {h['held_mib']} MiB held, {h.get('free_after_mib')} MiB free"
        return f"{gpu} none: {(mixed.get('hog_errors') or {}).get(gpu) or h.get('error') or 'not started'}"[:160]

    tally = mixed.get("tally") or {}
    zero = mixed.get("zero_admission_ooms")
    out = ["### The box under memory pressure on both cards: the mixed storyboard", "",
           "| what | value |", "| --- | --- |",
           f"| other tenant | {'; '.join(hog(g) for g in GPUS) if any(hogs.values()) or mixed.get('hog_errors') else 'simulated: ' + str(mixed.get('simulated_others_used_mib')) + ' MiB per card'} |",
           f"| jobs | {_num(mixed.get('jobs'), 'd')}: {tally.get('done', '-')} done, {tally.get('degraded', '-')} degraded, "
           f"{tally.get('failed', '-')} failed |",
           f"| rendered per card (gpu0 / gpu1) | {_per_gpu(mixed, 'job_done')} |",
           f"| admission OOMs (gpu0 / gpu1) | **{_per_gpu(mixed, 'oom')}**: "
           f"{'zero on both' if zero else ('not zero' if zero is False else 'nothing rendered')} |",
           f"| given back for no room | {_per_gpu(mixed, 'no_room')} |",
           f"| in place / re-published / failed | {_per_gpu(mixed, 'degrading_in_place')}; {_per_gpu(mixed, 'republished_down')}; "
           f"{_per_gpu(mixed, 'job_failed')} |",
           f"| busy (gpu0 / gpu1) | {_busy(mixed)} |",
           f"| restarts (gpu0 / gpu1) | {_restarts(mixed)} |",
           f"| images/s | {_num(mixed.get('images_per_s'), '.3f')} ({_num(mixed.get('wall_s'), '.1f')} s) |", ""]
    if mixed.get("error"):
        out += [f"Error: {str(mixed['error'])[:500]}", ""]
    if mixed.get("warnings"):
        out += ["Warnings: " + json.dumps(mixed["warnings"][:4])[:800], ""]
    return out


def box_md(doc: dict | None) -> list[str]:
    if not doc:
        return []
    out = ["## One worker per GPU (issue 18)", ""]
    if doc.get("speed"):
        out += speed_md(doc["speed"])
    if doc.get("mixed"):
        out += mixed_md(doc["mixed"])
    if doc.get("error"):
        out += [f"Stage error: {doc['error']}", ""]
    return out
