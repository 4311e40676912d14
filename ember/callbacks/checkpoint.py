"""ModelCheckpoint: save checkpoints periodically and keep the top-k by a monitored
metric. Every rank calls the save (sharded strategies write shards); only global
rank zero deletes files. Its bookkeeping is part of the checkpoint, so top-k
stays consistent across resumes."""
from __future__ import annotations

import math
import os
import re
import shutil
import time

import torch

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError, invalid_choice


class ModelCheckpoint(Callback):
    """
    Args:
        dirpath: where to write; default ``<log_dir>/checkpoints``.
        filename: template such as ``"{epoch}-{step}-{val/loss:.3f}"`` (metric names are
            inserted as ``name=value``, with ``/`` written as ``_``).
        monitor / mode: the metric to rank checkpoints by (``"min"`` or ``"max"``).
        save_top_k: keep the k best (−1 all, 0 none); without a monitor, the k latest.
        save_last: also keep ``last`` pointing at the newest checkpoint (a symlink, or a
            copy where links are not possible).
        every_n_train_steps / every_n_epochs / train_time_interval: when to save
            (defaults: every epoch end).
        save_weights_only: write a plain ``.safetensors`` file of the weights instead.
    """

    CHECKPOINT_NAME_LAST = "last"

    def __init__(self, dirpath: str | None = None, filename: str | None = None, monitor: str | None = None,
                 mode: str = "min", save_top_k: int = 1, save_last: bool | None = None,
                 every_n_train_steps: int | None = None, every_n_epochs: int | None = None,
                 train_time_interval=None, save_weights_only: bool = False, save_on_train_epoch_end: bool | None = None,
                 auto_insert_metric_name: bool = True, verbose: bool = False):
        if mode not in ("min", "max"):
            raise invalid_choice("ModelCheckpoint(mode)", mode, ["min", "max"])
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise MisconfigurationError(f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0 (none) or k >= 1")
        for name, v in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if v is not None and (not isinstance(v, int) or v < 0):
                raise MisconfigurationError(f"ModelCheckpoint({name}={v!r}): use a non-negative int or None")
        if sum(x is not None and x != 0 for x in (every_n_train_steps, every_n_epochs, train_time_interval)) > 1:
            raise MisconfigurationError("ModelCheckpoint: set only one of every_n_train_steps, every_n_epochs, "
                                        "train_time_interval")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename, self.monitor, self.mode = filename, monitor, mode
        self.save_top_k, self.save_last = save_top_k, save_last
        self.every_n_train_steps = every_n_train_steps or 0
        if hasattr(train_time_interval, "total_seconds"):
            train_time_interval = train_time_interval.total_seconds()
        self.train_time_interval = train_time_interval
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (
            0 if (self.every_n_train_steps or train_time_interval) else 1)
        self.save_weights_only, self.auto_insert_metric_name, self.verbose = save_weights_only, auto_insert_metric_name, verbose
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.best_k_models: dict[str, float] = {}
        self.kth_best_model_path = ""
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.last_model_path = ""
        self._last_global_step_saved = -1
        self._last_time = time.monotonic()
        if not (self.every_n_train_steps or self.train_time_interval):
            self.inactive_hooks = frozenset({"on_train_batch_end"})

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}, every_n_train_steps={self.every_n_train_steps}, every_n_epochs={self.every_n_epochs}}}"

    # -- hooks ------------------------------------------------------------------------------
    def setup(self, trainer, module, stage):
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.log_dir, "checkpoints")
        self._last_time = time.monotonic()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self._last_global_step_saved or trainer.sanity_checking:
            return
        due = False
        if self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0 and trainer.global_step:
            due = True
        elif self.train_time_interval:
            if trainer.world_size == 1:
                due = time.monotonic() - self._last_time >= self.train_time_interval
            elif trainer.global_step % trainer.log_every_n_steps == 0:   # agree without a per-step collective
                due = bool(trainer.strategy.broadcast(time.monotonic() - self._last_time >= self.train_time_interval))
        if due:
            self._save(trainer)

    def on_validation_end(self, trainer, module):
        # mid-epoch validations only; at an epoch end the save happens in on_train_epoch_end
        if trainer.sanity_checking or trainer.stage != "fit" or self.save_on_train_epoch_end:
            return
        if trainer._epoch_finished or trainer._batches_done >= trainer.num_training_batches:
            return
        if self.monitor is not None and not self.every_n_train_steps and not self.train_time_interval:
            self._save(trainer)

    def on_train_epoch_end(self, trainer, module):
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    # -- saving -------------------------------------------------------------------------------
    def format_checkpoint_name(self, metrics: dict, epoch: int, step: int) -> str:
        template = self.filename or "{epoch}-{step}"
        values = {"epoch": epoch, "step": step, **{k: float(v) for k, v in metrics.items()}}

        def repl(m):
            name, fmt = m.group(1), m.group(2) or ""
            if name not in values:
                raise MisconfigurationError(f"ModelCheckpoint(filename={template!r}): {name!r} is not a logged "
                                            f"metric; logged: {sorted(metrics)}")
            v = format(values[name], fmt[1:]) if fmt else str(values[name])
            return f"{name.replace('/', '_')}={v}" if self.auto_insert_metric_name else v
        return re.sub(r"\{([^{}:]+)(:[^{}]*)?\}", repl, template).replace("/", "_")

    def _monitor_value(self, trainer):
        if self.monitor is None:
            return None
        v = trainer.callback_metrics.get(self.monitor)
        if v is None:
            raise MisconfigurationError(
                f"ModelCheckpoint(monitor={self.monitor!r}) could not find the metric; logged metrics are "
                f"{sorted(trainer.callback_metrics)}. Log it with self.log({self.monitor!r}, ...) or change monitor.")
        return float(v)

    def _is_better(self, score, than) -> bool:
        if math.isnan(score):
            return False
        return score < than if self.mode == "min" else score > than

    def _save(self, trainer) -> None:
        score = self._monitor_value(trainer)
        self._last_global_step_saved = trainer.global_step
        self._last_time = time.monotonic()
        name = self.format_checkpoint_name(trainer.callback_metrics, trainer.current_epoch, trainer.global_step)
        ext = ".safetensors" if self.save_weights_only else ""
        path = os.path.join(self.dirpath, name + ext)
        keep = self.save_top_k != 0
        worst = None
        if keep and score is not None and self.save_top_k > 0 and len(self.best_k_models) >= self.save_top_k:
            worst = self.kth_best_model_path
            keep = self._is_better(score, self.best_k_models[worst])
        if keep:
            self._write(trainer, path)
            self.best_k_models[path] = score if score is not None else float(trainer.global_step)
            if score is None and self.save_top_k > 0:
                # without a monitor keep the k latest
                while len(self.best_k_models) > self.save_top_k:
                    oldest = min(self.best_k_models, key=self.best_k_models.get)
                    self.best_k_models.pop(oldest)
                    self._remove(trainer, oldest)
            elif worst is not None:
                self.best_k_models.pop(worst, None)
                if worst != path:
                    self._remove(trainer, worst)
            self._update_best()
        if self.save_last:
            last = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + ext)
            self._link_last(trainer, path if keep else None, last)
        if trainer.is_global_zero and keep:
            aliases = ["latest"] + (["best"] if path == self.best_model_path else [])
            for lg in trainer.loggers:
                lg.after_save_checkpoint(path, aliases=aliases, score=score)

    def save_last_now(self, trainer) -> str:
        """Save the newest state as ``last`` (used on preemption)."""
        self.dirpath = self.dirpath or os.path.join(trainer.log_dir, "checkpoints")
        path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST)
        trainer.save_checkpoint(path)
        self.last_model_path = path
        return path

    def _write(self, trainer, path):
        if self.save_weights_only:
            from ember import checkpoint_io as cio
            weights = trainer.strategy.module_state_dict(trainer.model)
            if trainer.is_global_zero:
                os.makedirs(self.dirpath, exist_ok=True)
                cio.save_weights_file(path, weights)
            trainer.strategy.barrier("save_weights")
        else:
            trainer.save_checkpoint(path)
        if self.verbose and trainer.is_global_zero:
            print(f"ember: saved checkpoint {path}")

    def _link_last(self, trainer, target, last):
        if target is None or not trainer.is_global_zero:
            if target is None:
                self._write(trainer, last)
                self.last_model_path = last
            return
        tmp = last + ".link.tmp"
        try:
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(os.path.basename(target), tmp)
            if os.path.isdir(last) and not os.path.islink(last):
                shutil.rmtree(last)
            os.replace(tmp, last)
        except OSError:
            if os.path.lexists(last):
                shutil.rmtree(last) if os.path.isdir(last) and not os.path.islink(last) else os.remove(last)
            (shutil.copytree if os.path.isdir(target) else shutil.copy2)(target, last)
        self.last_model_path = last

    def _remove(self, trainer, path):
        if not trainer.is_global_zero or not path or not os.path.exists(path):
            return
        last = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST)
        if os.path.islink(last) and os.path.realpath(last) == os.path.realpath(path):
            return  # 'last' still points here
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def _update_best(self):
        if not self.best_k_models:
            return
        pick = min if self.mode == "min" or self.monitor is None else max
        if self.monitor is None:
            self.best_model_path = max(self.best_k_models, key=self.best_k_models.get)
            self.kth_best_model_path = min(self.best_k_models, key=self.best_k_models.get)
            return
        self.best_model_path = pick(self.best_k_models, key=self.best_k_models.get)
        self.best_model_score = torch.tensor(self.best_k_models[self.best_model_path])
        worst = max if self.mode == "min" else min
        self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self):
        return {"monitor": self.monitor, "best_model_score": None if self.best_model_score is None else float(self.best_model_score),
                "best_model_path": self.best_model_path, "best_k_models": dict(self.best_k_models),
                "kth_best_model_path": self.kth_best_model_path, "last_model_path": self.last_model_path,
                "dirpath": self.dirpath}

    def load_state_dict(self, state):
        if state.get("dirpath") and self.dirpath not in (None, state["dirpath"]):
            # a new run directory: keep our own bookkeeping fresh but remember the best
            self.best_model_path = state.get("best_model_path", "")
            return
        self.dirpath = state.get("dirpath", self.dirpath)
        self.best_k_models = {k: float(v) for k, v in state.get("best_k_models", {}).items() if os.path.exists(k)}
        self.kth_best_model_path = state.get("kth_best_model_path", "")
        self.best_model_path = state.get("best_model_path", "")
        s = state.get("best_model_score")
        self.best_model_score = None if s is None else torch.tensor(s)
        self.last_model_path = state.get("last_model_path", "")
