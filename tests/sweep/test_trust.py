"""A sweep store is data, never config: a hostile or damaged ``sweep.db`` row runs nothing, writes nothing
outside the sweep and gets one line under every command that reads a store (moga sweep, sweep status,
report, reproduce, demo); a symlink at any file a sweep writes changes nothing outside; a finished sweep
on a read-only directory is read without a write."""

import json
import os
import sqlite3

import pytest
import yaml
from typer.testing import CliRunner

from moga.status import Status
from moga.sweep.spec import Sweep, cell_id
from moga.sweep.store import SweepStore
from moga.sweep.worker import run_worker

from .conftest import SPEC


@pytest.fixture
def sweep_dir(settled_copy, tmp_path):
    """A settled sweep's directory, its config beside it as sweep.yaml."""
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(SPEC))
    return settled_copy.dir


def _cli(*args):
    from moga.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


def plant(sweep_dir, cid, params, status="pending", result=None):
    with sqlite3.connect(sweep_dir / "sweep.db") as con:
        con.execute("INSERT INTO cells (id, idx, params, status, result) VALUES (?, 99, ?, ?, ?)",
                    (cid, params if isinstance(params, str) else json.dumps(params), status, result))
    con.close()


def hostile(kind, marker):
    """(id, params) of a row no config made: foreign params (a shell command as the model), a path as the id,
    params that are not JSON."""
    foreign = {"optim.lr": 0.05, "model.depth": 1, "model.name": "os:system", "model.command": f"touch {marker}"}
    return {"foreign": (cell_id(foreign), foreign), "traversal": ("../../escaped", foreign),
            "damaged": ("0123456789ab", '{"optim.lr": 0.05, "model.depth')}[kind]


def snapshot(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "sweep.db" not in p.name)


@pytest.mark.parametrize("kind", ["foreign", "traversal", "damaged", "directory"])
def test_a_hostile_row_runs_nothing_and_is_one_line_everywhere(sweep_dir, tmp_path, kind):
    """Also a directory where sweep.db belongs: named as such, not "holds no sweep" or SQLite's traceback."""
    marker = tmp_path / "ran"
    if kind == "directory":
        for db in sweep_dir.glob("sweep.db*"):
            db.unlink()
        (sweep_dir / "sweep.db").mkdir()
    else:
        plant(sweep_dir, *hostile(kind, marker))
    before = snapshot(tmp_path)
    for args in (["sweep", tmp_path / "sweep.yaml", "--out", sweep_dir, "-q"], ["sweep", "status", sweep_dir],
                 ["report", sweep_dir, "--out", tmp_path / "report"]):
        out = _cli(*args)
        last = out.output.strip().splitlines()[-1]
        assert out.exit_code == 2 and last.startswith("error: store damaged") and "--rebuild" in last, (args, out.output)
        assert "Traceback" not in out.output and out.output.count("error") == 1
        assert kind != "directory" or f"{sweep_dir / 'sweep.db'}: it is a directory, not" in last, last
        assert snapshot(tmp_path) == before and not marker.exists(), args  # nothing run, nothing written
    out = _cli("sweep", tmp_path / "sweep.yaml", "--out", sweep_dir, "-q", "--rebuild")  # what the line promises
    assert out.exit_code == 0, out.output
    assert not marker.exists() and not (tmp_path / "escaped").exists()
    assert len(SweepStore(sweep_dir).cells()) == 4


def test_a_worker_refuses_a_cell_its_config_does_not_make(sweep_dir, tmp_path):
    """The last line of defence, for a worker that never saw the sweep's create_or_check (started by hand, or
    a row written while the sweep runs): a foreign cell is recorded as failed and refused, never trained."""
    marker = tmp_path / "ran"
    cid, params = hostile("foreign", marker)
    plant(sweep_dir, cid, params)
    with sqlite3.connect(sweep_dir / "sweep.db") as con:  # as if in the grid, so that only the worker can tell
        grid = json.loads(con.execute("SELECT value FROM meta WHERE key = 'grid'").fetchone()[0])
        con.execute("UPDATE meta SET value = ? WHERE key = 'grid'", (json.dumps(grid + [cid]),))
    con.close()
    assert run_worker(sweep_dir) == 1
    cell = {c["id"]: c for c in SweepStore(sweep_dir).cells()}[cid]
    assert cell["status"] == Status.FAILED and "is not a cell of this sweep's config" in cell["error"]
    assert not marker.exists() and not (sweep_dir / "cells" / cid).exists()


def test_recorded_seeds_that_change_more_than_the_seed_are_refused(sweep_dir):
    from moga.sweep.seeds import stored_include

    make = lambda include: Sweep.from_dict({**SPEC, "include": include})  # noqa: E731
    store = SweepStore(sweep_dir)
    ok = [{"optim.lr": 0.05, "model.depth": 1, "seed": 3}]
    for include, refused in ((ok, False), (ok + [{"optim.lr": 0.05, "model.depth": 1, "model.name": "os:system"}],
                                           True), ([{"optim.lr": 0.05, "model.depth": 1, "seed": "3"}], True)):
        definition = {**store.definition(), "spec": {**store.definition()["spec"], "include": include}}
        with sqlite3.connect(store.path) as con:
            con.execute("UPDATE meta SET value = ? WHERE key = 'sweep'", (json.dumps(definition),))
        con.close()
        if refused:
            with pytest.raises(Exception, match="store damaged: .* its recorded include"):
                stored_include(sweep_dir, make)
        else:
            assert stored_include(sweep_dir, make) == ok


