"""Fine-tune Hugging Face Transformers models with the ember Trainer, no loop code.

    from ember.integrations.transformers import TransformersModule, TextClassificationData
    data = TextClassificationData("path/to/model", train="train.csv", val_split=0.1)
    module = TransformersModule("path/to/model", task="sequence-classification", lr=2e-5)
    ember.Trainer(max_epochs=3).fit(module, datamodule=data)
    module.save_pretrained("out/", tokenizer=data.tokenizer)

See docs/transformers.md. ``import ember`` does not import this module (nor transformers).
"""
from __future__ import annotations

import importlib
import math
import os
import warnings
from typing import Any

import functools

import torch
from torch import nn
from torch.nn import functional as F

from ember.callbacks.base import Callback
from ember.errors import CheckpointError, MisconfigurationError, invalid_choice
from ember.checkpoint.trust import check_export_dir
from ember.integrations.hf_data import (CausalLMData, LengthGroupedSampler, PadCollator, TextClassificationData,
                                        TokenizedDataset)
from ember.integrations import packing
from ember.integrations.hf_io import _offline, load_tokenizer
from ember.integrations.packing import PackCollator
from ember.module import TrainModule

__all__ = ["TransformersModule", "TextClassificationData", "CausalLMData", "ExportBestPretrained",
           "TokenizedDataset", "PadCollator", "PackCollator", "LengthGroupedSampler", "TASKS"]

#: task name -> transformers Auto class
TASKS = {"sequence-classification": "AutoModelForSequenceClassification",
         "token-classification": "AutoModelForTokenClassification",
         "causal-lm": "AutoModelForCausalLM",
         "seq2seq-lm": "AutoModelForSeq2SeqLM"}
_TOKEN_TASKS = ("causal-lm", "seq2seq-lm", "token-classification")   # losses averaged over tokens
SCHEDULERS = ("linear", "cosine", "constant")


def _names_custom_code(config_file: str) -> bool:
    """Whether a Hugging Face config file maps Auto classes to custom code (``auto_map``)."""
    import json
    try:
        if os.path.getsize(config_file) > 16 * 2**20:
            return True
        with open(config_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError):
        return True
    return isinstance(cfg, dict) and "auto_map" in cfg


