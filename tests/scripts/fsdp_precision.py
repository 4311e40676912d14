"""FSDP's one precision path (run under torchrun, 2 processes; writes OUT/precision.rank<r>.json).

For "bf16-mixed" and "32-true": the Trainer trains a small net under FSDPStrategy while
the module records, inside training_step, whether autocast is on and the dtype the
block weights have during forward (FSDP2's all-gathered parameters); then the same
batches replay through a hand-written FSDP2 loop (fully_shard with the same
MixedPrecisionPolicy, no autocast, same AdamW) and the final weights are compared.
The Accelerator path is checked the same way (a prepared FSDP model's forward).

    torchrun --nproc_per_node 2 fsdp_precision.py OUT
"""
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shard_common as sc  # noqa: E402

from ember import Accelerator, Trainer  # noqa: E402
from ember.strategies import FSDPStrategy  # noqa: E402

OUT = sys.argv[1]
STEPS = 4


def autocast_state() -> dict:
    return {"enabled": torch.is_autocast_enabled("cpu"), "dtype": str(torch.get_autocast_dtype("cpu"))}


class Recording(sc.Net):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = []        # (autocast state, block weight dtype in forward, output dtype) per step
        self.batches = []
        self._weight_dtypes = []
        for b in self.blocks:
            b.register_forward_pre_hook(lambda m, a: self._weight_dtypes.append(str(m.lin.weight.dtype)))

    def training_step(self, batch, batch_idx):
        self._weight_dtypes.clear()
        self.batches.append([t.clone() for t in batch])
        x, y = batch
        out = self(x)
        self.seen.append({**autocast_state(), "weights": sorted(set(self._weight_dtypes)),
                          "out": str(out.dtype)})
        return F.cross_entropy(out.float(), y)


def reference(init: sc.Net, batches, policy) -> dict:
    """The same training by hand: FSDP2 per block + root with ``policy``, no autocast."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    net = copy.deepcopy(init)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in net.blocks:
        fully_shard(b, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    opt = sc.make_optimizer(net)
    for x, y in batches:
        F.cross_entropy(net(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                             broadcast_from_rank0=False))


def main():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    out = {}
    policies = {"bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "32-true": MixedPrecisionPolicy()}
    for prec, policy in policies.items():
        torch.manual_seed(0)
        net = Recording()
        t = Trainer(strategy=FSDPStrategy(auto_wrap_policy={sc.Block}), precision=prec, max_steps=STEPS,
                    enable_checkpointing=False, **sc.QUIET)
        t.fit(net, sc.loader())
        got = t.strategy.module_state_dict(t.model)
        ref = reference(sc.make_net(seed=0), net.batches, policy)
        res = {"seen": net.seen, "precision_type": type(t.strategy.precision).__name__,
               "trainer_precision": t.precision, "steps": len(net.batches)}
        if t.is_global_zero:
            res["equal"] = sc.equal(got, ref)
            res["max_diff"] = sc.max_diff(got, ref)
        out[prec] = res

    # 16-mixed: no autocast either, fp16 all-gathers, the sharded loss scaler kept
    torch.manual_seed(0)
    net = Recording()
    t = Trainer(strategy=FSDPStrategy(auto_wrap_policy={sc.Block}), precision="16-mixed", max_steps=2,
                enable_checkpointing=False, **sc.QUIET)
    t.fit(net, sc.loader())
    out["16-mixed"] = {"seen": net.seen, "precision_type": type(t.strategy.precision).__name__,
                       "scaler": type(t.strategy.precision.scaler).__name__}

    # the Accelerator: a prepared FSDP model's forward under bf16-mixed
    acc = Accelerator(strategy=FSDPStrategy(auto_wrap_policy={sc.Block}), precision="bf16-mixed")
    torch.manual_seed(0)
    net = Recording()
    model = acc.prepare(net)
    x = torch.randn(4, sc.D_IN)
    with acc.autocast():
        inner = autocast_state()
    net._weight_dtypes.clear()
    y = model(x)
    out["accelerator"] = {"autocast_ctx": inner, "weights": sorted(set(net._weight_dtypes)), "out": str(y.dtype),
                          "precision_type": type(acc.strategy.precision).__name__,
                          "mixed_precision": acc.mixed_precision}
    sc.write_result(OUT, "precision", out, dist.get_rank())


if __name__ == "__main__":
    main()
