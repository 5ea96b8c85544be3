"""A claim's wall time adds up over resumes and survives a kill: the running total is on disk every tick."""

from __future__ import annotations

import json
import time

from moga.experiments.reproduce.clock import FILE, ClaimClock


class Fake:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_killed_call_keeps_the_time_it_saved_and_the_next_call_adds_to_it(tmp_path):
    now = Fake()
    clock = ClaimClock(tmp_path, tick=3600, now=now)
    clock.__enter__()  # never left: the process is killed after its last tick
    now.t += 125.0
    clock.save()
    now.t += 40.0  # time after the last tick is lost with the process
    with ClaimClock(tmp_path, tick=3600, now=now) as again:
        assert again.earlier == 125.0
        now.t += 10.0
        assert again.elapsed() == 135.0
    assert json.loads((tmp_path / FILE).read_text()) == {"seconds": 135.0}
    clock._stop.set()


def test_an_outcome_from_before_the_clock_file_counts_and_the_larger_total_wins(tmp_path):
    (tmp_path / "outcome.json").write_text(json.dumps({"seconds": 600.0}))
    assert ClaimClock(tmp_path).earlier == 600.0
    (tmp_path / FILE).write_text(json.dumps({"seconds": 900.0}))  # a later call was killed after 300 s more
    assert ClaimClock(tmp_path).earlier == 900.0
    (tmp_path / FILE).write_text("{torn")
    assert ClaimClock(tmp_path).earlier == 600.0  # a torn file counts nothing; the outcome's time remains


def test_the_beat_writes_the_total_while_the_call_runs(tmp_path):
    now = Fake()
    with ClaimClock(tmp_path, tick=0.001, now=now):
        now.t += 7.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # waits on the file's content, not on a fixed sleep
            try:
                if json.loads((tmp_path / FILE).read_text())["seconds"] == 7.0:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.001)
        assert json.loads((tmp_path / FILE).read_text())["seconds"] == 7.0
