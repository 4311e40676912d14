"""TransformersModule(peft_config=...): adapters through peft on tiny models built from
configs (a BERT sequence classifier, a Llama-style causal LM). What trains, the frozen
base, the optimizer, YAML configs, checkpoints that hold only what trains (size, exact
resume, the base's digest, load_from_checkpoint), the exports, gradient clipping with
frozen parameters, and the QLoRA wiring on a machine without bitsandbytes."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import SCRIPTS

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
sys.path.insert(0, str(SCRIPTS))

import ember  # noqa: E402
import hf_tiny  # noqa: E402
import peft_common as pc  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from ember.errors import CheckpointError, MisconfigurationError  # noqa: E402
from ember.integrations.transformers import (ExportBestPretrained, PadCollator,  # noqa: E402
                                             TextClassificationData, TransformersModule)


pytestmark = pytest.mark.usefixtures("one_thread")


def trainer_for(root, **kw):
    args = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=root, num_sanity_val_steps=0, precision="32-true", seed=0)
    args.update(kw)
    return ember.Trainer(**args)


def lm_loader(n=8, batch_size=2):
    return DataLoader(pc.lm_items(n), batch_size=batch_size, collate_fn=PadCollator(0, lm_labels=True))


def cls_data(n=96, batch_size=8):
    return TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(n),
                                  val=hf_tiny.sentiment_rows(32, 1), batch_size=batch_size)


def trainable(module):
    return {n for n, p in module.named_parameters() if p.requires_grad}


def clone(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


# ------------------------------------------------------------------------------ what trains
def test_lora_on_a_classifier_trains_adapters_and_head_only(tmp_path):
    base = hf_tiny.tiny_bert()
    start = clone(base.state_dict())
    module = TransformersModule(base, lr=5e-3, scheduler="constant", warmup_steps=0,
                                peft_config=pc.lora(["query", "value"], task_type="SEQ_CLS"))
    assert isinstance(module.model, peft.PeftModelForSequenceClassification)
    names = trainable(module)
    assert names and all(".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n for n in names)
    assert any("classifier.modules_to_save" in n for n in names)          # the head trains
    assert any("attention.self.query.lora_A" in n for n in names) and not any("key.lora" in n for n in names)
    # the optimizer holds exactly the trainable parameters, biases without weight decay
    opt = module.configure_optimizers()["optimizer"]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in module.parameters() if p.requires_grad}
    by_decay = {g["weight_decay"]: {n for n, p in module.named_parameters() if id(p) in {id(q) for q in g["params"]}}
                for g in opt.param_groups}
    assert by_decay[0.0] == {n for n in names if n.endswith("bias")}
    assert all(not n.endswith("bias") for n in by_decay[0.01])
    adapters_before = clone({n: p for n, p in module.named_parameters() if p.requires_grad})

    trainer = trainer_for(tmp_path, max_epochs=2)
    trainer.fit(module, datamodule=cls_data())
    # the frozen base is bit-identical to what it was given; the adapters and head moved
    now = module.model.get_base_model()
    for k, v in start.items():
        key = k if k in dict(now.named_parameters()) or k in dict(now.named_buffers()) else None
        ref = now.state_dict()
        live = ref.get(k, ref.get(k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")))
        if k.startswith("classifier."):
            live = ref[k.replace("classifier.", "classifier.original_module.")]
        assert live is not None and torch.equal(live, v), (k, key)
    moved = [n for n, p in module.named_parameters() if p.requires_grad and not torch.equal(p, adapters_before[n])]
    assert set(moved) == names


def test_lora_all_linear_causal_lm_learns_with_a_frozen_base(tmp_path):
    model = pc.tiny_llama()
    start = clone(model.state_dict())
    module = TransformersModule(model, lr=1e-2, warmup_steps=0, peft_config=pc.lora("all-linear"))
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in trainable(module) if ".lora_A." in n}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head" in n or "embed" in n for n in trainable(module))
    # the user's config is left as given (peft fills in a copy)
    assert module._peft_config.target_modules == "all-linear" == module.hparams["peft_config"]["target_modules"]
    trainer = trainer_for(tmp_path, max_epochs=1)
    loader = lm_loader(48, 8)
    before = trainer.validate(module, dataloaders=loader)[0]["val/loss"]
    trainer = trainer_for(tmp_path, max_epochs=8)
    trainer.fit(module, train_dataloaders=loader)
    after = trainer_for(tmp_path).validate(module, dataloaders=loader)[0]["val/loss"]
    assert after < before - 0.05
    base = module.model.get_base_model().state_dict()
    for k, v in start.items():
        live = base.get(k, base.get(k.replace(".weight", ".base_layer.weight")))
        assert torch.equal(live, v), k


def test_the_loggers_write_the_peft_config_as_plain_data(tmp_path):
    """peft's PeftType/TaskType are str enums: the hparams hold their values, which the
    default logger's hparams.yaml (yaml.safe_dump) and meta.json can write."""
    import yaml
    module = TransformersModule(pc.tiny_llama(), warmup_steps=0, peft_config=pc.lora("all-linear"))
    assert type(module.hparams["peft_config"]["peft_type"]) is str
    trainer = trainer_for(tmp_path, logger=True, max_steps=1)
    trainer.fit(module, train_dataloaders=lm_loader(4, 2))
    with open(os.path.join(trainer.logger.log_dir, "hparams.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved["peft_config"]["peft_type"] == "LORA"
    assert saved["peft_config"]["target_modules"] == "all-linear"
    # the base's record is in the first set the loggers got: validating after the fit adds no key
    assert saved["peft_base"]["digest"]
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, dataloaders=lm_loader(4, 2))
    assert not [w for w in caught if "after the first metrics" in str(w.message)]


def test_a_model_given_by_name_is_wrapped_when_it_is_read(tmp_path):
    folder = tmp_path / "llama"
    pc.tiny_llama().save_pretrained(folder)
    module = TransformersModule(str(folder), task="causal-lm", peft_config=pc.lora(["q_proj", "v_proj"]))
    assert "_pending_model" in module.__dict__        # not read yet
    trainer_for(tmp_path, max_steps=2).fit(module, train_dataloaders=lm_loader())
    assert isinstance(module.model, peft.PeftModelForCausalLM)
    assert {n.split(".lora")[0].rsplit(".", 1)[-1] for n in trainable(module)} == {"q_proj", "v_proj"}
    # a classifier whose labels come from the data: built (and wrapped) in configure_model
    bert = tmp_path / "bert"
    hf_tiny.tiny_bert().bert.save_pretrained(bert)
    module = TransformersModule(str(bert), lr=5e-3, peft_config=pc.lora(["query", "value"], task_type="SEQ_CLS"))
    assert module.model is None
    trainer_for(tmp_path, max_steps=2).fit(module, datamodule=cls_data())
    assert isinstance(module.model, peft.PeftModelForSequenceClassification) and module.num_labels == 2


def test_without_peft_one_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MisconfigurationError, match=r'pip install "ember\[peft\]"'):
        TransformersModule(hf_tiny.tiny_bert(), peft_config={"peft_type": "LORA", "r": 4})


