"""The store's errors a user can act on: a damaged sweep.db, a directory with no sweep; a report from it."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from moga.sweep.results import records
from moga.sweep.spec import Sweep
from moga.sweep.store import SweepStore
from moga.sweep.worker import run_worker

from .conftest import BASE, SPEC


def _app():
    from moga.cli import app

    return app


def test_report_takes_the_optimizer_from_the_base_config(settled):
    from moga.sweep.report.schema import parse_records

    rows = parse_records(records(settled), "model.depth")  # what `moga report DIR` reads
    assert len(rows) == 4 and {r.optimizer for r in rows} == {"muon"}


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_store_says_so_and_rebuilds_from_the_run_directories(settled_copy, damage):
    sweep, store = Sweep.from_dict(SPEC), settled_copy
    before = {c["id"]: c["result"] for c in store.cells()}
    data = store.path.read_bytes()
    for side in store.dir.glob("sweep.db-*"):
        side.unlink()
    store.path.write_bytes({"truncated": data[: len(data) // 3], "garbage": b"\x13moga" * 1000, "empty": b""}[damage])
    out = CliRunner().invoke(_app(), ["sweep", "status", str(store.dir)], terminal_width=300)
    assert out.exit_code == 2 and "damaged" in out.output and "--rebuild" in out.output, out.output
    assert "Traceback" not in out.output
    assert store.set_aside().name == "sweep.db.damaged"
    store.create_or_check(sweep)
    assert run_worker(store.dir) == 4
    assert {c["id"]: c["result"] for c in store.cells()} == before  # read back from result.json, not retrained


@pytest.mark.parametrize("make", [lambda d: d.mkdir(), lambda d: None])
def test_status_of_a_directory_without_a_sweep_creates_nothing(tmp_path, make):
    directory = tmp_path / "nothing"
    make(directory)
    out = CliRunner().invoke(_app(), ["sweep", "status", str(directory)], terminal_width=300)
    assert out.exit_code == 2 and "holds no sweep" in out.output, out.output
    assert not (directory / "sweep.db").exists()


def _dry_run(config: dict, tmp_path, store_dir) -> object:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return CliRunner().invoke(_app(), ["sweep", str(path), "--out", str(store_dir), "--dry-run"], terminal_width=300)


def test_a_dry_run_lists_what_would_run_and_writes_nothing(settled_copy, tmp_path):
    store = settled_copy
    before = (store.path.read_bytes(), store.cells(), store.events())
    # the settled grid extended by one depth and a seed at one cell: 2 new cells, the 4 settled ones stay
    extended = {**SPEC, "axes": {**SPEC["axes"], "model.depth": [1, 2, 3]},
                "include": [{"optim.lr": 0.05, "model.depth": 1, "seed": 1}]}
    out = _dry_run(extended, tmp_path, store.dir)
    assert out.exit_code == 0, out.output
    assert "3 of 7 cells would run (3 new, 0 waiting or resumed); 4 settled; nothing was written" in out.output
    rows = [line for line in out.output.splitlines() if line.startswith("│")]
    states = [row.rsplit("│", 2)[-2].strip() for row in rows]  # (the header row is drawn with ┃)
    assert states.count("finished") == 4 and states.count("new") == 3
    assert (store.path.read_bytes(), store.cells(), store.events()) == before
    fresh = tmp_path / "fresh"
    assert _dry_run(SPEC, tmp_path, fresh).exit_code == 0 and not fresh.exists()


def test_a_dry_run_into_a_store_of_another_sweep_is_refused_as_a_run_would_be(settled_copy, tmp_path):
    other = {**SPEC, "base": {**BASE, "train": {**BASE["train"], "steps": 3}}}
    out = _dry_run(other, tmp_path, settled_copy.dir)
    assert out.exit_code == 2 and "holds a different sweep" in out.output and "Traceback" not in out.output, out.output


def test_a_stale_claim_is_judged_on_the_observers_clock_not_the_owners():
    """A worker whose clock runs a day ahead (or behind) neither keeps its cell for a day nor loses it at once:
    only the observer's own time since the heartbeat last changed counts. Both clocks injected, no sleeps."""
    import tempfile
    import time

    sweep = Sweep.from_dict({"base": BASE, "axes": {"optim.lr": [0.05, 0.1], "model.depth": [1]},
                             "scale_key": "model.depth"})
    with tempfile.TemporaryDirectory() as tmp:
        now = [1000.0]  # the observer's monotonic clock
        observer = SweepStore(tmp, clock=lambda: now[0])
        observer.create_or_check(sweep)
        ahead = SweepStore(tmp, wall=lambda: time.time() + 86400)
        behind = SweepStore(tmp, wall=lambda: time.time() - 86400)
        remote = "another-host:1:aaaa"  # on another machine only the heartbeat tells whether it lives
        first, second = ahead.claim(remote, 60)["id"], behind.claim(remote, 60)["id"]
        assert observer.claim("here:2:bbbb", 60) is None  # first sight of both heartbeats, however old
        now[0] += 59
        assert observer.claim("here:2:bbbb", 60) is None
        assert ahead.heartbeat(first, remote)  # the ahead worker lives on; the behind one has gone silent
        now[0] += 2
        assert observer.claim("here:2:bbbb", 60)["id"] == second
        assert observer.claim("here:2:bbbb", 60) is None
        now[0] += 59
        assert observer.claim("here:2:bbbb", 60) is None  # 59 s since the observer saw it change
        now[0] += 1
        retaken = observer.claim("here:2:bbbb", 60)  # 60 s of silence on the observer's clock
        assert retaken["id"] == first
        assert [e["event"] for e in observer.events() if e["owner"] == "here:2:bbbb"] == ["retake", "retake"]
        assert not ahead.heartbeat(first, remote)  # the old owner learns that it lost the cell


