"""A full disk during `moga sweep`: one line naming the file and what to do, and no finished cell lost.

The disk fills as in tests/train/test_run_dir_inputs.py: a file size limit (RLIMIT_FSIZE) makes every write
past it fail (EFBIG), in `moga sweep` and the workers it starts. A cell's checkpoint is made far larger than
the store's files, so the limit falls between them: either the cell's write fails, or the store's."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

from moga.status import Status
from moga.sweep.spec import Sweep, cell_id
from moga.sweep.store import SweepStore

from .conftest import BASE

SRC = str(Path(__file__).resolve().parents[2] / "src")
FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
from moga.cli import app
app(sys.argv[2:])
"""
WIDE = {**BASE, "model": {"name": "residual_mlp", "width": 96, "depth": 1}}  # checkpoint.pt: about 260 kB
FIRST, SECOND = ({"optim.lr": lr, "model.depth": 1} for lr in (0.05, 0.1))


def _spec(*lrs: float) -> dict:
    return {"base": WIDE, "axes": {"optim.lr": list(lrs), "model.depth": [1]}, "scale_key": "model.depth"}


def _sweep(tmp_path, limit: int | None):
    """`moga sweep` over both cells, FIRST already finished; its output and the store."""
    config, out = tmp_path / "sweep.yaml", tmp_path / "sweep"
    config.write_text(yaml.safe_dump(_spec(0.05, 0.1)))
    env = {**os.environ, "PYTHONPATH": SRC}
    cmd = [sys.executable, "-c", FULL_DISK, str(limit or -1), "sweep", str(config), "-o", str(out), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return proc, SweepStore(out)


def _first_finished(tmp_path) -> SweepStore:
    store = SweepStore(tmp_path / "sweep")
    (tmp_path / "first.yaml").write_text(yaml.safe_dump(_spec(0.05)))
    proc = subprocess.run([sys.executable, "-m", "moga", "sweep", str(tmp_path / "first.yaml"), "-o",
                           str(store.dir), "-q"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr
    store.create_or_check(Sweep.from_dict(_spec(0.05, 0.1)))  # SECOND waits
    return store


def _one_error_line(proc) -> str:
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in output and len(errors) == 1, output
    return errors[0]


def _statuses(store: SweepStore) -> dict:
    return {c["id"]: c["status"] for c in store.cells()}


def _resumes_running_only_the_second(tmp_path, store: SweepStore, first_result: bytes) -> None:
    proc, _ = _sweep(tmp_path, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _statuses(store) == {cell_id(FIRST): Status.FINISHED, cell_id(SECOND): Status.FINISHED}
    assert (store.cell_dir(cell_id(FIRST)) / "result.json").read_bytes() == first_result
    assert [e["event"] for e in store.events() if e["cell"] == cell_id(FIRST)] == ["claim", Status.FINISHED]


def test_a_full_disk_under_a_cell_hands_it_back_in_one_line(tmp_path):
    """The cell's checkpoint cannot be written: not a failed cell (--retry-failed), and not every next cell
    failed the same way; one line naming the file, the cell pending again, the same command goes on."""
    store = _first_finished(tmp_path)
    first_result = (store.cell_dir(cell_id(FIRST)) / "result.json").read_bytes()
    proc, _ = _sweep(tmp_path, 128_000)
    line = _one_error_line(proc)
    checkpoint = store.cell_dir(cell_id(SECOND)) / "checkpoint.pt"
    assert f"could not write the checkpoint {checkpoint} (File too large)" in line, line
    assert "Free some space and run the same command again" in line and "handed back" in line, line
    assert _statuses(store) == {cell_id(FIRST): Status.FINISHED, cell_id(SECOND): Status.PENDING}
    _resumes_running_only_the_second(tmp_path, store, first_result)


def test_a_full_disk_under_the_store_is_one_line_and_keeps_the_finished_cells(tmp_path):
    """sweep.db cannot grow (SQLite: "disk I/O error" or "database or disk is full"): one line naming it."""
    store = _first_finished(tmp_path)
    first_result = (store.cell_dir(cell_id(FIRST)) / "result.json").read_bytes()
    db = store.path.read_bytes()
    proc, _ = _sweep(tmp_path, 16_384)  # below sweep.db's own size and its -shm's 32 kB
    line = _one_error_line(proc)
    assert f"the sweep store {store.path} could not be written" in line and "free some space and run the same " \
        "command again" in line and "no finished cell is lost" in line, line
    assert store.path.read_bytes() == db and not store.cell_dir(cell_id(SECOND)).exists()
    _resumes_running_only_the_second(tmp_path, store, first_result)


def test_a_full_disk_under_a_report_is_one_line_naming_the_file(settled_copy):
    """Below the store's files, above the HTML (which embeds its figures): the report's own write fails."""
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, "33000", "report", str(settled_copy.dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "Traceback" not in err and err.count("\n") == 0, proc.stdout + err
    assert err.startswith(f"error: could not write {settled_copy.dir / 'report'}/") and "File too large; free " \
        "some space or give --out DIR elsewhere" in err, err
    assert [c["status"] for c in settled_copy.cells()] == [Status.FINISHED] * 4