YAML_CHECK = """
import sys, yaml
from ember.cli.types import instantiate, resolve_class
from ember.module import TrainModule
assert "peft" not in sys.modules      # imported by the class path itself, as in `ember fit --config`
cfg = yaml.safe_load(sys.stdin.read())
module = instantiate(resolve_class("model", cfg["model"], TrainModule))
print(type(module._peft_config).__name__, module._peft_config.r, *sorted(module._peft_config.target_modules))
"""


def test_peft_config_from_a_yaml_class_path_and_nothing_else_opens(tmp_path):
    import subprocess
    from helpers import child_env
    from ember.cli.types import check_kwargs
    from ember.errors import UsageError
    hf_tiny.tiny_bert().save_pretrained(tmp_path / "bert")
    config = f"""
model:
  class_path: ember.integrations.transformers.TransformersModule
  init_args:
    model: {tmp_path / "bert"}
    peft_config:
      class_path: peft.LoraConfig
      init_args: {{task_type: SEQ_CLS, r: 4, target_modules: [query, value]}}
"""
    proc = subprocess.run([sys.executable, "-c", YAML_CHECK], input=config, capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["LoraConfig", "4", "query", "value"]
    for bad in ("subprocess.Popen", "peft.PeftModel", "peft.get_peft_model"):
        with pytest.raises(UsageError):
            check_kwargs("model.init_args", TransformersModule, {"peft_config": {"class_path": bad}})
    # plain data works too, through the same allow-list a checkpoint's meta.json goes through
    module = TransformersModule(hf_tiny.tiny_bert(), peft_config={"peft_type": "LORA", "r": 2, "task_type": "SEQ_CLS",
                                                                  "target_modules": ["query"]})
    assert module._peft_config.r == 2
    with pytest.raises(MisconfigurationError, match="megatron"):
        TransformersModule(hf_tiny.tiny_bert(), peft_config={"peft_type": "LORA", "megatron_core": "os",
                                                             "megatron_config": {}})
    with pytest.raises(MisconfigurationError, match="peft_type"):
        TransformersModule(hf_tiny.tiny_bert(), peft_config={"peft_type": "EVIL"})


def test_other_peft_methods_work_through_get_peft_model(tmp_path):
    from peft import IA3Config
    module = TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, peft_config=IA3Config(
        task_type="SEQ_CLS", target_modules=["key", "value", "output.dense"], feedforward_modules=["output.dense"]))
    names = trainable(module)
    assert any("ia3_l" in n for n in names)
    before = clone({n: p for n, p in module.named_parameters() if "ia3_l" in n})
    trainer_for(tmp_path, max_steps=3).fit(module, datamodule=cls_data())
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters() if n in before)


