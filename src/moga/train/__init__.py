"""The training engine: one loop for every model, optimizer and task, and the tools around it.

>>> from moga.train import load_config, run
>>> cfg = load_config("mlp.yaml", ["optim.lr=0.01", "model.depth=8"])
>>> result = run(cfg, "runs/mlp")          # resumable: call again to continue or to read the result
>>> result["status"], result["final_train_loss"]

`moga train CONFIG key=value ...` is the same from the shell (``torchrun`` for several processes).
"""

from moga.extras import needs_cli_extra

with needs_cli_extra("moga.train"):  # yaml, pydantic: `python -m moga.train` says how to get them
    from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from .config import ConfigError, RunConfig, apply_overrides, build_config, load_config
    from .hashing import config_diff, config_hash
    from .metrics import read_metrics
    from .schedule import Schedule, build_schedule

# The engine (and torch.distributed.checkpoint under it) loads on first use: a command that only reads configs,
# such as `moga reproduce --list`, does not pay for it.
_LAZY = {"DIVERGED": "engine", "FINISHED": "engine", "STOPPED": "engine", "Trainer": "engine",
         "read_result": "engine", "run": "engine", "lr_range_test": "lr_range"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'moga.train' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


__all__ = [
    "CheckpointError", "ConfigError", "DIVERGED", "FINISHED", "RunConfig", "STOPPED", "Schedule", "Trainer",
    "apply_overrides", "build_config", "build_schedule", "config_diff", "config_hash", "load_checkpoint",
    "load_config", "lr_range_test", "read_metrics", "read_result", "run", "save_checkpoint",
]
