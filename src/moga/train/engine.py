"""One training loop for every model, optimizer and task: ``run(config, run_dir) -> result``.

A run directory holds ``config.yaml`` (resolved), ``metrics.jsonl``, ``checkpoint.pt`` (with
``train.parallel=fsdp``: the sharded ``checkpoint.dcp/``, :mod:`moga.train.sharded_checkpoint`), ``plan.txt``
(the optimizer's role plan, when it has one) and, once the run ends, ``result.json``. Calling
``run`` again on the same directory resumes from the checkpoint (bit for bit on CPU) or, for a
finished run, returns the stored result without training.

The final-epoch training loss (``final_train_loss``) is the mean of the per-step training losses
over the run's last ``eval.final_window`` steps: by default one epoch of steps (text: one pass of
``batch_size * block_size`` tokens), or all steps when the run is shorter. Each step's loss is the
minibatch loss measured before that step's update, averaged over micro-batches and processes:
the running average the papers report as the training loss of the last epoch.
``train_eval_loss`` is the final model evaluated on the training split (no augmentation).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import moga
from moga.data import derive_seed
from moga.filelock import DirectoryBusy, writer_lock
from moga.files import read_only, write_json, write_text
from moga.optim import GeometryOptimizer
from moga.optim.multipliers import base_lr
from moga.status import Status

from . import distributed, parallel, sharded_checkpoint as sharded
from .branch import branch_state, check_branch_schedule
from .build import build_optimizer, model_from_config
from .checkpoint import (
    DATA_FINGERPRINT, CheckpointError, check_data, load_checkpoint, refuse_directory, rng_state, save_checkpoint,
    set_rng_state
)
from .config import RunConfig, as_config, dump_yaml, json_float
from .diagnostics import StepInstruments, alignment_record
from .evaluation import evaluate
from .hashing import hash_diff
from .metrics import MetricsLog, TensorBoardSink, WandbSink, progress_line
from .schedule import build_schedule
from .stops import StopFlag, divergence, nonfinite_flag
from .tasks import build_task

# Deferred on purpose, imported where used: torch._dynamo (seconds to import), only for train.compile.

CHECKPOINT, RESULT, CONFIG, METRICS, PLAN = "checkpoint.pt", "result.json", "config.yaml", "metrics.jsonl", "plan.txt"
LOCK = ".train.lock"  # held by the run's one writer (rank 0) while it runs; holds its PID
FINISHED, DIVERGED, STOPPED = Status.FINISHED, Status.DIVERGED, Status.STOPPED


def run(config: RunConfig | dict | str | Path, run_dir: str | Path, *, stop_at: int | None = None,
        quiet: bool = False, wait: bool = False) -> dict:
    """Train (or resume, or return the stored result of) the run in ``run_dir``; returns the result.

    ``stop_at``: checkpoint and return after this many steps (status ``"stopped"``); calling ``run``
    again continues. Under ``torchrun`` every process calls ``run`` and only rank 0 writes files.
    A SIGTERM or Ctrl-C also stops at the next step boundary with a checkpoint.
    One run directory has one writer: while another process runs it, ``run`` raises
    :class:`moga.filelock.DirectoryBusy` naming that process, or with ``wait`` waits for it to end.
    """
    cfg = as_config(config)
    dist = distributed.setup(cfg.train.device, cfg.train.parallel)
    try:
        result = Trainer(cfg, Path(run_dir), dist, quiet=quiet).fit(stop_at, wait=wait)
    except BaseException:
        distributed.teardown(dist, clean=False)
        raise
    distributed.teardown(dist)
    return result


def read_result(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / RESULT
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(result, dict):
            raise ValueError(f"a {type(result).__name__}, not a mapping")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is damaged ({str(e)[:120]}): delete it (rm {path}) and run the same "
                              "command again; the run resumes from its checkpoint (or trains again) and writes it "
                              "anew") from None
    return result


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, dist: distributed.Dist, quiet: bool = False):
        self.cfg, self.run_dir, self.dist = cfg, run_dir, dist
        self.hash = cfg.hash()
        self.quiet = quiet or not dist.main or not cfg.logging.progress
        self.fsdp = cfg.train.parallel == "fsdp"
        self.checkpoint_path = run_dir / (sharded.DIRECTORY if self.fsdp else CHECKPOINT)

    # --- setup -----------------------------------------------------------------------------------

    def _stored_result(self) -> dict | None:
        result = read_result(self.run_dir)
        if result is None:
            return None
        if result.get("config_hash") != self.hash:
            saved = self.run_dir / CONFIG
            diff = hash_diff(as_config(saved), self.cfg, result.get("config_hash")) if saved.is_file() else []
            raise CheckpointError(
                f"{self.run_dir} holds a finished run of another config (hash {result.get('config_hash')}, this "
                f"config {self.hash}); differing keys (stored -> now):\n  " + "\n  ".join(diff or ["?"]))
        return result

    def _load_state(self) -> dict | None:
        """The checkpoint's state (for fsdp, all but the shards), checked against this config."""
        cfg, one_file, dcp_dir = self.cfg, self.run_dir / CHECKPOINT, self.run_dir / sharded.DIRECTORY
        if not self.fsdp:
            refuse_directory(one_file)  # found now, not after training until the first save
        for name, kind in ((RESULT, "result"), (CONFIG, "config"), (PLAN, "plan"), (METRICS, "metrics")):
            refuse_directory(self.run_dir / name, kind)
        if (sharded.find_sharded(dcp_dir) or dcp_dir.is_dir()) and (self.fsdp or not one_file.is_file()):
            return sharded.load_engine_state(dcp_dir, cfg.to_dict(), self.hash)  # another parallel: refused
        if one_file.is_file():
            return load_checkpoint(one_file, cfg.to_dict(), self.hash)
        if cfg.train.branch_from is not None:
            if self.dist.active:
                raise CheckpointError("train.branch_from starts one process from a one-file checkpoint, not "
                                      f"{self.dist.world} (train.parallel={cfg.train.parallel})")
            return branch_state(cfg, self.run_dir, METRICS)
        return None

    def _setup(self) -> dict | None:
        cfg, d = self.cfg, self.dist
        state = self._load_state()
        self.task = build_task(cfg, main=d.main, barrier=lambda: distributed.barrier(d))
        if not self.task.has_split(cfg.eval.split):
            raise ValueError(f"eval.split={cfg.eval.split!r}, but the {cfg.data.name} data has no such split")
        self.data_fingerprint = self.task.fingerprint()
        if state is not None:
            check_data(state, self.data_fingerprint, self.checkpoint_path)
        # The same initial weights on every process (DDP also broadcasts rank 0's).
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        self.model = model_from_config(cfg, self.task.model_inputs).to(d.device)
        if self.fsdp:  # before the optimizer, which must see the sharded parameters
            parallel.shard_model(self.model, cfg.train.precision, cfg.train.offload)
        self.optimizer = build_optimizer(cfg, self.model)
        for group in self.optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.instruments = StepInstruments(cfg, self.model, self.optimizer, self.task, d.device)
        t = cfg.train
        self.total = t.steps if t.steps is not None else max(1, math.ceil(t.epochs * self.task.steps_per_epoch))
        self.schedule = build_schedule(cfg.schedule, self.total, self.task.steps_per_epoch)
        if state is not None and state["config_hash"] != self.hash:  # a branch (a checkpoint of our own has our hash)
            check_branch_schedule(self.schedule, state)
        window = self.task.steps_per_epoch if cfg.eval.final_window == "epoch" else cfg.eval.final_window
        self.eval_every = self.task.steps_per_epoch if cfg.eval.every == "epoch" else cfg.eval.every
        self.window = deque(maxlen=min(window, self.total))
        self.batches = self.task.train_batches()
        self.step, self.elapsed_before, self.since_log, self.since_eval, self.last_eval = 0, 0.0, [], [], None
        self.initial_loss = None  # the first step's loss: the divergence rule's reference
        self.grad_norm = None
        self.session_start = time.perf_counter()
        torch.manual_seed(derive_seed(cfg.seed, 1, d.rank))  # dropout and the like, per process
        if state is not None:
            self._restore(state)
        self.forward_model = self._wrap(self.model)
        return state

    def _wrap(self, model: nn.Module) -> nn.Module:
        self.ddp = None
        if self.dist.active and not self.fsdp:
            ids = [self.dist.device] if self.dist.device.type == "cuda" else None
            model = self.ddp = DistributedDataParallel(model, device_ids=ids)
        if self.cfg.train.compile:
            backend = "inductor" if self.cfg.train.compile is True else self.cfg.train.compile
            import torch._dynamo

            known = torch._dynamo.list_backends(exclude_tags=())
            if backend not in known:  # torch would only say so at the first forward, in a long traceback
                raise ValueError(f"train.compile={backend!r} is not a torch.compile backend; use true (inductor) "
                                 f"or one of {', '.join(known)}")
            model = torch.compile(model, backend=backend)
        return model

    def _open_logs(self, resumed: dict | None) -> None:
        cfg, d = self.cfg, self.dist
        self.log = MetricsLog(self.run_dir / METRICS, enabled=d.main,
                              truncate_to=resumed["metrics_bytes"] if resumed else 0, step=self.step)
        if not d.main:
            return
        if self.log.gap:
            print(f"warning: {self.log.gap}", file=sys.stderr, flush=True)
        write_text(self.run_dir / CONFIG, dump_yaml(cfg))
        plan = getattr(self.optimizer, "plan", None)
        if plan is not None:
            write_text(self.run_dir / PLAN, str(plan) + "\n")
        if cfg.logging.tensorboard:
            self.log.sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        if cfg.logging.wandb:
            self.log.sinks.append(WandbSink(self.run_dir, cfg.logging.wandb_project, cfg.to_dict(), self.hash))

    @property
    def elapsed(self) -> float:
        """Seconds of training over every session of this run."""
        return self.elapsed_before + time.perf_counter() - self.session_start

    # --- checkpoints -----------------------------------------------------------------------------

    def _save(self, path: Path | None = None) -> None:
        self.log.sync()  # the checkpoint records the metrics' length: they reach the disk first
        rngs = distributed.gather_objects(self.dist, rng_state())  # every process takes part
        engine = {
            "config": self.cfg.to_dict(), "config_hash": self.hash, "step": self.step,
            "schedule": {"name": self.schedule.name, "total": self.schedule.total, "warmup": self.schedule.warmup,
                         "min_ratio": self.schedule.min_ratio, "decay": self.schedule.decay},
            "rng": rngs, "data": self.batches.state_dict(), "window": list(self.window),
            "since_log": list(self.since_log), "since_eval": list(self.since_eval),
            "last_eval": self.last_eval, "elapsed": self.elapsed, "metrics_bytes": self.log.offset,
            "world_size": self.dist.world, "instruments": self.instruments.state_dict(),
            "initial_loss": self.initial_loss, DATA_FINGERPRINT: self.data_fingerprint,
        }
        if self.fsdp:
            sharded.save_sharded(self.checkpoint_path, self.model, self.optimizer, engine, main=self.dist.main,
                                 barrier=lambda: distributed.barrier(self.dist))
            return
        if self.dist.main:
            save_checkpoint(path or self.checkpoint_path, {**engine, "model": self.model.state_dict(),
                                                   "optimizer": self.optimizer.state_dict()})
        distributed.barrier(self.dist)

    def _restore(self, state: dict) -> None:
        if self.fsdp:
            sharded.load_sharded(state["directory"], self.model, self.optimizer)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.batches.load_state_dict(state["data"])
        rngs = state["rng"]
        set_rng_state(rngs[self.dist.rank] if self.dist.rank < len(rngs) else rngs[0])
        self.step, self.elapsed_before = int(state["step"]), float(state["elapsed"])
        self.window.extend(state["window"])
        self.since_log, self.since_eval = list(state["since_log"]), list(state["since_eval"])
        self.last_eval = state["last_eval"]
        self.instruments.load_state_dict(state.get("instruments"))
        self.initial_loss = state.get("initial_loss")

    # --- the loop --------------------------------------------------------------------------------

    def _writer_lock(self, wait: bool) -> contextlib.AbstractContextManager:
        """Rank 0 holds the run directory's lock; every rank learns whether it got it."""
        stack, holder = contextlib.ExitStack(), -1.0
        if self.dist.main:
            def waiting(pid):
                print(f"waiting for {self.run_dir}: in use by PID {pid or '?'}", file=sys.stderr, flush=True)

            try:
                stack.enter_context(writer_lock(self.run_dir / LOCK, wait=wait, on_wait=waiting))
            except DirectoryBusy as e:
                holder = float(e.holder or 0)
        (holder,) = distributed.all_sum(self.dist, [holder if self.dist.main else 0.0])
        if holder >= 0:
            raise DirectoryBusy(self.run_dir, int(holder) or None)
        return stack

    def fit(self, stop_at: int | None = None, *, wait: bool = False) -> dict:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ValueError(f"the run directory {self.run_dir} is an existing file; give another directory "
                             "(moga train --run-dir DIR)")
        created = not self.run_dir.exists()
        if not created and read_only(self.run_dir):  # a finished run on a read-only mount is read, not locked
            stored = self._stored_result()
            if stored is not None:
                return stored
        if self.dist.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._writer_lock(wait):
            try:
                return self._fit_locked(stop_at)
            except BaseException:
                # a config that cannot run leaves no empty directory behind (but for the lock, ours)
                if created and self.dist.main and [p.name for p in self.run_dir.iterdir()] == [LOCK]:
                    with contextlib.suppress(OSError):
                        (self.run_dir / LOCK).unlink()
                        self.run_dir.rmdir()
                raise

    def _fit_locked(self, stop_at: int | None) -> dict:
        stored = self._stored_result()
        if stored is not None:
            return stored
        if self.fsdp:  # before training, not at its first save
            sharded.refuse_links(self.checkpoint_path)
        if self.dist.main:
            sharded.discard_unfinished(self.run_dir / sharded.DIRECTORY)  # a save killed by kill -9
        distributed.barrier(self.dist)
        for wanted, package in ((self.cfg.logging.tensorboard, "tensorboard"), (self.cfg.logging.wandb, "wandb")):
            if wanted and importlib.util.find_spec(package) is None:  # fail on every process, before training
                raise ImportError(f"logging.{package}=true needs the {package} package: pip install {package} "
                                  f"(or set logging.{package}=false; metrics.jsonl has every number)")
        previous = torch.are_deterministic_algorithms_enabled()
        if self.cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        try:
            resumed = self._setup()
            self._open_logs(resumed)
            with StopFlag() as flag:
                return self._loop(stop_at, flag)
        finally:
            torch.use_deterministic_algorithms(previous)
            if hasattr(self, "log"):
                self.log.close()

    def _loop(self, stop_at: int | None, flag: StopFlag) -> dict:
        cfg, d, task = self.cfg, self.dist, self.task
        t0, start_step = time.perf_counter(), self.step
        self.session_start = last_log = t0
        per_step = cfg.train.grad_accum * task.micro_batch * (task.block_size if task.unit == "tokens" else 1)
        self.model.train()
        if stop_at is not None and self.step >= stop_at and self.step < self.total:
            return self._stopped()
        while self.step < self.total:
            local_loss = self._forward_backward()
            summed_loss, stop_votes = distributed.all_sum(d, [local_loss, float(flag.set)])
            loss = summed_loss / d.world
            if self.initial_loss is None:
                self.initial_loss = loss
            reason = divergence(cfg.train, loss, self.initial_loss)
            if reason is not None:
                return self._diverged(loss, reason)
            self._optimizer_step(loss)
            self.step += 1
            diagnostics = self.instruments.after_step(self.step, self._epoch())
            if diagnostics is not None:
                self.log.write(diagnostics)
            if cfg.logging.alignment_every and self.step % cfg.logging.alignment_every == 0:
                self.log.write(alignment_record(self.optimizer, self.step, self._epoch()))
            self.optimizer.zero_grad(set_to_none=True)
            self.window.append(loss)
            self.since_log.append(loss)
            self.since_eval.append(loss)

            now = time.perf_counter()
            if self.step % cfg.logging.log_every == 0 or self.step == self.total:
                rate = len(self.since_log) * per_step / max(now - last_log, 1e-9)
                done = self.step - start_step
                eta = (now - t0) / done * (self.total - self.step)
                self._log_train(rate, eta)
                last_log = now
            if self.eval_every and self.step % self.eval_every == 0 and self.step < self.total:
                self._evaluate_and_log()
            every = cfg.checkpoint.every
            stop = (stop_at is not None and self.step >= stop_at) or stop_votes > 0
            if self.step < self.total and (stop or (every and self.step % every == 0)):
                self._save()
            if self.step < self.total and self.step in cfg.checkpoint.keep and not self.fsdp:  # a branch point
                self._save(self.run_dir / f"checkpoint-{self.step}.pt")
            if stop and self.step < self.total:
                return self._stopped()
        return self._finish()

    def _optimizer_step(self, loss: float) -> None:
        """Clip the gradients (if asked), set this step's lr and take the optimizer's step."""
        clip, found_inf = self.cfg.train.grad_clip, None
        if clip is not None:  # the global norm: over DTensor shards, a sum over ranks
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            if isinstance(self.optimizer, GeometryOptimizer):  # it need not read the gradients again
                found_inf = nonfinite_flag(self.grad_norm)
        # The schedule is the one writer of the lr; the step rule (if any) is a factor on it.
        lr_factor = self.schedule.factor(self.step)
        # the base rate, not group 0's multiplied one
        base = base_lr(self.optimizer.param_groups[0], "initial_lr")
        lr_factor *= self.instruments.lr_scale(self.step, base * lr_factor)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lr_factor
        self.instruments.before_step(self.step)  # diagnostics' first probe
        if getattr(self.optimizer, "needs_loss", False):
            self.optimizer.step(loss=loss)
        elif found_inf is not None:
            self.optimizer.step(found_inf=found_inf)
        else:
            self.optimizer.step()

    def steps_untracked(self, steps: int) -> None:
        """``steps`` steps as :meth:`_loop` takes them, with nothing logged, evaluated or saved and the step counter
        kept: what :mod:`moga.train.step_cost` times."""
        for _ in range(steps):
            self._optimizer_step(self._forward_backward())
            self.optimizer.zero_grad(set_to_none=True)

    def _stopped(self) -> dict:
        """Not a result: the run continues when ``run`` is called again (nothing is written but the checkpoint)."""
        return {"status": STOPPED, "steps": self.step, "total_steps": self.total, "config_hash": self.hash}

    def _forward_backward(self) -> float:
        d, task, accum = self.dist, self.task, self.cfg.train.grad_accum
        total = torch.zeros((), dtype=torch.float64, device=d.device)  # read once per step, not per micro-batch
        for micro in range(accum):
            x, y = next(self.batches)
            shard = d.shard(len(y))
            x, y = x[shard].to(d.device, non_blocking=True), y[shard].to(d.device, non_blocking=True)
            with parallel.gradient_sync(self.model if self.ddp is None else self.ddp, micro == accum - 1):
                with parallel.autocast(self.cfg.train.precision, d.device):
                    loss, _, _ = task.loss(self.forward_model, x, y, accuracy=False)
                (loss / accum).backward()
            total += loss.detach().double()
        return float(total) / accum

    # --- records ---------------------------------------------------------------------------------

    def _epoch(self) -> float:
        return round(self.step / self.task.steps_per_epoch, 4)

    def _log_train(self, rate: float, eta: float) -> None:
        loss = sum(self.since_log) / len(self.since_log)
        lr = base_lr(self.optimizer.param_groups[0])
        unit = "tokens_per_s" if self.task.unit == "tokens" else "samples_per_s"
        record = {"type": "train", "step": self.step, "epoch": self._epoch(), "loss": loss, "lr": lr,
                  unit: rate, "time": round(self.elapsed, 3)}
        if self.grad_norm is not None:  # the last step's norm before clipping
            norm = self.grad_norm
            record["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        extra = self.optimizer.diagnostics() if callable(getattr(self.optimizer, "diagnostics", None)) else {}
        extra = {**extra, **self.instruments.info}
        record.update({k: v for k, v in extra.items() if k not in record})
        self.log.write(record)
        self.since_log = []
        if not self.quiet:
            shown = {{"eta": "eta_t", "smoothness_L": "L"}.get(k, k): v for k, v in extra.items()
                     if k in ("eta", "w_norm", "smoothness_L")}
            print(progress_line(self.step, self.total, loss, lr, rate, self.task.unit, eta, shown, self.dist.world),
                  flush=True)

    def _evaluate_and_log(self) -> dict:
        cfg = self.cfg
        record = {"type": "eval", "step": self.step, "epoch": self._epoch(),
                  "train_loss": sum(self.since_eval) / len(self.since_eval) if self.since_eval else None}
        of = lambda split: evaluate(self.model, self.task, cfg, self.dist, split, self.fsdp)  # noqa: E731
        if cfg.eval.train_eval:
            record["train_eval_loss"], record["train_eval_acc"] = of("train")
        split = cfg.eval.split
        if self.task.has_split(split):
            record[f"{split}_loss"], record[f"{split}_acc"] = of(split)
        record = {k: v for k, v in record.items() if v is not None}
        self.log.write(record)
        self.since_eval, self.last_eval = [], record
        if not self.quiet:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k not in ("type", "step", "epoch"))
            print(f"eval at step {self.step}: {shown}", flush=True)
        return record

    def _base_result(self, status: str) -> dict:
        return {"status": status, "name": self.cfg.name, "config_hash": self.hash, "steps": self.step,
                "total_steps": self.total, "epochs": self._epoch(), "seed": self.cfg.seed,
                "world_size": self.dist.world, "skipped_steps": getattr(self.optimizer, "skipped_steps", 0),
                "final_window_steps": len(self.window), DATA_FINGERPRINT: self.data_fingerprint,
                "moga_version": moga.__version__,
                "torch_version": torch.__version__}

    def _finish(self) -> dict:
        record = self.last_eval if self.last_eval and self.last_eval["step"] == self.step else self._evaluate_and_log()
        split = self.cfg.eval.split
        result = {**self._base_result(FINISHED),
                  "final_train_loss": sum(self.window) / len(self.window),
                  "train_eval_loss": record.get("train_eval_loss"), "train_eval_acc": record.get("train_eval_acc"),
                  "eval_split": split, "val_loss": record.get(f"{split}_loss"), "val_acc": record.get(f"{split}_acc"),
                  "wall_time_s": round(self.elapsed, 3)}
        if self.cfg.checkpoint.save_final:
            self._save()
        return self._write_result(result)

    def _diverged(self, loss: float, reason: str) -> dict:
        self.log.write({"type": "diverged", "step": self.step, "loss": json_float(loss), "reason": reason})
        if not self.quiet:
            print(f"diverged at step {self.step}: loss {loss} ({reason})", flush=True)
        result = {**self._base_result(DIVERGED), "final_train_loss": math.inf, "train_eval_loss": math.inf,
                  "train_eval_acc": None, "eval_split": self.cfg.eval.split, "val_loss": math.inf, "val_acc": None,
                  "diverged_step": self.step, "diverged_loss": json_float(loss), "diverged_reason": reason,
                  "wall_time_s": round(self.elapsed, 3)}
        return self._write_result(result)

    def _write_result(self, result: dict) -> dict:
        if self.dist.main:
            write_json(self.run_dir / RESULT, result)
        distributed.barrier(self.dist)
        return result
