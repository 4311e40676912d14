"""TrainModule and DataModule: what users subclass."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ember.errors import CheckpointError, MisconfigurationError
from ember.hparams import AttributeDict, HyperparametersMixin, _copy_hparams  # noqa: F401  (re-exported)


def _raw_optimizer(opt: Any) -> Any:
    """The torch optimizer under ember's wrappers (``ember.step.StepOptimizer``: manual
    optimization, the Accelerator's prepared ones)."""
    from ember.step import StepOptimizer
    while isinstance(opt, StepOptimizer) or (not isinstance(opt, torch.optim.Optimizer)
                                             and "optimizer" in getattr(opt, "__dict__", {})):
        opt = opt.optimizer
    return opt


class TrainModule(HyperparametersMixin, nn.Module):
    """Subclass and implement ``training_step`` and ``configure_optimizers``.

    Hooks (all optional): ``validation_step``, ``test_step``, ``predict_step``,
    ``configure_model``, ``setup``/``teardown``, ``prepare_data``, ``configure_callbacks``,
    ``on_fit_start/end``, ``on_train_epoch_start/end``, ``on_train_batch_start/end``,
    ``on_{validation,test,predict}_start/end``, ``..._epoch_start/end``, ``..._batch_start/end``,
    ``on_{validation,test,predict}_model_eval`` (and ``..._model_train``), the batch-transfer
    hooks, ``loss_count``, ``on_before/after_backward``, ``on_before_optimizer_step``,
    ``configure_gradient_clipping``, ``optimizer_step``, ``on_before_zero_grad``,
    ``optimizer_zero_grad``, ``lr_scheduler_step``, ``on_save_checkpoint``,
    ``on_load_checkpoint``, as Lightning's. The loop calls only the ones a subclass
    overrides (order: ember/trainer/events.py; docs/trainer.md, "Hooks and their order").
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True
        self.hparams = AttributeDict()
        self._trainer = None

    # -- context ---------------------------------------------------------------
    @property
    def trainer(self) -> Any:
        """The Trainer running this module (an error outside one)."""
        if self._trainer is None:
            raise MisconfigurationError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @property
    def device(self) -> torch.device:
        """The device the module trains on: the strategy's, or its first parameter's outside a
        Trainer."""
        if self._trainer is not None:
            return self._trainer.strategy.root_device
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @property
    def on_gpu(self) -> bool:
        """Whether :attr:`device` is a CUDA device (Lightning's ``LightningModule.on_gpu``)."""
        return self.device.type == "cuda"

    @property
    def device_mesh(self):
        """The strategy's ``torch.distributed.DeviceMesh`` (``ModelParallelStrategy``: dims
        ``("data_parallel", "tensor_parallel")``; ``FSDPStrategy``: its sharding mesh), for
        ``configure_model`` to apply tensor-parallel plans and ``fully_shard``; None for
        strategies without one."""
        strategy = getattr(self._trainer, "strategy", None)
        return getattr(strategy, "device_mesh", None)

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    # -- Lightning helpers ------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's floating-point parameters (the default dtype when it has none)."""
        p = next((p for p in self.parameters() if p.is_floating_point()), None)
        return p.dtype if p is not None else torch.get_default_dtype()

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes (0 outside a Trainer)."""
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (0 outside a Trainer)."""
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def logger(self) -> Any:
        """The trainer's first logger (None without one)."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list:
        """The trainer's loggers (empty outside a Trainer)."""
        return list(self._trainer.loggers) if self._trainer is not None else []

    def freeze(self) -> None:
        """Stop gradients for every parameter and switch to eval mode."""
        for p in self.parameters():
            p.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Let every parameter train again and switch to train mode."""
        for p in self.parameters():
            p.requires_grad = True
        self.train()

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Manual optimization with several optimizers: only the parameters of
        ``optimizer`` keep ``requires_grad``; those held only by the other optimizers
        get ``requires_grad=False`` until :meth:`untoggle_optimizer`."""
        saved: dict = {}
        for opt in self.trainer.optimizers:
            for g in opt.param_groups:
                for p in g["params"]:
                    if p not in saved:
                        saved[p] = p.requires_grad
                        p.requires_grad = False
        for g in _raw_optimizer(optimizer).param_groups:
            for p in g["params"]:
                p.requires_grad = saved.get(p, p.requires_grad)
        self._param_requires_grad_state = saved

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give the other optimizers' parameters back the ``requires_grad`` they had
        before :meth:`toggle_optimizer`."""
        raw = _raw_optimizer(optimizer)
        saved = self.__dict__.get("_param_requires_grad_state") or {}
        for opt in self.trainer.optimizers:
            if _raw_optimizer(opt) is raw:
                continue
            for g in opt.param_groups:
                for p in g["params"]:
                    if p in saved:
                        p.requires_grad = saved[p]
        self._param_requires_grad_state = {}

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``with self.toggled_optimizer(opt):`` toggles ``opt`` in, untoggles on exit."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: "float | None" = None,
                       gradient_clip_algorithm: "str | None" = None) -> "torch.Tensor | None":
        """Clip ``optimizer``'s gradients (manual optimization, after backward) by the rules
        the training loop uses (``ember.step``): unscaled first under 16-mixed, total norm
        over sharded (DTensor) gradients, per device mesh. ``gradient_clip_val`` /
        ``gradient_clip_algorithm`` ("norm" or "value") default to the Trainer's.
        Returns the total norm before clipping ("norm"), else None."""
        t = self.trainer
        val = t.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        algorithm = gradient_clip_algorithm or t.gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise MisconfigurationError(f"clip_gradients(gradient_clip_algorithm={algorithm!r}): use 'norm' or 'value'")
        if val is None or val == 0:
            return None
        return t.step_rules.clip_optimizer(_raw_optimizer(optimizer), float(val), algorithm)

    def to_torchscript(self, file_path: "str | None" = None, method: str = "script",
                       example_inputs: Any = None, **kwargs: Any) -> Any:
        """``torch.jit.script`` (or ``method="trace"`` with ``example_inputs``, default
        ``self.example_input_array``) of this module in eval mode; saved to
        ``file_path`` when given. Train mode is restored afterwards."""
        mode = self.training
        self.eval()
        try:
            if method == "script":
                out = torch.jit.script(self, **kwargs)
            elif method == "trace":
                inputs = example_inputs if example_inputs is not None else getattr(self, "example_input_array", None)
                if inputs is None:
                    raise MisconfigurationError("to_torchscript(method='trace') needs example_inputs= (or "
                                                "self.example_input_array)")
                out = torch.jit.trace(self, example_inputs=inputs, **kwargs)
            else:
                raise MisconfigurationError(f"to_torchscript(method={method!r}): use 'script' or 'trace'")
        finally:
            self.train(mode)
        if file_path is not None:
            torch.jit.save(out, file_path)
        return out

    @torch.no_grad()
    def to_onnx(self, file_path: Any, input_sample: Any = None, **kwargs: Any) -> Any:
        """``torch.onnx.export`` of this module in eval mode with ``input_sample``
        (default ``self.example_input_array``); needs the ``onnx`` packages torch's
        exporter uses."""
        sample = input_sample if input_sample is not None else getattr(self, "example_input_array", None)
        if sample is None:
            raise MisconfigurationError("to_onnx needs input_sample= (or self.example_input_array)")
        mode = self.training
        self.eval()
        try:
            return torch.onnx.export(self, sample if isinstance(sample, tuple) else (sample,), file_path, **kwargs)
        finally:
            self.train(mode)

    # -- logging -----------------------------------------------------------------
    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: str | Any = "mean", sync_dist: bool = False,
            batch_size: int | None = None, **_ignored: Any) -> None:
        """Log a scalar tensor, number or ``torchmetrics.Metric``. Costs a dict lookup
        per call; values reach the host only when a logger or the progress bar emits.

        Args:
            name: the metric's name (``"val/loss"``).
            value: a scalar tensor, a number or a torchmetrics Metric (computed at epoch end).
            prog_bar: show it on the progress bar (epoch values: the value logged at epoch end).
            logger: send it to the loggers.
            on_step: log the value of each step (default: True in training, False elsewhere).
            on_epoch: log the epoch value (default: False in training, True elsewhere).
            reduce_fx: how the epoch value is made: "mean" (batch-size weighted), "sum", "max", "min".
            sync_dist: reduce the epoch value across processes (needed under DDP for a value
                that differs per rank).
            batch_size: weight of this value in the epoch mean (default: inferred from the batch).
        """
        t = self._trainer
        results = t.state.results if t is not None else None   # the running stage's (trainer.state)
        if results is None:
            return  # outside a loop (e.g. a plain forward): nothing to record
        results.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, batch_size)

    def log_dict(self, values: dict, **kwargs: Any) -> None:
        """``self.log(name, value, **kwargs)`` for each item."""
        for k, v in values.items():
            self.log(k, v, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank zero only; above the progress bar while it is live
        (``trainer.print``)."""
        if self._trainer is None:
            print(*args, **kwargs)
        else:
            self._trainer.print(*args, **kwargs)

    # -- optimizers (manual optimization) -----------------------------------------
    def optimizers(self) -> Any:
        """Manual optimization: the optimizer (or the list of them), wrapped so ``step()``
        goes through the strategy and precision (``ember.step.StepOptimizer``) and counts
        ``trainer.global_step``."""
        t = self.trainer
        st = t.state
        cached = st.manual_optimizers
        if cached is None or cached[0] is not t.optimizers:   # a new fit configures new optimizers
            from ember.step import StepOptimizer

            def count() -> None:
                t.global_step += 1
            cached = (t.optimizers, [StepOptimizer(o, t.step_rules, after_step=count) for o in t.optimizers])
            st.manual_optimizers = cached
        opts = cached[1]
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The schedulers from ``configure_optimizers`` (one, a list, or None)."""
        s = [c["scheduler"] for c in self.trainer.lr_scheduler_configs]
        return None if not s else (s[0] if len(s) == 1 else s)

    def manual_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Manual optimization: ``loss.backward()`` through the strategy (loss scaling, DDP
        sync), between the ``on_before_backward`` / ``on_after_backward`` hooks."""
        t = self.trainer
        rules, events = t.step_rules, t.events
        # DDP: the strategy prepares the reducer for this loss
        rules.hooked(rules.manual_backward, events["on_before_backward"], events["on_after_backward"])(
            loss, t.model, **kwargs)

    # -- collectives ----------------------------------------------------------------
    def all_gather(self, data: Any, sync_grads: bool = False) -> Any:
        """Stack ``data`` from every rank: tensors get a leading world dim."""
        from torch.utils._pytree import tree_map
        gather = self.trainer.strategy.all_gather
        return tree_map(lambda d: gather(d if isinstance(d, torch.Tensor) else torch.as_tensor(d, device=self.device)),
                        data)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather ``data`` (tensors, dicts/lists/tuples of them, lists of strings; dim 0 =
        samples) from every rank in dataset order, dropping the distributed sampler's
        duplicates so that exactly the dataset comes back. Called per batch in an
        evaluation step, the duplicates are dropped from the last batch of a full pass
        only (as Accelerate); called after the steps (``on_validation_epoch_end``) on the
        concatenation of the pass's outputs, from its end. A shorter pass
        (``limit_val_batches``) drops nothing. Every rank must make the same calls."""
        from ember.distributed import collectives as distributed
        t = self.trainer
        return distributed.gather_for_metrics(data, num_padded=t.padding_to_drop, strategy=t.strategy)

    # -- steps --------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Required: compute and return the loss of one batch (a tensor, or a dict with
        ``"loss"``; None skips the batch). Define ``validation_step``, ``test_step`` and
        ``predict_step(batch, batch_idx)`` the same way for the other loops."""
        raise MisconfigurationError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def configure_optimizers(self) -> Any:
        """Required for automatic optimization: return an optimizer, a list of them, or
        ``{"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"|"epoch",
        "frequency": 1, "monitor": "val/loss"}}``."""
        raise MisconfigurationError(
            f"{type(self).__name__}.configure_optimizers is missing: return an optimizer, a list of "
            "optimizers, or {'optimizer': opt, 'lr_scheduler': ...}")

    def configure_model(self) -> None:
        """Build large layers here: called inside the strategy's init context (meta device
        under FSDP), after the strategy is set up and before the optimizers."""

    # Lightning-style hooks; the loop calls only those a subclass overrides (a hook
    # nobody overrides costs nothing). The order of events is in ember/trainer/events.py.
    def on_fit_start(self) -> None:
        """Called once at the start of ``fit``, after setup and any checkpoint restore."""

    def on_fit_end(self) -> None:
        """Called once at the end of a ``fit`` that did not raise (also one stopped for a preemption signal)."""

    def on_train_start(self) -> None:
        """Called before the first training epoch (after the sanity check)."""

    def on_train_end(self) -> None:
        """Called after the last training epoch."""

    def on_train_epoch_start(self) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self) -> None:
        """Called at the end of each training epoch, after validation; values logged here
        are epoch values by default."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Called before each ``training_step``; return -1 to end the epoch early."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training batch (and its optimizer step, on the last micro-batch)."""

    def on_validation_epoch_start(self) -> None:
        """Called before the first batch of a validation pass."""

    def on_validation_epoch_end(self) -> None:
        """Called after the last batch of a validation pass; ``self.log`` still works here."""

    def on_test_epoch_start(self) -> None:
        """Called before the first batch of the test loop."""

    def on_test_epoch_end(self) -> None:
        """Called after the last batch of the test loop; ``self.log`` still works here."""

    def on_predict_epoch_start(self) -> None:
        """Called before the first batch of ``predict``."""

    def on_predict_epoch_end(self) -> None:
        """Called after the last batch of ``predict``."""

    def on_validation_start(self) -> None:
        """Called at the start of a validation pass (not during the sanity check)."""

    def on_validation_end(self) -> None:
        """Called after a validation pass, once its epoch values are emitted."""

    def on_test_start(self) -> None:
        """Called at the start of the test loop."""

    def on_test_end(self) -> None:
        """Called after the test loop, once its values are emitted."""

    def on_predict_start(self) -> None:
        """Called at the start of ``predict``."""

    def on_predict_end(self) -> None:
        """Called at the end of ``predict``."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each ``validation_step`` (also in the sanity check)."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each ``validation_step`` with its output."""

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each ``test_step``."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each ``test_step`` with its output."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each ``predict_step``."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each ``predict_step`` with its output."""

    def on_validation_model_eval(self) -> None:
        """Puts the module in eval mode before a validation pass (override to keep e.g. dropout on)."""
        self.eval()

    def on_validation_model_train(self) -> None:
        """Puts the module back in train mode after a validation pass run during training."""
        self.train()

    def on_test_model_eval(self) -> None:
        """Puts the module in eval mode before the test loop."""
        self.eval()

    def on_test_model_train(self) -> None:
        """Puts the module back in train mode after the test loop (when it was training before)."""
        self.train()

    def on_predict_model_eval(self) -> None:
        """Puts the module in eval mode before ``predict``."""
        self.eval()

    def prepare_data(self) -> None:
        """Download or write data once per machine (local rank 0), before ``setup``; do not
        set state here (other processes do not run it)."""

    def setup(self, stage: str) -> None:
        """Called on every process at the start of fit/validate/test/predict (``stage``), after the
        datamodule's and the callbacks' ``setup`` and before ``configure_model``: build layers or
        datasets that need the process environment here."""

    def teardown(self, stage: str) -> None:
        """Called at the end of fit/validate/test/predict (also after an error)."""

    def configure_callbacks(self) -> Any:
        """Return a callback or a list of callbacks to add to the Trainer's at the start of each
        run; one of the same type as a Trainer callback replaces it (Lightning's rule)."""
        return []

    def configure_precision(self, device: torch.device) -> "str | None":
        """The precision a Trainer given none (``precision=None``, the default, and no
        ``$EMBER_PRECISION``) runs this module in on ``device``: a precision string, or
        None for ``"32-true"``. Asked once, before the first run sets up the device; a
        precision passed to the Trainer always wins. ``TransformersModule`` returns
        ``"bf16-mixed"`` where the device multiplies bfloat16 in hardware."""
        return None

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter the batch before it is moved to the device; return the batch."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move the batch to ``device`` (tensors in nested lists/tuples/dicts); override for
        custom batch types. Return the batch."""
        from ember.strategies.base import move_to_device
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter the batch after it is on the device (e.g. GPU augmentations); return the batch."""
        return batch

    def loss_count(self, batch: Any) -> "torch.Tensor | int | None":
        """For a ``training_step`` that returns a *sum* of per-item losses (e.g. over target
        tokens): the number of items in ``batch`` (the raw batch, before it moves to the
        device). The Trainer then divides the losses of each optimizer step by their item
        count over every micro-batch and process (``ember.step.StepRules.count_divisor``),
        so the step's gradient is the mean over every item, as one big batch. Default (not
        overridden): ``training_step`` returns a mean, divided by the window's size. An
        override may be a property that is None for a run whose losses are means (the
        Trainer reads it once per epoch and then counts nothing), as TransformersModule's."""
        return None

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Called before the backward of each training micro-batch with the loss that is
        back-propagated (divided by the accumulation window's size or item count)."""

    def on_after_backward(self) -> None:
        """Called after the backward of each training micro-batch (gradients still scaled under 16-mixed)."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before each optimizer step, with unscaled gradients (also under 16-mixed)."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: "float | None" = None,
                                    gradient_clip_algorithm: "str | None" = None) -> None:
        """Clip gradients before each optimizer step; called with the Trainer's
        ``gradient_clip_val``/``gradient_clip_algorithm`` (gradients already unscaled).
        The default clips as the Trainer would; override to clip differently."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step ``optimizer`` (e.g. after a learning-rate warm-up). The loop has already run
        forward and backward: ``optimizer_closure()`` only returns the micro-batch's loss, so
        ``optimizer.step(closure=optimizer_closure)`` works as in Lightning, but closures that
        re-evaluate the model (LBFGS) need manual optimization. ``optimizer`` steps through the
        precision (skipped on inf/NaN gradients under 16-mixed)."""
        optimizer.step(closure=optimizer_closure)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        """Called before the gradients of ``optimizer`` are zeroed, after the optimizer step."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Zero the gradients of ``optimizer`` after its step (default: ``set_to_none=True``)."""
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Any = None) -> None:
        """Step one scheduler at its interval; ``metric`` is the monitored value (None without
        a ``monitor``). Override for schedulers with another ``step`` signature."""
        scheduler.step() if metric is None else scheduler.step(metric)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Add entries to ``checkpoint`` (a dict of tensors and plain values) before it is written."""

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Read back what ``on_save_checkpoint`` added, when a checkpoint is restored."""

    # -- checkpoints ----------------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(cls, path: str, map_location: str | torch.device = "cpu", strict: bool = True,
                             trust_deepspeed: bool = False, **overrides: Any) -> TrainModule:
        """Rebuild the module from the hparams saved in ``path`` (updated by
        ``overrides``) and load its weights. Nothing is unpickled: the weights are
        safetensors, or a DCP folder read without arbitrary unpickling; sharded
        checkpoints (FSDP) are consolidated in this one process.

        A DeepSpeed checkpoint is read with DeepSpeed's own loader, which unpickles
        (can run code): pass ``trust_deepspeed=True`` only for checkpoints you made.
        Subclasses can restrict which saved hparams are used (:meth:`checkpoint_hparams`).
        """
        from ember.checkpoint import io as cio
        weights, _, meta = cio.read_checkpoint(str(path), load_state=False)
        if weights is None and meta.get("strategy") == "deepspeed" and not trust_deepspeed:
            raise CheckpointError(f"{path} is a DeepSpeed checkpoint; DeepSpeed's loader unpickles its files, "
                                  "which can run code. Pass trust_deepspeed=True if you made this checkpoint")
        saved = meta.get("hparams") or {}
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: meta.json 'hparams' is a {type(saved).__name__}, expected an object")
        hparams = cls.checkpoint_hparams(dict(saved), str(path))
        hparams.update(overrides)
        try:
            module = cls(**hparams)
        except TypeError as e:
            raise CheckpointError(f"cannot rebuild {cls.__name__} from the checkpoint's hparams "
                                  f"{sorted(hparams)}: {e}. Pass the missing arguments as keywords.") from e
        module.configure_model()
        if weights is None:   # sharded (FSDP / DeepSpeed): consolidate in this process, no process group
            if meta.get("strategy") == "deepspeed":
                from ember.strategies.deepspeed import load_full_weights
            else:
                from ember.strategies.fsdp import load_full_weights
            weights = load_full_weights(str(path))
        cio.check_compatible(module, weights, str(path)) if strict else None
        module.load_state_dict(weights, strict=strict)
        return module.to(map_location)

    @classmethod
    def checkpoint_hparams(cls, hparams: dict, path: str) -> dict:
        """The saved hparams that :meth:`load_from_checkpoint` passes to the constructor
        (all of them here). Override to drop or check what a checkpoint may set, e.g.
        options that would load code or reach the network."""
        return hparams


