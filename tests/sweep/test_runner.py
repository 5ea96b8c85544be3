"""Real sweeps end to end: workers, SIGKILL and restart, concurrent processes, divergence, Ray."""

import json
import math
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from moga.sweep.executor import run_sweep
from moga.sweep.results import records
from moga.sweep.owners import owner_is_dead
from moga.sweep.spec import Sweep
from moga.sweep.store import SweepStore

BASE = {
    "seed": 0,
    "model": {"name": "residual_mlp", "width": 16},
    "data": {"name": "digits"},
    "optim": {"name": "moga", "lr": 0.1},
    "schedule": {"name": "cosine", "warmup_fraction": 0.1},
    "train": {"steps": 12, "batch_size": 32},
    "eval": {"every": 0, "train_eval": False},
    "checkpoint": {"every": 3},
    "logging": {"progress": False},
}
AXES = {
    "optim.name": ["moga", "adamw"],
    "model.depth": [1, 3],
    "optim.lr": {"by": "optim.name", "values": {"moga": [0.05, 0.1], "adamw": [0.003, 0.01]}},
}


def write_sweep(tmp_path: Path, axes=AXES, **extra) -> Path:
    path = tmp_path / "sweep.yaml"
    # in the order given, as a hand-written config has it (the store keeps its copy with sorted keys)
    path.write_text(yaml.safe_dump({"base": BASE, "axes": axes, "scale_key": "model.depth", **extra}, sort_keys=False))
    return path


def finish_events(store: SweepStore) -> Counter:
    return Counter(e["cell"] for e in store.events() if e["event"] in ("finished", "diverged", "skipped"))


def final_losses(store: SweepStore) -> dict:
    return {c["id"]: (c["status"], c["result"]["final_train_loss"], c["result"]["val_loss"]) for c in store.cells()}


def test_a_cells_losses_do_not_depend_on_the_number_of_workers(tmp_path):
    """Every cell runs with the sweep's own thread count, whatever the workers; it is recorded in the cell."""
    axes = {"optim.name": ["moga"], "model.depth": [2], "optim.lr": [0.05, 0.1]}
    path = write_sweep(tmp_path, axes=axes)
    stores = {}
    for workers in (1, 2):
        run_sweep(Sweep.from_file(path), tmp_path / f"w{workers}", workers=workers, progress=False)
        stores[workers] = SweepStore(tmp_path / f"w{workers}")
    assert final_losses(stores[1]) == final_losses(stores[2])
    assert {c["result"]["threads"] for s in stores.values() for c in s.cells()} == {1}
    (tmp_path / "two").mkdir()
    two = write_sweep(tmp_path / "two", axes={**axes, "optim.lr": [0.05]}, threads=2)
    run_sweep(Sweep.from_file(two), tmp_path / "t2", workers=1, progress=False)
    assert {c["result"]["threads"] for c in SweepStore(tmp_path / "t2").cells()} == {2}


def _default_sigint() -> None:
    # A test run started in the background (nohup, `cmd &` in a script) inherits SIGINT ignored, and
    # Python then never raises KeyboardInterrupt: give the sweep a terminal's default, as a user has it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def moga_sweep(config: Path, out: Path, *extra: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moga", "sweep", str(config), "--out", str(out), "--quiet", *extra]
    return subprocess.Popen(cmd, start_new_session=True, stdout=stdout, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint)


def test_tiny_sweep_end_to_end(tmp_path):
    sweep = Sweep.from_file(write_sweep(tmp_path))
    counts = run_sweep(sweep, tmp_path / "out", workers=2, progress=False)
    assert counts["finished"] == len(sweep.cells) == 8
    store = SweepStore(tmp_path / "out")
    assert set(finish_events(store).values()) == {1}
    rows = records(store)
    assert len(rows) == 8 and all(math.isfinite(r["train_loss"]) for r in rows)
    for cell in store.cells():  # the store and the run directory agree
        on_disk = yaml.safe_load((store.cell_dir(cell["id"]) / "result.json").read_text())
        assert on_disk["final_train_loss"] == cell["result"]["final_train_loss"]
    # Running it again does nothing: every cell is settled.
    before = len(store.events())
    assert run_sweep(sweep, tmp_path / "out", workers=1, progress=False)["finished"] == 8
    assert len(store.events()) == before

    from moga.sweep.report import write_report

    paths = write_report(rows, tmp_path / "report", scale_key="model.depth", formats=("png",))
    assert (tmp_path / "report" / "report.html").is_file() and paths


