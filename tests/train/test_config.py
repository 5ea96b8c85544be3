"""The config schema: files, overrides, and errors that say what is valid."""

import pytest
from typer.testing import CliRunner

from moga.train import ConfigError, build_config, config_diff, config_hash, load_config
from moga.train.build import model_kwargs

from .conftest import tiny


def test_yaml_file_with_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: residual_mlp\n  depth: 4\noptim:\n  name: moga\n  lr: 1e-3\n"
                    "train:\n  steps: 10\n")
    cfg = load_config(path, ["optim.lr=0.1", "model.depth=8", "optim.betas=[0.9, 0.95]", "train.loss_ceiling=1e2",
                             "schedule.name=cosine", "schedule.warmup_fraction=0.1"])
    assert cfg.optim.lr == 0.1 and cfg.model.kwargs == {"depth": 8}
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.train.loss_ceiling == 100.0
    assert load_config(path).optim.lr == 1e-3  # YAML 1.1 would read "1e-3" as a string


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('seed = 3\n[optim]\nname = "adamw"\nlr = 3e-4\n[train]\nepochs = 2\nbatch_size = "full"\n')
    cfg = load_config(path)
    assert (cfg.seed, cfg.optim.name, cfg.optim.lr, cfg.train.epochs, cfg.train.batch_size) == (
        3, "adamw", 3e-4, 2.0, "full")


def test_unknown_key_lists_the_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.steps=5", "optim.lrr=0.1"])
    msg = str(e.value)
    assert "optim.lrr" in msg and "did you mean 'lr'" in msg
    for key in ("name", "lr", "weight_decay", "momentum", "betas", "p"):
        assert key in msg
    with pytest.raises(ConfigError, match="valid keys in the top level: seed, name, model, data, optim"):
        load_config(None, ["train.steps=5", "optimizer.lr=0.1"])