class DataModule(HyperparametersMixin):
    """Bundles the data of a run: ``prepare_data`` (once, rank zero), ``setup(stage)``
    (every rank), ``*_dataloader()``, and optional ``state_dict``/``load_state_dict``
    stored in checkpoints. ``save_hyperparameters()`` in ``__init__`` records its
    arguments in ``self.hparams``, as on the module."""

    def __init__(self) -> None:
        self.trainer = None
        self.hparams = AttributeDict()

    def prepare_data(self) -> None:
        """Download or write data once per machine (local rank 0), before ``setup``."""

    def setup(self, stage: str) -> None:
        """Build the datasets on every rank; ``stage`` is "fit", "validate", "test" or "predict"."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built, at the end of the stage."""

    def train_dataloader(self) -> Any:
        """The training DataLoader (required for ``fit``)."""
        raise NotImplementedError

    def val_dataloader(self) -> Any:
        """The validation DataLoader, or a list of them (None: no validation)."""
        return None

    def test_dataloader(self) -> Any:
        """The test DataLoader(s), for ``trainer.test``."""
        raise NotImplementedError

    def predict_dataloader(self) -> Any:
        """The DataLoader(s) for ``trainer.predict``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """State saved in checkpoints (plain values and tensors)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""


def overrides(obj: Any, base: type, name: str) -> bool:
    """True when ``type(obj)`` overrides ``base.name``."""
    return getattr(type(obj), name, None) is not getattr(base, name, None)
