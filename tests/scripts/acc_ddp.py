"""Accelerator under several processes (run with 2): training equals a single-process
reference, collectives, process ordering. Each rank writes ``OUT/rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/acc_ddp.py OUT
    python -m ember launch --num-processes 2 tests/scripts/acc_ddp.py OUT
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Accelerator

OUT = sys.argv[1]


def data(n=64):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 5, generator=g)
    return x, (x @ torch.randn(5, generator=g) > 0).long()


def reference(gas: int, world: int):
    """Plain PyTorch, one process, batch 16 (= 2 ranks x 8); the scheduler steps
    ``world`` times per optimizer step (the Accelerator's rule)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
    x, y = data()
    for i, (xb, yb) in enumerate(DataLoader(TensorDataset(x, y), batch_size=8 * world)):
        (F.cross_entropy(net(xb), yb) / gas).backward()
        if (i + 1) % gas == 0:
            opt.step()
            for _ in range(world):
                sched.step()
            opt.zero_grad()
    return net, sched


def accelerated(gas: int):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
    acc = Accelerator(gradient_accumulation_steps=gas)
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    sched, loader, net, opt = acc.prepare(sched, loader, net, opt)
    syncs = 0
    for xb, yb in loader:
        with acc.accumulate(net):
            acc.backward(F.cross_entropy(net(xb), yb))
            syncs += acc.sync_gradients
            opt.step()
            sched.step()
            opt.zero_grad()
    return acc, acc.unwrap_model(net), sched, syncs


def main():
    res = {}
    for gas in (1, 2):
        acc, net, sched, syncs = accelerated(gas)
        ref, ref_sched = reference(gas, acc.num_processes)
        res[f"max_diff_gas{gas}"] = max((a - b).abs().max().item()
                                        for a, b in zip(net.state_dict().values(), ref.state_dict().values()))
        res[f"sched_steps_gas{gas}"] = sched.last_epoch
        res[f"ref_sched_steps_gas{gas}"] = ref_sched.last_epoch
        res[f"syncs_gas{gas}"] = syncs
    rank, world = acc.process_index, acc.num_processes
    res.update(rank=rank, world=world, local_rank=acc.local_process_index, main=acc.is_main_process,
               local_main=acc.is_local_main_process)

    # gather_for_metrics: exactly the dataset (N odd, so the sampler pads one sample)
    n = 1001
    for shuffle in (False, True):
        loader = acc.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=8, shuffle=shuffle))
        got = [acc.gather_for_metrics(b) for (b,) in loader]
        res[f"gfm_shuffle{shuffle}"] = torch.cat(got).tolist()
    # the ranks' global streams differ: the order is rank 0's draw on every rank (one broadcast per pass)
    torch.manual_seed(100 + acc.process_index)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=8, shuffle=True))
    res["gfm_rank_seeds"] = [torch.cat([acc.gather_for_metrics(b) for (b,) in loader]).tolist() for _ in range(2)]
    # the same by hand with several tensors and a list of strings per batch
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=16))
    preds, labels = [], []
    for (b,) in loader:
        out = acc.gather_for_metrics({"pred": b * 2, "ids": [f"s{i}" for i in b.tolist()]})
        preds.append(out["pred"])
        labels += out["ids"]
    res["gfm_dict_pred"] = torch.cat(preds).tolist()
    res["gfm_dict_ids"] = labels

    # collectives
    t = torch.tensor([float(rank + 1)])
    res["reduce_sum"] = acc.reduce(t).tolist()
    res["reduce_mean"] = acc.reduce(t, "mean").tolist()
    res["reduce_max"] = acc.reduce({"a": t * 3}, "max")["a"].tolist()
    res["reduce_scale"] = acc.reduce(t, "sum", scale=0.5).tolist()
    res["gather_ragged"] = acc.gather(torch.full((rank + 1, 2), rank)).tolist()
    res["gather_scalar"] = acc.gather(torch.tensor(rank * 10)).tolist()
    padded = acc.pad_across_processes(torch.ones(2, rank + 2), dim=1, pad_index=-1)
    res["pad"] = padded.tolist()
    res["pad_first"] = acc.pad_across_processes(torch.ones(rank + 1), pad_first=True).tolist()
    res["broadcast_tensor"] = acc.broadcast(torch.tensor([rank + 5.0])).tolist()
    res["broadcast_obj"] = acc.broadcast({"from": rank}, from_process=1)
    res["gather_object"] = acc.gather_object([f"r{rank}"])
    with acc.split_between_processes(list(range(5))) as part:
        res["split_list"] = part
    with acc.split_between_processes(torch.arange(5), apply_padding=True) as part:
        res["split_tensor_padded"] = part.tolist()
    with acc.split_between_processes({"a": [1, 2, 3], "b": torch.tensor([4, 5, 6])}) as part:
        res["split_dict"] = {"a": part["a"], "b": part["b"].tolist()}
    if rank == 1:
        acc.set_trigger()
    res["trigger"] = acc.check_trigger()
    res["trigger_again"] = acc.check_trigger()

    # ordering: the main process's body has finished before the others start theirs
    marker = os.path.join(OUT, "main_first_done")
    with acc.main_process_first():
        if acc.is_main_process:
            import time
            time.sleep(0.3)
            open(marker, "w").close()
        res["marker_seen_in_body"] = os.path.exists(marker)
    lmarker = os.path.join(OUT, "local_main_first_done")
    with acc.local_main_process_first():
        if acc.is_local_main_process:
            open(lmarker, "w").close()
        res["local_marker_seen_in_body"] = os.path.exists(lmarker)

    @acc.on_main_process
    def only_main():
        return "ran"

    @acc.on_local_main_process
    def only_local_main():
        return "ran"

    res["on_main"] = only_main()
    res["on_local_main"] = only_local_main()

    # save_model / trackers: written once, by the main process
    net2 = acc.prepare(copy.deepcopy(net))
    res["saved_files"] = acc.save_model(net2, os.path.join(OUT, "export"), max_shard_size=300)
    acc = Accelerator(log_with="csv", project_dir=OUT)
    acc.init_trackers("proj", config={"lr": 0.2})
    acc.log({"loss": torch.tensor(0.5)}, step=3)
    res["tracker_null"] = acc.get_tracker("csv").log_metrics({"x": 1}, step=0) is None
    acc.end_training()
    acc.wait_for_everyone()
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
