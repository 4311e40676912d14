"""LoRA under DDP and FSDP2: 2 real processes (torchrun, gloo, CPU) running
tests/scripts/peft_dist.py equal one process on the combined batches to 1e-5, with
gradient clipping engaged (the norm over the trainable gradients only, sharded or not);
their checkpoints hold only what trains and load back in one process."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import SCRIPTS, child_env

pytest.importorskip("transformers")
pytest.importorskip("peft")
sys.path.insert(0, str(SCRIPTS))

import ember  # noqa: E402
import hf_tiny  # noqa: E402
import peft_common as pc  # noqa: E402
import peft_dist  # noqa: E402
from ember.integrations.transformers import TransformersModule  # noqa: E402
from ember.strategies.environments import find_free_port  # noqa: E402

pytestmark = pytest.mark.multiproc


NAMES = ["named", "llama", "bert"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    pc.tiny_llama(seed=5).save_pretrained(folder)
    return str(folder)


def launch(kind, tmp_path_factory, base_dir):
    out = tmp_path_factory.mktemp(f"peft_{kind}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(SCRIPTS / "peft_dist.py"), kind, str(out), base_dir]
    proc = subprocess.run(cmd, cwd=out, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return kind, out


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def dist_run(request, tmp_path_factory, base_dir):
    return launch(request.param, tmp_path_factory, base_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base_dir):
    """One process, the same fits on batches of 4 (both ranks' batches together)."""
    torch.set_num_threads(1)
    out = {}

    class Norms(ember.callbacks.Callback):
        def on_train_start(self, trainer, module):   # the trainable state before the first step
            module.start = {k: v.detach().clone() for k, v in module.state_dict().items()}

        def on_before_optimizer_step(self, trainer, module, optimizer):
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            module.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    for name, make_module, make_loader in peft_dist.fits(base_dir):
        module = make_module()
        module.norms = []
        trainer = ember.Trainer(max_steps=2, precision="32-true", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, seed=0, callbacks=[Norms()],
                                default_root_dir=tmp_path_factory.mktemp("ref"), gradient_clip_val=peft_dist.CLIP)
        trainer.fit(module, train_dataloaders=make_loader(4))
        assert len(module.norms) == 2
        out[name] = module
    return out


@pytest.mark.parametrize("name", NAMES)
def test_lora_equals_one_process_on_the_combined_batch(dist_run, reference, base_dir, name):
    kind, out = dist_run
    got = torch.load(out / f"{kind}.{name}.pt", weights_only=True)
    ref = reference[name].state_dict()
    assert got.keys() == ref.keys() and all(".lora_" in k or "modules_to_save" in k for k in got)
    first = peft_dist.fits(base_dir)[NAMES.index(name)][1]()
    assert first.model is not None      # a model given by name is read on first use
    # the reference's own start: the adapters of a base given by name are drawn when it is
    # read, from the random stream of that moment (first's would be other draws)
    start = reference[name].start
    assert min(reference[name].norms) > 2 * peft_dist.CLIP     # the clipping was engaged at every step
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-5)
        # the steps themselves (each about the clipped gradient): a wrong clipping norm, e.g.
        # one shard's alone under FSDP, would change them by tens of percent
        torch.testing.assert_close(got[k] - start[k], ref[k] - start[k], rtol=1e-2, atol=1e-6)
    assert [k for k in ref if not torch.equal(ref[k], start[k])] == list(ref)   # every entry trained


@pytest.mark.parametrize("name", NAMES)
def test_the_checkpoint_holds_only_what_trains_and_loads_in_one_process(dist_run, reference, name):
    kind, out = dist_run
    path = out / f"{kind}.{name}.ckpt"
    from ember.checkpoint import io as cio
    weights, _, _ = cio.read_checkpoint(str(path), load_state=False)
    if weights is None:      # FSDP: a sharded (DCP) folder, consolidated here
        from ember.strategies.fsdp import load_full_weights
        weights = load_full_weights(str(path))
    ref = reference[name].state_dict()
    assert weights.keys() == ref.keys()      # the trainable entries only, no frozen base
    # a base given by name is read again from its folder (same digest); an object is given again
    base = {"named": dict, "llama": lambda: dict(model=pc.tiny_llama()), "bert": lambda: dict(model=hf_tiny.tiny_bert())}
    loaded = TransformersModule.load_from_checkpoint(str(path), **base[name]())
    got = loaded.state_dict()
    assert got.keys() == ref.keys()
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-5)