def test_padding_free_batches_run_through_the_adapters():
    """A padding-free (packed) batch gives the padded batch's logits and loss with the
    adapters applied (the transformers model inside the PeftModel runs it)."""
    from ember.integrations.transformers import PackCollator
    from peft_dist import cls_items
    module = TransformersModule(hf_tiny.tiny_bert(), peft_config=pc.lora(["query", "value"], task_type="SEQ_CLS"))
    module.eval()
    items = cls_items()
    with torch.no_grad():
        padded, packed = module._run(PadCollator(0)(items)), module._run(PackCollator()(items))
        with module.model.disable_adapter():
            plain = module._run(PadCollator(0)(items))
    torch.testing.assert_close(packed.logits, padded.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=0, atol=1e-5)
    assert not torch.allclose(plain.logits, padded.logits, atol=1e-3)     # the adapters count


# ------------------------------------------------------------------------------ gradient clipping
def test_clipping_norm_counts_only_the_trainable_gradients(tmp_path):
    class Record(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.pre = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

        def on_before_zero_grad(self, trainer, module, optimizer):
            self.post = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    rec = Record()
    module = TransformersModule(pc.tiny_llama(), lr=1e-3, peft_config=pc.lora("all-linear"))
    trainer_for(tmp_path, max_steps=1, gradient_clip_val=0.01, callbacks=[rec]).fit(module, train_dataloaders=lm_loader())
    assert set(rec.pre) == trainable(module)        # frozen parameters carry no gradient
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in rec.pre.values()]))
    assert norm > 0.01
    for n in rec.pre:
        torch.testing.assert_close(rec.post[n], rec.pre[n] * (0.01 / (norm + 1e-6)), rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def big_base(tmp_path_factory):
    """A Llama base big enough that the adapters are a small part of it (1.2M parameters, 4.7 MB)."""
    folder = tmp_path_factory.mktemp("base")
    pc.tiny_llama(hidden=128, layers=4, vocab=2000).save_pretrained(folder)
    return folder


def _lm_run(root, base, max_steps, ckpt_path=None, callbacks=()):
    module = TransformersModule(str(base), task="causal-lm", lr=5e-3, warmup_steps=0,
                                peft_config=pc.lora(["q_proj", "v_proj"]))
    trainer = trainer_for(root, max_steps=max_steps, callbacks=list(callbacks), enable_checkpointing=True)
    trainer.fit(module, train_dataloaders=lm_loader(24, 4), ckpt_path=ckpt_path)
    return module, trainer


def test_adapter_checkpoints_are_small_and_resume_bit_exactly(tmp_path, big_base):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    full, full_trainer = _lm_run(tmp_path / "full", big_base, 9, callbacks=[ckpt])     # 6 batches an epoch
    full_trainer.save_checkpoint(tmp_path / "final")
    mid = tmp_path / "ckpt" / "epoch=0-step=4"
    base_size = os.path.getsize(big_base / "model.safetensors")
    weights = os.path.getsize(mid / "model.safetensors")
    assert base_size > 4e6 and weights < 0.1 * base_size   # (about 1% here)
    with open(mid / "meta.json") as f:
        meta = json.load(f)
    assert meta["hparams"]["peft_base"]["model"] == str(big_base)
    assert meta["hparams"]["peft_base"]["digest"].startswith("sha256:")
    assert meta["hparams"]["peft_config"]["target_modules"] == ["q_proj", "v_proj"]
    from safetensors import safe_open
    with safe_open(str(mid / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_" in k for k in keys)
    state = torch.load(mid / "trainer_state.pt", weights_only=True)
    assert len(state["optimizers"][0]["state"]) == len(keys)      # optimizer state of what trains only

    resumed, _ = _lm_run(tmp_path / "resumed", big_base, 9, ckpt_path=str(mid))
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = TransformersModule(str(big_base), task="causal-lm", peft_config=pc.lora(["q_proj", "v_proj"]))
    first = dict(start.model.named_parameters())
    assert all(not torch.equal(p, first[n]) for n, p in full.model.named_parameters() if ".lora_" in n)

    # load_from_checkpoint: base read again from its folder, plus the adapters: identical outputs
    last = tmp_path / "final"
    loaded = TransformersModule.load_from_checkpoint(str(last)).eval()
    batch = next(iter(lm_loader(8, 8)))
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, full.eval()(**batch).logits)

    # another base under the same path: resuming (or loading) names both digests
    pc.tiny_llama(seed=1, hidden=128, layers=4, vocab=2000).save_pretrained(big_base)
    with pytest.raises(CheckpointError, match=r"trained on the base .*digest sha256:.*this module's base is .*digest"):
        _lm_run(tmp_path / "other", big_base, 9, ckpt_path=str(mid))
    with pytest.raises(CheckpointError, match="digest"):
        TransformersModule.load_from_checkpoint(str(last))


def test_a_base_given_as_an_object_must_be_given_again(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    module = TransformersModule(pc.tiny_llama(), lr=5e-3, peft_config=pc.lora())
    trainer_for(tmp_path, max_steps=3, callbacks=[ckpt], enable_checkpointing=True).fit(
        module, train_dataloaders=lm_loader())
    path = ckpt.last_model_path or ckpt.best_model_path
    with pytest.raises(CheckpointError, match="pass the same pretrained model object as model="):
        TransformersModule.load_from_checkpoint(path)     # model_config alone rebuilds an untrained base
    loaded = TransformersModule.load_from_checkpoint(path, model=pc.tiny_llama()).eval()
    batch = next(iter(lm_loader(8, 8)))
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, module.eval()(**batch).logits)


def _one_step_checkpoint(tmp_path):
    """A LoRA module trained one step, and its checkpoint's path."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    module = TransformersModule(pc.tiny_llama(), peft_config=pc.lora())
    trainer_for(tmp_path, max_steps=1, callbacks=[ckpt], enable_checkpointing=True).fit(
        module, train_dataloaders=lm_loader())
    return module, ckpt.last_model_path or ckpt.best_model_path


def _edit_meta(path, edit) -> None:
    """``edit(meta)`` on the checkpoint's meta.json, written back."""
    meta_file = os.path.join(path, "meta.json")
    with open(meta_file) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def test_a_checkpoint_cannot_make_peft_import_code(tmp_path):
    from helpers import reseal
    _, path = _one_step_checkpoint(tmp_path)
    _edit_meta(path, lambda meta: meta["hparams"]["peft_config"].update(megatron_config={"x": 1}, megatron_core="os"))
    reseal(path)
    with pytest.raises(CheckpointError, match="refusing .*megatron"):
        TransformersModule.load_from_checkpoint(path, model=pc.tiny_llama())


def test_a_qlora_checkpoint_needs_its_quantization_config_given_again(tmp_path):
    """A QLoRA run's meta.json holds its quantization_config as text only (here written
    as such a run would: bitsandbytes is not installed to make one)."""
    module, path = _one_step_checkpoint(tmp_path)
    _edit_meta(path, lambda meta: meta["hparams"].update(
        model_kwargs={"quantization_config": "BitsAndBytesConfig {load_in_4bit: true}"}))
    with pytest.raises(CheckpointError, match=r"quantized base .*pass model_kwargs="):
        TransformersModule.load_from_checkpoint(path, model=pc.tiny_llama())
    loaded = TransformersModule.load_from_checkpoint(path, model=pc.tiny_llama(), model_kwargs={})
    a, b = loaded.state_dict(), module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a checkpoint that does not name its base cannot be checked against it: said, not silent
    _edit_meta(path, lambda meta: meta["hparams"].pop("peft_base"))
    with pytest.warns(UserWarning, match="cannot be checked"):
        TransformersModule.load_from_checkpoint(path, model=pc.tiny_llama(), model_kwargs={})


# ------------------------------------------------------------------------------ export
def test_save_pretrained_adapter_folder_and_merged_folder(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    tok = hf_tiny.make_tokenizer(eos_only=True)
    module = TransformersModule(pc.tiny_llama(), lr=1e-2, tokenizer=tok, peft_config=pc.lora("all-linear"))
    trainer_for(tmp_path, max_steps=2).fit(module, train_dataloaders=lm_loader())
    module.eval()
    batch = next(iter(lm_loader(8, 8)))
    with torch.no_grad():
        live = module(**batch).logits
        plain = module.model.get_base_model()
        with module.model.disable_adapter():
            base_logits = plain(**batch).logits
    assert not torch.allclose(live, base_logits, atol=1e-3)     # the adapters change the outputs

    out = module.save_pretrained(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    loaded = PeftModel.from_pretrained(pc.tiny_llama(), out).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, live)

    out = module.save_pretrained(tmp_path / "merged", merged=True)
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not any("lora" in k or "base_layer" in k for k in keys)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        # W + BA in one matrix vs x W + (x A) B: the same map, rounded in another order
        torch.testing.assert_close(merged(**batch).logits, live, rtol=0, atol=2e-5)
    # the live module is not merged: its adapters are still separate and it trains on
    assert any(".lora_A." in n for n, _ in module.named_parameters())
    assert not any(getattr(m, "merged", False) for m in module.model.modules())
    before = clone({n: p for n, p in module.named_parameters() if p.requires_grad})
    trainer_for(tmp_path, max_steps=2).fit(module.train(), train_dataloaders=lm_loader())
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("merged", [False, True])
def test_export_best_pretrained_from_an_adapter_checkpoint(tmp_path, merged):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/score", mode="max", save_top_k=1)

    class FirstEpochBest(TransformersModule):     # the best checkpoint is not the last weights
        def validation_step(self, batch, batch_idx):
            self.log("val/score", -float(self.current_epoch))
            return super().validation_step(batch, batch_idx)

    module = FirstEpochBest(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0,
                            peft_config=pc.lora(["query", "value"], task_type="SEQ_CLS"))
    export = ExportBestPretrained(tmp_path / "export", merged=merged)
    trainer = trainer_for(tmp_path, max_epochs=3, callbacks=[ckpt, export], enable_checkpointing=True)
    dm = cls_data()
    trainer.fit(module, datamodule=dm)
    assert export.exported_from == ckpt.best_model_path and "epoch=0" in ckpt.best_model_path
    best = TransformersModule.load_from_checkpoint(ckpt.best_model_path, model=hf_tiny.tiny_bert()).eval()
    enc = dm.tokenizer(["the plot was superb", "a boring film"], padding=True, return_tensors="pt")
    if merged:
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    else:
        model = PeftModel.from_pretrained(hf_tiny.tiny_bert(), tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**enc).logits, best.model(**enc).logits, rtol=0, atol=2e-5 if merged else 0)
        assert not torch.allclose(model(**enc).logits, module.eval().model(**enc).logits, atol=1e-3)


# ------------------------------------------------------------------------------ QLoRA
def test_qlora_without_bitsandbytes_fails_before_training():
    import importlib.util
    from transformers import BitsAndBytesConfig
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    with pytest.raises(MisconfigurationError, match=r'bitsandbytes.*pip install "ember\[qlora\]"'):
        TransformersModule("any/name", task="causal-lm", peft_config=pc.lora(),
                           model_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True)})