def test_extending_the_grid_keeps_finished_cells_and_runs_only_new_ones(tmp_path):
    out = tmp_path / "out"
    small = {"optim.name": ["moga"], "model.depth": [1], "optim.lr": [0.05, 0.1]}
    run_sweep(Sweep.from_file(write_sweep(tmp_path, axes=small)), out, progress=False)
    store = SweepStore(out)
    before = final_losses(store)
    # more lr values and a new scale, minus one excluded cell
    wider = {"optim.name": ["moga"], "model.depth": [1, 3], "optim.lr": [0.025, 0.05, 0.1]}
    sweep = Sweep.from_file(write_sweep(tmp_path, axes=wider, exclude=[{"model.depth": 3, "optim.lr": 0.025}]))
    counts = run_sweep(sweep, out, progress=False)
    assert counts["finished"] == 2 + 3 and len(sweep.cells) == 5
    after = final_losses(store)
    assert {k: after[k] for k in before} == before  # the finished cells are untouched
    assert set(finish_events(store).values()) == {1}  # and none ran twice
    claimed = Counter(e["cell"] for e in store.events() if e["event"] == "claim")
    assert all(claimed[k] == 1 for k in after)
    assert any(e["event"].startswith("extend +3") for e in store.events())
    # narrowing the grid again keeps the finished cells in the store, out of the records
    run_sweep(Sweep.from_file(write_sweep(tmp_path, axes=small)), out, progress=False)
    assert len(store.cells()) == 5 and len(records(store)) == 2


def test_a_killed_runs_claim_outside_a_narrower_grid_waits_for_the_grid_to_take_it_back(tmp_path):
    """A staged sweep (reproduce gap-width) resumes at its first, narrowest stage: the cell a killed run held at a
    later stage is dropped there, not refused as damage, and resumes from its run directory when its stage comes."""
    out = tmp_path / "out"
    small = {"optim.name": ["moga"], "model.depth": [1], "optim.lr": [0.05]}
    wider = {"optim.name": ["moga"], "model.depth": [1, 3], "optim.lr": [0.05]}
    run_sweep(Sweep.from_file(write_sweep(tmp_path, axes=small)), out, progress=False)
    wide = Sweep.from_file(write_sweep(tmp_path, axes=wider))
    store = SweepStore(out)
    store.create_or_check(wide)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = f"{socket.gethostname()}:{dead.stdout.strip()}:killed"
    claim = store.claim(owner, timeout=3600)
    assert claim["params"]["model.depth"] == 3 and owner_is_dead(owner)
    narrow = Sweep.from_file(write_sweep(tmp_path, axes=small))
    assert store.create_or_check(narrow)["dropped"] == 1 and claim["id"] not in {c["id"] for c in store.cells()}
    # a store an earlier moga left with the narrow grid recorded and the claim still in it: dropped the same way
    with sqlite3.connect(store.path) as con:
        con.execute("INSERT INTO cells (id, idx, params, status, owner, claims, updated) VALUES (?, 99, ?, "
                    "'running', ?, 1, 0)", (claim["id"], json.dumps(claim["params"]), owner))
    assert store.create_or_check(narrow)["dropped"] == 1 and claim["id"] not in {c["id"] for c in store.cells()}
    counts = run_sweep(wide, out, progress=False)
    assert counts["finished"] == 2 and {c["id"]: c["status"] for c in store.cells()}[claim["id"]] == "finished"


def test_a_different_base_config_is_refused(tmp_path):
    run_sweep(Sweep.from_file(write_sweep(tmp_path, axes={**AXES, "model.depth": [1]})), tmp_path / "out", progress=False)
    path = tmp_path / "sweep.yaml"
    changed = {**BASE, "train": {"steps": 13, "batch_size": 32}}
    path.write_text(yaml.safe_dump({"base": changed, "axes": AXES, "scale_key": "model.depth"}))
    with pytest.raises(ValueError, match="different sweep .its base config changed: train.steps"):
        run_sweep(Sweep.from_file(path), tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="its axes changed"):  # a new axis changes what every cell means
        run_sweep(Sweep.from_file(write_sweep(tmp_path, axes={**AXES, "model.width": [16]})), tmp_path / "out",
                  progress=False)
    assert len(SweepStore(tmp_path / "out").cells()) == 4  # refused before anything was written