def test_the_adapter_export_loads_in_peft(dist_run, reference, base_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    kind, out = dist_run
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / f"{kind}.named.export")
    batch = next(iter(peft_dist.fits(base_dir)[0][2](8)))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**batch).logits, reference["named"].eval()(**batch).logits,
                                   rtol=0, atol=1e-5)
    if kind == "fsdp":   # a merged export of a sharded model is refused, with the way to do it
        for r in range(2):
            msg = (out / f"merged_error.rank{r}.txt").read_text()
            assert "sharded" in msg and "load_from_checkpoint" in msg
        assert not (out / "merged").exists()


def test_resuming_an_adapter_checkpoint_is_bit_exact(dist_run):
    kind, out = dist_run
    runs = torch.load(out / f"{kind}.resume.pt", weights_only=True)
    a, b = runs["resumed"], runs["straight"]
    assert a.keys() == b.keys() and all(".lora_" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_under_deepspeed_equals_one_process(ds_ops, tmp_path_factory, reference, base_dir):
    """ZeRO-2 (DeepSpeed steps the optimizer and clips): the LoRA classifier on 2 processes
    equals one process on the combined batch; the frozen base is untouched, and DeepSpeed's
    checkpoint holds only what trains (ZeRO-2 stores frozen parameters unless told not to)."""
    pytest.importorskip("deepspeed")
    kind, out = launch("deepspeed", tmp_path_factory, base_dir)
    full = torch.load(out / "deepspeed.bert.pt", weights_only=True)
    ref = reference["bert"].state_dict()
    start_module = peft_dist.fits(base_dir)[NAMES.index("bert")][1]()
    start = start_module.state_dict()
    assert set(ref) <= set(full)
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], rtol=0, atol=1e-5)
        torch.testing.assert_close(full[k] - start[k], ref[k] - start[k], rtol=1e-2, atol=1e-6)
    assert set(full) == set(ref)      # module_state_dict: the trainable entries
    # the checkpoint holds the trainable weights only; it loads in one process onto the base
    from ember.strategies.deepspeed import load_full_weights
    saved = load_full_weights(str(out / "deepspeed.bert.ckpt"))
    assert set(saved) == set(ref)
    for k in ref:
        torch.testing.assert_close(saved[k].float(), ref[k], rtol=0, atol=1e-5)
    files = [f for f in (out / "deepspeed.bert.ckpt").rglob("*_states.pt")]   # weights and optimizer states
    assert len(files) == 3, files
    base_bytes = sum(t.numel() * t.element_size() for t in start_module.model.state_dict().values())
    assert sum(f.stat().st_size for f in files) < 0.5 * base_bytes, [(f.name, f.stat().st_size) for f in files]
    runs = torch.load(out / "deepspeed.resume.pt", weights_only=True)   # resumed from it: bit-exact
    assert runs["resumed"].keys() == runs["straight"].keys() == set(ref)
    assert all(torch.equal(runs["resumed"][k], runs["straight"][k]) for k in ref)
    base = {k: v.clone() for k, v in start_module.model.get_base_model().state_dict().items()}
    start_module.load_state_dict(saved)   # onto the same base: the frozen keys are not missing
    got = start_module.state_dict()
    assert all(torch.equal(got[k], saved[k]) for k in ref)
    assert all(torch.equal(v, base[k]) for k, v in start_module.model.get_base_model().state_dict().items()
               if ".lora_" not in k and "modules_to_save" not in k and k in base)
