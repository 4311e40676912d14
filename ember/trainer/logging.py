"""Values logged with ``self.log``: kept as tensors on the device until they are
emitted (every ``log_every_n_steps`` and at epoch end), then moved to the host in
one transfer. Nothing here runs a collective or a host sync per step."""
from __future__ import annotations

import sys

import torch

from ember.errors import MisconfigurationError, invalid_choice

_REDUCE = ("mean", "sum", "max", "min")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# (on_step, on_epoch) defaults per stage, as in Lightning
_DEFAULTS = {"train": (True, False), "validate": (False, True), "test": (False, True),
             "predict": (False, False), "sanity": (False, True)}


def _is_metric(value) -> bool:
    """A torchmetrics.Metric? (without importing torchmetrics: a user who passes one
    has imported it already)."""
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(value, tm.Metric)


class _Entry:
    __slots__ = ("name", "on_step", "on_epoch", "prog_bar", "logger", "reduce_fx", "sync_dist",
                 "last", "total", "weight", "metric", "updated", "given")

    def __init__(self, name, on_step, on_epoch, prog_bar, logger, reduce_fx, sync_dist, metric):
        self.name, self.on_step, self.on_epoch = name, on_step, on_epoch
        self.prog_bar, self.logger, self.reduce_fx, self.sync_dist = prog_bar, logger, reduce_fx, sync_dist
        self.metric = metric
        self.last = None
        self.total = None
        self.weight = 0
        self.updated = False
        #: (on_step, on_epoch, reduce_fx, sync_dist) as last passed to self.log, unresolved:
        #: a call passing the same compares one tuple; another set is checked (Results.log)
        self.given = None

    def epoch_value(self):
        if self.metric is not None:
            return self.metric.compute()
        if self.total is None:
            return None
        if self.reduce_fx == "mean":
            return self.total / max(self.weight, 1)
        return self.total


