"""Follows one job's progress the way a Python client would: nats-py, plain subscriptions.

Used by tests/e2e/progress.rs. The part between the `README` markers is the README's snippet,
word for word (the test checks it): it prints each event until the worker lets go of the job.

    python follow_progress.py nats://127.0.0.1:4222 PROJECT JOB_ID
"""

import asyncio
import json
import sys

import nats


async def main(url: str, project: str, job_id: str) -> None:
    # README: begin
    nc = await nats.connect(url)
    settled = asyncio.Event()

    async def on_progress(msg):
        event = json.loads(msg.data)  # schema/json/shot-progress.schema.json
        print(event["event"], event["worker"], f'step {event["step"]}/{event["steps"]}',
              f'images {event["images_done"]}/{event["images"]}', flush=True)
        if event["event"] == "settled":  # the outcome is on shots.done.<project>.<job_id>
            settled.set()

    await nc.subscribe(f"shots.progress.{project}.{job_id}", cb=on_progress)
    # README: end
    await nc.flush()
    print("ready", flush=True)
    await asyncio.wait_for(settled.wait(), timeout=120)
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
