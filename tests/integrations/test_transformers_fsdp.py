"""TransformersModule under FSDP reads its pretrained weights on rank 0 only: 2 real
processes (torchrun, gloo, CPU) running tests/scripts/hf_fsdp_load.py, plus the lazy
read of a model given by name in one process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import SCRIPTS, child_env

pytest.importorskip("transformers")
sys.path.insert(0, str(SCRIPTS))

import hf_tiny  # noqa: E402
from ember.integrations.transformers import TransformersModule  # noqa: E402
from ember.strategies.environments import find_free_port  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(3)
    cfg = GPT2Config(vocab_size=hf_tiny.vocab_size(), n_embd=512, n_layer=6, n_head=8, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=4, eos_token_id=4)
    GPT2LMHeadModel(cfg).save_pretrained(folder)       # ~19M parameters, 75 MB
    broken = folder.parent / "broken"                    # the same, its weights file cut short
    broken.mkdir()
    for name in os.listdir(folder):
        data = (folder / name).read_bytes()
        (broken / name).write_bytes(data[:1000] if name.endswith(".safetensors") else data)
    return folder


def _torchrun(saved, out, *args) -> None:
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(SCRIPTS / "hf_fsdp_load.py"), str(saved), str(out), *args]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def fsdp_run(saved, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_fsdp")
    _torchrun(saved, out)
    res = {(mode, r): torch.load(out / f"{mode}.rank{r}.pt", weights_only=True)
           for mode in ("once", "every") for r in range(2)}
    res.update({("broken", r): (out / f"broken.rank{r}.txt").read_text() for r in range(2)})
    return res


@pytest.mark.multiproc
def test_fsdp_shards_hold_the_saved_weights_after_setup(fsdp_run, saved):
    from transformers import GPT2LMHeadModel
    ref = GPT2LMHeadModel.from_pretrained(saved).state_dict()
    for r in range(2):
        start = fsdp_run[("once", r)]["start"]
        assert sorted(start) == sorted(k for k in ref if k in start) and len(start) >= len(ref) - 1
        for k, v in start.items():
            assert torch.equal(v, ref[k]), (r, k)


@pytest.mark.multiproc
def test_fsdp_only_rank0_reads_the_weights(fsdp_run, saved):
    size = os.path.getsize(saved / "model.safetensors")
    r0, r1 = fsdp_run[("once", 0)], fsdp_run[("once", 1)]
    assert not r0["meta_after_configure"] and r1["meta_after_configure"]   # rank 1: built from the config
    rises = {k: v["rise"] / size for k, v in fsdp_run.items() if k[0] != "broken"}
    print("peak RSS rise / model size:", rises)
    # rank 0 held the whole model; rank 1 only its half (a shard), about half of what it
    # held when it read the weights itself (the whole model, then its shard)
    assert rises[("once", 0)] > 0.9, rises
    assert rises[("once", 1)] < 0.75, rises
    assert rises[("every", 1)] > 1.2, rises
    assert rises[("every", 1)] - rises[("once", 1)] > 0.7, rises


@pytest.mark.multiproc
def test_fsdp_training_equals_every_rank_loading(fsdp_run):
    once, every = fsdp_run[("once", 0)]["final"], fsdp_run[("every", 0)]["final"]
    assert sorted(once) == sorted(every)
    assert all(torch.equal(once[k], every[k]) for k in once)
    assert any(not torch.equal(once[k], fsdp_run[("once", 0)]["start"][k]) for k in once)   # it trained
    for k in once:
        assert torch.equal(once[k], fsdp_run[("once", 1)]["final"][k])


@pytest.mark.multiproc
def test_fsdp_other_ranks_build_in_the_users_dtype(saved, tmp_path):
    # model_kwargs={"dtype": torch.bfloat16}: rank 0's from_pretrained gives bf16; rank 1
    # builds from the config on the meta device in the same dtype, so its shards are bf16
    from transformers import GPT2LMHeadModel
    from ember.integrations.hf_load import _dtype_kwarg
    ref = GPT2LMHeadModel.from_pretrained(saved, **{_dtype_kwarg(): torch.bfloat16}).state_dict()
    assert all(v.dtype == torch.bfloat16 for v in ref.values())
    _torchrun(saved, tmp_path, "bf16")
    for r in range(2):
        rec = torch.load(tmp_path / f"bf16.rank{r}.pt", weights_only=True)
        assert rec["meta_after_configure"] == (r == 1)          # rank 1: built from the config
        dtypes = rec["local_dtypes"]
        assert len(dtypes) >= len(ref) - 1 and set(dtypes.values()) == {torch.bfloat16}, (r, dtypes)
        start = rec["start"]
        assert sorted(start) == sorted(k for k in ref if k in start) and len(start) >= len(ref) - 1
        for k, v in start.items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, ref[k]), (r, k, v.dtype)


@pytest.mark.multiproc
def test_fsdp_weights_rank0_cannot_read_fail_every_rank(fsdp_run):
    r0, r1 = fsdp_run[("broken", 0)], fsdp_run[("broken", 1)]
    assert r0 != "None" and not r0.startswith("CheckpointError"), r0     # rank 0: its own exception
    assert r1.startswith("CheckpointError: rank 0 could not load the pretrained model") and "broken" in r1, r1
    assert r0.split(": ", 1)[1][:40] in r1                               # rank 0's message, on rank 1


def test_model_by_name_is_read_on_first_use(saved):
    module = TransformersModule(os.fspath(saved), task="causal-lm")
    assert "model" not in module._modules            # nothing read yet
    assert module.model.config.n_embd == 512         # first use reads it
    from transformers import GPT2LMHeadModel
    ref = GPT2LMHeadModel.from_pretrained(saved).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in module.model.state_dict().items())
    assert module._modules["model"] is module.model and "_pending_model" not in module.__dict__


def test_rank0_moves_its_pretrained_model_to_meta_keeping_tied_weights(saved):
    # before sharding, rank 0 drops its full model from the device side like the other ranks
    # (its weights stay in the host-memory state dict it sends); GPT-2's tied embedding and
    # head must stay one parameter, or rank 0 would shard one parameter more than the others
    from transformers import GPT2LMHeadModel
    from ember.strategies.full_load import to_meta
    model = GPT2LMHeadModel.from_pretrained(saved)
    assert model.lm_head.weight is model.transformer.wte.weight
    n_params = len(list(model.parameters()))
    full = model.state_dict()
    to_meta(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == n_params
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert not any(t.is_meta for t in full.values())        # the state to send is untouched
    untied = GPT2LMHeadModel.from_pretrained(saved).to("meta")     # what Module.to alone does
    assert untied.lm_head.weight is not untied.transformer.wte.weight