class Results:
    """The logged values of one stage (train / validate / test)."""

    def __init__(self, stage: str):
        self.stage = stage
        self.entries: dict[str, _Entry] = {}
        self.batch = None          # set by the loop; used to infer batch sizes lazily
        self._batch_size = None
        #: set by the evaluation loop when it runs several dataloaders: names get
        #: a "/dataloader_idx_N" suffix, as in Lightning
        self.dataloader_idx = None
        #: set by the fit loop around on_train_epoch_end: values logged there default to
        #: epoch values (as Lightning) and are emitted right after the hook (``late``)
        self.epoch_end_hook = False
        self.late: set = set()
        #: an evaluation stage logged a value with on_step=True: its loop emits step values per batch
        self.eval_step_values = False

    def new_batch(self, batch) -> None:
        self.batch, self._batch_size = batch, None

    def _infer_batch_size(self) -> int:
        if self._batch_size is None:
            self._batch_size = _batch_size(self.batch)
        return self._batch_size

    def log(self, name, value, prog_bar=False, logger=True, on_step=None, on_epoch=None,
            reduce_fx="mean", sync_dist=False, batch_size=None):
        if self.dataloader_idx is not None:
            name = f"{name}/dataloader_idx_{self.dataloader_idx}"
        e = self.entries.get(name)
        if e is None:
            e = self._new_entry(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
        elif e.given != (on_step, on_epoch, reduce_fx, sync_dist):
            self._check_same_options(e, on_step, on_epoch, reduce_fx, sync_dist)
        if self.epoch_end_hook:
            self.late.add(name)
        if e.metric is not None:
            e.last = e.metric._forward_cache if e.on_step else None
            e.updated = True
            return
        acc = value
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.numel() != 1:
                raise MisconfigurationError(
                    f"self.log({name!r}, ...): value must be a scalar, got a tensor of shape {tuple(value.shape)}")
            # epoch sums in fp32 whatever the value's dtype: 200 batches of 32 at 66.0 overflow
            # fp16 (max 65504) and lose all precision in bf16 (8-bit mantissa)
            acc = value.float() if value.dtype in _LOW_PRECISION else value
        e.last = value
        e.updated = True
        if e.on_epoch:
            if e.reduce_fx == "mean":
                bs = batch_size if batch_size is not None else self._infer_batch_size()
                e.total = acc * bs if e.total is None else e.total + acc * bs
                e.weight += bs
            elif e.total is None:
                e.total = acc
            elif e.reduce_fx == "sum":
                e.total = e.total + acc
            elif e.reduce_fx == "max":
                e.total = torch.maximum(torch.as_tensor(e.total), torch.as_tensor(value))
            else:
                e.total = torch.minimum(torch.as_tensor(e.total), torch.as_tensor(value))

    def _resolve(self, name, on_step, on_epoch, reduce_fx):
        if callable(reduce_fx) and not isinstance(reduce_fx, str):
            reduce_fx = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}.get(reduce_fx, reduce_fx)
        if reduce_fx not in _REDUCE:
            raise invalid_choice(f"self.log({name!r}, reduce_fx)", reduce_fx, _REDUCE)
        d_step, d_epoch = (False, True) if self.epoch_end_hook else _DEFAULTS.get(self.stage, (False, True))
        on_step = d_step if on_step is None else bool(on_step)
        on_epoch = d_epoch if on_epoch is None else bool(on_epoch)
        return on_step, on_epoch, reduce_fx

    def _check_same_options(self, e, on_step, on_epoch, reduce_fx, sync_dist) -> None:
        """A name logged again with other options: first time this epoch (another run,
        epoch or module), they replace the old ones; later in the epoch they must resolve
        to the same options, or it is an error."""
        now = dict(zip(("on_step", "on_epoch", "reduce_fx"), self._resolve(e.name, on_step, on_epoch, reduce_fx)),
                   sync_dist=bool(sync_dist))
        for opt, v in now.items():
            if not e.updated:
                setattr(e, opt, v)
            elif getattr(e, opt) != v:
                raise MisconfigurationError(
                    f"self.log({e.name!r}, ..., {opt}={v!r}) conflicts with an earlier self.log({e.name!r}, ...) "
                    f"with {opt}={getattr(e, opt)!r} in this {self.stage} stage: one metric name is logged with one "
                    f"set of options. Pass the same {opt} everywhere {e.name!r} is logged, or use another name")
        e.given = (on_step, on_epoch, reduce_fx, sync_dist)

    def _new_entry(self, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist):
        if not isinstance(name, str) or not name:
            raise MisconfigurationError(f"self.log: name must be a non-empty string, got {name!r}")
        given = (on_step, on_epoch, reduce_fx, sync_dist)
        on_step, on_epoch, reduce_fx = self._resolve(name, on_step, on_epoch, reduce_fx)
        if self.stage != "train" and on_step and not on_epoch:
            pass  # allowed: per-step validation values (emitted at every step's log point)
        metric = value if _is_metric(value) else None
        if metric is None and not isinstance(value, (torch.Tensor, int, float, bool)) \
                and not (type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0):   # np.float32(1)
            raise MisconfigurationError(
                f"self.log({name!r}, value): expected a tensor, a number or a torchmetrics.Metric, "
                f"got {type(value).__name__}")
        e = _Entry(name, on_step, on_epoch, prog_bar, logger, reduce_fx, bool(sync_dist), metric)
        e.given = given
        self.entries[name] = e
        if on_step and self.stage != "train":
            self.eval_step_values = True   # the evaluation loop sends step values to the loggers
        return e

    # -- reading (only at emission points) --------------------------------------
    def step_values(self) -> dict:
        """Latest on-step values (tensors), keyed as they are logged."""
        out = {}
        for e in self.entries.values():
            if e.on_step and e.updated and e.last is not None:
                out[e.name + "_step" if e.on_epoch else e.name] = (e, e.last)
        return out

    def latest_step_values(self, reduced_only: bool = False) -> dict:
        """Latest value of each ``on_step`` metric logged in this epoch (detached tensors,
        where they were logged), under ``name_step`` and, for step-only metrics, ``name``.
        ``reduced_only`` (several processes): not the ``sync_dist`` ones, whose value on
        this rank is not the reduced one (they keep the value of the last log point)."""
        out = {}
        for e in self.entries.values():
            if reduced_only and e.sync_dist:
                continue
            if e.on_step and e.updated and e.last is not None and e.metric is None:
                out[e.name + "_step" if e.on_epoch else e.name] = e.last
        return out

    def epoch_values(self, names=None) -> dict:
        out = {}
        for e in self.entries.values():
            if names is not None and e.name not in names:
                continue
            if e.on_epoch and (e.updated or e.metric is not None):
                v = e.epoch_value()
                if v is not None:
                    out[e.name + "_epoch" if e.on_step else e.name] = (e, v)
        return out

    def prog_bar_values(self, emitted: dict) -> dict:
        """What the progress bar shows for this stage: the latest value of each
        ``prog_bar`` step metric, and the *emitted* value of each ``prog_bar`` epoch
        metric (taken from ``emitted``, the trainer's ``callback_metrics``), never
        a partial per-batch value of an epoch metric."""
        out = {}
        for e in list(self.entries.values()):
            if not e.prog_bar:
                continue
            if e.on_step and e.last is not None:
                out[e.name + "_step" if e.on_epoch else e.name] = e.last
            if e.on_epoch:
                key = e.name + "_epoch" if e.on_step else e.name
                if key in emitted:
                    out[key] = emitted[key]
        return out

    def reset(self) -> None:
        self.dataloader_idx = None
        self.late = set()
        for e in self.entries.values():
            e.total, e.weight, e.updated, e.last = None, 0, False, None
            if e.metric is not None:
                e.metric.reset()