def test_a_quantized_base_is_prepared_for_kbit_training():
    """peft.prepare_model_for_kbit_training runs on a base transformers marks as quantized
    (here a bfloat16 model flagged as loaded in 4 bits: the 4-bit kernels themselves need
    bitsandbytes): its float16/bfloat16 weights are upcast to float32 and it is frozen."""
    plain = TransformersModule(pc.tiny_llama(dtype=torch.bfloat16), peft_config=pc.lora())
    assert plain.model.get_base_model().model.norm.weight.dtype == torch.bfloat16
    model = pc.tiny_llama(dtype=torch.bfloat16)
    model.is_loaded_in_4bit = True
    module = TransformersModule(model, peft_config=pc.lora(), gradient_checkpointing=True)
    base = module.model.get_base_model()
    assert base.model.norm.weight.dtype == torch.float32 and base.lm_head.weight.dtype == torch.float32
    assert all(".lora_" in n for n in trainable(module))


# ------------------------------------------------------------------------------ export targets
def test_an_export_never_writes_into_its_base_a_checkpoint_or_a_file(tmp_path):
    """save_pretrained and ExportBestPretrained refuse, before writing anything: the
    folder the base model was read from (a merged export there would replace the base
    weights), a folder inside it, an ember checkpoint, and a file. An existing folder
    of other files takes the export, as transformers' save_pretrained does."""
    from ember.checkpoint.io import META_NAME
    base = tmp_path / "base"
    hf_tiny.tiny_bert().save_pretrained(base)
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    module = TransformersModule(str(base), task="sequence-classification", num_labels=2, lr=1e-2, warmup_steps=0,
                                peft_config=pc.lora(["query", "value"], task_type="SEQ_CLS"))
    for target in (base, base / "sub"):
        for merged in (False, True):
            with pytest.raises(MisconfigurationError, match="loaded from"):
                module.save_pretrained(target, merged=merged)
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before and not (base / "sub").exists()
    ckpt = tmp_path / "ckpt"
    trainer_for(tmp_path, max_steps=1).fit(module, datamodule=cls_data())
    module.trainer.save_checkpoint(ckpt)
    assert (ckpt / META_NAME).is_file()
    files = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(MisconfigurationError, match="inside the checkpoint"):
        module.save_pretrained(ckpt / "export")
    assert sorted(p.name for p in ckpt.iterdir()) == files
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(MisconfigurationError, match="is a file"):
        module.save_pretrained(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    other = tmp_path / "exports"
    other.mkdir()
    (other / "notes.txt").write_text("kept")
    module.save_pretrained(other)
    assert (other / "adapter_model.safetensors").is_file() and (other / "notes.txt").read_text() == "kept"
    # the callback checks at setup: the fit fails before its first step
    fresh = TransformersModule(str(base), task="sequence-classification", num_labels=2, lr=1e-2, warmup_steps=0,
                               peft_config=pc.lora(["query", "value"], task_type="SEQ_CLS"))
    trainer = trainer_for(tmp_path, max_steps=2, callbacks=[ExportBestPretrained(base, merged=True)])
    with pytest.raises(MisconfigurationError, match="ExportBestPretrained.*loaded from"):
        trainer.fit(fresh, datamodule=cls_data())
    assert trainer.global_step == 0
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before


# ------------------------------------------------------------------------------ batches for adapters
def test_adapters_get_random_padding_free_batches_by_default(tmp_path):
    """TextClassificationData's default batches: length-grouped for full fine-tuning;
    random (the composition transformers' Trainer draws) and padding-free for adapters on
    a BERT-architecture model; random and padded for adapters on another model. Given
    values always win."""
    from ember.data import LengthGroupedSampler
    from ember.integrations.packing import PackCollator
    from transformers import LlamaForSequenceClassification

    class Seen(ember.callbacks.Callback):
        def on_train_start(self, trainer, module):
            dl = trainer.train_dataloader
            self.grouped = isinstance(getattr(dl, "sampler", None), LengthGroupedSampler)
            self.packed = isinstance(dl.collate_fn, PackCollator)

    def fit(module, **data_kw):
        seen = Seen()
        dm = TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(32), batch_size=8, **data_kw)
        trainer_for(tmp_path, max_steps=1, callbacks=[seen]).fit(module, datamodule=dm)
        assert dm.batches() == (seen.grouped, seen.packed)
        return seen.grouped, seen.packed

    lora = pc.lora(["query", "value"], task_type="SEQ_CLS")
    assert TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(8)).batches() == (True, False)
    assert fit(TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0)) == (True, False)
    assert fit(TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0, peft_config=lora)) == (False, True)
    assert fit(TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0, peft_config=lora),
               group_by_length=True) == (True, False)
    assert fit(TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0, peft_config=lora),
               padding_free=False) == (False, False)
    assert fit(TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0, peft_config=lora),
               pad_to_multiple_of=8) == (False, False)
    assert fit(TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0),
               group_by_length=False, padding_free=True) == (False, True)
    llama = pc.tiny_llama()
    llama_cls = LlamaForSequenceClassification(llama.config)
    llama_cls.config.pad_token_id = 0
    assert fit(TransformersModule(llama_cls, lr=1e-2, warmup_steps=0,
                                  peft_config=pc.lora(["q_proj", "v_proj"], task_type="SEQ_CLS"))) == (False, False)
    with pytest.raises(MisconfigurationError, match="group_by_length='yes' is not valid"):
        TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(8), group_by_length="yes")