def _processes_mentioning(text: str) -> list[int]:
    """Live processes other than this one whose command line holds ``text`` (a sweep's directory, which lies
    under pytest's tmp_path: its name holds "pytest", so that word cannot tell this process from the workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def _live_progress(store: SweepStore) -> dict[str, int]:
    """Cells running under a live owner -> the last step in their metrics.jsonl; {} while the store is new."""
    try:
        cells = store.cells()
    except Exception:  # the store is still being created by the sweep under test
        return {}
    progress = {}
    for cell in cells:
        if cell["status"] != "running" or owner_is_dead(cell["owner"]):
            continue  # a stale claim of an earlier round: nobody is training it
        path = store.cell_dir(cell["id"]) / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        progress[cell["id"]] = max((json.loads(x)["step"] for x in lines if x.endswith("}")), default=0)
    return progress


# A model of the user's (``model.name: held_mlp:HeldMLP``): the depth paper's MLP, which holds a cell's training
# once its run has taken more steps than the gate file says, until the gate goes. The test then kills a sweep
# that is certainly mid-cell, wherever the cell's run had got to, instead of racing it to a step.
HELD_MLP = """
import os, time
from pathlib import Path
from moga.models import ResidualMLP

GATE = Path(__file__).with_name("gate")


class HeldMLP(ResidualMLP):
    steps_taken = 0

    def forward(self, x):
        if self.training:
            self.steps_taken += 1
            if GATE.is_file() and self.steps_taken > int(GATE.read_text()):
                (GATE.parent / f"held-{os.getpid()}").touch()
                while GATE.is_file():
                    time.sleep(0.01)
        return super().forward(x)
"""


@pytest.fixture
def held_model(tmp_path, monkeypatch) -> Path:
    """``held_mlp:HeldMLP`` importable here and in the sweeps this test starts; returns its gate's path."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "held_mlp.py").write_text(HELD_MLP)
    monkeypatch.syspath_prepend(str(models))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(models), os.environ.get("PYTHONPATH")])))
    return models / "gate"


def kill_held_cell(proc: subprocess.Popen, gate: Path, after_steps: int, whole_group: bool) -> None:
    """SIGKILL the sweep once one of its cells has taken ``after_steps`` steps in this run and holds there.

    A cell not yet started in any round takes more steps than that, so each round lands mid-cell as long as
    one such cell is left: a round interrupts at most the two cells its workers run and finishes only cells
    an earlier round interrupted.
    """
    for held in gate.parent.glob("held-*"):
        held.unlink()
    tmp = gate.with_suffix(".tmp")
    tmp.write_text(str(after_steps))
    tmp.replace(gate)  # a reader sees the whole number or no gate
    while not any(gate.parent.glob("held-*")):
        assert proc.poll() is None, "the sweep ended before a cell reached the gate"
        time.sleep(0.05)
    if whole_group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGKILL)  # only the parent: its workers, held or not, must notice and stop
    proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(900)  # a safety net only: under load this waits for cells to reach their gates
