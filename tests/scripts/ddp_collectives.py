"""Exercise DDPStrategy directly (no Trainer): launching, collectives, DDP
gradient sync, gather_for_metrics. Usage: ddp_collectives.py OUT_DIR
(started as a plain script, under torchrun, or with SLURM_* variables)."""
import json
import os
import sys

import torch

import ember.distributed as ed
from ember.data import num_padded, prepare_dataloader
from ember.strategies.ddp import DDPStrategy

out_dir = sys.argv[1]
strategy = DDPStrategy(devices=int(os.environ.get("EMBER_TEST_DEVICES", "2")))
strategy.setup_environment()
rank, world = strategy.global_rank, strategy.world_size
res = {"rank": rank, "world": world, "env": strategy.cluster_environment.name,
       "local_rank": strategy.local_rank,
       "env_vars": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                   "MASTER_ADDR", "MASTER_PORT")}}

# collectives
t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
res["reduce"] = {op: strategy.reduce(t, op).tolist() for op in ("sum", "mean", "max", "min")}
res["reduce_int_mean"] = strategy.reduce(torch.tensor(rank + 1), "mean").item()
try:
    strategy.reduce(t, "avgx")
except ValueError as e:
    res["bad_op"] = str(e)
res["all_gather"] = strategy.all_gather(t).tolist()
res["all_gather_cat"] = strategy.all_gather_cat(torch.arange(rank + 2).float()).tolist()
res["all_gather_object"] = strategy.all_gather_object({"r": rank})
res["broadcast_obj"] = strategy.broadcast({"from": rank}, src=1)
res["broadcast_t"] = strategy.broadcast(torch.full((2,), float(rank)), src=1).tolist()
res["gather"] = ed.gather(torch.arange(rank + 1)).tolist()
res["pad"] = ed.pad_across_processes(torch.ones(rank + 1, 2), dim=0, pad_index=-1).tolist()
res["pad_first"] = ed.pad_across_processes(torch.ones(2, rank + 1), dim=1, pad_first=True).tolist()

# gather_for_metrics over a 7-sample dataset sharded by the ResumableSampler, batch 2
ds = torch.utils.data.TensorDataset(torch.arange(7) * 10)
dl = prepare_dataloader(torch.utils.data.DataLoader(ds, batch_size=2), seed=0,
                        **strategy.distributed_sampler_kwargs())
seen = torch.cat([b[0] for b in dl])
res["num_padded"] = num_padded(dl)
g = ed.gather_for_metrics({"x": seen, "names": [f"s{int(v)}" for v in seen]},
                          num_padded=num_padded(dl), strategy=strategy)
res["gfm"] = g["x"].tolist()
res["gfm_names"] = g["names"]
res["gfm_default_pg"] = ed.gather_for_metrics(seen, num_padded=num_padded(dl)).tolist()

# DDP: gradients are averaged over ranks
torch.manual_seed(0)
model = strategy.setup_module(torch.nn.Linear(3, 1, bias=False))
x = torch.full((1, 3), float(rank + 1))
model(x).sum().backward()
res["grad"] = model.module.weight.grad.tolist()
with strategy.no_backward_sync(model, True):
    model.module.weight.grad = None
    model(x).sum().backward()
res["grad_nosync"] = model.module.weight.grad.tolist()
res["is_ddp"] = type(model).__name__

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
