"""When a background helper of the lease should end: on SIGTERM/SIGINT, or once its parent is gone.

The hog (hog.py), the stage's memory sampler (vram_sampler.py) and gpu_sampler.py's command mode
run in the background of fleet.sh and are stopped with a signal. Each also ends by itself when
fleet.sh is gone, so a stage that dies cannot leave the card full or a call held open: on the
2026-11-30 lease an orphaned sampler kept lease.sh's pipe open until the call's 600 s limit.

    stopper = Stopper(parent=pid)      # installs the signal handlers
    while stopper.running():
        ...; time.sleep(0.2)
"""

from __future__ import annotations

import os
import signal


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


class Stopper:
    def __init__(self, parent: int | None = None):
        self.parent = parent
        self.stopped = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    def _stop(self, *_) -> None:
        self.stopped = True

    def running(self) -> bool:
        return not self.stopped and (self.parent is None or alive(self.parent))