def _batch_size(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, dict):
        for v in batch.values():
            return _batch_size(v)
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    shape = getattr(batch, "shape", None)
    return shape[0] if shape else 1


def to_host(named: dict, strategy=None) -> dict[str, float]:
    """Reduce the sync_dist values across ranks, then turn everything into Python
    floats with a single device->host transfer. Under several processes every rank
    calls this at each emission point, with or without values: all of them take part
    in the check that they reduce the same ``sync_dist`` names (:func:`_check_same_keys`)."""
    multi = strategy is not None and strategy.world_size > 1
    if multi:
        _check_same_keys(strategy, [n for n, (e, _) in named.items() if e.sync_dist and e.metric is None])
    if not named:
        return {}
    names = list(named)
    vals = []
    for n in names:
        e, v = named[n]
        v = torch.as_tensor(v).detach().float().reshape(())
        vals.append(v)
    dev = vals[0].device
    vals = [v.to(dev) for v in vals]
    if multi:
        sync = [i for i, n in enumerate(names) if named[n][0].sync_dist and named[n][0].metric is None]
        if sync:
            for op in _REDUCE:
                idx = [i for i in sync if named[names[i]][0].reduce_fx == op]
                if idx:
                    red = strategy.reduce(torch.stack([vals[i] for i in idx]), op)
                    for j, i in enumerate(idx):
                        vals[i] = red[j]
    return dict(zip(names, torch.stack(vals).tolist()))


def _check_same_keys(strategy, keys: list[str]) -> None:
    """Every rank reduces the same ``sync_dist`` names, or every rank raises. One
    all_gather of two integers (how many names, a digest of them) per emission point;
    the names themselves are gathered only when the ranks differ."""
    from ember.data.worker_seed import mix
    keys = sorted(keys)
    mine = torch.tensor([len(keys), mix(*keys) if keys else 0], dtype=torch.int64, device=strategy.root_device)
    gathered = strategy.all_gather(mine).reshape(-1, 2).tolist()
    if all(g == gathered[0] for g in gathered):
        return
    all_keys = strategy.all_gather_object(keys)   # every rank saw the mismatch: all gather the names
    names = sorted({k for ks in all_keys for k in ks})
    detail = "; ".join(
        f"{n!r} on rank(s) {[r for r, ks in enumerate(all_keys) if n in ks]}, "
        f"not on rank(s) {[r for r, ks in enumerate(all_keys) if n not in ks]}"
        for n in names if any(n not in ks for ks in all_keys))
    raise MisconfigurationError(
        "self.log(..., sync_dist=True): ranks logged different metric names with sync_dist=True since the last "
        "log point, "
        f"so their reductions would not match and the run would hang: {detail}. Log every sync_dist metric on "
        "every rank (log a neutral value where a rank has none), or drop sync_dist=True for it")
