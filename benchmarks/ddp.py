"""DDP benchmarks (2 processes, gloo, CPU).

Throughput: ember's Trainer against a hand-written torchrun + DistributedDataParallel
loop, in the same processes (alternating rounds), on an MLP 512 -> 2048 -> 2048 -> 10
with a global batch of 256 (128 per rank). The table row holds the medians of the
wall-clock rounds and the median of the per-round ratios (rounds alternate, so a
ratio compares neighbours in time); the samples per CPU-second of rank 0 are
printed too (less sensitive to other processes on a busy machine)::

    python benchmarks/ddp.py                # starts torchrun itself; prints a markdown row
    python benchmarks/ddp.py --rounds 5 --steps 40

Clean exits: N two-process runs of a small ember fit (launched from a plain
``python script.py``) and, for comparison, N runs of a bare torch script that
destroys its process group without ember's exit handling (``raw``), and of the
same bare script ending only as ember does, through ``on_exit(_exit)``
(``raw-onexit``); counts the exit codes::

    python benchmarks/ddp.py exit-loop --runs 40
    python benchmarks/ddp.py exit-loop --runs 60 --kinds raw,raw-onexit
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

HERE = os.path.abspath(__file__)
PER_RANK_BATCH = 128


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 10))


def dataset(steps: int, world: int):
    g = torch.Generator().manual_seed(0)
    n = PER_RANK_BATCH * world * steps
    return TensorDataset(torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g))


# -- throughput worker (runs under torchrun) ---------------------------------------

def raw_round(steps: int, warmup: int) -> float:
    """The hand-written loop: DistributedSampler + DDP + SGD. Returns samples per
    second of wall-clock time and per second of this process's CPU time."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler
    world = dist.get_world_size()
    ds = dataset(steps + warmup, world)
    loader = DataLoader(ds, batch_size=PER_RANK_BATCH, sampler=DistributedSampler(ds, shuffle=False))
    model = DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    t0 = c0 = None
    for i, (x, y) in enumerate(loader):
        if i == warmup:
            t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    n = steps * PER_RANK_BATCH * world
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def ember_round(steps: int, warmup: int) -> float:
    from ember import Trainer, TrainModule
    from ember.callbacks import Callback

    class MLP(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(Callback):
        t0 = t1 = c0 = c1 = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup:
                self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.t1, self.c1 = time.perf_counter(), time.process_time()

    clock = Clock()
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(devices=world, strategy="ddp", max_epochs=1, callbacks=[clock], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    trainer.fit(MLP(), DataLoader(dataset(steps + warmup, world), batch_size=PER_RANK_BATCH))
    n = steps * PER_RANK_BATCH * world
    return n / (clock.t1 - clock.t0), n / (clock.c1 - clock.c0)


def throughput_worker(args) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    raw, ember = [], []
    raw_round(2, 1)   # warm up the process (allocator, gloo buffers) outside the measurements
    for i in range(args.rounds):   # alternate (ABBA), so that drift of the machine hits both alike
        if i % 2 == 0:
            raw.append(raw_round(args.steps, args.warmup))
            ember.append(ember_round(args.steps, args.warmup))
        else:
            ember.append(ember_round(args.steps, args.warmup))
            raw.append(raw_round(args.steps, args.warmup))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"raw": raw, "ember": ember}), flush=True)


def throughput(args) -> None:
    from ember.strategies.environments import find_free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(find_free_port()), HERE, "throughput-worker", "--rounds", str(args.rounds), "--steps",
           str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not line:
        sys.exit(f"benchmark failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    res = json.loads(line[0][7:])
    for i, what in ((1, "per CPU-second of rank 0"), (0, "wall-clock")):
        r, e = [v[i] for v in res["raw"]], [v[i] for v in res["ember"]]
        pairs = [a / b for a, b in zip(e, r)]
        print(f"{what}: raw {[round(v) for v in r]}, ember {[round(v) for v in e]} samples/s; per-round "
              f"ratio {[round(v, 3) for v in pairs]} (median {statistics.median(pairs):.3f})")
    raw = statistics.median(v[0] for v in res["raw"])
    ember = statistics.median(v[0] for v in res["ember"])
    ratio = statistics.median(e[0] / r[0] for e, r in zip(res["ember"], res["raw"]))
    print("| benchmark | hand-written torchrun + DDP (samples/s) | ember Trainer (samples/s) | "
          "ratio (median of per-round ratios) |")
    print("|---|---|---|---|")
    print(f"| DDP 2x gloo CPU, MLP 512-2048-2048-10, global batch 256 | {raw:.0f} | {ember:.0f} | "
          f"{ratio:.3f} |")


# -- clean exits ------------------------------------------------------------------------

def exit_worker_ember(args) -> None:
    """A small 2-process fit from a plain `python script.py`."""
    from ember import Trainer, TrainModule

    class Tiny(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(devices=2, strategy="ddp", max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))


def exit_worker_raw(args) -> None:
    """The same without ember: init, DDP steps, destroy_process_group, normal interpreter exit."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    for _ in range(3):
        model(torch.randn(2, 4)).pow(2).mean().backward()
    dist.destroy_process_group()
    if args.mode == "exit-worker-raw-onexit":   # only ember's last exit step: end at C exit() via on_exit(_exit)
        from ember.strategies.launchers import _skip_native_teardown
        _skip_native_teardown()


def exit_loop(args) -> None:
    from ember.strategies.environments import find_free_port
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    for kind in args.kinds.split(","):
        codes, aborts = collections.Counter(), 0
        for _ in range(args.runs):
            if kind == "ember":   # ember launches rank 1 itself; exit code covers both ranks
                procs = [subprocess.Popen([sys.executable, HERE, "exit-worker-ember"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
            else:
                port = str(find_free_port())
                worker = "exit-worker-raw-onexit" if kind == "raw-onexit" else "exit-worker-raw"
                procs = [subprocess.Popen([sys.executable, HERE, worker], env=dict(
                    env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    for r in range(2)]
            for p in procs:
                out = p.communicate(timeout=300)[0]
                codes[p.returncode] += 1
                aborts += out.count("terminate called")
        print(f"{kind}: {args.runs} two-process runs; exit codes {dict(codes)}; "
              f"'terminate called' messages: {aborts}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="throughput",
                    choices=["throughput", "throughput-worker", "exit-loop", "exit-worker-ember", "exit-worker-raw",
                             "exit-worker-raw-onexit"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--kinds", default="ember,raw",
                    help="exit-loop: comma-separated subset of ember,raw,raw-onexit "
                         "(raw-onexit: the raw script plus only ember's on_exit(_exit) ending)")
    args = ap.parse_args()
    {"throughput": throughput, "throughput-worker": throughput_worker, "exit-loop": exit_loop,
     "exit-worker-ember": exit_worker_ember, "exit-worker-raw": exit_worker_raw,
     "exit-worker-raw-onexit": exit_worker_raw}[args.mode](args)


if __name__ == "__main__":
    main()
