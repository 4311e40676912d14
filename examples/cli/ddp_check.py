"""A plain torch.distributed script to check a launch:
`ember launch --num-processes 2 examples/cli/ddp_check.py --flag x`.

Each process joins the process group from the environment torchrun set up,
all-reduces its rank + 1, and rank 0 prints what it saw."""
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    total = total.cuda()
dist.all_reduce(total)
if rank == 0:
    print(f"world size {world}, sum of rank+1 = {total.item():g} (expected {world * (world + 1) / 2:g})")
    print(f"script arguments: {sys.argv[1:]}")
    for key in ("EMBER_PRECISION", "EMBER_STRATEGY", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        print(f"{key}={os.environ.get(key)}")
dist.destroy_process_group()
