"""Per-rank parameter + optimizer-state memory and training speed of DDP, FSDP,
DeepSpeed ZeRO 1/2/3 (2 processes), HSDP and a data x tensor parallel 2-D mesh
(4 processes) on a small transformer (gloo on CPU).

    python benchmarks/sharding.py                      # all strategies, markdown table
    python benchmarks/sharding.py --only fsdp zero3 --steps 10

Each strategy runs in its own pair of processes (``Accelerator(devices=2)`` starts
them) with an ``Accelerator`` loop: AdamW, fp32, a fixed batch of random tokens.
Memory is the bytes of the distinct tensor storages each rank holds for parameters
(a DTensor's local shard, a ZeRO-3 partition) and for the optimizer (its states and,
under DeepSpeed, the fp32 master partition); gradients and activations are not
counted. Steps/s is measured after warm-up steps, between barriers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

KINDS = ("ddp", "fsdp", "zero1", "zero2", "zero3", "hsdp2x2", "dp2xtp2")
NPROC = {"hsdp2x2": 4, "dp2xtp2": 4}        # the others run on 2 processes


def build_model(vocab: int, d_model: int, layers: int, heads: int):
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d_model)
            layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens):
            h = self.encoder(self.emb(tokens[:, :-1]))
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens[:, 1:].flatten())

    torch.manual_seed(0)
    return LM()


def _storage_bytes(tensors) -> int:
    import torch
    from torch.distributed.tensor import DTensor
    seen = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.device.type == "meta" or t.numel() == 0:
            continue
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _memory(strategy, model, optimizer) -> tuple[int, int]:
    raw = strategy.unwrap_module(model)
    params = [getattr(p, "ds_tensor", p) for p in raw.parameters()]
    inner = getattr(optimizer, "optimizer", optimizer)          # AcceleratedOptimizer -> strategy's optimizer
    import torch
    torch_opt = inner.optimizer if isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer) else inner
    opt_tensors = []                                              # (a ZeRO optimizer wraps the torch one)
    for st in torch_opt.state.values():
        opt_tensors += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        opt_tensors += list(getattr(inner, name, None) or [])
    return _storage_bytes(params), _storage_bytes(opt_tensors)


def worker(kind: str, args) -> None:
    import torch
    from torch import nn
    from ember import Accelerator
    nproc = NPROC.get(kind, 2)
    if kind == "ddp":
        strategy = "ddp"
    elif kind == "fsdp":
        from ember.strategies import FSDPStrategy
        strategy = FSDPStrategy(devices=2, auto_wrap_policy={nn.TransformerEncoderLayer})
    elif kind == "hsdp2x2":
        from ember.strategies import FSDPStrategy
        strategy = FSDPStrategy(devices=4, hsdp=(2, 2))          # per-block units by default
    elif kind == "dp2xtp2":
        from ember.strategies import ModelParallelStrategy
        strategy = ModelParallelStrategy(devices=4, data_parallel_size=2, tensor_parallel_size=2)
    else:
        from ember.strategies import DeepSpeedStrategy
        strategy = DeepSpeedStrategy(devices=2, stage=int(kind[-1]), stage3_param_persistence_threshold=0)
    acc = Accelerator(strategy=strategy, devices=nproc, seed=0)
    model = build_model(args.vocab, args.d_model, args.layers, args.heads)
    if kind == "dp2xtp2":     # Megatron's FFN split in every encoder layer (attention stays replicated)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        tp = acc.strategy.device_mesh["tensor_parallel"]
        for layer in model.encoder.layers:
            parallelize_module(layer, tp, {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()})
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    # the ranks of one tensor-parallel group must see the same batch
    g = torch.Generator().manual_seed(getattr(acc.strategy, "data_parallel_rank", acc.process_index))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)

    def step():
        loss = model(tokens)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(args.warmup):
        step()
    acc.wait_for_everyone()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    float(loss)
    acc.wait_for_everyone()
    elapsed = time.perf_counter() - t0
    mem = acc.strategy.all_gather_object(_memory(acc.strategy, model, opt))
    if acc.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"kind": kind, "n_params": n_params, "steps_per_s": args.steps / elapsed,
                       "param_bytes": [m[0] for m in mem], "optim_bytes": [m[1] for m in mem]}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args)

    rows = []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    passthrough = [f"--{k}={v}" for k, v in (("steps", args.steps), ("warmup", args.warmup), ("layers", args.layers),
                                             ("d-model", args.d_model), ("heads", args.heads), ("vocab", args.vocab),
                                             ("batch", args.batch), ("seq", args.seq))]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.only:
            out = os.path.join(tmp, f"{kind}.json")
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", kind, "--out", out,
                                *passthrough], env=env, capture_output=True, text=True)
            if r.returncode != 0 or not os.path.exists(out):
                print(f"{kind} failed:\n{r.stderr[-3000:]}", file=sys.stderr)
                continue
            with open(out) as f:
                rows.append(json.load(f))
    if not rows:
        sys.exit(1)
    mb = 1 / 2**20
    base = next((r for r in rows if r["kind"] == "ddp"), None)
    base_total = max(base["param_bytes"]) + max(base["optim_bytes"]) if base else None
    print(f"{rows[0]['n_params'] / 1e6:.2f}M-parameter transformer ({args.layers} layers, d_model {args.d_model}), "
          f"AdamW fp32, gloo on CPU, {args.batch}x{args.seq} tokens per data-parallel rank and step\n")
    print("| strategy | processes | params / rank (MiB) | optimizer / rank (MiB) | total / rank (MiB) | vs DDP | steps/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    names = {"ddp": "DDP", "fsdp": "FSDP (per layer)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
             "hsdp2x2": "HSDP (replicate 2, shard 2)", "dp2xtp2": "data 2 x tensor 2 (FSDP2 + TP FFN)"}
    for r in rows:
        pb, ob = max(r["param_bytes"]), max(r["optim_bytes"])
        rel = f"{(pb + ob) / base_total:.2f}x" if base_total else "-"
        print(f"| {names[r['kind']]} | {NPROC.get(r['kind'], 2)} | {pb * mb:.1f} | {ob * mb:.1f} | {(pb + ob) * mb:.1f} "
              f"| {rel} | {r['steps_per_s']:.2f} |")


if __name__ == "__main__":
    main()
