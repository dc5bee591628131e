"""Summarises fleet.sh's `see` run (issue 16) into see-the-work.json and prints it.

    python3 deploy/gpu/see_summary.py RUN_DIR OUT.json

From the run's meta.txt (when the cancel was sent and answered), the worker's JSON log (when the
render of the cancelled job stopped), `status --watch` frames (the steps seen), `submit --wait`'s
output (its progress lines and final table), `shotfleet cancel`'s answer and /metrics.
"""

import json
import os
import re
import sys
from datetime import datetime


def main(run: str, out: str) -> None:
    meta: dict[str, str] = {}
    for line in open(os.path.join(run, "meta.txt")):
        key, _, value = line.rstrip("\n").partition("=")
        meta.setdefault(key, value)

    def read(name: str) -> str:
        try:
            return open(os.path.join(run, name), errors="replace").read()
        except OSError:
            return ""

    begin = float(meta.get("cancel_begin", "nan"))
    stopped = None
    for line in read("worker.log").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        fields = rec.get("fields", {})
        if fields.get("message", "").startswith("cancelled: its work stopped") and fields.get("rendering"):
            stopped = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
    watch = read("status-watch.txt")
    steps = [int(m) for m in re.findall(r"see/see-long step (\d+)/", watch)]
    submit = read("submit-see.txt")
    summary = {
        "cancel_answered_s": round(float(meta.get("cancel_answered", "nan")) - begin, 3),
        "render_stopped_s": round(stopped - begin, 3) if stopped else None,
        "last_step_seen": max(steps) if steps else None,
        "cancel_rc": meta.get("cancel_rc"),
        "submit_rc": meta.get("submit_rc", "0"),
        "cancel": read("cancel.txt").strip().splitlines(),
        "submit_table": [l for l in submit.splitlines() if re.match(r"(see-\S+ +\S+ +p1|\d+ done)", l)],
        "progress_lines": len(re.findall(r"^see-\S+: (step|taken)", submit, re.M)),
        "waiting_lines": len(re.findall(r"waiting in the queue", submit)),
        "watch_frames": watch.count("consumer "),
        "metrics": sorted({l.split("{")[0].split(" ")[0] for l in read("metrics-full.txt").splitlines() if l.startswith("shotfleet_")}),
        "error": meta.get("error"),
    }
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "metrics"}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
