"""Job files (JSON Lines storyboards) for deploy/gpu/fleet.sh.

    python3 deploy/gpu/storyboards.py uniform FILE --run R --set S --jobs 16 --images 1 \
        --width 1024 --height 1024 --steps 30
    python3 deploy/gpu/storyboards.py mixed FILE --run R --jobs 200 --steps 4 [--scale 8]
        [--slice 0:500] [--classes xs,s,m --rest REST]
    python3 deploy/gpu/storyboards.py lora-board FILE --run R --set S --jobs 48 --characters a,b,c,d \
        --width 1024 --height 1024 --steps 8
    python3 deploy/gpu/storyboards.py storyboard FILE --run R --set S --jobs 60 --steps 30 [--scale 8]

uniform: one set of a timed run: the same size, steps and guidance for every job (so a worker
with batch_jobs > 1 may render them together), distinct seeds and prompts, all p0.
mixed: the budget stage's run under memory pressure: sizes from 512x512 to 1536x1536 (square and
not, multiples of 64), 1 to 4 images, priorities p0/p1/p2, drawn from a fixed seed so a rerun
submits the same jobs (and the first N of a longer draw are the N of a shorter one). --scale N
divides every side by N (the CPU dry run's tiny model: 8 gives 64..192 px). --slice A:B keeps jobs
A+1..B of the draw (their ids keep their numbers: halves of one run). --classes keeps the jobs of
those memory classes (schema/src/class.rs: one image's pixels) in FILE and writes the others to
REST. lora-board: the LoRA storyboard of issue 14 (point 5): --jobs shots over the --characters
(LoRA names, one each at weight 1), shot i of character i mod N; the first character's shots 0, 4,
8, 12 are p0 anchors, the last one's shots 3, 7, 11, 15 p2 backfill, the rest p1; in the file in a
fixed shuffle (stride 7) where neighbours differ in character. Prints one line: jobs, images, and
the size, priority and class counts (and REST's). storyboard: issue 17's mixed storyboard, --jobs
single-image shots over SDXL's usual sizes (STORYBOARD_SIZES), as many of each, interleaved in a
fixed shuffle as a storyboard's shots change framing, all p1; onnx/bench_storyboard.py renders the
same shots (storyboard_shots) through diffusers.
Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import json
import random

PROMPTS = [
    "a lighthouse on a cliff at dawn, ink wash",
    "a fox in a snowy forest, soft light",
    "a market street in the rain at night, neon",
    "an old sailing ship in a storm, oil painting",
    "a cat asleep on a windowsill, afternoon sun",
    "a desert canyon at sunset, wide shot",
    "a glass greenhouse full of ferns, morning fog",
    "a robot reading in a library, warm lamp light",
]

# The mixed run's sizes (width, height) with their weights: most jobs small to medium, as a
# storyboard's are, with enough large ones to press the budget.
MIXED_SIZES = [
    ((512, 512), 4), ((640, 768), 3), ((768, 768), 3), ((1024, 1024), 4),
    ((1152, 896), 2), ((896, 1152), 2), ((1280, 1280), 1), ((1536, 1536), 1),
]
MIXED_IMAGES = [(1, 4), (2, 3), (3, 2), (4, 2)]
MIXED_PRIORITIES = [("p0", 2), ("p1", 2), ("p2", 1)]

# SDXL's usual sizes (its training buckets near one megapixel), for the mixed storyboard.
STORYBOARD_SIZES = [(1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216)]
STORYBOARD_SEED = 20261202

# A memory class's largest one-image pixel count, smallest first (schema/src/class.rs); xl above.
CLASS_MAX_PIXELS = [("xs", 512 * 512), ("s", 768 * 768), ("m", 1024 * 1024), ("l", 1536 * 1536)]


def memory_class(width: int, height: int) -> str:
    return next((name for name, most in CLASS_MAX_PIXELS if width * height <= most), "xl")


def job(run: str, set_name: str, i: int, width: int, height: int, steps: int, images: int, priority: str,
        seed: int) -> dict:
    return {
        "job_id": f"{run}-{set_name}-{i:03d}", "project": "fleet", "shot_id": f"{set_name}{i:03d}",
        "priority": priority, "prompt": f"{PROMPTS[i % len(PROMPTS)]}, take {i}",
        "width": width, "height": height, "steps": steps, "guidance": 5.0, "seed": seed, "images": images,
    }


def lora_board(args) -> list[dict]:
    names = [c for c in args.characters.split(",") if c]
    priorities = {0: "p0", 4: "p0", 8: "p0", 12: "p0", 3: "p2", 7: "p2", 11: "p2", 15: "p2"}
    shots = []
    for i in range(args.jobs):
        shot = job(args.run, args.set, i, args.width, args.height, args.steps, 1, priorities.get(i, "p1"), 3000 + i)
        shot["loras"] = [{"name": names[i % len(names)], "weight": 1.0}]
        shots.append(shot)
    stride = 7 if args.jobs % 7 else 5
    return [shots[(k * stride) % args.jobs] for k in range(args.jobs)]


def uniform(args) -> list[dict]:
    return [job(args.run, args.set, i, args.width, args.height, args.steps, args.images, "p0", 1000 + i)
            for i in range(1, args.jobs + 1)]


def pick(rng: random.Random, weighted: list) -> object:
    return rng.choices([v for v, _ in weighted], weights=[w for _, w in weighted])[0]


def storyboard_shots(n: int, seed: int = STORYBOARD_SEED) -> list[tuple[int, int, int]]:
    """n shots as (width, height, seed): the sizes in turn, as many of each (n / 5, the first
    sizes one more where n does not divide), shuffled with a fixed seed."""
    rng = random.Random(seed)
    sizes = [STORYBOARD_SIZES[i % len(STORYBOARD_SIZES)] for i in range(n)]
    rng.shuffle(sizes)
    return [(w, h, 5000 + i) for i, (w, h) in enumerate(sizes)]


def firsts_of_sizes(sizes: list[str]) -> tuple[dict[str, int], int]:
    """For images in the order they were done, each size's first (its index), and the index of
    the last such first: the images after it are the steady state, every size already seen."""
    first: dict[str, int] = {}
    for k, size in enumerate(sizes):
        first.setdefault(size, k)
    return first, max(first.values(), default=0)


def storyboard(args) -> list[dict]:
    # Scaled down (the CPU dry run's tiny model), a side stays a multiple of 16, what that
    # model's UNet needs (SDXL's sizes are multiples of 32 and divide by 8 evenly).
    side = lambda v: v if args.scale == 1 else max(16, round(v / args.scale / 16) * 16)  # noqa: E731
    return [job(args.run, args.set, i, side(w), side(h), args.steps, 1, "p1", seed)
            for i, (w, h, seed) in enumerate(storyboard_shots(args.jobs))]


def mixed(args) -> list[dict]:
    rng = random.Random(args.seed)
    jobs = []
    for i in range(1, args.jobs + 1):
        width, height = pick(rng, MIXED_SIZES)
        jobs.append(job(args.run, args.set, i, width // args.scale, height // args.scale, args.steps,
                        pick(rng, MIXED_IMAGES), pick(rng, MIXED_PRIORITIES), rng.randrange(1, 2**31)))
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("uniform", "mixed", "lora-board", "storyboard"))
    ap.add_argument("file")
    ap.add_argument("--run", required=True, help="prefix of the job ids (unique per submission)")
    ap.add_argument("--set", default="a", help="set name, part of the job and shot ids")
    ap.add_argument("--jobs", type=int, required=True)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--scale", type=int, default=1, help="mixed: divide every side by this")
    ap.add_argument("--seed", type=int, default=20261130, help="mixed: the draw's seed")
    ap.add_argument("--slice", default=None, help="A:B keeps jobs A+1..B of the draw")
    ap.add_argument("--classes", default=None, help="keep only these memory classes (comma separated) in FILE")
    ap.add_argument("--rest", default=None, help="with --classes: where the other jobs go")
    ap.add_argument("--characters", default="char-1,char-2,char-3,char-4", help="lora-board: the LoRA names")
    args = ap.parse_args()
    jobs = {"uniform": uniform, "mixed": mixed, "lora-board": lora_board, "storyboard": storyboard}[args.kind](args)
    if args.slice:
        start, _, end = args.slice.partition(":")
        jobs = jobs[int(start or 0):int(end) if end else None]
    rest = []
    if args.classes is not None:
        keep = {c.strip() for c in args.classes.split(",") if c.strip()}
        rest = [j for j in jobs if memory_class(j["width"], j["height"]) not in keep]
        jobs = [j for j in jobs if memory_class(j["width"], j["height"]) in keep]
    write(args.file, jobs)
    line = counts(jobs)
    if args.rest:
        write(args.rest, rest)
        line["rest"] = counts(rest)
    print(json.dumps(line))


def write(path: str, jobs: list[dict]) -> None:
    with open(path, "w") as f:
        for j in jobs:
            f.write(json.dumps(j) + "\n")


def counts(jobs: list[dict]) -> dict:
    sizes = collections.Counter(f"{j['width']}x{j['height']}" for j in jobs)
    prios = collections.Counter(j["priority"] for j in jobs)
    classes = collections.Counter(memory_class(j["width"], j["height"]) for j in jobs)
    return {"jobs": len(jobs), "images": sum(j["images"] for j in jobs), "sizes": dict(sorted(sizes.items())),
            "priorities": dict(sorted(prios.items())), "classes": dict(sorted(classes.items()))}


if __name__ == "__main__":
    main()
