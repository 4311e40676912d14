"""TransformersModule under FSDP (2 processes, gloo, CPU) reading its pretrained weights
on rank 0 only, run by tests/integrations/test_transformers_fsdp.py:

    python -m torch.distributed.run --nproc_per_node 2 hf_fsdp_load.py MODEL_DIR OUT_DIR [bf16]

MODEL_DIR holds a GPT-2 of ~75 MB saved with ``save_pretrained``. Two fits of 3 steps,
each rank writing OUT_DIR/<mode>.rank<R>.pt:
- "every": ``TransformersModule(GPT2LMHeadModel.from_pretrained(MODEL_DIR), ...)``: every
  rank reads the weights (the control);
- "once": ``TransformersModule(MODEL_DIR, ...)``: the weights are read when the Trainer
  sets the module up;
- with the argument ``bf16``, instead of the above, one fit "bf16" only: as "once" with
  ``model_kwargs={dtype: torch.bfloat16}`` (``torch_dtype`` on older transformers), one
  step: rank 1 builds its meta model in rank 0's dtype, so every rank's local shards are
  bf16 (recorded as "local_dtypes"; a separate run, as a mismatch aborts the job);
- then a copy of MODEL_DIR (../broken) whose weights file is cut short: each rank
  writes the error it raised to OUT_DIR/broken.rank<R>.txt.
Each records the rise of its peak resident memory (VmHWM, reset through
/proc/self/clear_refs before the fit) from building the module to the start of training,
whether the model was on the meta device after configure_model, the full weights
(all-gathered) at the start of training and after the 3 steps.
"""
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_tiny  # noqa: E402

from ember import Trainer  # noqa: E402
from ember.callbacks import Callback  # noqa: E402
from ember.integrations.transformers import PadCollator, TransformersModule  # noqa: E402
from ember.strategies import FSDPStrategy  # noqa: E402

MODEL_DIR = os.path.abspath(sys.argv[1])


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Recorder(TransformersModule):
    record: dict = {}

    def configure_model(self):
        super().configure_model()
        self.record["meta_after_configure"] = any(p.is_meta for p in self.model.parameters())


def full_weights(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return {k[len("model."):]: v.detach().clone() for k, v in sd.items() if k.startswith("model.")}


class AtStart(Callback):
    def on_train_start(self, trainer, module):
        module.record["rise"] = status("VmHWM") - module.record["rss_before"]
        module.record["start"] = full_weights(trainer)     # every rank gathers the full weights
        module.record["local_dtypes"] = {n: p.to_local().dtype for n, p in trainer.model.named_parameters()}


def fit(mode: str, out: str, model_kwargs: "dict | None" = None, max_steps: int = 3) -> None:
    from transformers import GPT2LMHeadModel
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                        # VmHWM := VmRSS
    before = status("VmRSS")
    model = GPT2LMHeadModel.from_pretrained(MODEL_DIR) if mode == "every" else MODEL_DIR
    module = Recorder(model, task="causal-lm", lr=1e-3, warmup_steps=0, scheduler="constant",
                      model_kwargs=model_kwargs)
    module.record = {"rss_before": before}
    del model
    loader = DataLoader(hf_tiny.token_items("causal-lm", 12), batch_size=2, collate_fn=PadCollator(0, lm_labels=True))
    trainer = Trainer(strategy=FSDPStrategy(timeout=60), max_steps=max_steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, seed=0,
                      callbacks=[AtStart()])
    trainer.fit(module, loader)
    rec = dict(module.record, final=full_weights(trainer))
    torch.save(rec, os.path.join(out, f"{mode}.rank{trainer.global_rank}.pt"))


def main(out: str) -> None:
    torch.set_num_threads(1)
    fit("every", out)     # first: the lazy imports of a first fit count against the control
    fit("once", out)
    # a weights file rank 0 cannot read: every rank raises (no rank waits for the broadcast)
    broken = os.path.join(os.path.dirname(MODEL_DIR), "broken")
    try:
        module = Recorder(broken, task="causal-lm")
        Trainer(strategy=FSDPStrategy(timeout=60), max_steps=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False).fit(module, [])
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    with open(os.path.join(out, f"broken.rank{os.environ['RANK']}.txt"), "w") as f:
        f.write(str(error))


def main_bf16(out: str) -> None:
    from ember.integrations.hf_load import _dtype_kwarg
    torch.set_num_threads(1)
    fit("bf16", out, model_kwargs={_dtype_kwarg(): torch.bfloat16}, max_steps=1)


if __name__ == "__main__":
    main_bf16(sys.argv[2]) if sys.argv[3:] == ["bf16"] else main(sys.argv[2])
