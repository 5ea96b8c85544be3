"""A record's stamps of MOGA's and Muon's defaults read back as what they ran, from this moga and older ones;
what a config's optim section runs under them. The store's refusals built on these: tests/sweep/test_store.py."""

from moga.optim.multipliers import DEFAULT, PAPER, Preset, preset_options
from moga.optim.muon import MOGA_MUON, MUON_DEFAULT, PUBLISHED, muon_preset
from moga.optim.preset_history import (
    MOGA_STAMP, describe_change, moga_default, moga_pin, moga_runs, muon_runs, stamps
)


def test_a_record_reads_back_the_defaults_it_was_stamped_with():
    record = {"anything": "else", **stamps()}
    assert moga_default(record) == preset_options("default")
    assert muon_runs(None, record) is muon_preset(MUON_DEFAULT)


def test_records_from_before_the_stamps_read_as_the_defaults_of_then():
    assert moga_default({}) == PAPER  # no MOGA stamp: the paper's, the only default there was
    assert moga_default({MOGA_STAMP: {"embedding": 0.0625}}) == Preset({"embedding": 0.0625}, nesterov=False)
    assert muon_runs(None, {}) is MOGA_MUON  # no Muon stamp: moga's all-geometry Muon
    assert muon_runs("paper", {}) is MOGA_MUON  # a MOGA preset name is not Muon's: its default
    assert muon_runs("published", {}) is PUBLISHED


def test_what_a_config_runs_and_the_one_setting_that_runs_an_old_default_again():
    plain = Preset(dict(DEFAULT.lr_multipliers), nesterov=not DEFAULT.nesterov)
    now = moga_runs({}, DEFAULT)
    assert now == DEFAULT and moga_runs({"preset": "default"}, plain) == plain
    assert moga_runs({"nesterov": plain.nesterov}, DEFAULT) == plain
    assert moga_runs({"preset": "paper", "nesterov": True}, DEFAULT) == Preset({}, nesterov=True)
    assert moga_pin(plain, now, nesterov_free=True) == {"nesterov": plain.nesterov}
    assert moga_pin(plain, now, nesterov_free=False) is None  # nesterov would reach another optimizer too
    assert moga_pin(PAPER, now, nesterov_free=False) == {"preset": "paper"}
    assert describe_change(PAPER, Preset({"embedding": 0.0625}, nesterov=True)) == (
        "MOGA's lr multipliers none -> {'embedding': 0.0625}, MOGA's momentum plain -> Nesterov")