def moga_sweep(axes=None, **optim):
    base = {**BASE, "optim": {"name": "moga", "lr": 0.05, **optim}}
    return Sweep.from_dict({"base": base, "axes": {"optim.lr": [0.05], "model.depth": [1], **(axes or {})},
                            "scale_key": "model.depth"})


def test_a_preset_is_compared_by_what_it_runs(tmp_path, monkeypatch):
    """Pinning optim.preset: paper on a sweep stored while the default was the paper's extends it (a reproduction
    pinned after its store was made). Once the default changes, a store that ran the old default is refused, and
    pinning paper, what its cells ran, extends it again."""
    from moga.optim.multipliers import PAPER, PRESETS, Preset
    from moga.sweep.spec import SweepError

    monkeypatch.setitem(PRESETS, "default", PAPER)  # a sweep stored while the default was the paper's choice
    SweepStore(tmp_path / "on-default").create_or_check(moga_sweep())
    store = SweepStore(tmp_path / "sweep")
    store.create_or_check(moga_sweep())
    assert store.create_or_check(moga_sweep(preset="paper")) == {"added": 0, "dropped": 0}
    assert "moga_default_preset" not in store.definition()  # the default is the paper's: nothing to record
    monkeypatch.setitem(PRESETS, "default", Preset({"embedding": 0.0625}, nesterov=True))  # the default changes
    with pytest.raises(SweepError, match=r"its base config changed: optim.preset \(MOGA's lr multipliers none -> "
                       r"{'embedding': 0.0625}, MOGA's momentum plain -> Nesterov\)"):  # the stored base pins paper
        SweepStore(tmp_path / "sweep").create_or_check(moga_sweep(preset="default"))
    store = SweepStore(tmp_path / "sweep")
    assert store.create_or_check(moga_sweep(preset="paper")) == {"added": 0, "dropped": 0}
    assert store.definition()["moga_default_preset"] == {"lr_multipliers": {"embedding": 0.0625}, "nesterov": True}
    with pytest.raises(SweepError, match=r"and its base runs the default: its finished MOGA cells ran the old one "
                       r"\(optim.preset: paper in its base runs what they ran\)"):  # a base left on the default
        SweepStore(tmp_path / "on-default").create_or_check(moga_sweep())
    assert SweepStore(tmp_path / "on-default").create_or_check(moga_sweep(preset="paper")) == {"added": 0, "dropped": 0}


