"""Tuning before training: the learning-rate finder and the batch-size finder.

    result = ember.tuner.lr_find(trainer, module, train_loader)
    lr = result.suggestion()        # steepest descent of the smoothed loss
    result.plot("lr.png")

    bs = ember.tuner.scale_batch_size(trainer, module, datamodule=dm)   # CUDA OOM bound
    bs = ember.tuner.scale_batch_size(trainer, module, datamodule=dm, max_val=256)   # a user bound (CPU)

Both run short fits of the user's module on a trial Trainer built from the user's
trainer's strategy and settings (so the user's trainer itself is never changed), and
put back what those fits touch: the module's weights (and gradients), the optimizer
states and the random number generators. Nothing is logged, checkpointed or called back
during the search. Under DDP the learning-rate finder reduces the losses over the
ranks, so every rank gets the same curve and suggestion.
"""
from __future__ import annotations

import copy
import gc
import math
import random
from dataclasses import dataclass, field
import torch

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError, NonFiniteLossError, invalid_choice

# --------------------------------------------------------------------------- saving / restoring
class _Snapshot:
    """What a search changes outside its own trial Trainer: the module's tensors and
    gradients (and its link to the user's trainer), the optimizers the user's trainer
    holds, the strategy's precision, and the RNGs."""

    def __init__(self, trainer, module):
        self.trainer, self.module = trainer, module
        self.module_state = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()]
        self.module_dict = {k: module.__dict__.get(k, _MISSING)
                            for k in ("_trainer", "training_step")}
        self.training = module.training
        self.optim = [(o, copy.deepcopy(o.state_dict())) for o in trainer.optimizers]
        self.precision = trainer.strategy.precision
        self.rng = _rng_state()

    def restore(self) -> None:
        t, m = self.trainer, self.module
        t.strategy.precision = self.precision
        with torch.no_grad():
            m.load_state_dict(self.module_state)   # copies in place: the parameters stay the same objects
        for p, g in self.grads:
            p.grad = g
        for k, v in self.module_dict.items():
            if v is _MISSING:
                m.__dict__.pop(k, None)
            else:
                m.__dict__[k] = v
        m.train(self.training)
        for o, s in self.optim:
            o.load_state_dict(s)
        _set_rng_state(self.rng)


_MISSING = object()