def _resolve_task(task) -> tuple[str, type | None]:
    """-> (task name or 'custom', class). Strings may also be dotted class paths."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        import transformers
    if isinstance(task, str) and task in TASKS:
        return task, getattr(transformers, TASKS[task])
    if isinstance(task, str) and "." in task:
        mod, _, name = task.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as err:
            raise MisconfigurationError(f"task={task!r}: cannot import it ({err}); choose one of "
                                        f"{list(TASKS)} or an AutoModelFor... class") from err
        return _resolve_task(cls)
    if isinstance(task, type) and hasattr(task, "from_pretrained"):
        for name, auto in TASKS.items():
            if task is getattr(transformers, auto):
                return name, task
        return _task_of_class(task.__name__) or "custom", task
    raise invalid_choice("task", task, list(TASKS) + ["an AutoModelFor... class"])


def _task_of_class(name: str) -> str | None:
    if "ForSequenceClassification" in name:
        return "sequence-classification"
    if "ForTokenClassification" in name:
        return "token-classification"
    if "ForCausalLM" in name or "LMHeadModel" in name:
        return "causal-lm"
    if "ForSeq2SeqLM" in name or "ForConditionalGeneration" in name:
        return "seq2seq-lm"
    return None


def _no_decay(module: nn.Module, name: str) -> bool:
    return name.endswith("bias") or "norm" in type(module).__name__.lower() or "norm" in name.lower()


class TransformersModule(TrainModule):
    """A TrainModule around a Hugging Face ``PreTrainedModel``.

    Args:
        model: a local folder / cached Hub name, or a ``PreTrainedModel``.
        task: ``"sequence-classification"``, ``"token-classification"``, ``"causal-lm"``,
            ``"seq2seq-lm"``, an ``AutoModelFor...`` class or its dotted path. Default: taken
            from a model object's class, else ``"sequence-classification"``.
        lr, weight_decay: AdamW; biases and normalisation weights get no weight decay.
        warmup_ratio / warmup_steps: linear warmup (steps win over the ratio), then
            ``scheduler`` (``"linear"``, ``"cosine"`` or ``"constant"``), stepped every optimizer step.
        num_labels, id2label, label2id: classification heads. When none is given the
            model is built in ``configure_model`` with the labels of the DataModule.
        gradient_checkpointing: recompute activations in backward (less memory).
        freeze_base: train only the task head.
        model_kwargs: passed to ``from_pretrained`` (e.g. ``attn_implementation``).
        token_exact_accumulation: for token-level losses, average over all target tokens of
            an optimizer step (every micro-batch and rank), not per micro-batch.
        generate_kwargs: for ``predict_step`` of language models (default ``max_new_tokens=32``).
        tokenizer: used to decode generations and saved by ``save_pretrained``; defaults to the
            DataModule's.
        local_files_only: never reach the network when loading by name (default True).
        model_config: a config dict to build an untrained model from (how checkpoints of
            modules made from model objects are rebuilt).
        packed_attention: the attention kernel for padding-free batches
            (``TextClassificationData(padding_free=True)``): ``"sdpa"`` (PyTorch's SDPA per
            text, training and inference) or ``"flex"`` (FlexAttention with a document mask;
            inference only on CPU). See :mod:`ember.integrations.packing`.
        peft_config: a ``peft.PeftConfig`` (e.g. ``peft.LoraConfig(r=8, target_modules="all-linear")``),
            or its ``to_dict()`` data: the model is wrapped with ``peft.get_peft_model`` when
            it is built and ``module.model`` is the ``PeftModel``. Only the adapters and the
            ``modules_to_save`` train; checkpoints hold those (and their optimizer state),
            naming the base by path and digest; ``save_pretrained`` writes PEFT's adapter
            folder (``merged=True``: a plain transformers folder). Needs
            ``pip install "ember[peft]"``; see :mod:`ember.integrations.adapters`.
    """

    def __init__(self, model: Any = None, task: Any = None, lr: float = 2e-5, weight_decay: float = 0.01,
                 warmup_ratio: float = 0.06, warmup_steps: int | None = None, scheduler: str = "linear",
                 num_labels: int | None = None, id2label: dict | None = None, label2id: dict | None = None,
                 gradient_checkpointing: bool = False, freeze_base: bool = False, model_kwargs: dict | None = None,
                 token_exact_accumulation: bool = True, generate_kwargs: dict | None = None,
                 tokenizer: Any = None, local_files_only: bool = True, model_config: dict | None = None,
                 adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 packed_attention: str = "sdpa", peft_config: Any = None):
        super().__init__()
        self.save_hyperparameters(ignore=["model", "tokenizer", "task", "peft_config"])
        self._peft_config = None
        if peft_config is not None:   # before anything is read: a missing peft or bad config fails here
            from ember.integrations import adapters
            self._peft_config = adapters.check_config(peft_config)
            try:
                self.hparams["peft_config"] = adapters.config_to_dict(self._peft_config)
            except TypeError as err:
                warnings.warn(f"peft_config: {err}, which a checkpoint's meta.json cannot hold; pass "
                              "peft_config= to load_from_checkpoint yourself", UserWarning, stacklevel=2)
        self._base_keys: frozenset = frozenset()   # state keys of the frozen base (adapters only)
        self._peft_base: dict | None = None
        if scheduler not in SCHEDULERS:
            raise invalid_choice("scheduler", scheduler, SCHEDULERS)
        if packed_attention not in packing.ATTENTION:
            raise invalid_choice("packed_attention", packed_attention, packing.ATTENTION)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
            raise MisconfigurationError(f"lr={lr!r} is not valid; use a positive number")
        if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise MisconfigurationError(f"weight_decay={weight_decay!r} is not valid; use a number >= 0")
        if not isinstance(warmup_ratio, (int, float)) or not 0 <= warmup_ratio < 1:
            raise MisconfigurationError(f"warmup_ratio={warmup_ratio!r} is not valid; use a fraction in [0, 1)")
        if warmup_steps is not None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
                                         or warmup_steps < 0):
            raise MisconfigurationError(f"warmup_steps={warmup_steps!r} is not valid; use an int >= 0 or None")
        if model is None and model_config is None:
            raise MisconfigurationError("TransformersModule(model=...) is missing: give a local folder, a cached "
                                        "Hub name or a PreTrainedModel")
        if task is None:
            task = (_task_of_class(type(model).__name__) if isinstance(model, nn.Module) else None) \
                or "sequence-classification"
        self.task, self._auto_cls = _resolve_task(task)
        self.hparams["task"] = self.task if self.task in TASKS else f"{self._auto_cls.__module__}.{self._auto_cls.__qualname__}"
        id2label = {int(k): str(v) for k, v in id2label.items()} if id2label else None
        if id2label and label2id is None:
            label2id = {v: k for k, v in id2label.items()}
        if num_labels is not None and id2label is not None and num_labels != len(id2label):
            raise MisconfigurationError(f"num_labels={num_labels} disagrees with id2label, which names "
                                        f"{len(id2label)} classes")
        if num_labels is None and id2label is not None:
            num_labels = len(id2label)
        if num_labels is not None and (isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1):
            raise MisconfigurationError(f"num_labels={num_labels!r} is not valid; use an int >= 1")
        self.num_labels, self.id2label, self.label2id = num_labels, id2label, label2id
        self.lr, self.weight_decay, self.scheduler = float(lr), float(weight_decay), scheduler
        self.warmup_ratio, self.warmup_steps = float(warmup_ratio), warmup_steps
        self.adam_betas, self.adam_eps = tuple(adam_betas), float(adam_eps)
        self.packed_attention = packed_attention
        self.gradient_checkpointing, self.freeze_base = gradient_checkpointing, freeze_base
        self.model_kwargs = dict(model_kwargs or {})
        if self.model_kwargs.get("quantization_config") is not None:
            from ember.integrations.adapters import check_quantization
            check_quantization(self.model_kwargs)   # QLoRA without bitsandbytes: said before any training
        self.token_exact_accumulation = token_exact_accumulation
        self.generate_kwargs = {"max_new_tokens": 32, **(generate_kwargs or {})}
        self.local_files_only = local_files_only
        self.tokenizer = load_tokenizer(tokenizer, local_files_only) if tokenizer is not None else None
        if isinstance(tokenizer, (str, os.PathLike)):
            self.hparams["tokenizer"] = os.fspath(tokenizer)
        self.model: nn.Module | None = None
        self.metrics = nn.ModuleDict()
        self._exact = False
        if isinstance(model, nn.Module):
            self.hparams["model_config"] = model.config.to_dict()
            self._set_model(model)
        elif isinstance(model, (str, os.PathLike)):
            self.hparams["model"] = os.fspath(model)
            if self.task not in ("sequence-classification", "token-classification") or num_labels is not None:
                from ember.integrations.hf_load import pretrained_config
                pretrained_config(self, os.fspath(model))   # config.json only: a bad name fails here
                del self.model                      # the weights are read when first used (see __getattr__)
                self._pending_model = os.fspath(model)
        else:
            self._set_model(self._from_config(model_config))
        if self._peft_config is not None:
            # the base every checkpoint of this run names (meta.json), known before the loggers
            # get the hparams at the start of a fit (later keys would miss TensorBoard's HPARAMS tab)
            self.hparams["peft_base"] = self._base_record()

    #: the saved hparams :meth:`load_from_checkpoint` may take from a checkpoint's meta.json
    CHECKPOINT_HPARAMS = frozenset({
        "model", "task", "lr", "weight_decay", "warmup_ratio", "warmup_steps", "scheduler", "num_labels",
        "id2label", "label2id", "gradient_checkpointing", "freeze_base", "model_kwargs", "token_exact_accumulation",
        "generate_kwargs", "tokenizer", "model_config", "adam_betas", "adam_eps", "packed_attention",
        "peft_config"})
    #: the ``model_kwargs`` a checkpoint may set (nothing that loads code or picks remote files)
    CHECKPOINT_MODEL_KWARGS = frozenset({"attn_implementation", "torch_dtype", "dtype", "low_cpu_mem_usage"})

    @classmethod
    def checkpoint_hparams(cls, hparams: dict, path: str) -> dict:
        """Allow-list what a checkpoint may set: no ``trust_remote_code`` or other loader
        options, no folders whose config names custom code (``auto_map``), no task class
        outside transformers, and always ``local_files_only=True``. Pass such arguments
        to ``load_from_checkpoint`` yourself when you trust them."""
        from ember.errors import CheckpointError

        def refuse(what: str):
            return CheckpointError(f"refusing {path}: its meta.json hparams {what}; pass the argument to "
                                   "load_from_checkpoint yourself if you trust it")
        out = {k: v for k, v in hparams.items() if k in cls.CHECKPOINT_HPARAMS}
        mk = out.get("model_kwargs") or {}
        if not isinstance(mk, dict):
            raise refuse(f"set model_kwargs to {mk!r}")
        if "quantization_config" in mk:   # a QLoRA run's (meta.json holds only its text): given again, or
            mk = {k: v for k, v in mk.items() if k != "quantization_config"}   # refused by load_from_checkpoint
            out["model_kwargs"] = mk
        bad = sorted(k for k in mk if k not in cls.CHECKPOINT_MODEL_KWARGS)
        if bad:
            raise refuse(f"set model_kwargs {bad} (a checkpoint may set only "
                         f"{sorted(cls.CHECKPOINT_MODEL_KWARGS)})")
        task = out.get("task")
        if task is not None and not (isinstance(task, str) and (task in TASKS or task.startswith("transformers."))):
            raise refuse(f"name task={task!r}, which is neither one of {list(TASKS)} nor a transformers class")
        cfg = out.get("model_config")
        if cfg is not None and (not isinstance(cfg, dict) or "auto_map" in cfg):
            raise refuse("give a model_config with auto_map (custom model code)")
        pc = out.get("peft_config")
        if pc is not None:   # rebuilt from JSON data only, through peft's own config classes
            from ember.integrations.adapters import config_from_dict, require_peft
            require_peft()   # a missing peft is said as such
            try:
                out["peft_config"] = config_from_dict(pc, "meta.json hparams peft_config")
            except MisconfigurationError as err:
                raise refuse(f"give a peft_config that cannot be rebuilt safely ({err})") from err
        for key, files in (("model", ("config.json",)), ("tokenizer", ("tokenizer_config.json", "config.json"))):
            name = out.get(key)
            if name is None:
                continue
            if not isinstance(name, str):
                raise refuse(f"set {key}={name!r}")
            for fname in files:
                f = os.path.join(name, fname)
                if os.path.isfile(f) and _names_custom_code(f):
                    raise refuse(f"name {key}={name!r}, whose {fname} has auto_map (custom code that "
                                 "trust_remote_code would run)")
        out["local_files_only"] = True
        return out

    # ------------------------------------------------------------------ building
    def _label_kwargs(self) -> dict:
        if self.task not in ("sequence-classification", "token-classification") or self.num_labels is None:
            return {}
        id2label = self.id2label or {i: f"LABEL_{i}" for i in range(self.num_labels)}
        return {"num_labels": self.num_labels, "id2label": id2label,
                "label2id": self.label2id or {v: k for k, v in id2label.items()}}

    def _load(self, name: str) -> nn.Module:
        from ember.integrations.hf_load import load_pretrained
        return load_pretrained(self, name)

    def _from_config(self, cfg: dict) -> nn.Module:
        from ember.integrations.hf_load import model_from_config
        return model_from_config(self, cfg)

    def __getattr__(self, name: str) -> Any:
        # a model given by name is read on first use, or by configure_model (once per job under FSDP)
        if name == "model" and self.__dict__.get("_pending_model") is not None:
            self._set_model(self._load(self.__dict__.pop("_pending_model")))
            return self._modules["model"]
        return super().__getattr__(name)

    def _set_model(self, model: nn.Module) -> None:
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise MisconfigurationError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
        if self.task in ("sequence-classification", "token-classification"):
            if self.num_labels is not None and cfg.num_labels != self.num_labels:
                raise MisconfigurationError(f"num_labels={self.num_labels} but the model has {cfg.num_labels} "
                                            "outputs; build the model with the right num_labels")
            if self.id2label:
                cfg.id2label, cfg.label2id = dict(self.id2label), dict(self.label2id)
            self.num_labels = cfg.num_labels
            self.id2label = {int(k): v for k, v in cfg.id2label.items()}
            self.label2id = dict(cfg.label2id)
        if self.freeze_base:
            base = getattr(model, "base_model", model)
            if base is model:
                raise MisconfigurationError(f"freeze_base=True: {type(model).__name__} has no separate base model")
            for p in base.parameters():
                p.requires_grad_(False)
        if self.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(cfg, "use_cache"):
                cfg.use_cache = False
        if self._peft_config is not None:
            from ember.integrations import adapters
            if self.hparams.get("model") is None and self._peft_base is None:
                # a model given as an object: its weights are not in any folder; named by their digest
                self._peft_base = {"model": None, "digest": adapters.state_digest(model)}
            model, base = adapters.wrap(model, self._peft_config, self.gradient_checkpointing)
            self._base_keys = frozenset(f"model.{k}" for k in base)
        self.model = model
        self._build_metrics()

    def _build_metrics(self) -> None:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import torchmetrics
            from torchmetrics import classification as C
        stages = {}
        for stage in ("val", "test"):
            m = {}
            if self.task == "sequence-classification":
                k = self.num_labels
                if k == 2:
                    m["acc"], m["f1"] = C.BinaryAccuracy(), C.BinaryF1Score()
                elif k and k > 2:
                    m["acc"] = C.MulticlassAccuracy(num_classes=k, average="micro")
                    m["f1"] = C.MulticlassF1Score(num_classes=k, average="macro")
            elif self.task in _TOKEN_TASKS:
                m["loss"] = torchmetrics.MeanMetric()
                if self.task == "token-classification":
                    m["acc"] = C.MulticlassAccuracy(num_classes=self.num_labels, average="micro", ignore_index=-100)
                else:
                    m["ppl"] = _perplexity_class()()
            stages[stage] = nn.ModuleDict(m)
        self.metrics = nn.ModuleDict(stages)

    def configure_model(self) -> None:
        """Build the model now if the labels were left to the DataModule; check that the
        model and the data agree on the classes; share the DataModule's tokenizer."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if self.tokenizer is None and getattr(dm, "tokenizer", None) is not None:
            self.tokenizer = dm.tokenizer
        data_labels = getattr(dm, "id2label", None) if self.task in ("sequence-classification",
                                                                     "token-classification") else None
        from ember.integrations.hf_load import build_model
        strategy = getattr(self._trainer, "strategy", None)
        pending = self.__dict__.pop("_pending_model", None)
        if pending is not None:
            with torch.device("cpu"):   # metrics: real tensors inside a meta-device init context (FSDP)
                self._set_model(build_model(self, pending, strategy))
        if self.model is None:
            if data_labels:
                self.num_labels, self.id2label = len(data_labels), dict(data_labels)
                self.label2id = {v: k for k, v in data_labels.items()}
            with torch.device("cpu"):
                self._set_model(build_model(self, self.hparams["model"], strategy))
            if self.num_labels is not None:
                self.hparams.update(num_labels=self.num_labels, id2label=dict(self.id2label),
                                    label2id=dict(self.label2id))
        elif data_labels:
            if len(data_labels) != self.num_labels:
                raise MisconfigurationError(
                    f"num_labels={self.num_labels} but the data has {len(data_labels)} classes "
                    f"{list(data_labels.values())}; make them agree (or leave num_labels unset)")
            if all(str(v) == f"LABEL_{k}" for k, v in self.model.config.id2label.items()):
                self.id2label = dict(data_labels)
                self.label2id = {v: k for k, v in data_labels.items()}
                self.model.config.id2label, self.model.config.label2id = dict(self.id2label), dict(self.label2id)
        tok = self.tokenizer
        if tok is not None and getattr(self.model.config, "pad_token_id", 0) is None and tok.pad_token_id is not None:
            self.model.config.pad_token_id = tok.pad_token_id

    # ------------------------------------------------------------------ adapters: what a checkpoint holds
    def _frozen_base_keys(self, prefix: str = "") -> set[str]:
        """The state keys of the frozen base (an adapter run): base tensors that do not train."""
        if not self._base_keys:
            return set()
        trainable = {f"{prefix}{n}" for n, p in self.named_parameters() if p.requires_grad}
        return {f"{prefix}{k}" for k in self._base_keys} - trainable

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The module's state; with ``peft_config``, without the frozen base's weights (what
        a checkpoint of an adapter run holds: the adapters, the ``modules_to_save``, and
        anything else that trains). The whole model's state: ``module.model.state_dict()``."""
        if not self._base_keys:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        full = super().state_dict(*args, prefix=prefix, keep_vars=keep_vars)
        drop = self._frozen_base_keys(prefix)
        out = destination if destination is not None else type(full)()
        if destination is None and hasattr(full, "_metadata"):
            out._metadata = full._metadata
        for k, v in full.items():
            if k not in drop:
                out[k] = v
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load :meth:`state_dict`'s entries. With ``peft_config`` the frozen base's keys may
        be missing (a checkpoint of an adapter run holds only what trains); any other
        missing or unexpected key is an error when ``strict``."""
        if not self._base_keys:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        from torch.nn.modules.module import _IncompatibleKeys
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        frozen = self._frozen_base_keys()
        missing = [k for k in result.missing_keys if k not in frozen]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing[:10]}, "
                               f"unexpected keys {result.unexpected_keys[:10]}")
        return _IncompatibleKeys(missing, result.unexpected_keys)

    def _base_record(self) -> dict | None:
        """The base an adapter run trains on: ``{"model": folder, "digest": ...}`` (sha256 of
        its config.json and weight files) or, for a model given as an object,
        ``{"model": None, "digest": ...}`` of its weights when they were wrapped. None
        without ``peft_config``."""
        if self._peft_config is None:
            return None
        if self._peft_base is None:
            from ember.integrations import adapters
            name = self.hparams.get("model")
            folder = adapters.folder_of(name)
            digest = adapters.folder_digest(folder) if folder else f"unknown ({name} is not a local folder)"
            self._peft_base = {"model": name, "digest": digest}
        return dict(self._peft_base)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The base an adapter run trains on goes into the checkpoint's meta.json (hparams
        ``peft_base``; also set when the module is built, for weights-only saves)."""
        super().on_save_checkpoint(checkpoint)
        if self._peft_config is not None:
            self.hparams["peft_base"] = self._base_record()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """An adapter checkpoint resumes only onto the base it was trained on (same digest)."""
        super().on_load_checkpoint(checkpoint)
        saved = ((checkpoint.get("meta") or {}).get("hparams") or {}).get("peft_base")
        if self._peft_config is not None or saved is not None:
            from ember.integrations.adapters import check_base
            if self._peft_config is None:
                raise CheckpointError(f"{self.trainer.ckpt_path} holds adapter weights (peft); build the "
                                      "module with the same peft_config to resume from it")
            check_base(saved, self._base_record(), str(self.trainer.ckpt_path))

    @classmethod
    def load_from_checkpoint(cls, path: str, map_location: str | torch.device = "cpu", strict: bool = True,
                             trust_deepspeed: bool = False, **overrides: Any) -> "TransformersModule":
        """:meth:`TrainModule.load_from_checkpoint`; a checkpoint of an adapter run rebuilds
        the base (read again from the folder it names, which must have the same digest; a
        model given as an object must be passed again as ``model=``) and its adapters."""
        from ember.checkpoint import io as cio
        hparams = cio.read_meta_checked(str(path)).get("hparams") or {}
        mk = hparams.get("model_kwargs") if isinstance(hparams, dict) else None
        if isinstance(mk, dict) and "quantization_config" in mk and "model_kwargs" not in overrides:
            raise CheckpointError(f"{path} was trained on a quantized base (model_kwargs quantization_config), "
                                  "which a checkpoint cannot set: pass model_kwargs={'quantization_config': ...} "
                                  "to load_from_checkpoint (or model_kwargs={} for the adapters on a float base)")
        module = super().load_from_checkpoint(path, map_location=map_location, strict=strict,
                                              trust_deepspeed=trust_deepspeed, **overrides)
        saved = hparams.get("peft_base") if isinstance(hparams, dict) else None
        if saved is not None or module._peft_config is not None:
            from ember.integrations.adapters import check_base
            check_base(saved, module._base_record() or {}, str(path))
        return module

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise MisconfigurationError(
                "the model is built when the labels are known: pass num_labels=/id2label= to TransformersModule, "
                "or run it through a Trainer with a DataModule that has num_labels")
        return self.model

    def forward(self, **inputs):
        return self._require_model()(**inputs)

    def _run(self, batch: dict):
        """The model on a batch: padded (``model(**batch)``) or padding-free
        (:func:`~ember.integrations.packing.packed_forward`)."""
        model = self._require_model()
        if packing.is_packed(batch):
            if self._peft_config is not None:   # the transformers model inside, its adapters injected
                if getattr(self._peft_config, "is_prompt_learning", False):
                    raise MisconfigurationError("padding_free=True does not support prompt-learning adapters "
                                                f"({type(self._peft_config).__name__}); use padding_free=False")
                model = model.get_base_model()
            if not self.__dict__.get("_packable"):
                packing.check_packable(model, self.task)
                self._packable = True
            return packing.packed_forward(model, batch, self.packed_attention)
        if self._example_packed(batch):
            return model(**packing.example_packed_inputs(model, batch, labels=True))
        return model(**batch)

    def _example_packed(self, batch) -> bool:
        """A causal-LM batch of packed whole examples (``CausalLMData(packing=True)`` with
        prompt/completion or chat data); checks once that the model keeps them apart."""
        if self.task != "causal-lm" or not packing.is_example_packed(batch):
            return False
        if not self.__dict__.get("_example_packable"):
            packing.check_example_packable(self._require_model())
            self._example_packable = True
        return True

    @staticmethod
    def _batch_size(batch) -> int | None:
        if packing.is_packed(batch):
            return packing.num_texts(batch)
        return batch["input_ids"].shape[0] if "input_ids" in batch else None

    # ------------------------------------------------------------------ losses
    def _token_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sum of token losses, number of target tokens, logits); labels -100 are ignored,
        causal LM labels are shifted as the model does. The target tokens are the answer
        tokens for supervised fine-tuning data (labels -100 on prompts, non-assistant turns
        and padding), packed or not: token-exact accumulation counts exactly those."""
        if packing.is_packed(batch):
            packing.check_packable(self._require_model(), self.task)   # raises: token-level losses are padded
        if "labels" not in batch:
            raise MisconfigurationError(f"the batch has no 'labels' (keys: {sorted(batch)}); the {self.task} "
                                        "loss needs them")
        labels = batch["labels"]
        if self._example_packed(batch):   # examples kept apart: restarting position ids, no cache
            inputs = packing.example_packed_inputs(self.model, batch)
        else:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
        if self.task == "seq2seq-lm" and "decoder_input_ids" not in inputs:
            prep = getattr(self.model, "prepare_decoder_input_ids_from_labels", None)
            if prep is not None:
                inputs["decoder_input_ids"] = prep(labels=labels)
            else:
                inputs["labels"] = labels
        logits = self.model(**inputs).logits
        if logits.dim() == labels.dim() + 1 and logits.shape[:-1] != labels.shape:   # rows run flattened
            logits = logits.reshape(*labels.shape, logits.shape[-1])
        if self.task == "causal-lm":
            targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
        else:
            targets = labels
        targets = targets.to(logits.device)
        loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-100, reduction="sum")
        return loss_sum, (targets != -100).sum(), logits

    # ------------------------------------------------------------------ precision
    def _keeps_float32(self) -> bool:
        """A regression head (one output), or a model held in another dtype than float32:
        runs ember keeps in the precision they were given. A model given by name and not
        read yet is not read here (under FSDP only rank 0 reads it, in configure_model):
        the dtype in ``model_kwargs`` answers instead, and its ``config.json`` with the
        module's labels (when the data's labels build the head, they are not known yet)."""
        model = self._modules.get("model")
        config = getattr(model, "config", None)
        if model is None and self.hparams.get("model") is not None:   # given by name, not read yet
            dtype = self.model_kwargs.get("dtype", self.model_kwargs.get("torch_dtype"))
            if dtype is not None and dtype not in (torch.float32, "float32"):
                return True    # loaded in the user's dtype (ember's from_pretrained default is float32)
            pending = self.__dict__.get("_pending_model")
            if pending is not None:
                try:
                    from ember.integrations.hf_load import pretrained_config
                    config = pretrained_config(self, pending)[0]
                except Exception:   # reading the model reports it, with the real error
                    config = None
        if self.num_labels == 1 or getattr(config, "problem_type", None) == "regression" \
                or (self.task == "sequence-classification" and getattr(config, "num_labels", None) == 1):
            return True
        if isinstance(model, nn.Module):
            dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
            return bool(dtypes) and dtypes != {torch.float32}
        return False

    def configure_precision(self, device: torch.device) -> str | None:
        """``"bf16-mixed"`` where ``device`` multiplies bfloat16 matrices in hardware (a CPU
        with AMX or AVX512-BF16, a GPU of compute capability 8.0 or later), else None
        (float32). Used when the Trainer is given no precision. Float32 is kept for a
        regression head and for a model whose weights are not float32. In ember's
        benchmark a bf16-mixed step took 0.64-0.71x of a float32 one on such a CPU, at the
        same accuracy (docs/transformers.md, "bf16 on the CPU")."""
        from ember.precision.hardware import native_bf16
        if self._keeps_float32() or native_bf16(device) is None:
            return None
        return "bf16-mixed"

    # ------------------------------------------------------------------ steps
    def on_fit_start(self) -> None:
        """On a CPU that multiplies bfloat16 in hardware (AVX512-BF16, AMX), a fit in float32
        (a precision given by hand: given none, the Trainer runs :meth:`configure_precision`'s
        bf16-mixed) suggests ``precision="bf16-mixed"`` once per process (rank zero)."""
        from ember.precision.hardware import suggest_bf16
        t = self.trainer
        if t.is_global_zero and not self._keeps_float32():
            suggest_bf16(t.precision, self.device.type)

    def on_train_start(self) -> None:
        t = self.trainer
        self._exact = bool(self.token_exact_accumulation and self.task in _TOKEN_TASKS
                           and (t.accumulate_grad_batches > 1 or t.world_size > 1)
                           and not t.strategy.owns_optimizer_step)

    @property
    def loss_count(self):
        """Token-exact accumulation (decided at train start): the function that counts a
        batch's target tokens (labels not -100, causal LM labels shifted as the model does);
        ``training_step`` then returns their loss sum and the Trainer divides each step's
        losses by the count over its micro-batches and ranks. None when this run's losses
        are means (one process without accumulation, a sequence task, or
        ``token_exact_accumulation=False``): the Trainer's step then counts nothing."""
        return self._target_tokens if self._exact else None

    def _target_tokens(self, batch):
        if "labels" not in batch:
            return None
        labels = batch["labels"]
        return ((labels[..., 1:] if self.task == "causal-lm" else labels) != -100).sum()

    def training_step(self, batch, batch_idx):
        bs = self._batch_size(batch)
        if self._exact:
            loss_sum, n, _ = self._token_loss(batch)
            self.log("train/loss", loss_sum.detach() / n.clamp(min=1), prog_bar=True, batch_size=bs)
            return loss_sum   # divided by the window's token count on every rank (loss_count)
        out = self._run(batch)
        if getattr(out, "loss", None) is None:
            raise MisconfigurationError(f"the model returned no loss; the batch needs 'labels' (keys: {sorted(batch)})")
        self.log("train/loss", out.loss.detach(), prog_bar=True, batch_size=bs)
        return out.loss

    def _eval_step(self, batch, stage: str):
        self._require_model()
        m = self.metrics[stage] if stage in self.metrics else {}
        bs = self._batch_size(batch)
        if self.task in _TOKEN_TASKS:
            loss_sum, n, logits = self._token_loss(batch)
            m["loss"].update(loss_sum / n.clamp(min=1), n)
            self.log(f"{stage}/loss", m["loss"], prog_bar=stage == "val")
            if "ppl" in m:
                m["ppl"].update(loss_sum / n.clamp(min=1), n)
                self.log(f"{stage}/ppl", m["ppl"])
            if "acc" in m:
                m["acc"](logits.argmax(-1), batch["labels"])
                self.log(f"{stage}/acc", m["acc"])
            return None
        out = self._run(batch)
        if getattr(out, "loss", None) is not None:
            self.log(f"{stage}/loss", out.loss, on_epoch=True, sync_dist=True, batch_size=bs, prog_bar=stage == "val")
        if self.task == "sequence-classification" and "labels" in batch and m:
            preds, target = out.logits.argmax(-1), batch["labels"]
            for name, metric in m.items():
                metric(preds, target)
                self.log(f"{stage}/{name}", metric, prog_bar=stage == "val" and name == "acc")
        return None

    def validation_step(self, batch, batch_idx):
        return self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._eval_step(batch, "test")

    def predict_step(self, batch, batch_idx):
        """Classification: ``{"label": ids, "probs": probabilities}``; token classification:
        ``{"label": ids per token, -100 at padding}``; language models: the generated text
        (a list of strings) when a tokenizer is attached, else the generated token ids."""
        model = self._require_model()
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if self.task in ("sequence-classification", "token-classification"):
            probs = self._run(inputs).logits.float().softmax(-1)
            label = probs.argmax(-1)
            if self.task == "token-classification" and "attention_mask" in inputs:
                label = label.masked_fill(inputs["attention_mask"] == 0, -100)
                return {"label": label}
            return {"label": label, "probs": probs}
        if self.task in ("causal-lm", "seq2seq-lm"):
            kw = dict(self.generate_kwargs)
            pad = self.tokenizer.pad_token_id if self.tokenizer is not None else model.config.pad_token_id
            if pad is not None:
                kw.setdefault("pad_token_id", pad)
            gen = model.generate(**{k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}, **kw)
            if self.task == "causal-lm":
                gen = gen[:, inputs["input_ids"].shape[1]:]
            if self.tokenizer is not None:
                return self.tokenizer.batch_decode(gen, skip_special_tokens=True)
            return gen
        return model(**inputs)

    # ------------------------------------------------------------------ optimization
    def _fused_ok(self, params) -> bool:
        """AdamW's fused kernel (transformers' Trainer default, ``adamw_torch_fused``):
        one kernel per step instead of a Python loop over parameters (a sixth of a step's
        time on CPU for MiniLM). Only for plain floating tensors on a device that has the
        kernel, and not where the strategy steps the optimizer itself (DeepSpeed steps its
        own flat partitions)."""
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        t = self._trainer
        if t is not None and t.strategy.owns_optimizer_step:
            return False
        ok = set(_get_fused_kernels_supported_devices())
        return bool(params) and all(type(p) is nn.Parameter and p.is_floating_point() and p.device.type in ok
                                    for p in params)

    def configure_optimizers(self):
        model = self._require_model()
        decay, no_decay, seen = [], [], set()
        for mod in model.modules():
            for pname, p in mod.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:   # tied weights once
                    seen.add(id(p))
                    (no_decay if _no_decay(mod, pname) else decay).append(p)
        groups = [g for g in ({"params": decay, "weight_decay": self.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        if not groups:
            raise MisconfigurationError("no trainable parameters (is everything frozen?)")
        fused = {"fused": True} if self._fused_ok(decay + no_decay) else {}
        opt = torch.optim.AdamW(groups, lr=self.lr, betas=self.adam_betas, eps=self.adam_eps, **fused)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self._schedule(opt), "interval": "step", "frequency": 1}}

    def _schedule(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """transformers' ``get_scheduler``, sized by the Trainer's ``estimated_stepping_batches``."""
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from transformers import get_scheduler
        warmup, total = self.warmup_steps, None
        if self.scheduler != "constant" or warmup is None:
            t = self._trainer
            if t is None or not t.num_training_batches:
                raise MisconfigurationError(
                    f"TransformersModule(scheduler={self.scheduler!r}, warmup_steps={self.warmup_steps!r}) is sized "
                    "from the Trainer's data (estimated_stepping_batches): call configure_optimizers inside "
                    "Trainer.fit, or pass scheduler=\"constant\" and warmup_steps=N, which need no total")
            total = t.estimated_stepping_batches
            warmup = warmup if warmup is not None else math.ceil(self.warmup_ratio * total)
        name = "constant_with_warmup" if self.scheduler == "constant" else self.scheduler
        return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)

    # ------------------------------------------------------------------ export
    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, task: Any = None, device_map: Any = None,
                        max_memory: dict | None = None, offload_folder: str | os.PathLike | None = None,
                        no_split_module_classes: list[str] | None = None, dtype: Any = None,
                        **kwargs) -> "TransformersModule":
        """A module from a local folder or cached Hub name. With ``device_map`` (``"auto"`` or a
        dict, see ``ember.big_modeling``) the model is built empty and its safetensors weights
        go straight to the mapped devices, offloading to CPU and disk (``offload_folder``)
        within ``max_memory``; without it, the same as ``TransformersModule(model, ...)``.
        Other keyword arguments are TransformersModule's."""
        if device_map is None:
            return cls(model, task=task, **kwargs)
        from ember.big_modeling.loading import load_pretrained
        _, auto_cls = _resolve_task(task if task is not None else "sequence-classification")
        labels = {k: kwargs[k] for k in ("num_labels", "id2label", "label2id") if kwargs.get(k) is not None}
        hf_model = load_pretrained(auto_cls, model, device_map=device_map, max_memory=max_memory,
                                   offload_folder=offload_folder, no_split_module_classes=no_split_module_classes,
                                   dtype=dtype, local_files_only=kwargs.get("local_files_only", True) or _offline(),
                                   **labels)
        return cls(hf_model, task=task, **kwargs)

    @property
    def trains_adapters(self) -> bool:
        """True when only adapters train (``peft_config`` given)."""
        return self._peft_config is not None

    def packs_texts(self) -> bool:
        """Whether padding-free batches (``TextClassificationData(padding_free=True)``) run
        on this module: sequence classification with a BERT-architecture encoder, and no
        prompt-learning adapter (read from the config; the weights are not loaded)."""
        if self.task != "sequence-classification" or getattr(self._peft_config, "is_prompt_learning", False):
            return False
        model = self.__dict__.get("model") or self._modules.get("model")
        config = getattr(model, "config", None)
        if config is None and isinstance(self.hparams.get("model"), str):
            from ember.integrations.hf_load import pretrained_config
            config = pretrained_config(self, self.hparams["model"])[0]
        return getattr(config, "model_type", None) in packing.PACKABLE_MODEL_TYPES \
            and not getattr(config, "is_decoder", False)

    def export_inputs(self, tokenizer: Any = None) -> list:
        """The folders this module's model and tokenizer were read from (an export never
        writes into them: :func:`ember.checkpoint.trust.check_export_dir`)."""
        model = self.__dict__.get("model") or self._modules.get("model")
        tok = tokenizer if tokenizer is not None else self.tokenizer
        return [self.hparams.get("model"), getattr(getattr(model, "config", None), "_name_or_path", None),
                tok if isinstance(tok, (str, os.PathLike)) else getattr(tok, "name_or_path", None)]

    def save_pretrained(self, save_directory: str, tokenizer: Any = None, state_dict: dict | None = None,
                        merged: bool = False, **kwargs) -> str:
        """Write a folder that ``AutoModelFor....from_pretrained`` (and, with a tokenizer,
        ``AutoTokenizer.from_pretrained``) load. ``tokenizer`` defaults to the attached one.

        With ``peft_config``: PEFT's adapter folder (``adapter_config.json`` +
        ``adapter_model.safetensors``, loaded by ``PeftModel.from_pretrained(base, folder)``);
        ``merged=True`` writes a plain transformers folder with the adapters merged into a
        copy of the base (the live module stays unmerged and can go on training).
        ``state_dict``: weights to write instead of the live ones (a checkpoint's)."""
        model = self._require_model()
        if merged and self._peft_config is not None:
            from ember.integrations.adapters import check_mergeable
            check_mergeable(model)
        save_directory = check_export_dir(save_directory, self.export_inputs(tokenizer))
        os.makedirs(save_directory, exist_ok=True)
        if state_dict is not None:
            state_dict = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state_dict.items()}
        if self._peft_config is not None:
            from ember.integrations import adapters
            if merged:
                adapters.save_merged(model, save_directory, state_dict, **kwargs)
            else:
                adapters.save_adapter(model, save_directory, state_dict, **kwargs)
        else:
            model.save_pretrained(save_directory, state_dict=state_dict, **kwargs)
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if isinstance(tok, (str, os.PathLike)):
            tok = load_tokenizer(tok, self.local_files_only)
        if tok is not None:
            tok.save_pretrained(save_directory)
        return save_directory


