"""Lightning's finetuning callbacks: :class:`BaseFinetuning` (freeze modules before
training, unfreeze them later into a new optimizer parameter group) and
:class:`BackboneFinetuning` (unfreeze ``module.backbone`` at a given epoch)::

    from ember.callbacks import BackboneFinetuning
    trainer = ember.Trainer(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=5)])

The parameter groups added to the optimizer are stored in the callback's state, so
a resumed run rebuilds them before the optimizer state is loaded.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Generator, Iterable, Optional, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError

__all__ = ["BaseFinetuning", "BackboneFinetuning", "multiplicative"]

log = logging.getLogger(__name__)
Modules = Union[nn.Module, Iterable[Union[nn.Module, Iterable]]]


def multiplicative(epoch: int) -> float:
    """The default ``lambda_func`` of :class:`BackboneFinetuning`: 1.5 per epoch."""
    return 1.5


class BaseFinetuning(Callback):
    """Base class for finetuning callbacks (as ``lightning.pytorch.callbacks.BaseFinetuning``).

    Override :meth:`freeze_before_training` (called at ``setup``) and
    :meth:`finetune_function` (called at every training epoch start, once per
    optimizer). Use the static helpers :meth:`freeze`, :meth:`make_trainable` and
    :meth:`unfreeze_and_add_param_group`. Only ``trainer.optimizers`` and
    ``trainer.current_epoch`` are read from the trainer.
    """

    # read by the trainer: load this callback's state before the optimizers' states
    restore_before_optimizers = True

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._trainer: Any = None
        self._module: Optional[nn.Module] = None

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        frozen = [] if self._module is None else [n for n, p in self._module.named_parameters()
                                                  if not p.requires_grad]
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata, "frozen": frozen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._internal_optimizer_metadata = {int(k): v for k, v in state_dict["internal_optimizer_metadata"].items()}
        if self._module is not None and "frozen" in state_dict:
            frozen = set(state_dict["frozen"])
            for n, p in self._module.named_parameters():
                p.requires_grad_(n not in frozen)
        if self._trainer is not None and self._module is not None:
            self._rebuild_param_groups()

    def _rebuild_param_groups(self) -> None:
        named = dict(self._module.named_parameters())
        for idx, opt in enumerate(getattr(self._trainer, "optimizers", None) or []):
            groups = self._internal_optimizer_metadata.get(idx)
            if not groups or len(groups) == len(opt.param_groups):
                continue
            missing = [n for g in groups for n in g["params"] if n not in named]
            if missing:
                raise MisconfigurationError(f"{type(self).__name__}: the checkpoint's optimizer {idx} holds "
                                            f"parameters this module lacks: {missing[:5]}")
            opt.param_groups = [{**g, "params": [named[n] for n in g["params"]]} for g in groups]

    def _store(self, module: nn.Module, opt_idx: int, num_groups: int, groups: list[dict]) -> None:
        if num_groups == len(groups) and opt_idx in self._internal_optimizer_metadata:
            return
        names = {id(p): n for n, p in module.named_parameters()}
        self._internal_optimizer_metadata[opt_idx] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in groups]

    # -- hooks ----------------------------------------------------------------------------
    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self._trainer, self._module = trainer, module
        if stage == "fit":
            self.freeze_before_training(module)

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            num_groups = len(optimizer.param_groups)
            self.finetune_function(module, trainer.current_epoch, optimizer)
            self._store(module, opt_idx, num_groups, optimizer.param_groups)

    def freeze_before_training(self, module: nn.Module) -> None:
        """Freeze what should not train at first (e.g. ``self.freeze(module.backbone)``)."""
        raise NotImplementedError("override freeze_before_training(module) in your finetuning callback")

    def finetune_function(self, module: nn.Module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Unfreeze layers at chosen epochs (e.g. with :meth:`unfreeze_and_add_param_group`)."""
        raise NotImplementedError("override finetune_function(module, epoch, optimizer) in your finetuning callback")

    # -- helpers (static, as Lightning's) ---------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules (and modules with direct parameters) of ``modules``."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            found: list[nn.Module] = []
            for m in modules:
                found.extend(BaseFinetuning.flatten_modules(m))
            return found
        return [m for m in modules.modules()
                if not list(m.children()) or list(m.parameters(recurse=False))]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True,
                      requires_grad: bool = True) -> Generator[nn.Parameter, None, None]:
        """Parameters of ``modules`` whose ``requires_grad`` equals ``requires_grad``
        (batch-norm parameters skipped when ``train_bn`` is False)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            for p in mod.parameters(recurse=False):
                if p.requires_grad == requires_grad:
                    yield p

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Set ``requires_grad=True`` on every parameter of ``modules``."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm):
                mod.track_running_stats = True
            for p in mod.parameters(recurse=False):
                p.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze one module's own parameters (batch norm also stops tracking statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for p in module.parameters(recurse=False):
            p.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; batch-norm layers stay trainable when ``train_bn``."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable) -> list:
        """``params`` without those ``optimizer`` already holds (logged when some were)."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        params = list(params)
        out = [p for p in params if id(p) not in held]
        if len(out) != len(params):
            log.warning("%d of the parameters to add are already in the optimizer; they keep their group",
                        len(params) - len(out))
        return out

    @staticmethod
    def unfreeze_and_add_param_group(modules: Modules, optimizer: torch.optim.Optimizer,
                                     lr: Optional[float] = None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new group,
        with ``lr`` (default: the first group's lr divided by ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})


class BackboneFinetuning(BaseFinetuning):
    """Freeze ``module.backbone`` until ``unfreeze_backbone_at_epoch``, then train it in
    a new parameter group whose lr starts at ``backbone_initial_lr`` (default: the
    first group's lr times ``backbone_initial_ratio_lr``) and is multiplied by
    ``lambda_func(epoch + 1)`` each following epoch (capped at the first group's lr
    when ``should_align``). As ``lightning.pytorch.callbacks.BackboneFinetuning``.

    Args:
        unfreeze_backbone_at_epoch: the epoch (0-based) at whose start the backbone is
            unfrozen and added to the optimizer.
        lambda_func: ``epoch -> factor``: each later epoch the backbone's lr is multiplied
            by ``lambda_func(epoch + 1)`` (default: 1.5 every epoch).
        backbone_initial_ratio_lr: the backbone's first lr as a fraction of the first
            parameter group's lr at the unfreeze epoch (default 0.1).
        backbone_initial_lr: the backbone's first lr itself (default None: use
            ``backbone_initial_ratio_lr``).
        should_align: cap the backbone's lr at the first group's lr once it reaches it.
        initial_denom_lr: passed to :meth:`unfreeze_and_add_param_group`, which divides the
            first group's lr by it when no lr is given; the backbone's lr is always given
            here, so it does not change the result (kept for Lightning's signature).
        train_bn: keep the backbone's batch-norm layers trainable while it is frozen, and
            add their parameters with the rest at the unfreeze epoch (default True).
        verbose: log both learning rates (``logging.INFO``, logger ``ember.callbacks``) at
            the unfreeze epoch and each one after.
        rounding: decimal places of the learning rates in those log lines (default 12).
    """

    def __init__(self, unfreeze_backbone_at_epoch: int = 10, lambda_func: Callable[[int], float] = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2, backbone_initial_lr: Optional[float] = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = True,
                 verbose: bool = False, rounding: int = 12) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: Optional[float] = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict.get("previous_backbone_lr")
        super().load_state_dict(state_dict)

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if stage == "fit" and not isinstance(getattr(module, "backbone", None), nn.Module):
            raise MisconfigurationError("BackboneFinetuning needs the module to have a `backbone` attribute that "
                                        f"is an nn.Module; {type(module).__name__} has none")
        super().setup(trainer, module, stage)

    def freeze_before_training(self, module: nn.Module) -> None:
        self.freeze(module.backbone, train_bn=self.train_bn)

    def finetune_function(self, module: nn.Module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            initial = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                       else current_lr * self.backbone_initial_ratio_lr)
            self.previous_backbone_lr = initial
            self.unfreeze_and_add_param_group(module.backbone, optimizer, initial, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
            if self.verbose:
                log.info("current lr: %s, backbone lr: %s", round(current_lr, self.rounding),
                         round(initial, self.rounding))
        elif epoch > self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            nxt = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            nxt = current_lr if (self.should_align and nxt > current_lr) else nxt
            optimizer.param_groups[-1]["lr"] = nxt
            self.previous_backbone_lr = nxt
            if self.verbose:
                log.info("current lr: %s, backbone lr: %s", round(current_lr, self.rounding),
                         round(nxt, self.rounding))