def _rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        s["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return s


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s:
        torch.cuda.set_rng_state_all(s["cuda"])
    if "numpy" in s:
        import numpy as np
        np.random.set_state(s["numpy"])


def _search_trainer(trainer, callback: Callback, max_steps: int):
    """A bare trial Trainer on the user's trainer's strategy and training settings (its own
    loop state and metrics): only ``callback``, no logger, checkpoint, validation,
    progress bar or summary, ``max_steps`` steps."""
    from ember.trainer import Trainer
    env_ready = trainer.step_rules is not None   # its strategy (and precision) are set up
    search = Trainer(strategy=trainer.strategy, precision=trainer.strategy.precision if env_ready else trainer.precision,
                     accumulate_grad_batches=trainer.accumulate_grad_batches,
                     gradient_clip_val=trainer.gradient_clip_val,
                     gradient_clip_algorithm=trainer.gradient_clip_algorithm,
                     max_steps=max_steps, max_epochs=-1, limit_train_batches=trainer.limit_train_batches,
                     limit_val_batches=0, num_sanity_val_steps=0, check_val_every_n_epoch=None,
                     log_every_n_steps=2**62,     # no step metrics (and no per-log-point loss check)
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=trainer.use_distributed_sampler, inference_mode=trainer.inference_mode,
                     default_root_dir=trainer.default_root_dir)
    search.callbacks[:] = [callback]   # not even the run record
    return search


def _loss_of(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict):
        return outputs.get("loss")
    return None


# --------------------------------------------------------------------------- lr finder
@dataclass
class LRFinderResult:
    """The curve of an :func:`lr_find` run.

    ``lrs[i]`` is the learning rate of step ``i``; ``raw_losses[i]`` its training
    loss (mean over ranks and accumulated micro-batches); ``losses[i]`` the
    exponentially smoothed loss (``beta=0.98``, bias-corrected), as Lightning reports.
    ``diverged``: the sweep ended early, at the step whose smoothed loss exceeded
    ``early_stop_threshold`` times the lowest before it, or whose loss was not finite
    (that step is the last point, as in Lightning).
    """
    lrs: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    raw_losses: list = field(default_factory=list)
    diverged: bool = False

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate where the smoothed loss falls fastest before its lowest point,
        skipping the first ``skip_begin`` and the last ``skip_end`` points. The slope is
        taken over a window of a tenth of those points (per step, so per factor of the
        learning rate in ``"exponential"`` mode): the smoothed loss of the first steps still
        wanders by as much per step as the real descent falls, so a single-step gradient
        would pick the first point in some seeds. Always one of the swept rates, at or
        below the one with the lowest loss. ``None`` when fewer than 3 finite points remain."""
        n = len(self.lrs)
        idx = [i for i in range(skip_begin, n - skip_end) if i < len(self.losses) and math.isfinite(self.losses[i])]
        if len(idx) < 3:
            import warnings
            warnings.warn(f"lr_find: only {len(idx)} usable points after skipping {skip_begin}+{skip_end}; "
                          "no suggestion (raise num_training or lower skip_begin)", stacklevel=2)
            return None
        lowest = min(idx, key=lambda i: self.losses[i])
        cand = [i for i in idx if i <= lowest]
        if len(cand) < 3:   # the loss only rose: the least rising point of the whole curve
            cand = idx
        half = max(1, len(cand) // 20)
        best, pick = math.inf, cand[0]
        for j, i in enumerate(cand):
            a, b = cand[max(0, j - half)], cand[min(len(cand) - 1, j + half)]
            slope = (self.losses[b] - self.losses[a]) / (b - a)
            if slope < best:
                best, pick = slope, i
        return float(self.lrs[pick])

    def plot(self, path: str | None = None, suggest: bool = True):
        """Loss over learning rate (log x axis) with the suggestion marked. Writes a PNG
        to ``path`` and returns the path; with no path returns the matplotlib figure.
        The y axis spans the curve up to its lowest point (the starting level down to the
        minimum, with a margin): the losses of the last, diverging steps, which can reach
        1e20, would flatten the rest."""
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import matplotlib
        matplotlib.use("Agg", force=False)
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 4), dpi=110)
        ax.plot(self.lrs, self.losses, label="smoothed loss")
        ax.plot(self.lrs, self.raw_losses, alpha=0.3, label="loss")
        if self.lrs and self.lrs[-1] / max(self.lrs[0], 1e-300) > 10:
            ax.set_xscale("log")
        ylim = self._ylim()
        if ylim is not None:
            ax.set_ylim(*ylim)
        sug = self.suggestion() if suggest else None
        if sug is not None:
            i = self.lrs.index(sug)
            ax.plot([sug], [self.losses[i]], "o", color="red", markersize=8, label=f"suggestion {sug:.3g}")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        if path is None:
            return fig
        import os
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path

    def _ylim(self) -> tuple[float, float] | None:
        """(bottom, top): the lowest loss (smoothed or raw) to the highest smoothed loss up to
        the smoothed minimum, with a 10% margin; None when no loss is finite."""
        finite = [(i, v) for i, v in enumerate(self.losses) if math.isfinite(v)]
        if not finite:
            return None
        lowest = min(finite, key=lambda p: p[1])[0]
        top = max(v for i, v in finite if i <= lowest)
        bottom = min([v for _, v in finite] + [v for v in self.raw_losses[: lowest + 1] if math.isfinite(v)])
        pad = 0.1 * (top - bottom) or 0.1 * abs(top) or 1.0
        return bottom - pad, top + pad


class _LRFinder(Callback):
    def __init__(self, lrs: list, threshold: float | None, check_every: int = 10):
        self.lrs, self.threshold, self.check_every = lrs, threshold, check_every
        self.pending: list = []     # (step, detached loss) per micro-batch
        self.values: list = []      # per step, reduced over ranks (host floats)
        self.diverged = False

    def on_fit_start(self, trainer, module):
        trainer.state.lr_scheduler_configs = []   # the finder sets the lr itself
        self.optim = [(o, copy.deepcopy(o.state_dict())) for o in trainer.optimizers]

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._step = trainer.global_step
        lr = self.lrs[min(self._step, len(self.lrs) - 1)]
        for o in trainer.optimizers:
            for g in o.param_groups:
                g["lr"] = lr

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = _loss_of(outputs)
        if loss is not None:
            self.pending.append((self._step, loss.detach().float().reshape(())))
        if trainer.global_step > self._step and trainer.global_step % self.check_every == 0:
            self._collect(trainer)
            if _diverged(self.values, self.threshold):   # (a NaN/inf loss also ends it without a threshold)
                self.diverged = True
                trainer.request_stop("should_stop", agreed=True)   # the losses were reduced over ranks

    def on_train_end(self, trainer, module):
        self._collect(trainer)

    def _collect(self, trainer) -> None:
        """Per-step mean losses of the pending micro-batches, reduced over ranks (one transfer)."""
        steps = sorted({s for s, _ in self.pending})
        if not steps:
            return
        sums = torch.stack([sum(v for s, v in self.pending if s == st) for st in steps])
        counts = torch.tensor([sum(1 for s, _ in self.pending if s == st) for st in steps], device=sums.device)
        per_step = sums / counts
        if trainer.world_size > 1:
            per_step = trainer.strategy.reduce(per_step, "mean")
        self.values += per_step.cpu().tolist()
        self.pending = []
        del self.values[len(self.lrs):]


def _smooth(values: list, beta: float = 0.98) -> list:
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def _stop_index(values: list, threshold: float | None) -> int | None:
    """The step at which Lightning's finder stops: the first whose smoothed loss exceeds
    ``threshold`` times the lowest smoothed loss before it (from the second step on), or
    the first non-finite loss. None: the sweep ran to its end."""
    best = math.inf
    for i, (v, sm) in enumerate(zip(values, _smooth(values))):
        if not (math.isfinite(v) and math.isfinite(sm)):
            return i
        if threshold is not None and i > 0 and sm > threshold * best:
            return i
        if sm < best or i == 0:
            best = sm
    return None


def _diverged(values: list, threshold: float | None) -> bool:
    return _stop_index(values, threshold) is not None


def lr_find(trainer, module, train_dataloaders=None, datamodule=None, min_lr: float = 1e-8, max_lr: float = 1.0,
            num_training: int = 100, mode: str = "exponential", early_stop_threshold: float | None = 4.0) -> LRFinderResult:
    """Train ``num_training`` steps while the learning rate grows from ``min_lr`` to
    ``max_lr`` (``mode="exponential"``: geometric steps, ``"linear"``: equal steps) and
    record the loss of each step; stop early, as Lightning's finder, at the first step whose
    smoothed loss exceeds ``early_stop_threshold`` times the lowest before it, or whose loss
    is NaN/inf (``early_stop_threshold=None``: only then). The losses are read every 10 steps
    (one transfer, one collective under DDP), so training may go on a few steps past that
    point, but the curve ends there and the model is put back anyway; a loss that turned
    NaN between two reads ends the sweep in the same way (not with ``NonFiniteLossError``).

    The module's configured optimizers are used (their learning rate is overridden;
    schedulers are not stepped). Afterwards the weights, optimizer states, trainer
    and RNGs are exactly as before. Returns an :class:`LRFinderResult`; use
    ``result.suggestion()`` to pick a learning rate and ``result.plot(path)`` to look.
    """
    if mode not in ("exponential", "linear"):
        raise invalid_choice("mode", mode, ["exponential", "linear"])
    if not (0 < min_lr < max_lr):
        raise MisconfigurationError(f"lr_find(min_lr={min_lr!r}, max_lr={max_lr!r}): need 0 < min_lr < max_lr")
    if not isinstance(num_training, int) or num_training < 2:
        raise MisconfigurationError(f"lr_find(num_training={num_training!r}): use an int >= 2")
    n = num_training
    if mode == "exponential":
        lrs = [min_lr * (max_lr / min_lr) ** (i / (n - 1)) for i in range(n)]
    else:
        lrs = [min_lr + (max_lr - min_lr) * i / (n - 1) for i in range(n)]
    if not getattr(module, "automatic_optimization", True):
        raise MisconfigurationError("lr_find needs automatic optimization (the module sets "
                                    "automatic_optimization = False)")
    snap = _Snapshot(trainer, module)
    finder = _LRFinder(lrs, early_stop_threshold)
    try:
        search = _search_trainer(trainer, finder, n)
        try:
            search.fit(module, train_dataloaders=train_dataloaders, datamodule=datamodule)
        except NonFiniteLossError:
            # the loss became NaN/inf between two checks and the Trainer's own check (at an epoch's
            # end, agreed by every rank) stopped the fit: that is the divergence the sweep looks for
            finder.diverged = True
            finder._collect(search)
        for o, s in finder.optim:   # optimizers the module keeps between fits
            o.load_state_dict(s)
    finally:
        snap.restore()
    values = finder.values
    stop = _stop_index(values, early_stop_threshold)
    if stop is not None:   # where Lightning's finder stops: the curve ends there, that step included
        values = values[: stop + 1]
    return LRFinderResult(lrs=lrs[: len(values)], losses=_smooth(values), raw_losses=list(values),
                          diverged=finder.diverged or stop is not None)


# --------------------------------------------------------------------------- batch-size finder
def is_oom_error(exc: BaseException) -> bool:
    """True for out-of-memory errors of CUDA, cuDNN, MPS or the CPU allocator (the test
    of ``ember.utils.find_executable_batch_size``)."""
    from ember.utils import should_reduce_batch_size
    return should_reduce_batch_size(exc)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _batch_holder(module, datamodule, name: str):
    for obj in (datamodule, module):
        if obj is not None and hasattr(obj, name) and not callable(getattr(obj, name)):
            return obj, None
    hp = getattr(module, "hparams", None)
    if hp is not None and name in hp:
        return None, hp
    raise MisconfigurationError(
        f"scale_batch_size: found no attribute {name!r} on the datamodule, the module or module.hparams; the "
        f"train_dataloader() must read its batch size from one of them (batch_arg_name={name!r})")


class _Trial(Callback):
    def on_fit_start(self, trainer, module):
        ds = getattr(trainer.train_dataloader, "dataset", None)
        try:
            self.dataset_len = len(ds) if ds is not None else None
        except TypeError:
            self.dataset_len = None


def scale_batch_size(trainer, module, train_dataloaders=None, datamodule=None, mode: str = "power",
                     steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                     batch_arg_name: str = "batch_size", max_val: int | None = None) -> int:
    """The largest batch size that trains: each trial runs ``steps_per_trial`` training
    steps with the batch size set on the datamodule / module / ``module.hparams``
    attribute ``batch_arg_name`` (the ``train_dataloader()`` must read it).

    ``mode="power"`` doubles from ``init_val`` until a trial fails; ``"binsearch"``
    then bisects between the last success and the failure. A trial fails on an
    out-of-memory error (CUDA, cuDNN, CPU allocator) or when the batch size would
    exceed ``max_val`` (the bound to use on CPU, where memory does not run out
    cleanly); growth also stops at the dataset's length. At most ``max_trials``
    trials. Everything is restored afterwards except the attribute, which is left
    at the result; returns it. Single process only. For a custom loop, the decorator
    ``ember.utils.find_executable_batch_size`` halves a batch size on OOM and retries.
    """
    if mode not in ("power", "binsearch"):
        raise invalid_choice("mode", mode, ["power", "binsearch"])
    for k, v in (("init_val", init_val), ("max_trials", max_trials), ("steps_per_trial", steps_per_trial)):
        if not isinstance(v, int) or v < 1:
            raise MisconfigurationError(f"scale_batch_size({k}={v!r}): use an int >= 1")
    if train_dataloaders is not None:
        raise MisconfigurationError("scale_batch_size cannot resize a DataLoader passed in; give a datamodule or "
                                    "a module whose train_dataloader() reads the batch size attribute")
    obj, hp = _batch_holder(module, datamodule, batch_arg_name)
    if max_val is not None and max_val < init_val:
        raise MisconfigurationError(f"scale_batch_size(max_val={max_val}) is below init_val={init_val}")
    if trainer.world_size > 1:
        raise MisconfigurationError("scale_batch_size runs in one process; find the batch size first, then "
                                    "train under DDP")

    def set_bs(v: int) -> None:
        if hp is not None:
            hp[batch_arg_name] = v
        else:
            setattr(obj, batch_arg_name, v)

    original = hp[batch_arg_name] if hp is not None else getattr(obj, batch_arg_name)
    snap = _Snapshot(trainer, module)
    trial = _Trial()
    tried: dict[int, bool] = {}

    def run(bs: int) -> bool:
        if max_val is not None and bs > max_val:
            return False
        if bs in tried:
            return tried[bs]
        set_bs(bs)
        try:
            _search_trainer(trainer, trial, steps_per_trial).fit(module, datamodule=datamodule)
            ok = True
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            ok = False
        finally:
            snap.restore()
        if not ok:
            _free_memory()   # the failed trial's tensors (held by the traceback until now)
        tried[bs] = ok
        return ok

    try:
        good, bad, bs = None, None, init_val
        for _ in range(max_trials):
            if run(bs):
                good = bs
                n = getattr(trial, "dataset_len", None)
                if n is not None and bs >= n:
                    break
                bs *= 2
            else:
                bad = bs
                break
        if good is None:
            raise MisconfigurationError(f"scale_batch_size: even batch size {init_val} does not fit "
                                        f"(out of memory{' or above max_val' if max_val is not None else ''})")
        if mode == "binsearch" and bad is not None:
            while bad - good > 1 and len(tried) < max_trials:
                mid = (good + bad) // 2
                if run(mid):
                    good = mid
                else:
                    bad = mid
    except BaseException:
        set_bs(original)
        raise
    set_bs(good)
    return good
