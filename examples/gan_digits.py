"""A small GAN on scikit-learn's 8x8 digits with the ember Accelerator: two models,
two optimizers, a custom loop.

    python examples/gan_digits.py                         # one process, ~10 s on 2 CPU cores
    python examples/gan_digits.py --steps 100 --precision bf16-mixed
    ember launch --num-processes 2 examples/gan_digits.py
    python -m torch.distributed.run --nproc_per_node 2 examples/gan_digits.py

Every ``--log-every`` steps it prints the discriminator and generator losses
(averaged over processes) and how often the discriminator takes a real image for
real and a generated one for generated.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Accelerator

LATENT = 16


def digits() -> TensorDataset:
    from sklearn.datasets import load_digits
    images = torch.tensor(load_digits().images, dtype=torch.float32).reshape(-1, 64)
    return TensorDataset(images / 8.0 - 1.0)  # pixels 0..16 -> [-1, 1]


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(LATENT, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                         nn.Linear(128, 64), nn.Tanh())


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 64), nn.LeakyReLU(0.2),
                         nn.Linear(64, 1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="generator updates (default 400)")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--precision", default=None, help="e.g. 32-true (default), bf16-mixed, 16-mixed")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process (default 1: this model is too small to gain from more)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    acc = Accelerator(precision=args.precision, seed=args.seed)
    with acc.main_process_first():   # e.g. a download would happen once, on the main process
        data = digits()
    gen, disc = generator(), discriminator()
    opt_g = torch.optim.Adam(gen.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=args.lr, betas=(0.5, 0.999))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    gen, disc, opt_g, opt_d, loader = acc.prepare(gen, disc, opt_g, opt_d, loader)
    acc.print(f"{len(data)} digits, {acc.num_processes} process(es), {len(loader)} batches per process "
              f"per epoch, precision {acc.precision}")

    step, stats = 0, torch.zeros(4, device=acc.device)
    while step < args.steps:
        for (real,) in loader:
            n = real.shape[0]
            fake = gen(torch.randn(n, LATENT, device=acc.device))

            # discriminator: real -> 1, generated -> 0 (one forward over both halves)
            logits = disc(torch.cat([real, fake.detach()])).squeeze(1)
            target = torch.cat([torch.ones(n, device=acc.device), torch.zeros(n, device=acc.device)])
            loss_d = F.binary_cross_entropy_with_logits(logits, target)
            opt_d.zero_grad()
            acc.backward(loss_d)
            acc.clip_grad_norm_(disc.parameters(), 5.0)
            opt_d.step()

            # generator: make the discriminator say 1 for generated images
            loss_g = F.binary_cross_entropy_with_logits(disc(fake).squeeze(1), torch.ones(n, device=acc.device))
            opt_g.zero_grad()
            acc.backward(loss_g)
            opt_g.step()

            with torch.no_grad():
                right = ((logits > 0).float() == target).float()
                stats += torch.stack([loss_d.detach(), loss_g.detach(), right[:n].mean(), right[n:].mean()])
            step += 1
            if step % args.log_every == 0 or step == args.steps:
                k = args.log_every if step % args.log_every == 0 else step % args.log_every
                d, g, real_ok, fake_ok = (acc.reduce(stats, "mean") / k).tolist()   # one transfer
                acc.print(f"step {step:4d}  loss_d {d:.3f}  loss_g {g:.3f}  "
                          f"D right on real {real_ok:.2f} / on generated {fake_ok:.2f}")
                stats.zero_()
            if step >= args.steps:
                break

    with torch.no_grad():
        samples = acc.unwrap_model(gen)(torch.randn(256, LATENT, device=acc.device)).float()
    result = {"steps": step, "loss_d": d, "loss_g": g, "sample_mean": samples.mean().item(),
              "sample_std": samples.std().item()}
    acc.print(f"generated pixels: mean {result['sample_mean']:.2f}, std {result['sample_std']:.2f} "
              f"(real digits: mean {data.tensors[0].mean():.2f}, std {data.tensors[0].std():.2f})")
    acc.end_training()
    return result


if __name__ == "__main__":
    main()