def test_sigkill_at_random_points_then_restart_equals_an_uninterrupted_sweep(tmp_path, held_model):
    # Cells long enough to be killed mid-run (40 steps, checkpoints every 3, a metrics record every step).
    gate = held_model
    slow = {**BASE, "model": {**BASE["model"], "name": "held_mlp:HeldMLP"}, "train": {"steps": 40, "batch_size": 32},
            "logging": {"progress": False, "log_every": 1}}
    axes = {**AXES, "optim.lr": {"by": "optim.name", "values": {"moga": [0.1], "adamw": [0.01]}}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": slow, "axes": axes, "scale_key": "model.depth"}))
    reference = SweepStore(tmp_path / "reference")
    # As many workers as below: the same threads per worker, so the same floating-point reductions.
    run_sweep(Sweep.from_file(path), reference.dir, workers=2, progress=False)  # no gate: nothing holds

    out = tmp_path / "chaos"
    store = SweepStore(out)
    rng = random.Random(7)  # random only in where inside a cell's run each kill lands
    stale = set()  # (cell, owner) of every claim a kill left behind
    for round_ in range(4):
        proc = moga_sweep(path, out, "--workers", "2")
        kill_held_cell(proc, gate, after_steps=rng.randint(0, 30), whole_group=round_ != 3)
        deadline = time.time() + 15
        while _processes_mentioning(str(out)) and time.time() < deadline:
            time.sleep(0.2)
        assert not _processes_mentioning(str(out)), "workers outlived their killed parent"
        gate.unlink()
        stale |= {(c["id"], c["owner"]) for c in store.cells() if c["status"] == "running"}
    assert stale  # the first kill certainly interrupted a cell (no claim of an earlier round could look live)

    final = moga_sweep(path, out, "--workers", "2")
    assert final.wait(timeout=300) == 0, final.stderr.read().decode()
    assert finish_events(store) == Counter({c["id"]: 1 for c in store.cells()})  # each cell finished exactly once
    assert final_losses(store) == final_losses(reference)  # bit for bit, resumed or not
    retaken = {e["cell"] for e in store.events() if e["event"] == "retake"}
    assert {cell for cell, _ in stale} <= retaken  # every interrupted cell was taken over, and resumed


def test_a_running_sweep_extended_by_another_process_runs_the_new_cells(tmp_path, held_model):
    """`moga sweep` with an extended config beside a sweep still running: the running sweep's workers, which read
    the config before it grew, train the new cells they claim instead of refusing them as foreign."""
    gate = held_model
    base = {**BASE, "model": {**BASE["model"], "name": "held_mlp:HeldMLP"}, "train": {"steps": 4, "batch_size": 32}}
    config = lambda depths: {"base": base, "axes": {"optim.lr": [0.1], "model.depth": depths},  # noqa: E731
                             "scale_key": "model.depth"}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(config([1])))
    out = tmp_path / "out"
    gate.write_text("0")  # the first cell holds at its first step, with its worker's config read
    proc = moga_sweep(tmp_path / "a.yaml", out, "--workers", "1")
    while not any(gate.parent.glob("held-*")):
        assert proc.poll() is None, "the sweep ended before its cell reached the gate"
        time.sleep(0.05)
    store = SweepStore(out)
    assert store.create_or_check(Sweep.from_dict(config([1, 2, 3]))) == {"added": 2, "dropped": 0}  # as its run does
    gate.unlink()
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    assert [c["status"] for c in store.cells()] == ["finished"] * 3, [c.get("error") for c in store.cells()]
    assert len({c["owner"] for c in store.cells()}) == 1  # all three by the first sweep's one worker


def sweep_in_python(config: Path, out: Path, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """A program of the user's that calls ``run_sweep`` (as ``moga reproduce``, ``moga demo`` and ``moga tune``
    do), with the default SIGTERM handler."""
    code = ("import sys; from moga.sweep.executor import run_sweep; from moga.sweep.spec import Sweep; "
            "run_sweep(Sweep.from_file(sys.argv[1]), sys.argv[2], workers=1, progress=False)")
    return subprocess.Popen([sys.executable, "-c", code, str(config), str(out)], start_new_session=True,
                            stdout=stdout, stderr=subprocess.PIPE, preexec_fn=_default_sigint)


@contextmanager
def endless_sweep(tmp_path: Path, stdout=subprocess.DEVNULL, launch=moga_sweep):
    """`moga sweep` (its own process group; or ``launch``'s program) of one cell that trains until stopped,
    yielded once the cell has trained a step: (the process, its store). A process left running when the block
    ends is killed."""
    endless = {**BASE, "train": {"steps": 10**6, "batch_size": 32}, "checkpoint": {"every": 0},
               "logging": {"progress": False, "log_every": 1}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": endless, "axes": {"optim.lr": [0.05], "model.depth": [1]},
                                    "scale_key": "model.depth"}))
    store = SweepStore(tmp_path / "out")
    proc = launch(path, store.dir, "--workers", "1", stdout=stdout) if launch is moga_sweep else launch(
        path, store.dir, stdout=stdout)
    try:
        while max(_live_progress(store).values(), default=0) < 1:  # the cell is training
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        yield proc, store
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_on_the_process_group_checkpoints_and_releases_the_cell_once(tmp_path):
    import torch

    with endless_sweep(tmp_path) as (proc, store):
        seen = max(_live_progress(store).values())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the sweep and its workers
        assert proc.wait(timeout=120) == 130
    errors = proc.stderr.read().decode()
    assert "Traceback" not in errors and "KeyboardInterrupt" not in errors, errors
    (cell,) = store.cells()
    assert cell["status"] == "pending" and [e["event"] for e in store.events()] == ["claim", "release"]
    checkpoint = torch.load(store.cell_dir(cell["id"]) / "checkpoint.pt", weights_only=True)
    assert seen <= checkpoint["step"] < 10**6  # saved where it stopped (no periodic checkpoints in this config)