def old_default_store(path, monkeypatch):
    """A store written before the default took Nesterov momentum: it ran the tables at lr/16 with plain momentum,
    and recorded the default as its multipliers alone (the record of that version)."""
    import sqlite3

    from moga.optim.multipliers import PRESETS, Preset

    default = PRESETS["default"]
    monkeypatch.setitem(PRESETS, "default", Preset({"embedding": 0.0625}, nesterov=False))
    store = SweepStore(path)
    store.create_or_check(moga_sweep())
    monkeypatch.setitem(PRESETS, "default", default)
    definition = {**store.definition(), "moga_default_preset": {"embedding": 0.0625}}
    with sqlite3.connect(store.path) as con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'sweep'", (json.dumps(definition),))
    con.close()
    return SweepStore(path)


def test_a_store_of_the_default_before_nesterov_is_refused_and_extends_with_nesterov_off(tmp_path, monkeypatch):
    """An old record (multipliers alone) reads as plain momentum: its cells on the default ran what the default
    with nesterov off runs now, so pinning that extends the store (every cell is MOGA), and nothing else does."""
    from moga.sweep.spec import SweepError

    store = old_default_store(tmp_path / "sweep", monkeypatch)
    with pytest.raises(SweepError, match=r"default preset changed since it was stored \(MOGA's momentum plain -> "
                       r"Nesterov\), and its base runs the default: its finished MOGA cells ran the old one "
                       r"\(optim.nesterov: false in its base runs what they ran\)"):
        store.create_or_check(moga_sweep())
    with pytest.raises(SweepError, match=r"its base config changed: optim.preset \(MOGA's lr multipliers "
                       r"{'embedding': 0.0625} -> none\)"):
        store.create_or_check(moga_sweep(preset="paper"))
    with pytest.raises(SweepError, match=r"its base config changed: optim.nesterov \(MOGA's momentum plain -> "
                       r"Nesterov\)"):
        store.create_or_check(moga_sweep(nesterov=True))
    assert store.create_or_check(moga_sweep(nesterov=False)) == {"added": 0, "dropped": 0}
    assert store.definition()["moga_default_preset"] == {"lr_multipliers": {"embedding": 0.0625}, "nesterov": True}


def test_a_mixed_sweeps_base_nesterov_is_compared_as_a_key(tmp_path, monkeypatch):
    """With Muon cells too, the base's nesterov reaches Muon: pinning it on a store of the old default changes
    what Muon's cells run, so it is refused."""
    from moga.optim.multipliers import PRESETS, Preset
    from moga.sweep.spec import SweepError

    default = PRESETS["default"]
    monkeypatch.setitem(PRESETS, "default", Preset({"embedding": 0.0625}, nesterov=False))
    store = SweepStore(tmp_path / "sweep")
    store.create_or_check(moga_sweep({"optim.name": ["moga", "muon"]}))
    monkeypatch.setitem(PRESETS, "default", default)
    with pytest.raises(SweepError, match=r"MOGA's momentum plain -> Nesterov\), and its base runs the default: its "
                       r"finished MOGA cells ran the old one\)"):
        store.create_or_check(moga_sweep({"optim.name": ["moga", "muon"]}))
    with pytest.raises(SweepError, match=r"\(its base config changed: optim.nesterov\);"):
        store.create_or_check(moga_sweep({"optim.name": ["moga", "muon"]}, nesterov=False))


