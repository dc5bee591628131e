"""Publishes shot jobs the way a Python producer would: nats-py, JSON and MessagePack.

Used by tests/e2e/any_language.rs: it proves a producer in another language needs nothing
from shotfleet but the contract (schema/json/shot-job.schema.json) and the subject names.

    python publish_jobs.py nats://127.0.0.1:4222
"""

import asyncio
import json
import sys

import msgpack
import nats


def memory_class(width: int, height: int) -> str:
    """The same thresholds as schema/src/class.rs: one image's pixel count."""
    pixels = width * height
    for name, limit in (("xs", 512 * 512), ("s", 768 * 768), ("m", 1024 * 1024), ("l", 1536 * 1536)):
        if pixels <= limit:
            return name
    return "xl"


def job(job_id: str, width: int, height: int, **extra) -> dict:
    return {
        "v": 1,
        "job_id": job_id,
        "project": "pyshop",
        "shot_id": "s1",
        "prompt": "a paper boat on a puddle, 水彩",
        "width": width,
        "height": height,
        "steps": 20,
        "guidance": 5.5,
        "seed": 7,
        **extra,
    }


async def main(url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    sent = []

    # JSON to the computed class subject.
    j = job("py-json-1", 1024, 1024, images=2, loras=[{"name": "watercolor.v1", "weight": 0.7}])
    subject = f"shots.p1.{memory_class(1024, 1024)}.pyshop"
    await js.publish(subject, json.dumps(j).encode(), headers={"Nats-Msg-Id": f"{j['project']}/{j['job_id']}", "Content-Type": "application/json"})
    sent.append((subject, j["job_id"]))

    # MessagePack (named fields) to the class subject, with an unknown field a newer producer might add.
    j = job("py-msgpack-1", 512, 768, negative_prompt="blurry", future_field={"x": 1})
    subject = f"shots.p0.{memory_class(512, 768)}.pyshop"
    await js.publish(subject, msgpack.packb(j), headers={"Nats-Msg-Id": f"{j['project']}/{j['job_id']}", "Content-Type": "application/msgpack"})
    sent.append((subject, j["job_id"]))

    # A client that does not compute the class: `auto`, no Content-Type header (JSON).
    j = job("py-auto-1", 1536, 640, floor={"min_side": 512, "min_steps": 10})
    subject = "shots.p2.auto.pyshop"
    await js.publish(subject, json.dumps(j).encode(), headers={"Nats-Msg-Id": f"{j['project']}/{j['job_id']}"})
    sent.append((subject, j["job_id"]))

    # MessagePack to auto.
    j = job("py-auto-2", 768, 768)
    subject = "shots.p1.auto.pyshop"
    await js.publish(subject, msgpack.packb(j), headers={"Nats-Msg-Id": f"{j['project']}/{j['job_id']}", "Content-Type": "application/msgpack"})
    sent.append((subject, j["job_id"]))

    await nc.close()
    print(json.dumps(sent))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