def test_sigterm_to_the_sweep_ends_it_with_a_message_and_releases_the_cell(tmp_path):
    """SIGTERM (a scheduler's stop, `kill PID`) to `moga sweep` alone is Ctrl-C's path: the workers checkpoint,
    hand their cells back, and the sweep says how to resume, instead of vanishing without a word."""
    with endless_sweep(tmp_path, stdout=subprocess.PIPE) as (proc, store):
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
    out, errors = proc.stdout.read().decode(), proc.stderr.read().decode()
    said = "interrupted: this command's workers checkpointed and handed back any cell"
    assert "Traceback" not in errors and said in out, (out, errors)
    (cell,) = store.cells()
    assert cell["status"] == "pending" and [e["event"] for e in store.events()] == ["claim", "release"]


def test_sigterm_to_any_program_running_a_sweep_releases_the_cell(tmp_path):
    """`moga reproduce`, `moga demo` and `moga tune` run sweeps through ``run_sweep``: a SIGTERM to them also
    checkpoints the running cell and hands it back (it used to kill the parent alone, and its orphaned worker
    left the claim to go stale)."""
    with endless_sweep(tmp_path, launch=sweep_in_python) as (proc, store):
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) != 0
    assert "KeyboardInterrupt" in proc.stderr.read().decode()  # what the caller catches to say how to resume
    (cell,) = store.cells()
    assert cell["status"] == "pending" and [e["event"] for e in store.events()] == ["claim", "release"]


def test_two_processes_share_a_sweep_without_running_a_cell_twice(tmp_path):
    path = write_sweep(tmp_path)
    out = tmp_path / "out"
    SweepStore(out).create_or_check(Sweep.from_file(path))
    procs = [moga_sweep(path, out, "--workers", "1") for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()
    store = SweepStore(out)
    claims = Counter(e["cell"] for e in store.events() if e["event"] in ("claim", "retake"))
    assert claims == Counter({c["id"]: 1 for c in store.cells()})
    assert finish_events(store) == claims
    owners = {e["owner"] for e in store.events() if e["event"] == "claim"}
    assert len(owners) == 2  # both processes did work


def test_diverged_cells_are_data_and_early_stop_skips_larger_rates(tmp_path):
    axes = {"optim.name": ["adamw"], "model.depth": [2], "optim.lr": [0.001, 30.0, 300.0]}
    base = {**BASE, "train": {"steps": 20, "batch_size": 32, "loss_ceiling": 20.0}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": base, "axes": axes, "scale_key": "model.depth",
                                    "early_stop_diverged": True}))
    counts = run_sweep(Sweep.from_file(path), tmp_path / "out", workers=1, progress=False)
    assert (counts["finished"], counts["diverged"], counts["skipped"]) == (1, 1, 1)
    rows = {r["optim.lr"]: r for r in records(SweepStore(tmp_path / "out"))}
    assert math.isfinite(rows[0.001]["train_loss"])
    assert rows[30.0]["status"] == "diverged" and rows[30.0]["train_loss"] == math.inf
    assert rows[300.0]["status"] == "skipped" and rows[300.0]["train_loss"] == math.inf


def test_a_sweep_with_failed_cells_exits_non_zero_and_says_how_many(tmp_path):
    from typer.testing import CliRunner

    from moga.cli import app

    base = {**BASE, "train": {"steps": 2, "batch_size": 32}}
    path = tmp_path / "sweep.yaml"  # a width of 0 passes the config and fails in the model's constructor
    path.write_text(yaml.safe_dump({"base": base, "axes": {"model.width": [0, 16], "optim.lr": [0.05]},
                                    "scale_key": "model.width"}))
    result = CliRunner().invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out"), "--quiet"],
                                terminal_width=200)
    counts = SweepStore(tmp_path / "out").counts()
    assert (counts["finished"], counts["failed"]) == (1, 1)
    assert result.exit_code == 1 and "1 of 2 cells failed" in result.output, result.output
    assert "2 cells -> " in result.output and "(1 worker(s), 1 thread(s) each)" in result.output
    assert " s with 1 worker(s): " in result.output  # a time names the workers it ran on


def test_ray_executor(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'moga[ray]')")
    import ray

    sweep = Sweep.from_file(write_sweep(tmp_path))
    try:
        counts = run_sweep(sweep, tmp_path / "out", workers=2, executor="ray", progress=False)
    finally:
        ray.shutdown()
    assert counts["finished"] == 8
    assert set(finish_events(SweepStore(tmp_path / "out")).values()) == {1}