def test_wrong_types_and_values_are_named():
    with pytest.raises(ConfigError, match=r"train\.steps: .*integer.*'many'"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"optim\.name: .*'moga', 'muon'"):
        load_config(None, ["train.steps=5", "optim.name=lion"])
    with pytest.raises(ConfigError, match=r"optim\.lr: .*greater than or equal to 0"):
        load_config(None, ["train.steps=5", "optim.lr=-1"])
    with pytest.raises(ConfigError, match="batch_size must be > 0 or 'full'"):
        load_config(None, ["train.steps=5", "train.batch_size=0"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["train.steps"])


def test_contradictions():
    with pytest.raises(ConfigError, match="train.steps or train.epochs"):
        build_config({})
    with pytest.raises(ConfigError, match="not both"):
        build_config({"train": {"steps": 5, "epochs": 1}})
    with pytest.raises(ConfigError, match="p does not apply to optimizer adamw"):
        build_config(tiny(optim={"name": "adamw", "p": 2}))
    with pytest.raises(ConfigError, match="block_size does not apply to image data"):
        build_config(tiny(data={"block_size": 32}))
    with pytest.raises(ConfigError, match="give one warmup length"):
        build_config(tiny(schedule={"name": "cosine", "warmup_steps": 3, "warmup_fraction": 0.1}))
    with pytest.raises(ConfigError, match="has no warmup"):
        build_config(tiny(schedule={"warmup_steps": 3}))


def test_model_arguments_are_checked_against_the_constructor():
    cfg = build_config(tiny(model={"widht": 8}))
    with pytest.raises(ConfigError) as e:
        model_kwargs(cfg, {"in_features": 64})
    assert "model.widht" in str(e.value) and "width" in str(e.value) and "depth_scaling" in str(e.value)
    gpt = build_config({"model": {"name": "gpt", "n_layer": 2}, "train": {"steps": 1}})
    assert model_kwargs(gpt, {"vocab_size": 65, "block_size": 16, "in_features": 3}) == {
        "n_layer": 2, "vocab_size": 65, "block_size": 16}
    with pytest.raises(ConfigError, match="not both"):
        model_kwargs(build_config(tiny(model={"alpha": 0.5, "depth_scaling": "inverse_depth"})))


def test_hash_ignores_logging_and_diff_names_keys():
    a = build_config(tiny())
    b = build_config(tiny(logging={"log_every": 7}, checkpoint={"every": 100}, name="label"))
    c = build_config(tiny(optim={"lr": 0.1}, model={"depth": 3}))
    assert config_hash(a) == config_hash(b) != config_hash(c)
    assert config_diff(a, c) == ["model.depth: 2 -> 3", "optim.lr: 0.05 -> 0.1"]


def _app():
    import typer

    from moga.train.cli import lr_range, train

    app = typer.Typer(add_completion=False)
    app.command("train")(train)
    app.command("lr-range")(lr_range)
    return app


def test_cli_help_documents_every_key():
    from moga.train.config import RunConfig

    out = CliRunner().invoke(_app(), ["train", "--help"], terminal_width=200).output
    for section in ("model", "data", "optim", "schedule", "train", "eval", "checkpoint", "logging"):
        for key in RunConfig.model_fields[section].annotation.model_fields:
            assert f"{section}.{key}" in out
    for option in ("--run-dir", "--stop-at", "--quiet", "--print-config", "--keys"):
        assert option in out


def test_cli_reports_config_errors_and_prints_configs(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(_app(), ["train", "train.steps=3", "optim.lrr=1"], terminal_width=200)
    assert bad.exit_code == 2 and "optim.lrr" in bad.output
    good = runner.invoke(_app(), ["train", "train.steps=3", "optim.lr=0.5", "--print-config"])
    assert good.exit_code == 0 and "lr: 0.5" in good.output
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 4\n")
    out = runner.invoke(_app(), ["train", str(path), "model.width=8", "--print-config"])
    assert out.exit_code == 0 and "width: 8" in out.output and "steps: 4" in out.output


def test_cli_trains_stops_resumes_and_reports(tmp_path):
    runner = CliRunner()
    args = ["train", "model.width=8", "model.depth=1", "train.steps=6", "train.batch_size=32", "optim.lr=0.05",
            "logging.log_every=2", "-o", str(tmp_path / "run")]
    stopped = runner.invoke(_app(), args + ["--stop-at", "3"])
    assert stopped.exit_code == 0 and "status stopped" in stopped.output and "step 2/6" in stopped.output
    done = runner.invoke(_app(), args + ["-q"])
    assert done.exit_code == 0 and "status finished" in done.output and "step 4/6" not in done.output
    diverged = runner.invoke(_app(), ["train", "train.steps=20", "optim.name=sgd", "optim.lr=1e8", "-q",
                                      "-o", str(tmp_path / "boom")])
    assert diverged.exit_code == 0 and "status diverged" in diverged.output
    other = runner.invoke(_app(), args[:-2] + ["optim.lr=0.1", "-o", str(tmp_path / "run")])
    assert other.exit_code == 1 and "optim.lr: 0.05 -> 0.1" in other.output


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", "..", "."])
def test_run_names_are_single_path_components(name):
    with pytest.raises(ConfigError, match="single path component"):
        build_config(tiny(name=name))
    assert build_config(tiny(name="lr-0.1_depth8")).name == "lr-0.1_depth8"


def test_no_import_refuses_factories_outside_moga(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOGA_NO_IMPORT", "")  # off; and undone after the test, as --no-import sets it
    cfg = build_config({**tiny(), "model": {"name": "torch.nn:Linear", "in_features": 64, "out_features": 10}})
    assert model_kwargs(cfg)  # allowed by default
    help_text = CliRunner().invoke(_app(), ["train", "--help"], terminal_width=200).output
    assert "A config is code" in help_text and "--no-import" in help_text
    out = CliRunner().invoke(_app(), ["train", "model.name=os:system", f"model.command=touch {marker}",
                                      "train.steps=1", "--no-import", "-o", str(tmp_path / "run")])
    assert out.exit_code == 2 and "refused" in out.output and not marker.exists()
    monkeypatch.setenv("MOGA_NO_IMPORT", "1")
    with pytest.raises(ConfigError, match="refused"):
        model_kwargs(cfg)
    assert model_kwargs(build_config(tiny(model={"name": "moga.models:ResidualMLP"})))  # moga's own: allowed


def test_no_import_allows_only_registered_models_even_inside_moga(tmp_path, monkeypatch):
    """Any moga module can do harm when called with a config's keys: save_checkpoint writes a file."""
    target = tmp_path / "written.pt"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOGA_NO_IMPORT", "")
    out = CliRunner().invoke(_app(), ["train", "model.name=moga.train.checkpoint:save_checkpoint",
                                      f"model.path={target}", "model.state={}", "train.steps=1", "--no-import",
                                      "-o", str(tmp_path / "run")])
    assert out.exit_code == 2 and "refused" in out.output and "residual_mlp" in out.output, out.output
    assert not target.exists()
    monkeypatch.setenv("MOGA_NO_IMPORT", "1")
    for name in ("moga.train.checkpoint:save_checkpoint", "moga:__version__", "moga.models:model_from_config"):
        with pytest.raises(ConfigError, match="refused"):
            model_kwargs(build_config(tiny(model={"name": name})))
    from moga.models import GPT, CifarResNet
    from moga.train.build import model_factory

    assert model_factory("moga.models:GPT") is GPT  # registered, however spelt
    assert model_factory("moga.models.resnet:CifarResNet") is CifarResNet and model_factory("gpt") is GPT


def _alias_bomb(levels: int) -> str:
    """Billion laughs: each level lists the one before nine times, so 9**levels values from ~60 bytes a level."""
    lines = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "model:\n  name: residual_mlp\n" + "\n".join(lines) + "\ntrain: {steps: 1}\n"


def test_yaml_alias_bombs_and_huge_files_are_refused(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(6))  # 531441 values under model.<arg> (the reported one had 9**9)
    with pytest.raises(ConfigError, match="aliases are expanded"):
        load_config(path)
    path.write_text(_alias_bomb(5))  # 59049 values: a large config, but a config
    assert len(load_config(path).model.kwargs) == 5
    with pytest.raises(ConfigError, match="aliases are expanded"):
        load_config(None, ["train.steps=1", "model.x=[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
                                            "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], "
                                            "[*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]]"])
    path.write_text("train: {steps: 1}\n" + "#" * (2 << 20))
    with pytest.raises(ConfigError, match="is not a config"):
        load_config(path)


def test_a_key_given_twice_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("optim:\n  lr: 0.1\n  name: moga\n  lr: 0.2\ntrain: {steps: 1}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'lr' \(first given on line 2\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(None, ["train.steps=1", "model.x={a: 1, a: 2}"])
    path.write_text("train: &t {steps: 1, batch_size: 8}\neval:\n  every: 0\noptim:\n  lr: 0.1\n")
    assert load_config(path).optim.lr == 0.1  # anchors alone are fine


@pytest.mark.parametrize("override", ["train.steps=true", "seed=false", "optim.lr=true", "train.batch_size=on",
                                      "eval.every=yes", "model.k_base=true", "optim.smoothness=true"])
def test_booleans_are_not_numbers(override):
    with pytest.raises(ConfigError, match="is a boolean, which this key does not take"):
        load_config(None, ["train.steps=3", override])
    cfg = load_config(None, ["train.steps=3", "train.compile=true", "optim.name=sgd", "optim.nesterov=false"])
    assert cfg.train.compile is True and cfg.optim.nesterov is False  # keys that take booleans still do


def test_a_saved_config_builds_the_same_task(tmp_path):
    """config.yaml lists every key (unset ones as null); reloading it must not pass those to the loader."""
    from moga.train import load_config
    from moga.train.config import dump_yaml
    from moga.train.tasks import build_task

    cfg = load_config(None, ["data.name=digits", "model.name=residual_mlp", "train.steps=1"])
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_yaml(cfg))
    again = load_config(saved)
    assert again.to_dict() == cfg.to_dict()
    assert len(build_task(again).data.train) == len(build_task(cfg).data.train)


def test_fused_is_torchs_own_switch_and_leaves_old_hashes_alone():
    import torch

    from moga.train.build import build_optimizer, model_from_config

    cfg = build_config(tiny(optim={"name": "adamw", "fused": True}))
    opt = build_optimizer(cfg, model_from_config(cfg, {"in_features": 4, "out_features": 3}))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    assert build_config(tiny(optim={"name": "adamw", "fused": None})).hash() == build_config(tiny(optim={"name": "adamw"})).hash()
    with pytest.raises(ConfigError, match="fused does not apply to optimizer moga"):
        build_config(tiny(optim={"name": "moga", "fused": True}))


def test_offload_needs_fsdp_and_changes_no_hash():
    with pytest.raises(ConfigError, match="train.offload=true .* needs train.parallel=fsdp"):
        build_config(tiny(train={"steps": 2, "offload": True}))
    fsdp = tiny(train={"steps": 2, "parallel": "fsdp"})
    offloaded = tiny(train={"steps": 2, "parallel": "fsdp", "offload": True})
    assert build_config(offloaded).hash() == build_config(fsdp).hash()
    assert config_diff(build_config(fsdp), build_config(offloaded)) == []
    assert config_diff(build_config(fsdp), build_config(offloaded), hashed_only=False) == ["train.offload: False -> True"]


def test_lr_multipliers_reach_the_optimizer_and_leave_old_hashes_alone():
    from moga.train.build import build_optimizer, model_from_config

    cfg = build_config(tiny(optim={"name": "muon", "lr": 0.02, "lr_multipliers": {"readout": 0.5, "vector": 4}}))
    opt = build_optimizer(cfg, model_from_config(cfg, {"in_features": 4, "out_features": 3}))
    lrs = {g["role"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"input": 0.02, "hidden": 0.02, "readout": 0.01, "vector": 0.08}
    assert build_config(tiny(optim={"lr_multipliers": None})).hash() == build_config(tiny()).hash()
    assert build_config(tiny(optim={"lr_multipliers": {"readout": 2}})).hash() != build_config(tiny()).hash()
    with pytest.raises(ConfigError, match="optim.lr_multipliers.head"):
        build_config(tiny(optim={"lr_multipliers": {"head": 2}}))
    with pytest.raises(ConfigError, match="optim.lr_multipliers.readout: Input should be greater than 0"):
        build_config(tiny(optim={"lr_multipliers": {"readout": 0}}))
    with pytest.raises(ConfigError, match="lr_multipliers does not apply to optimizer adamw"):
        build_config(tiny(optim={"name": "adamw", "lr_multipliers": {"readout": 2}}))


def test_a_preset_reaches_the_optimizer_and_hashes_by_what_it_runs(monkeypatch):
    """optim.preset builds (every optimizer accepts it: a reproduction pins it for all it sweeps), reaches MOGA's
    groups, and a bad name is a config error listing the presets. The hash follows the multipliers, not the
    name: paper and default hash alike while they are the same, and apart once the default has its own."""
    from moga.optim.multipliers import PAPER, PRESETS, Preset
    from moga.train.build import build_optimizer, model_from_config

    cfg = build_config(tiny(optim={"preset": "paper"}))
    opt = build_optimizer(cfg, model_from_config(cfg, {"in_features": 4, "out_features": 3}))
    assert opt.preset == "paper" and {g["preset"] for g in opt.param_groups} == {"paper"}
    assert build_optimizer(*(lambda c: (c, model_from_config(c, {"in_features": 4, "out_features": 3})))(
        build_config(tiny()))).preset == "default"
    for name in ("adamw", "muon"):
        build_config(tiny(optim={"name": name, "preset": "paper"}))
    with pytest.raises(ConfigError, match="optim.preset: Input should be 'default', 'paper', 'muoneq', 'published' or 'moga'"):
        build_config(tiny(optim={"preset": "papers"}))
    # muoneq hashes as what it runs: the default with row_spectral on the hidden matrices, unless the config's own
    muoneq = build_config(tiny(optim={"preset": "muoneq"})).hash()
    assert muoneq == build_config(tiny(optim={"geometries": {"hidden": "row_spectral"}})).hash() != build_config(tiny()).hash()
    assert build_config(tiny(optim={"preset": "muoneq", "geometries": {"hidden": "spectral"}})).hash() == \
        build_config(tiny(optim={"geometries": {"hidden": "spectral"}})).hash()
    monkeypatch.setitem(PRESETS, "default", PAPER)  # while the default is the paper's choice
    unset, paper, default = (build_config(tiny(optim=o)).hash() for o in ({}, {"preset": "paper"}, {"preset": "default"}))
    assert unset == paper == default
    for changed in (Preset({"input": 0.5}), Preset({}, nesterov=True)):  # a default with other multipliers, momentum
        monkeypatch.setitem(PRESETS, "default", changed)
        assert build_config(tiny()).hash() == build_config(tiny(optim={"preset": "default"})).hash() != \
            build_config(tiny(optim={"preset": "paper"})).hash() == paper
    adamw = {"name": "adamw", "lr": 1e-3}  # an optimizer without presets: no change
    assert build_config(tiny(optim=adamw)).hash() == build_config(tiny(optim={**adamw, "preset": "paper"})).hash()


def optimizer_of(optim: dict):
    from moga.train.build import build_optimizer, model_from_config

    cfg = build_config(tiny(optim=optim))
    return build_optimizer(cfg, model_from_config(cfg, {"in_features": 4, "out_features": 3}))


def test_an_unset_nesterov_is_the_presets_for_moga_and_each_optimizers_own_default_for_the_others():
    """optim.nesterov unset: MOGA takes its preset's (default: Nesterov; paper: plain); Muon keeps its own (on),
    torch's SGD its own (off). Set, it wins everywhere."""
    assert {g["nesterov"] for g in optimizer_of({}).param_groups} == {True}
    assert {g["nesterov"] for g in optimizer_of({"preset": "paper"}).param_groups} == {False}
    assert {g["nesterov"] for g in optimizer_of({"nesterov": False}).param_groups} == {False}
    assert {g["nesterov"] for g in optimizer_of({"preset": "paper", "nesterov": True}).param_groups} == {True}
    assert {g["nesterov"] for g in optimizer_of({"name": "muon"}).param_groups} == {True}
    assert {g["nesterov"] for g in optimizer_of({"name": "muon", "preset": "paper"}).param_groups} == {True}
    assert {g["nesterov"] for g in optimizer_of({"name": "sgd", "momentum": 0.9}).param_groups} == {False}


# Hashes of the tests' tiny config on main before MOGA's default took Nesterov momentum (commit 61f8c61), when
# the default was the embedding tables at lr/16 with plain momentum.
BEFORE_NESTEROV = {
    "paper": ({"preset": "paper"}, "cf8b08ecb06c28ee"),
    "paper, nesterov off": ({"preset": "paper", "nesterov": False}, "2032c6f8392ae047"),
    "paper, nesterov on": ({"preset": "paper", "nesterov": True}, "d1b45474ce0f84b9"),
    "paper, tables at 1/16": ({"preset": "paper", "lr_multipliers": {"embedding": 0.0625}}, "bb810d607bea7eb3"),
    "paper, tables, nesterov": ({"preset": "paper", "lr_multipliers": {"embedding": 0.0625}, "nesterov": True},
                                "38e0ee9734398d21"),
    "default, nesterov on": ({"nesterov": True}, "5fbabaa0eaa6e8fd"),
    "muon": ({"name": "muon", "preset": "moga"}, "cd464e27c8078838"),  # the old recipe, by name
    "sgd": ({"name": "sgd", "momentum": 0.9}, "7d288ea8f0a0fd03"),
}
DEFAULT_BEFORE_NESTEROV = "abd0fae829163ab8"  # tiny() on the default (tables at lr/16, plain momentum)


@pytest.mark.parametrize("case", BEFORE_NESTEROV)
def test_a_config_that_runs_what_it_ran_before_the_default_took_nesterov_keeps_its_hash(case):
    optim, before = BEFORE_NESTEROV[case]
    assert build_config(tiny(optim=optim)).hash() == before


def test_muon_hashes_by_its_recipe_and_a_run_of_the_old_one_is_named():
    """Every Muon run before the published recipe ran moga's all-geometry Muon: that hash is preset moga's now, and
    a resume refused for it names the setting; MOGA's names on a Muon cell run Muon's default; Muon's names are
    not MOGA's."""
    from moga.train.hashing import hash_diff

    old = BEFORE_NESTEROV["muon"][1]
    published = build_config(tiny(optim={"name": "muon"}))
    assert published.hash() != old
    assert build_config(tiny(optim={"name": "muon", "preset": "paper"})).hash() == published.hash()
    assert build_config(tiny(optim={"name": "muon", "preset": "published"})).hash() == published.hash()
    (why,) = hash_diff(published, published, old)
    assert why.endswith("resumes with optim.preset=moga")
    with pytest.raises(ConfigError, match="optim.preset 'moga' is Muon's; MOGA's presets: default, paper"):
        build_config(tiny(optim={"preset": "moga"}))
    with pytest.raises(ConfigError, match="did you mean 'preset'"):
        build_config(tiny(optim={"name": "muon", "presets": "moga"}))


def test_the_default_hashes_by_its_momentum():
    """A config left on the default gets a new hash, that of the default with nesterov on, the same run; the
    default with nesterov off runs what the default ran before, and has its hash."""
    default = build_config(tiny()).hash()
    assert default != DEFAULT_BEFORE_NESTEROV and default == BEFORE_NESTEROV["default, nesterov on"][1]
    assert build_config(tiny(optim={"nesterov": False})).hash() == DEFAULT_BEFORE_NESTEROV


def test_hash_diff_names_the_setting_that_resumes_a_run_of_an_earlier_default(monkeypatch):
    """No key differs between a run's config and the same config now; the hash moved with MOGA's default. The
    message names the setting that gives the run's hash back, tried, not guessed, and says when none does."""
    from moga.optim.multipliers import PAPER, PRESETS, Preset
    from moga.train.hashing import hash_diff

    default, cfg = PRESETS["default"], build_config(tiny())
    stored = {}
    for era, was in (("papers", PAPER), ("tables", Preset({"embedding": 1 / 16}, nesterov=False))):
        monkeypatch.setitem(PRESETS, "default", was)
        stored[era] = cfg.hash(), build_config(tiny(optim={"nesterov": False})).hash()
    monkeypatch.setitem(PRESETS, "default", default)
    for era, setting, optim in (("papers", "optim.preset=paper", {"preset": "paper"}),
                                ("tables", "optim.nesterov=false", {"nesterov": False})):
        [why] = hash_diff(cfg, cfg, stored[era][0])
        assert "no key differs" in why and "Nesterov momentum" in why and why.endswith(f"resumes with {setting}")
        assert build_config(tiny(optim=optim)).hash() == stored[era][0]  # the setting does give the hash back
    plain = build_config(tiny(optim={"nesterov": False}))  # nesterov off, set under the tables' default
    assert "no setting of this version reproduces the run's hash" in hash_diff(plain, plain, stored["tables"][1])[0]
    assert "optim.preset=paper" in hash_diff(cfg, cfg)[0] and "optim.nesterov=false" in hash_diff(cfg, cfg)[0]
    assert hash_diff(cfg, build_config(tiny(optim={"lr": 0.5}))) == ["optim.lr: 0.05 -> 0.5"]


def test_a_run_with_lr_multipliers_logs_the_base_lr(tmp_path):
    """The logged lr is the schedule's base rate, not the first group's multiplied one."""
    from moga.train import read_metrics, run

    cfg = tiny(optim={"lr": 0.05, "lr_multipliers": {"input": 4.0}}, schedule={"name": "cosine", "warmup_steps": 2})
    run(cfg, tmp_path / "run")
    logged = [r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")]
    plain = tiny(optim={"lr": 0.05}, schedule={"name": "cosine", "warmup_steps": 2})
    run(plain, tmp_path / "plain")
    assert logged == [r["lr"] for r in read_metrics(tmp_path / "plain" / "metrics.jsonl", "train")]
    import torch
    groups = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["optimizer"]["param_groups"]
    assert {g["role"]: g["lr_multiplier"] for g in groups}["input"] == 4.0


def test_role_geometries_reach_the_plan_and_bad_specs_are_config_errors():
    from moga.train.build import build_optimizer, model_from_config

    cfg = build_config(tiny(optim={"geometries": {"readout": "adam:sign"}, "matrices": "col(q=2)"}))
    opt = build_optimizer(cfg, model_from_config(cfg, {"in_features": 4, "out_features": 3}))
    by_role = {e.role: (e.geometry, e.update) for e in opt.plan}
    assert by_role["readout"] == ("sign", "adam") and by_role["hidden"] == ("col(q=2)", "lmo")
    with pytest.raises(ConfigError, match="optim.geometries: unknown geometry 'bogus'"):
        build_config(tiny(optim={"geometries": {"readout": "bogus"}}))
    with pytest.raises(ConfigError, match="optim.geometries.head"):
        build_config(tiny(optim={"geometries": {"head": "sign"}}))
    assert build_config(tiny(optim={"geometries": None})).hash() == build_config(tiny()).hash()


def test_overrides_may_give_a_parameter_glob_its_own_geometry():
    """The orthogonalized step on attention only (docs/math.md §2.9): a per-name geometry, which roles cannot say."""
    from moga.models import GPT
    from moga.train.build import build_optimizer

    attention = {"*.attn.*.weight": {"geometry": "spectral"}}
    cfg = build_config(tiny(model={"name": "gpt", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 11,
                                   "block_size": 4}, optim={"name": "moga", "overrides": attention}))
    opt = build_optimizer(cfg, GPT(n_layer=1, n_embd=8, n_head=2, vocab_size=11, block_size=4))
    geometries = {e.name: e.geometry for e in opt.plan}
    assert geometries["blocks.0.attn.c_attn.weight"] == geometries["blocks.0.attn.c_proj.weight"] == "spectral"
    assert geometries["blocks.0.mlp.c_fc.weight"] == "row(p=2)"
    with pytest.raises(ConfigError, match="overrides"):
        build_config(tiny(optim={"name": "moga", "overrides": {"*.attn.*.weight": {"geometri": "spectral"}}}))


def test_the_optim_section_is_the_optimizers_signatures(monkeypatch):
    """Every option an optimizer's signature takes is an optim key, and every optim key is one (or a key of the
    run: name, lr, the step rule); an option a signature gains becomes a key, typed, left out of the hash while
    unset, and nonfinite takes every policy the optimizers take."""
    from moga.optim.nonfinite import POLICIES
    from moga.optim.registry import config_options
    from moga.train import config

    assert set(config.OptimConfig.model_fields) == set(config_options()) | config._RUN_KEYS
    assert config.OptimConfig.model_fields["momentum"].description.startswith("moga, muon, sgd:")
    for policy in POLICIES:
        assert load_config(None, ["train.steps=1", f"optim.nonfinite={policy}"]).optim.nonfinite == policy
    monkeypatch.setattr(config, "_OPTIONS", {**config._OPTIONS, "adam_lr": (float, ("muon",))})
    section = config._optim_section()
    assert section.model_fields["adam_lr"].description == "muon"
    assert section(name="muon", adam_lr=0.5).adam_lr == 0.5
    with pytest.raises(ValueError, match="adam_lr"):
        section(name="muon", adam_lr="fast")
    before = config_hash(load_config(None, ["train.steps=1"]))
    d = load_config(None, ["train.steps=1"]).to_dict()
    assert config_hash({**d, "optim": {**d["optim"], "adam_lr": None}}) == before
    assert config_hash({**d, "optim": {**d["optim"], "adam_lr": 0.5}}) != before
