"""Generation speed of a GPT-2-style model in memory, dispatched on the CPU, and with half of
its blocks offloaded to disk: ember.big_modeling and Accelerate's own
``load_checkpoint_and_dispatch`` side by side, in the same process, on the same checkpoint.

    python benchmarks/offload.py                      # 12 blocks of width 768 (GPT-2 small shape)
    python benchmarks/offload.py --layers 4 --reps 1  # a quick look

For each setup: greedy ``generate()`` of ``--new-tokens`` tokens after a 32-token prompt
(batch 1; tokens/s of the decoding) and one 256-token forward (prefill tokens/s), per
wall-clock second and per CPU second of the process (steadier on a shared machine); the
median of ``--reps`` rounds, each round running every setup once. Every setup must
produce the same tokens as the in-memory model.
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


def measure_once(model, prompt, long_ids, new_tokens: int) -> tuple[list[float], torch.Tensor]:
    """[decode tokens per wall s, per CPU s, prefill tokens per wall s, per CPU s], generated ids."""
    with torch.no_grad():
        w, c = time.perf_counter(), time.process_time()
        gen = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones_like(prompt))
        w, c = time.perf_counter() - w, time.process_time() - c
        w2, c2 = time.perf_counter(), time.process_time()
        model(long_ids)
        w2, c2 = time.perf_counter() - w2, time.process_time() - c2
    return [new_tokens / w, new_tokens / c, long_ids.numel() / w2, long_ids.numel() / c2], gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config
    from ember import big_modeling as ebm
    from ember.checkpoint.io import save_model_sharded
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
    models = []          # (setup, library, model); measured in rounds, all setups in each round
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        save_model_sharded(ref.state_dict(), ckpt, max_shard_size="200MB")
        models.append(("in memory (plain model)", "-", ref))
        libs = [("ember", ebm.init_empty_weights, ebm.load_checkpoint_and_dispatch)]
        if have_acc:
            import accelerate
            libs.append((f"accelerate {accelerate.__version__}", accelerate.init_empty_weights,
                         accelerate.load_checkpoint_and_dispatch))
        for setup, dmap in (("cpu", {"": "cpu"}), ("half on disk", disk_map(args.layers))):
            for lib, init_ctx, load in libs:
                t = time.perf_counter()
                off = tempfile.mkdtemp(dir=tmp)
                model = load(build(cfg, init_ctx), ckpt, device_map=dict(dmap), offload_folder=off,
                             no_split_module_classes=["GPT2Block"]).eval()
                models.append((setup, f"{lib} (load {time.perf_counter() - t:.2f} s)", model))
        with torch.no_grad():
            for _, _, m in models:
                m(long_ids[:, :8])     # warm-up
        runs: list[list[list[float]]] = [[] for _ in models]
        same = [True] * len(models)
        want = None
        for _ in range(args.reps):
            for k, (_, _, m) in enumerate(models):
                figs, gen = measure_once(m, prompt, long_ids, args.new_tokens)
                want = gen if want is None else want
                same[k] &= bool(torch.equal(gen, want))
                runs[k].append(figs)
        rows = [(setup, lib, *[statistics.median(r[i] for r in runs[k]) for i in range(4)], same[k])
                for k, (setup, lib, _) in enumerate(models)]
    print(f"\nmedians of {args.reps} rounds (each round runs every setup once)\n")
    print("| setup | library | decode tok/s | decode tok/CPU-s | prefill tok/s | prefill tok/CPU-s | same tokens |")
    print("|---|---|---:|---:|---:|---:|---|")
    for setup, lib, dw, dc, pw, pc, ok in rows:
        print(f"| {setup} | {lib} | {dw:.1f} | {dc:.1f} | {pw:.0f} | {pc:.0f} | {'yes' if ok else 'NO'} |")
    if not have_acc:
        print("\n(accelerate is not installed: pip install accelerate to measure it side by side)")


if __name__ == "__main__":
    main()
