"""ModelCheckpoint: save checkpoints periodically and keep the top-k by a monitored
metric. Every rank calls the save (sharded strategies write shards); only global
rank zero links ``last`` and deletes files. Whether to save, the file name and the
monitored score are rank zero's, broadcast in one collective at each save point, so
every rank takes the same save/keep/delete decision (a metric logged without
``sync_dist`` cannot make ranks disagree). Its bookkeeping is part of the
checkpoint, so top-k stays consistent across resumes."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import uuid
import warnings
from typing import Any

import torch

from ember.callbacks.base import Callback
from ember.errors import CheckpointError, MisconfigurationError, invalid_choice

_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")
#: stop reasons after which the fit saves where it stopped (``on_train_end``)
_MID_EPOCH_STOPS = ("max_time", "timer", "early_stopping", "should_stop", "max_steps")


class ModelCheckpoint(Callback):
    """Save checkpoints while training (enabled by default with its defaults below).

    Args:
        dirpath: where to write; default ``<log_dir>/checkpoints`` (``log_dir`` is the first
            logger's run folder, or ``default_root_dir`` without a logger).
        filename: template such as ``"{epoch}-{step}-{val/loss:.3f}"``; each field becomes
            ``name=value`` (``auto_insert_metric_name=False``: just the value) and ``/`` in
            names is written as ``_``. Default ``"{epoch}-{step}"``.
        monitor: the logged metric to rank checkpoints by (default None: no ranking, the
            newest are kept).
        mode: ``"min"`` (default: a lower ``monitor`` is better) or ``"max"``.
        save_top_k: keep the k best (-1 all, 0 none); without a monitor, the k latest.
        save_last: also keep ``last`` pointing at the newest checkpoint (a symlink where
            the file system allows it, else a copy); ``last`` is what ``ckpt_path="last"`` finds.
            It follows every save, so it is the newest state: Lightning's ``last.ckpt``
            is written only with a top-k save (docs/porting.md, deliberate differences).
        every_n_train_steps: save every N optimizer steps (when set, not at epoch ends).
        every_n_epochs: save at the end of every N-th epoch (default 1 when neither of the
            other two is set).
        train_time_interval: save when this much training time has passed since the last
            save (seconds or a ``datetime.timedelta``). Set at most one of the three.
        save_weights_only: write plain ``.safetensors`` files of the weights (no trainer
            state: they cannot be resumed from, but load with ``Module.load_from_checkpoint``).
        save_on_train_epoch_end: True: never save after a mid-epoch validation.
        auto_insert_metric_name: write ``name=value`` for each filename field (False: just the value).
        verbose: print a line at each save.
    """

    CHECKPOINT_NAME_LAST = "last"

    def __init__(self, dirpath: str | None = None, filename: str | None = None, monitor: str | None = None,
                 mode: str = "min", save_top_k: int = 1, save_last: bool | None = None,
                 every_n_train_steps: int | None = None, every_n_epochs: int | None = None,
                 train_time_interval: float | Any = None, save_weights_only: bool = False, save_on_train_epoch_end: bool | None = None,
                 auto_insert_metric_name: bool = True, verbose: bool = False):
        if mode not in ("min", "max"):
            raise invalid_choice("ModelCheckpoint(mode)", mode, ["min", "max"])
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
            raise MisconfigurationError(f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0 (none) or k >= 1")
        for name, v in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise MisconfigurationError(f"ModelCheckpoint({name}={v!r}): use a non-negative int or None")
        if hasattr(train_time_interval, "total_seconds"):
            train_time_interval = train_time_interval.total_seconds()
        if train_time_interval is not None and (isinstance(train_time_interval, bool) or
                                                not isinstance(train_time_interval, (int, float)) or
                                                train_time_interval <= 0):
            raise MisconfigurationError(f"ModelCheckpoint(train_time_interval={train_time_interval!r}): use "
                                        "positive seconds or a datetime.timedelta")
        if sum(bool(x) for x in (every_n_train_steps, every_n_epochs, train_time_interval)) > 1:
            raise MisconfigurationError("ModelCheckpoint: set only one of every_n_train_steps, every_n_epochs, "
                                        "train_time_interval")
        if filename is not None and (not isinstance(filename, str) or not filename or os.sep in filename.replace("/", "")):
            raise MisconfigurationError(f"ModelCheckpoint(filename={filename!r}): use a non-empty template "
                                        "without path separators, e.g. '{epoch}-{step}'")
        if filename is not None and _reserved(filename):
            raise MisconfigurationError(f"ModelCheckpoint(filename={filename!r}): {_reserved(filename)}")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename, self.monitor, self.mode = filename, monitor, mode
        self.save_top_k, self.save_last = save_top_k, save_last
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (
            0 if (self.every_n_train_steps or train_time_interval) else 1)
        self.save_weights_only, self.auto_insert_metric_name, self.verbose = save_weights_only, auto_insert_metric_name, verbose
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.best_k_models: dict[str, float] = {}
        self.kth_best_model_path = ""
        self.kth_value: float | None = None
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.last_model_path = ""
        self._last_global_step_saved = -1
        self._last_time = time.monotonic()
        self._val_ran = False
        self._warned = False
        self._stale: list[str] = []
        self._lock = None
        if not (self.every_n_train_steps or self.train_time_interval):
            self.inactive_hooks = frozenset({"on_train_batch_end"})

    @property
    def state_key(self) -> str:
        return (f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}, every_n_train_steps="
                f"{self.every_n_train_steps}, every_n_epochs={self.every_n_epochs}}}")

    # -- hooks ------------------------------------------------------------------------------
    def setup(self, trainer, module, stage):
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.log_dir, "checkpoints")
        self._last_time = time.monotonic()
        self._val_ran = False
        if stage != "fit" or getattr(trainer, "fast_dev_run", 0):
            return
        # rank zero writes and deletes here: it checks the folder is writable and takes the
        # folder's lock now (not at the first save); every rank learns the outcome
        from ember.checkpoint import trust as checks
        from ember.checkpoint.lock import DirLock
        from ember.strategies.full_load import raise_rank0_error
        error = None
        if trainer.is_global_zero:
            try:
                checks.check_writable(self.dirpath, f"ModelCheckpoint(dirpath={self.dirpath!r})")
                if self.save_last:   # `last` is replaced at every save: only when ember made it
                    name = self.CHECKPOINT_NAME_LAST + (".safetensors" if self.save_weights_only else "")
                    checks.check_replace(os.path.join(self.dirpath, name), "ModelCheckpoint(save_last=True)")
                if self._lock is None or not self._lock.held:
                    self._lock = DirLock(self.dirpath)
                    self._lock.acquire(f"ModelCheckpoint(dirpath={self.dirpath!r})")
            except Exception as err:   # any error (a disk error writing the lock too): every rank learns it
                error = err
        raise_rank0_error(trainer.strategy, error, f"ModelCheckpoint(dirpath={self.dirpath!r}): rank 0 could not "
                          "prepare the folder", complete=True)

    def teardown(self, trainer, module, stage):
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self._last_global_step_saved or trainer.sanity_checking:
            return
        due = False
        if self.every_n_train_steps:
            due = trainer.global_step > 0 and trainer.global_step % self.every_n_train_steps == 0
        elif self.train_time_interval:
            if trainer.world_size == 1:
                due = time.monotonic() - self._last_time >= self.train_time_interval
            elif trainer.global_step % trainer.log_every_n_steps == 0:   # agree without a per-step collective
                due = trainer.strategy.agree(time.monotonic() - self._last_time >= self.train_time_interval, "rank0")
        if due:
            self._save(trainer)

    def on_validation_end(self, trainer, module):
        if trainer.sanity_checking or trainer.stage != "fit":
            return
        self._val_ran = True
        # mid-epoch validations only; at an epoch end the save happens in on_train_epoch_end
        if self.save_on_train_epoch_end or trainer.epoch_finished \
                or trainer.batches_done >= trainer.num_training_batches:
            return
        if self.monitor is not None and not self.every_n_train_steps and not self.train_time_interval \
                and self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer, module):
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    def on_train_end(self, trainer, module):
        # a fit stopped mid-epoch (max_time, Timer, EarlyStopping, should_stop, max_steps) saves
        # where it stopped, so ckpt_path="last" continues at the next batch (every rank agreed)
        if trainer.stop_reason in _MID_EPOCH_STOPS and not trainer.epoch_finished \
                and trainer.batches_done and trainer.global_step != self._last_global_step_saved:
            self._save(trainer)
        # a background save still in flight is committed now (every rank: the same state),
        # so 'last', the deletions and the loggers' after_save_checkpoint happen before the
        # loggers are finalized
        if trainer.strategy.save_pending:
            trainer.strategy.wait_for_checkpoint()

    # -- names --------------------------------------------------------------------------------
    def format_checkpoint_name(self, metrics: dict, epoch: int, step: int) -> str:
        """The file name (without extension) for ``metrics`` at ``epoch``/``step``."""
        template = self.filename or "{epoch}-{step}"
        values = {"epoch": epoch, "step": step, **{k: float(v) for k, v in metrics.items()}}

        def repl(m):
            name, fmt = m.group(1).strip(), m.group(2) or ""
            if name not in values:
                raise MisconfigurationError(f"ModelCheckpoint(filename={template!r}): {name!r} is not a logged "
                                            f"metric; logged: {sorted(metrics)}")
            v = format(values[name], fmt[1:]) if fmt else str(values[name])
            return f"{name}={v}" if self.auto_insert_metric_name else v
        name = _FIELD.sub(repl, template).replace("/", "_").replace(os.sep, "_")
        if _reserved(name):
            raise MisconfigurationError(f"ModelCheckpoint(filename={template!r}) gives the name {name!r}: "
                                        f"{_reserved(name)}")
        return name

    def _template_fields(self) -> list[str]:
        return [m.group(1).strip() for m in _FIELD.finditer(self.filename or "")] if self.filename else []

    def _missing(self, trainer) -> list[str]:
        names = ([self.monitor] if self.monitor else []) + [
            f for f in self._template_fields() if f not in ("epoch", "step")]
        return [n for n in names if n not in trainer.callback_metrics]

    def _metrics_expected(self, trainer) -> bool:
        """Whether a missing metric is an error now (the loops that log it have run) or
        only not yet available (a validation metric before the first validation)."""
        if self._val_ran:
            return True
        return trainer.epoch_finished and not trainer.val_dataloaders

    # -- saving -------------------------------------------------------------------------------
    def _is_better(self, score: float, than: float) -> bool:
        return score < than if self.mode == "min" else score > than

    def _worst(self, scores: dict) -> str:
        if self.monitor is None:   # without a monitor the oldest goes first
            return min(scores, key=scores.get)
        return (max if self.mode == "min" else min)(scores, key=scores.get)

    def _save(self, trainer) -> None:
        if getattr(trainer, "fast_dev_run", 0):   # a smoke test writes nothing (as in Lightning)
            return
        missing = self._missing(trainer)
        score = None
        if self.monitor is not None and not missing:
            score = float(trainer.callback_metrics[self.monitor])
            if math.isnan(score):   # a NaN ranks last
                score = math.inf if self.mode == "min" else -math.inf
        step = trainer.global_step
        ext = ".safetensors" if self.save_weights_only else ""
        path = None
        if not missing:
            name = self.format_checkpoint_name(trainer.callback_metrics, trainer.current_epoch, step)
            path = self._free_path(os.path.join(self.dirpath, name + ext), step, ext)
        if trainer.world_size > 1:
            # rank zero's view decides (its metric, its directory listing, its top-k as it
            # restored it from the files its node sees): one collective, so save / keep /
            # delete are the same on every rank
            missing, score, path, best = trainer.strategy.broadcast(
                (missing, score, path, self.best_k_models if trainer.is_global_zero else None))
            if best != self.best_k_models:
                self.best_k_models = dict(best)
                self._update_best()
        if missing:
            msg = (f"ModelCheckpoint(monitor={self.monitor!r}, filename={self.filename!r}) could not find "
                   f"{missing}: {trainer.describe_missing_metric(missing[0])}. Metrics available now: "
                   f"{sorted(trainer.callback_metrics)}.")
            if self._metrics_expected(trainer):
                raise MisconfigurationError(msg)
            if not self._warned and trainer.is_global_zero:
                warnings.warn(msg + " Skipping this save (no validation has run yet)" + (
                    "; 'last' is written (save_last=True)." if self.save_last else "."), stacklevel=2)
            self._warned = True
            if self.save_last:   # as in Lightning, `last` does not wait for the monitored metric
                self._last_global_step_saved = step
                self._last_time = time.monotonic()
                self._update_last(trainer, None, ext)
            return
        self._last_global_step_saved = step
        self._last_time = time.monotonic()
        others = {p: s for p, s in self.best_k_models.items() if p != path}
        if self.save_top_k == 0:
            keep = False
        elif self.save_top_k == -1 or score is None or len(others) < self.save_top_k:
            keep = True
        else:
            keep = self._is_better(score, others[self._worst(others)])
        if keep:
            # the bookkeeping is updated before the write, so the checkpoint records itself
            # and the files it supersedes (deleted once it is committed, or on resume if a
            # crash came in between)
            before = (dict(self.best_k_models), list(self._stale))
            kept = dict(others, **{path: score if score is not None else float(step)})
            drop = []
            while self.save_top_k > 0 and len(kept) > self.save_top_k:
                worst = self._worst({p: s for p, s in kept.items() if p != path})
                kept.pop(worst)
                drop.append(worst)
            self.best_k_models = kept
            self._stale = [p for p in dict.fromkeys([*self._stale, *drop]) if p not in kept]
            self._update_best()
            if self.save_last:
                self.last_model_path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + ext)
            try:
                self._write(trainer, path)
            except BaseException:
                self.best_k_models, self._stale = before
                self._update_best()
                raise
        elif self.save_last:
            self._update_last(trainer, None, ext)    # writes 'last' itself: a save of its own
        # what the new checkpoint supersedes goes only once it is committed, on every rank's
        # part (a background save: at the next save, load or the end of fit), so a kill at
        # any moment leaves a complete checkpoint that ckpt_path="last" resumes
        stale, best = list(self._stale), path == self.best_model_path
        trainer.strategy.after_commit(lambda: self._committed(trainer, path if keep else None, ext, stale,
                                                              score, best))

    def _committed(self, trainer, path, ext, stale, score, best) -> None:
        """After ``path`` (None: nothing kept) is committed: point ``last`` at it, delete
        the checkpoints it supersedes, tell the loggers. Local file operations only."""
        if path is not None and self.save_last:
            self._update_last(trainer, path, ext)
        for p in stale:
            if p not in self.best_k_models:
                self._remove(trainer, p)
        self._stale = [p for p in self._stale if p not in stale]
        if trainer.is_global_zero and path is not None:
            aliases = ["latest"] + (["best"] if best else [])
            for lg in trainer.loggers:
                lg.after_save_checkpoint(path, aliases=aliases, score=score)

    def _free_path(self, path: str, step: int, ext: str) -> str:
        """``path``, or ``path-v1``, ``-v2``... when a checkpoint of another step has that name
        (a template without ``{step}``). The same step is overwritten: that is a re-save after
        a resume, of the same state."""
        base = path[: -len(ext)] if ext else path
        candidate, version = path, 0
        while os.path.lexists(candidate) and os.path.basename(candidate) != self.CHECKPOINT_NAME_LAST + ext \
                and _saved_step(candidate) != step:
            version += 1
            candidate = f"{base}-v{version}{ext}"
        return candidate

    def _remove_stale(self, trainer) -> None:
        stale, self._stale = self._stale, []
        for p in stale:
            if p not in self.best_k_models:
                self._remove(trainer, p)

    def on_train_start(self, trainer, module):
        # left by a crash between a save and its clean-up
        self._remove_stale(trainer)
        if trainer.is_global_zero and self.dirpath and os.path.isdir(self.dirpath):
            for name in os.listdir(self.dirpath):
                if re.fullmatch(re.escape(self.CHECKPOINT_NAME_LAST) + _LINK_TMP, name):
                    try:
                        os.remove(os.path.join(self.dirpath, name))
                    except OSError:
                        pass

    def save_last_now(self, trainer) -> str:
        """Save the current state as a full checkpoint ``last`` (used on preemption)."""
        self.dirpath = self.dirpath or os.path.join(trainer.log_dir, "checkpoints")
        path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST)
        trainer.save_checkpoint(path)
        self.last_model_path = path
        return path

    def _write(self, trainer, path):
        if self.save_weights_only:
            from ember.checkpoint import io as cio
            from ember.strategies.full_load import raise_rank0_error
            weights = trainer.strategy.module_state_dict(trainer.model)
            error = None
            if trainer.is_global_zero:
                try:
                    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                    cio.save_weights_file(path, weights, {"epoch": str(trainer.current_epoch),
                                                          "global_step": str(trainer.global_step)})
                except Exception as err:   # reported to every rank below, raised here as it is
                    error = err
            # rank 0's outcome in place of a closing barrier: a failed write raises on every rank
            raise_rank0_error(trainer.strategy, error, f"checkpoint {path} was not written on rank 0")
        else:
            trainer.save_checkpoint(path)
        if self.verbose and trainer.is_global_zero:
            score = f" ({self.monitor}={float(trainer.callback_metrics[self.monitor]):.5g})" if self.monitor else ""
            print(f"ember: saved checkpoint {path}{score}")

    def _update_last(self, trainer, target, ext):
        """Point ``last`` at ``target`` (a symlink swapped in atomically), or, when nothing
        was kept, write the state to ``last`` itself."""
        last = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + ext)
        self.last_model_path = last
        if target is None:
            self._write(trainer, last)
            return
        if not trainer.is_global_zero:
            return
        from ember.checkpoint import io as cio
        from ember.checkpoint import trust as checks
        why = checks.not_replaceable(last)   # checked at setup; here only if it appeared since
        if why:
            warnings.warn(f"ModelCheckpoint(save_last=True): not updating {last}: {why}; ember replaces only "
                          "what it made", UserWarning, stacklevel=2)
            return
        tmp = f"{last}.{uuid.uuid4().hex[:8]}.link.tmp"
        try:
            os.symlink(os.path.basename(target), tmp)
        except (OSError, NotImplementedError):
            self._copy_last(target, last)
            return
        try:
            if os.path.isdir(last) and not os.path.islink(last):
                # a real directory (a preemption save, an ember checkpoint: checked above): move it
                # aside, it is ignored by discovery
                old = f"{last}.old-{uuid.uuid4().hex[:12]}"
                os.rename(last, old)
                os.replace(tmp, last)
                cio.remove_checkpoint(old)
            else:
                os.replace(tmp, last)   # atomic on POSIX
        except OSError:
            if os.path.lexists(tmp):
                os.remove(tmp)
            self._copy_last(target, last)

    @staticmethod
    def _copy_last(target, last):
        from ember.checkpoint import io as cio
        what = "ModelCheckpoint(save_last=True)"
        if os.path.isdir(target):
            tmp = cio.make_staging(last, what)        # refuses a `last` or `last.ember-tmp` ember did not make
            shutil.copytree(target, tmp, dirs_exist_ok=True)
            cio.commit_directory(tmp, last, what)
        else:
            from ember.checkpoint import trust as checks
            checks.check_replace(last, what)
            cio.replace_file(last, lambda tmp: shutil.copy2(target, tmp))

    def _remove(self, trainer, path):
        if not trainer.is_global_zero or not path or not os.path.lexists(path) or not self._own(path):
            return
        for name in (self.CHECKPOINT_NAME_LAST, self.CHECKPOINT_NAME_LAST + ".safetensors"):
            last = os.path.join(self.dirpath, name)
            if os.path.islink(last) and os.path.realpath(last) == os.path.realpath(path):
                return  # 'last' still points here
        from ember.checkpoint import io as cio
        from ember.checkpoint import trust as checks
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                cio.remove_checkpoint(path)        # only what is recognisably an ember checkpoint
            elif (path.endswith(".safetensors") or os.path.islink(path)) and not checks.not_replaceable(path):
                os.remove(path)                     # a link of ours, or a weights file ember wrote
            else:
                raise CheckpointError(f"refusing to delete {path}: it is not a checkpoint ember wrote")
        except (CheckpointError, OSError) as err:
            warnings.warn(f"ModelCheckpoint: {err}; it is kept", UserWarning, stacklevel=2)

    def _update_best(self):
        if not self.best_k_models:
            self.best_model_path, self.kth_best_model_path, self.kth_value = "", "", None
            self.best_model_score = None
            return
        if self.monitor is None:
            self.best_model_path = max(self.best_k_models, key=self.best_k_models.get)
            self.kth_best_model_path = min(self.best_k_models, key=self.best_k_models.get)
            return
        best = (min if self.mode == "min" else max)(self.best_k_models, key=self.best_k_models.get)
        self.best_model_path = best
        self.best_model_score = torch.tensor(self.best_k_models[best])
        self.kth_best_model_path = self._worst(self.best_k_models)
        self.kth_value = self.best_k_models[self.kth_best_model_path]

    # -- state ------------------------------------------------------------------------------
    def state_dict(self):
        return {"monitor": self.monitor, "mode": self.mode, "dirpath": self.dirpath,
                "best_model_score": None if self.best_model_score is None else float(self.best_model_score),
                "best_model_path": self.best_model_path, "best_k_models": dict(self.best_k_models),
                "kth_best_model_path": self.kth_best_model_path, "last_model_path": self.last_model_path,
                "last_global_step_saved": self._last_global_step_saved, "stale": list(self._stale)}

    def _own(self, p) -> bool:
        """Whether ``p`` is a path this callback may act on (delete, evict, link): an entry
        directly inside its ``dirpath``, symlinks resolved. Paths read from a checkpoint
        are checked with this, so a crafted ``trainer_state.pt`` cannot reach outside."""
        if not isinstance(p, str) or not p or not self.dirpath:
            return False
        root = os.path.realpath(self.dirpath)
        p = os.path.normpath(p)
        name = os.path.basename(p)
        if name in ("", ".", "..") or os.path.realpath(os.path.dirname(p)) != root:
            return False
        return not os.path.lexists(p) or os.path.dirname(os.path.realpath(p)) == root

    def load_state_dict(self, state):
        if not isinstance(state, dict):
            raise CheckpointError(f"ModelCheckpoint state is a {type(state).__name__}, expected a dict")
        try:
            self._last_global_step_saved = int(state.get("last_global_step_saved", -1))
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"ModelCheckpoint state: last_global_step_saved is corrupt ({err})") from err
        saved_dir = state.get("dirpath")
        same_dir = (isinstance(saved_dir, str) and bool(saved_dir) and self.dirpath is not None
                    and os.path.realpath(self.dirpath) == os.path.realpath(saved_dir))
        s = state.get("best_model_score")
        score = torch.tensor(float(s)) if isinstance(s, (int, float)) and not isinstance(s, bool) else None
        best = state.get("best_model_path", "")
        if not same_dir:
            # a new run directory (e.g. a new logger version): start a fresh top-k there, as
            # Lightning does, but remember the best of the earlier run (never acted on)
            self.best_model_path = best if isinstance(best, str) else ""
            self.best_model_score = score
            return
        paths = state.get("best_k_models") or {}
        stale = state.get("stale") or []
        if not isinstance(paths, dict) or not isinstance(stale, list):
            raise CheckpointError("ModelCheckpoint state: best_k_models / stale are corrupt")
        refused = [p for p in [*paths, *stale, state.get("last_model_path") or ""] if p and not self._own(p)]
        if refused:
            warnings.warn(f"ModelCheckpoint: the checkpoint lists paths outside {self.dirpath} "
                          f"({[str(p)[:200] for p in refused[:5]]}); they are ignored (never deleted or "
                          "linked)", UserWarning, stacklevel=2)
        # checkpoints deleted since (by hand, or a crash after the save) drop out
        self.best_k_models = {k: float(v) for k, v in paths.items()
                              if self._own(k) and isinstance(v, (int, float)) and os.path.exists(k)}
        last = state.get("last_model_path") or ""
        self.last_model_path = last if self._own(last) else ""
        self._stale = [p for p in stale if self._own(p) and p not in self.best_k_models]
        if self.best_k_models:
            self._update_best()
        else:
            self.best_model_path = best if self._own(best) else ""
            self.best_model_score = score


#: the end of the temporary link's name ``_update_last`` swaps in (``last.<8 hex>.link.tmp``)
_LINK_TMP = r"(\.safetensors)?\.[0-9a-f]{8}\.link\.tmp"


def _reserved(name: str) -> str:
    """Why ``name`` cannot be a checkpoint name ('' when it can)."""
    from ember.checkpoint.lock import LOCK_NAME
    base = name.strip()
    if base in (ModelCheckpoint.CHECKPOINT_NAME_LAST, ModelCheckpoint.CHECKPOINT_NAME_LAST + ".safetensors"):
        return "'last' is reserved for the link to the newest checkpoint (save_last); choose another name"
    from ember.checkpoint.format import LEGACY_TMP_SUFFIX, TMP_SUFFIX, is_unfinished_name
    if is_unfinished_name(base) or re.search(r"\.old-[0-9a-f]*$", base) or base == LOCK_NAME:
        return (f"names ending in '{TMP_SUFFIX}' (ember's staging folders), '{LEGACY_TMP_SUFFIX}' or '.old-...' "
                "are reserved for unfinished saves, which checkpoint discovery ignores; choose another name")
    return ""


def _saved_step(path: str) -> int | None:
    """The global step a checkpoint (directory or weights file) was saved at, if readable."""
    from ember.checkpoint import io as cio
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, cio.META_NAME)) as f:
                return int(json.load(f)["global_step"])
        return int(cio.read_safetensors_metadata(path)["global_step"])
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None