def test_a_store_from_before_the_published_muon_is_refused_and_resumes_on_the_old_recipe(tmp_path):
    """A store without the Muon record ran moga's all-geometry Muon in its Muon cells: resuming them on the
    published recipe would mix the two, so it is refused; pinning optim.preset: moga on its Muon cells runs what
    they ran (and hashes as they did), so that extends it."""
    import sqlite3

    from moga.sweep.spec import SweepError

    def muon_sweep(**optim):
        base = {**BASE, "optim": {"name": "muon", "lr": 0.05, **optim}}
        return Sweep.from_dict({"base": base, "axes": {"optim.lr": [0.05], "model.depth": [1]},
                                "scale_key": "model.depth"})

    store = SweepStore(tmp_path / "sweep")
    store.create_or_check(muon_sweep())
    assert store.definition()["muon_default_preset"] == "published"
    definition = {k: v for k, v in store.definition().items() if k != "muon_default_preset"}  # the old record
    with sqlite3.connect(store.path) as con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'sweep'", (json.dumps(definition),))
    con.close()
    with pytest.raises(SweepError, match=r"Muon's default became the published recipe .* its finished Muon cells "
                       r"ran moga's all-geometry Muon \(optim.preset: moga on every Muon cell runs what they ran\)"):
        SweepStore(tmp_path / "sweep").create_or_check(muon_sweep())
    assert SweepStore(tmp_path / "sweep").create_or_check(muon_sweep(preset="moga")) == {"added": 0, "dropped": 0}


def test_a_preset_axis_on_the_default_is_refused_once_the_default_changed(tmp_path, monkeypatch):
    from moga.optim.multipliers import PRESETS, Preset
    from moga.sweep.spec import SweepError

    monkeypatch.setitem(PRESETS, "default", Preset({"embedding": 0.0625}))
    store = SweepStore(tmp_path / "sweep")
    store.create_or_check(moga_sweep({"optim.preset": ["paper", "default"]}, preset="paper"))
    assert store.create_or_check(moga_sweep({"optim.preset": ["paper", "default"]}, preset="paper")) == \
        {"added": 0, "dropped": 0}
    monkeypatch.setitem(PRESETS, "default", Preset({"embedding": 0.0625}, nesterov=True))
    with pytest.raises(SweepError, match=r"default preset changed since it was stored \(MOGA's momentum plain -> "
                       r"Nesterov\), and its optim.preset axis runs 'default'"):
        store.create_or_check(moga_sweep({"optim.preset": ["paper", "default"]}, preset="paper"))
    assert store.create_or_check(moga_sweep({"optim.preset": ["paper"]}, preset="paper"))["dropped"] == 1


def test_a_dependent_muon_preset_override_is_compared_by_what_it_runs(tmp_path):
    """A store from before the published Muon, without the override, extends with it (its Muon cells ran moga's
    Muon); a store that ran the override's moga Muon is refused when the override moves to the published one, and
    any other change of the overrides is refused."""
    import sqlite3

    from moga.sweep.spec import SweepError

    def mixed(overrides=None):
        base = {**BASE, "optim": {"name": "moga", "lr": 0.05}}
        return Sweep.from_dict({"base": base, "axes": {"optim.name": ["muon", "moga"], "model.depth": [1], "optim.lr": [0.05]},
                                "overrides": overrides or {}, "scale_key": "model.depth"})

    pin = {"optim.preset": {"by": "optim.name", "values": {"muon": "moga"}}}
    old = SweepStore(tmp_path / "old")
    old.create_or_check(mixed())
    definition = {k: v for k, v in old.definition().items() if k != "muon_default_preset"}
    with sqlite3.connect(old.path) as con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'sweep'", (json.dumps(definition),))
    con.close()
    assert SweepStore(tmp_path / "old").create_or_check(mixed(pin)) == {"added": 0, "dropped": 0}

    new = SweepStore(tmp_path / "new")
    new.create_or_check(mixed(pin))
    with pytest.raises(SweepError, match=r"its Muon cells ran moga's all-geometry Muon.*would now run the published"):
        SweepStore(tmp_path / "new").create_or_check(mixed())
    with pytest.raises(SweepError, match=r"its overrides changed"):
        SweepStore(tmp_path / "new").create_or_check(mixed({**pin, "optim.momentum": {"by": "optim.name", "values": {"muon": 0.9}}}))
