"""Where numbers go: a JSONL file (always), a progress line, TensorBoard and W&B (when asked).

``metrics.jsonl`` holds one JSON object per line with a ``type``: ``train`` (every log_every steps:
mean loss since the last record, lr, throughput of all processes together, the last step's gradient norm
before clipping when ``train.grad_clip`` is set, and optimizer diagnostics such as the adaptive
step's ``eta`` and ``w_norm``, or the depth-paper step rule's ``grad_dual_norm`` and ``smoothness_L``),
``eval`` (train/val loss and accuracy), ``diagnostics`` (per-layer norms, every
``logging.diagnostics_every`` steps: see :mod:`moga.train.diagnostics`) and ``diverged``.
On resume the file is cut back to where the checkpoint was taken, so no record appears twice; a file
shorter than that (records lost in a power cut) gets a ``gap`` record, never padding.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from moga.files import fsync_file, open_append

# Deferred on purpose, imported where used: tensorboard and wandb (optional), only when logging to them.


class MetricsLog:
    """Append-only JSONL; ``offset`` is the byte length to restore on resume.

    ``truncate_to``: the length the checkpoint recorded. A longer file is cut back to it (the records written
    after the checkpoint are made again). A shorter one lost records the checkpoint had seen (its last writes
    never reached the disk): it is never padded; it is cut to its last whole line, a ``gap`` record says how
    many bytes were lost at which step, and ``gap`` holds that line for the caller to print.
    """

    def __init__(self, path: str | Path, enabled: bool = True, truncate_to: int | None = 0, step: int = 0):
        self.path, self.enabled = Path(path), enabled
        self.sinks: list = []
        self.gap: str | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open_append(self.path)  # created when missing; a symlink there is refused
        size = os.fstat(self.file.fileno()).st_size
        if truncate_to is not None and size >= truncate_to:
            self._cut(truncate_to)
        elif truncate_to is not None:
            with open(self.path, "rb") as f:
                whole = f.read().rfind(b"\n") + 1
            self._cut(whole)
            self.gap = (f"{self.path} is shorter than its checkpoint recorded ({size} of {truncate_to} bytes: its "
                        f"last records never reached the disk); resuming after a gap record")
            self.write({"type": "gap", "step": step, "lost_bytes": truncate_to - whole})

    def _cut(self, size: int) -> None:
        os.ftruncate(self.file.fileno(), size)
        self.file.seek(0, os.SEEK_END)  # appends go to the end anyway; ``offset`` must say where that is

    def sync(self) -> None:
        """Flush the records to the disk: called before each checkpoint, which records ``offset``."""
        if self.enabled:
            fsync_file(self.file)

    @property
    def offset(self) -> int:
        return self.file.tell() if self.enabled else 0

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            for sink in self.sinks:
                sink.close()


def read_metrics(path: str | Path, type: str | None = None) -> list[dict]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if type is None or r.get("type") == type]


# --- optional sinks ------------------------------------------------------------------------------

def _scalars(record: dict) -> dict[str, float]:
    prefix = record.get("type", "train")
    return {f"{prefix}/{k}": float(v) for k, v in record.items()
            if k not in ("type", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
                              "(or set logging.tensorboard=false; metrics.jsonl has every number)") from None
        self.writer = SummaryWriter(str(log_dir))

    def write(self, record: dict) -> None:
        for k, v in _scalars(record).items():
            self.writer.add_scalar(k, v, record.get("step", 0))

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Offline by default (WANDB_MODE=offline unless set), so a run never waits on the network."""

    def __init__(self, run_dir: Path, project: str, config: dict, run_id: str):
        try:
            import wandb
        except ImportError:
            raise ImportError("logging.wandb=true needs the wandb package: pip install wandb "
                              "(or set logging.wandb=false)") from None
        os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(project=project, dir=str(run_dir), config=config, id=run_id, resume="allow")

    def write(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record.get("step", 0))

    def close(self) -> None:
        self.run.finish()


# --- progress line -------------------------------------------------------------------------------

def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_rate(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def progress_line(step: int, total: int, loss: float, lr: float, rate: float, unit: str, eta: float,
                  extra: dict | None = None, processes: int = 1) -> str:
    """``rate``: tokens or samples per second of all processes together (each trains on its slice of
    the global batch, so it is the global batch's size over the step time)."""
    width = len(str(total))
    throughput = f"{format_rate(rate)} {'tok' if unit == 'tokens' else 'samples'}/s"
    if processes > 1:
        throughput += f" over {processes} procs"
    parts = [f"step {step:>{width}}/{total}", f"loss {loss:.4f}", f"lr {lr:.2e}", throughput,
             f"eta {format_duration(eta)}"]
    parts += [f"{k} {v:.3g}" for k, v in (extra or {}).items()]
    return " | ".join(parts)
