"""One writer per run directory: a second `moga train` (or `moga reproduce -o DIR`) refuses, naming the
first one's PID, or with --wait starts when it ends.

Real processes, ordered by state, never by sleeps: the first process is frozen (SIGSTOP) once its PID is in
the lock file, so it holds the lock for as long as the test needs; a waiter is released by killing it.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moga.filelock import DirectoryBusy, lock_holder
from moga.train import read_metrics, run
from moga.train.engine import LOCK

from .conftest import tiny

CONFIG = tiny(train={"steps": 20}, eval={"every": 0, "max_batches": 1}, checkpoint={"every": 2},
              logging={"log_every": 1})
MOGA = [sys.executable, "-m", "moga"]


def _env():
    src = str(Path(__import__("moga").__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def _until(condition, what: str, proc=None, limit: float = 120.0):
    """Poll state (a file's content, a line of output); the limit only turns a hang into a failure."""
    deadline = time.monotonic() + limit
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (rc {proc.returncode}) before {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def _holding(lock: Path, args: list[str]) -> subprocess.Popen:
    """A real moga process, frozen while it holds ``lock``."""
    proc = subprocess.Popen(MOGA + args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _until(lambda: lock_holder(lock) == proc.pid, f"PID {proc.pid} holds {lock}", proc)
    os.kill(proc.pid, signal.SIGSTOP)
    return proc


def _app():
    import typer

    from moga.experiments.reproduce.cli import reproduce_command
    from moga.train.cli import train

    app = typer.Typer(add_completion=False)
    app.command("train")(train)
    app.command("reproduce")(reproduce_command)
    return app


def test_a_second_train_refuses_then_waits(tmp_path):
    config, run_dir = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(CONFIG))
    first = _holding(run_dir / LOCK, ["train", str(config), "-q", "-o", str(run_dir)])
    try:
        with pytest.raises(DirectoryBusy, match=f"in use by another moga process \\(PID {first.pid}\\)"):
            run(CONFIG, run_dir, quiet=True)
        out = CliRunner().invoke(_app(), ["train", str(config), "-q", "-o", str(run_dir)])
        assert out.exit_code == 1 and f"PID {first.pid}" in out.output and "--wait" in out.output
        assert lock_holder(run_dir / LOCK) == first.pid  # the refused process changed nothing

        second = subprocess.Popen(MOGA + ["train", str(config), "-q", "--wait", "-o", str(run_dir)], env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = second.stderr.readline()  # blocks until the second process says it waits
        assert f"in use by PID {first.pid}" in line, line
        first.kill()  # kill -9 mid-run (perhaps mid-save): the OS drops its lock
        first.wait()
        stdout, stderr = second.communicate(timeout=300)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 0 and "status finished" in stdout, stderr[-2000:]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl", "train")]
    assert steps == list(range(1, CONFIG["train"]["steps"] + 1))  # one writer's records, in order
    assert json.loads((run_dir / "result.json").read_text())["steps"] == CONFIG["train"]["steps"]


def test_a_second_reproduce_refuses(tmp_path):
    from moga.experiments.reproduce.cli import LOCK as REPRODUCE_LOCK

    out = tmp_path / "joint"
    first = _holding(out / REPRODUCE_LOCK, ["reproduce", "joint", "--quick", "-q", "-o", str(out)])
    try:
        result = CliRunner().invoke(_app(), ["reproduce", "joint", "--quick", "-q", "-o", str(out)])
        assert result.exit_code == 1 and f"PID {first.pid}" in result.output, result.output
        assert lock_holder(out / REPRODUCE_LOCK) == first.pid
    finally:
        first.kill()
        first.wait()


def test_the_lock_does_not_outlive_the_run(tmp_path):
    """Sequential runs of one directory take the lock afresh; a config that cannot run leaves no directory."""
    from moga.filelock import writer_lock

    cfg = tiny(train={"steps": 4}, eval={"every": 0, "max_batches": 1})
    assert run(cfg, tmp_path / "run", stop_at=2, quiet=True)["status"] == "stopped"
    assert run(cfg, tmp_path / "run", quiet=True)["status"] == "finished"
    with writer_lock(tmp_path / "run" / LOCK):  # free: taken without waiting
        assert lock_holder(tmp_path / "run" / LOCK) == os.getpid()
    with pytest.raises(ValueError):
        run(tiny(eval={"split": "nope"}), tmp_path / "bad", quiet=True)
    assert not (tmp_path / "bad").exists()