def test_resuming_grouped_adapter_batches_under_the_random_default_names_group_by_length(tmp_path):
    """An adapter checkpoint saved mid-epoch with length-grouped batches (given, or chosen
    by an older default), resumed under the default (random batches for adapters): the
    warning names the argument that gives the checkpoint's sampler back; with it, no warning."""
    import warnings
    lora = pc.lora(["query", "value"], task_type="SEQ_CLS")

    def fit(steps, ckpt=None, **data_kw):
        dm = TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(64), batch_size=8, **data_kw)
        ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3, save_top_k=-1)
        trainer_for(tmp_path, max_steps=steps, enable_checkpointing=True, callbacks=[ck]).fit(
            TransformersModule(hf_tiny.tiny_bert(), lr=1e-2, warmup_steps=0, peft_config=lora), datamodule=dm,
            ckpt_path=ckpt)

    fit(3, group_by_length=True)
    first = str(tmp_path / "ck" / "epoch=0-step=3")
    with pytest.warns(UserWarning, match=r"sampler was a LengthGroupedSampler and is now a ResumableSampler.*"
                                         r"group_by_length=True gives the checkpoint's sampler"):
        fit(4, ckpt=first)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=r"(?!.*sampler was a)")
        fit(4, ckpt=first, group_by_length=True)