@functools.lru_cache(maxsize=None)
def _perplexity_class():
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # imported when a model is built (it takes seconds), the random streams kept
        import torchmetrics

    class Perplexity(torchmetrics.MeanMetric):
        """exp(token-weighted mean loss)."""

        def compute(self):
            return torch.exp(super().compute())
    return Perplexity


class ExportBestPretrained(Callback):
    """At the end of ``fit``, write a ``save_pretrained`` folder (plus the tokenizer) from
    the best checkpoint of the trainer's ``ModelCheckpoint`` (its newest one without a
    monitor; the current weights when there is no checkpoint). Rank zero writes, once;
    the live module keeps its weights. For a module with ``peft_config`` the folder is
    PEFT's adapter folder, or with ``merged=True`` a plain transformers folder with the
    adapters merged (:meth:`TransformersModule.save_pretrained`)."""

    def __init__(self, dirpath: str, tokenizer: Any = None, merged: bool = False):
        self.dirpath = os.fspath(dirpath)
        self.tokenizer = tokenizer
        self.merged = bool(merged)
        self.exported_from: str | None = None

    def setup(self, trainer, module, stage: str) -> None:
        """A folder the export may not write to fails the fit before training, not after.
        Rank 0 writes the export, so its check decides, and reaches every rank."""
        if stage == "fit" and isinstance(module, TransformersModule):
            from ember.strategies.full_load import raise_rank0_error
            error = None
            if trainer.is_global_zero:
                try:
                    check_export_dir(self.dirpath, module.export_inputs(self.tokenizer), "ExportBestPretrained")
                except Exception as err:   # raised on rank 0 as it is, named on the others
                    error = err
            raise_rank0_error(trainer.strategy, error, f"ExportBestPretrained(dirpath={self.dirpath!r}): rank 0 refused it")

    def on_fit_end(self, trainer, module) -> None:
        if not isinstance(module, TransformersModule):
            raise MisconfigurationError(f"ExportBestPretrained needs a TransformersModule, got {type(module).__name__}")
        from ember.checkpoint import io as cio
        if self.merged and module._peft_config is not None and module.model is not None:
            from ember.integrations.adapters import check_mergeable
            check_mergeable(module.model)   # every rank, before any collective
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "best_model_path", "") if ckpt is not None else ""
        from ember.strategies.full_load import raise_rank0_error
        strategy = trainer.strategy
        weights, error = None, None
        if trainer.is_global_zero and path and os.path.exists(path):
            try:
                weights, _, _ = cio.read_checkpoint(path, load_state=False)   # None for a sharded (DCP) checkpoint
            except Exception as err:   # reported to every rank below, raised here as it is
                error = err
        if getattr(strategy, "is_sharded", False):
            # rank 0's read outcome first: no rank waits in the next broadcast for one that failed
            raise_rank0_error(strategy, error, f"ExportBestPretrained: rank 0 could not read {path}")
            if strategy.broadcast(weights is None):
                # no full weights in the checkpoint: gather the current ones (a collective)
                if trainer.is_global_zero and path:
                    warnings.warn(f"ExportBestPretrained: {path} holds sharded weights; exporting the current "
                                  "weights instead", UserWarning, stacklevel=2)
                weights, path = strategy.module_state_dict(trainer.model), ""
        if trainer.is_global_zero and error is None:
            self.exported_from = path if path and weights is not None else "current weights"
            try:
                module.save_pretrained(self.dirpath, tokenizer=self.tokenizer, state_dict=weights, merged=self.merged)
            except Exception as err:   # reported to every rank below, raised here as it is
                error = err
        # rank 0's outcome in place of a closing barrier: a failed read or write raises on every rank
        raise_rank0_error(strategy, error, f"ExportBestPretrained({self.dirpath!r}) failed on rank 0")
