"""The wall time a reproduction has taken, summed over every call that worked on it, kills included.

A claim runs for hours and resumes after a kill -9 or in a later session; its outcome states the time it
took in all. The running total is written atomically to ``OUT/seconds.json`` every ``tick`` seconds, so a
kill loses at most one tick of the count instead of everything since the last finished call.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from moga.files import write_json

FILE = "seconds.json"


class ClaimClock:
    """``with ClaimClock(out) as clock: ...``; ``clock.elapsed()`` is the total so far, earlier calls included."""

    def __init__(self, out: Path, *, tick: float = 30.0, now=time.monotonic):
        self.path = Path(out) / FILE
        self.tick, self.now = tick, now
        self.earlier = max(_seconds(self.path), _seconds(Path(out) / "outcome.json"))  # outcome: a run made before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="moga-claim-clock", daemon=True)

    def __enter__(self) -> ClaimClock:
        self.started = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.save()

    def elapsed(self) -> float:
        return round(self.earlier + self.now() - self.started, 1)

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, {"seconds": self.elapsed()})
        except OSError:  # a full disk costs the count one tick, never the run
            pass

    def _beat(self) -> None:
        while not self._stop.wait(self.tick):
            self.save()


def _seconds(path: Path) -> float:
    try:
        return float(json.loads(path.read_text()).get("seconds", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):  # none yet, or unreadable: nothing counted
        return 0.0