@pytest.mark.parametrize("kind", ["foreign", "mismatch", "sweep.db", "cells", "report"])
def test_reproduce_and_demo_refuse_a_hostile_store(tmp_path, kind):
    """A foreign row, a row whose id is not its params' hash, or a symlink planted at the store, the cells or the
    report: one line, exit 1, nothing run and nothing written outside."""
    from moga.experiments.demo import demo_sweep
    from moga.experiments.reproduce.catalog import get
    from moga.experiments.reproduce.kinds import RunArgs

    marker, outside = tmp_path / "ran", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious\n")
    for args, sweep in ((["reproduce", "depth-mlp", "--quick", "-w", "1", "-q", "--seeds", "1"],
                         RunArgs(scale="quick").sweep(get("depth-mlp"), [])),  # what the command makes: no extension
                        (["demo", "--quick", "-w", "1", "--seeds", "1"],
                         Sweep.from_dict({**demo_sweep(quick=True), "include": []}))):
        out_dir = tmp_path / args[0]
        if kind in ("foreign", "mismatch"):
            SweepStore(out_dir).create_or_check(sweep)
            params = {**sweep.cells[0], "model.name": "os:system", "model.command": f"touch {marker}"}
            plant(out_dir, cell_id(params) if kind == "foreign" else "0123456789ab", params)
        else:
            out_dir.mkdir()
            (out_dir / kind).symlink_to(outside / "keep" if kind == "sweep.db" else outside)
        out = _cli(*args, "-o", out_dir)
        last = out.output.strip().splitlines()[-1]
        assert out.exit_code == 1 and "error: " in last and "Traceback" not in out.output, out.output
        assert ("store damaged" if kind in ("foreign", "mismatch") else f"{out_dir / kind} is a symlink") in last
        assert not marker.exists() and not (out_dir / "outcome.json").exists()
        assert not (out_dir / "cells").exists() or (out_dir / "cells").is_symlink()
        assert sorted(p.name for p in outside.iterdir()) == ["keep"] and (outside / "keep").read_text() == "precious\n"


SWEEP_FILES = ("sweep.db", "sweep.db-wal", "sweep.db-shm", "cells", "report")


@pytest.mark.parametrize("name", SWEEP_FILES)
def test_a_symlink_at_any_file_a_sweep_writes_changes_nothing_outside(tmp_path, name):
    """sweep.db and its side files are opened by SQLite, which follows links: refused. A cell's lock and run
    files go through moga.files (tests/train/test_run_dir_inputs.py); here the directories that hold them."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious\n")
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    target = outside / ("keep" if name.startswith("sweep.db") else "")
    (sweep_dir / name).symlink_to(target)
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({**SPEC, "axes": {"optim.lr": [0.05], "model.depth": [1]}}))
    out = _cli("sweep", config, "--out", sweep_dir, "-q")
    if name == "report":
        assert out.exit_code == 0, out.output
        out = _cli("report", sweep_dir)
        assert out.exit_code == 1 and "is a symlink" in out.output, out.output
    else:
        assert out.exit_code in (1, 2) and "is a symlink" in out.output, out.output
    assert "Traceback" not in out.output
    assert sorted(p.name for p in outside.iterdir()) == ["keep"] and (outside / "keep").read_text() == "precious\n"


def test_a_cell_lock_that_is_a_symlink_is_refused(sweep_dir, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    store = SweepStore(sweep_dir)
    cid = store.cells()[0]["id"]
    with sqlite3.connect(store.path) as con:
        con.execute("UPDATE cells SET status = 'pending', result = NULL WHERE id = ?", (cid,))
    con.close()
    lock = store.cell_dir(cid) / ".lock"
    lock.unlink()
    lock.symlink_to(outside)
    assert run_worker(sweep_dir) == 1
    cell = {c["id"]: c for c in store.cells()}[cid]
    assert cell["status"] == Status.FAILED and "is a symlink" in cell["error"].strip().splitlines()[-1]
    assert outside.read_text() == "precious\n"


def test_a_finished_sweep_on_a_read_only_directory_is_read_without_writing(sweep_dir, tmp_path):
    for side in sweep_dir.glob("sweep.db-*"):
        side.unlink()
    files = [p for p in sweep_dir.rglob("*") if p.is_file()]
    before = {p: p.read_bytes() for p in files}
    dirs = [sweep_dir, *(p for p in sweep_dir.rglob("*") if p.is_dir())]
    for p in files:
        os.chmod(p, 0o444)
    for d in dirs:
        os.chmod(d, 0o555)
    try:
        status = _cli("sweep", "status", sweep_dir)
        assert status.exit_code == 0 and "0.05" in status.output, status.output
        report = _cli("report", sweep_dir, "--out", tmp_path / "report")
        assert report.exit_code == 0 and (tmp_path / "report" / "report.html").is_file(), report.output
        here = _cli("report", sweep_dir)  # its default output is inside the read-only sweep: one line
        assert here.exit_code == 1 and here.output.startswith(f"error: {sweep_dir} is read-only"), here.output
        assert sorted(p for p in sweep_dir.rglob("*") if p.is_file()) == sorted(files)
        assert {p: p.read_bytes() for p in files} == before
    finally:
        for d in dirs:
            os.chmod(d, 0o755)
