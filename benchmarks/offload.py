"""Generation speed of a GPT-2-style model in memory, dispatched on the CPU, and with half of
its blocks offloaded to disk: ember.big_modeling and Accelerate's own
``load_checkpoint_and_dispatch`` side by side, in the same process, on the same checkpoint.

    python benchmarks/offload.py                      # 12 blocks of width 768 (GPT-2 small shape)
    python benchmarks/offload.py --layers 4 --reps 1  # a quick look

For each setup: greedy ``generate()`` of ``--new-tokens`` tokens after a 32-token prompt
(batch 1; tokens/s of the decoding) and one 256-token forward (prefill tokens/s); the
median of ``--reps`` runs. Every setup must produce the same tokens as the in-memory model.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def build(cfg, init_ctx=None):
    from transformers import GPT2LMHeadModel
    if init_ctx is None:
        return GPT2LMHeadModel(cfg)
    with init_ctx():
        model = GPT2LMHeadModel(cfg)
    model.tie_weights()     # Accelerate's empty init unties lm_head from wte; its docs ask for this
    return model


def disk_map(n_layer: int) -> dict:
    half = n_layer // 2
    dmap = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu"}
    dmap.update({f"transformer.h.{i}": "cpu" if i < half else "disk" for i in range(n_layer)})
    dmap.update({"transformer.ln_f": "disk", "lm_head": "cpu"})
    return dmap


def measure(model, prompt, long_ids, new_tokens: int, reps: int) -> tuple[float, float, torch.Tensor]:
    gen = None
    dec, pre = [], []
    with torch.no_grad():
        model(long_ids[:, :8])     # warm-up
        for _ in range(reps):
            t = time.perf_counter()
            gen = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(prompt))
            dec.append(new_tokens / (time.perf_counter() - t))
            t = time.perf_counter()
            model(long_ids)
            pre.append(long_ids.numel() / (time.perf_counter() - t))
    return statistics.median(dec), statistics.median(pre), gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config
    from ember import big_modeling as ebm
    from ember.checkpoint_io import save_model_sharded
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=512, n_embd=args.width, n_layer=args.layers,
                     n_head=max(1, args.width // 64), bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    ref = build(cfg).eval()
    n_params = sum(p.numel() for p in ref.parameters())
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, args.vocab, (1, 32), generator=g)
    long_ids = torch.randint(2, args.vocab, (1, 256), generator=g)
    have_acc = importlib.util.find_spec("accelerate") is not None
    print(f"GPT-2 shape: {args.layers} blocks, width {args.width}, vocab {args.vocab}: {n_params / 1e6:.1f}M params "
          f"({n_params * 4 / 2**20:.0f} MiB fp32); torch {torch.__version__}, {args.threads} threads")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        save_model_sharded(ref.state_dict(), ckpt, max_shard_size="200MB")
        dec, pre, want = measure(ref, prompt, long_ids, args.new_tokens, args.reps)
        rows.append(("in memory (plain model)", "-", dec, pre, True))
        del ref
        setups = [("cpu", {"": "cpu"}), ("half on disk", disk_map(args.layers))]
        libs = [("ember", ebm.init_empty_weights, ebm.load_checkpoint_and_dispatch)]
        if have_acc:
            import accelerate
            libs.append((f"accelerate {accelerate.__version__}", accelerate.init_empty_weights,
                         accelerate.load_checkpoint_and_dispatch))
        for setup, dmap in setups:
            for lib, init_ctx, load in libs:
                off = tempfile.mkdtemp(dir=tmp)
                t = time.perf_counter()
                model = load(build(cfg, init_ctx), ckpt, device_map=dict(dmap), offload_folder=off,
                             no_split_module_classes=["GPT2Block"]).eval()
                load_s = time.perf_counter() - t
                dec, pre, gen = measure(model, prompt, long_ids, args.new_tokens, args.reps)
                rows.append((f"{setup}", f"{lib} (load {load_s:.2f} s)", dec, pre, torch.equal(gen, want)))
                del model
    print(f"\n| setup | library | decode tokens/s | prefill tokens/s | same tokens |\n|---|---|---:|---:|---|")
    for setup, lib, dec, pre, same in rows:
        print(f"| {setup} | {lib} | {dec:.1f} | {pre:.0f} | {'yes' if same else 'NO'} |")
    if not have_acc:
        print("\n(accelerate is not installed: pip install accelerate to measure it side by side)")


if __name__ == "__main__":
    main()
