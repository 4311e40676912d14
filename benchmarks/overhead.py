"""Per-step overhead of ember vs a raw PyTorch loop on a tiny MLP.

    python benchmarks/overhead.py                 # 5 interleaved repetitions
    python benchmarks/overhead.py --reps 9 --steps 3000

Tiny MLP 32->64->10, batch 64, in-memory tensors, the same DataLoader for every
variant, torch.set_num_threads(1). Each variant runs in its own process;
repetitions are interleaved; steady-state steps/s is measured between step
``--warmup`` and the last step by timestamps taken in the DataLoader's
collate_fn (identical code in every variant). Timings on a shared 2-core machine
vary by +-20% between runs of the same code, so use many repetitions (--reps 15)
and read the per-repetition ratio beside the ratio of medians. Also counts Python
function calls per step under cProfile, and with --callgrind machine instructions
per step under valgrind (both deterministic, unlike timings): "steady state" is
the difference between a run of 2N and of N steps divided by N, so one-time setup
cancels; "incl. setup" divides a whole N-step run by N.

Variants: raw (hand-written loop), trainer (ember Trainer with DEFAULT settings:
progress bar, model summary, TensorBoard logger, checkpointing), accelerator
(ember Accelerator custom loop), raw-in-trainer-process (the raw loop in a process that
also imported ember and built a default Trainer it never uses).

``--data samples`` (default): a TensorDataset of samples, batch_size=64 — the
DataLoader's per-index RandomSampler runs in the raw loop, ember's resumable
sampler (index lists) in the ember variants, so the raw loop makes MORE calls.
``--data batches``: a dataset of pre-made batches read with batch_size=None, so
every variant's sampler does the same one-index-per-step work and the call counts
compare the loops alone (the figure quoted as "calls per step" in the README).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("raw", "trainer", "accelerator")
#: the Trainer with one default switched off (``--variants raw,trainer,trainer-nobar,...``): where its time goes
ABLATIONS = {"trainer-nobar": {"enable_progress_bar": False}, "trainer-nolog": {"logger": False},
             "trainer-nockpt": {"enable_checkpointing": False},
             "trainer-bare": {"enable_progress_bar": False, "logger": False, "enable_checkpointing": False,
                              "enable_model_summary": False},
             # the TensorBoard logger handing every scalar to its writer thread at once (before handoff_secs)
             "trainer-tb-immediate": {"logger": "tb-immediate"}}


DATA = "samples"   # set from --data in the child
CPU_STAMPS: list = []   # the main thread's CPU time at each batch (time.thread_time)
PROC_STAMPS: list = []   # the process's CPU time (every thread) at each batch (time.process_time)


def _setup(steps: int):
    import torch
    from torch.utils.data import DataLoader, Dataset, TensorDataset
    from torch.utils.data._utils.collate import default_collate, default_convert
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stamps = []
    cpu_stamps, proc_stamps = CPU_STAMPS, PROC_STAMPS
    cpu_stamps.clear()
    proc_stamps.clear()

    def collate(samples):
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.thread_time())
        proc_stamps.append(time.process_time())
        for h in _HOOKS:
            h()
        return default_collate(samples)

    if DATA == "batches":
        class Batches(Dataset):   # pre-made batches: one index per step for every sampler
            def __init__(self):
                self.x = torch.randn(steps, 64, 32)
                self.y = torch.randint(0, 10, (steps, 64))

            def __len__(self):
                return steps

            def __getitem__(self, i):
                return self.x[i], self.y[i]

        def convert(batch):
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.thread_time())
            proc_stamps.append(time.process_time())
            return default_convert(batch)

        loader = DataLoader(Batches(), batch_size=None, shuffle=True, collate_fn=convert)
    else:
        x = torch.randn(steps * 64, 32)
        y = torch.randint(0, 10, (steps * 64,))
        loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, collate_fn=collate)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return torch, loader, net, stamps


def run_raw(steps):
    torch, loader, net, stamps = _setup(steps)
    import torch.nn.functional as F
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def go():
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
    return go, stamps


def run_raw_in_trainer_process(steps):
    """The raw loop in a process that has also imported ember and built a default Trainer it
    never uses: what the process alone (its imports, heap, threads) costs the raw loop."""
    import ember
    ember.Trainer(max_epochs=1, default_root_dir=tempfile.mkdtemp(prefix="ember-bench-"))
    return run_raw(steps)


def run_trainer(steps, **trainer_kw):
    torch, loader, net, stamps = _setup(steps)
    import torch.nn.functional as F
    from ember import Trainer, TrainModule

    class Tiny(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    root = tempfile.mkdtemp(prefix="ember-bench-")
    if trainer_kw.get("logger") == "tb-immediate":
        from ember.loggers import TensorBoardLogger
        trainer_kw["logger"] = TensorBoardLogger(root, handoff_secs=0)
    # defaults: progress bar, summary, logger, checkpoints (an ablation switches one off)
    trainer = Trainer(max_epochs=1, default_root_dir=root, **trainer_kw)
    module = Tiny()
    return (lambda: trainer.fit(module, loader)), stamps


def run_accelerator(steps):
    torch, loader, net, stamps = _setup(steps)
    import torch.nn.functional as F
    from ember import Accelerator
    acc = Accelerator()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model, opt, dl = acc.prepare(net, opt, loader)

    def go():
        for x, y in dl:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
    return go, stamps


def child(variant: str, steps: int, warmup: int, profile: bool) -> dict:
    if variant in ABLATIONS:
        go, stamps = run_trainer(steps, **ABLATIONS[variant])
    else:
        go, stamps = {"raw": run_raw, "trainer": run_trainer, "accelerator": run_accelerator,
                        "raw-in-trainer-process": run_raw_in_trainer_process}[variant](steps)
    if profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        go()
        pr.disable()
        return {"calls_per_step": pstats.Stats(pr).total_calls / steps}
    go()
    n = len(stamps) - 1 - warmup
    return {"steps_per_s": n / (stamps[-1] - stamps[warmup]),
            "main_cpu_us_per_step": 1e6 * (CPU_STAMPS[-1] - CPU_STAMPS[warmup]) / n,
            "proc_cpu_us_per_step": 1e6 * (PROC_STAMPS[-1] - PROC_STAMPS[warmup]) / n}


def thread_report(variant: str, steps: int, warmup: int) -> list[dict]:
    """Every thread of the process between step ``warmup`` and the last step: its context
    switches per step (a voluntary switch is a wake-up after waiting) and its CPU time
    (Linux ``/proc/self/task``). Shows what runs beside the training thread."""
    import threading

    def table():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/status") as f:
                    st = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[tid] = (st["Name"].strip(), int(st["voluntary_ctxt_switches"]),
                        int(st["nonvoluntary_ctxt_switches"]),
                        (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    if variant in ABLATIONS:
        go, stamps = run_trainer(steps, **ABLATIONS[variant])
    else:
        go, stamps = {"raw": run_raw, "trainer": run_trainer, "accelerator": run_accelerator,
                        "raw-in-trainer-process": run_raw_in_trainer_process}[variant](steps)
    marks = {}

    def hook():   # one snapshot at step ``warmup`` and one at the end, taken from the collate function
        if len(stamps) == warmup:
            marks["a"] = (table(), len(stamps))
        elif len(stamps) == steps - 1:
            marks["b"] = (table(), len(stamps))
            marks["names"] = {t.native_id: f"{t.name} ({type(t).__module__}.{type(t).__qualname__})"
                              for t in threading.enumerate()}
    _HOOKS.append(hook)
    go()
    (a, sa), (b, sb) = marks["a"], marks["b"]
    n = sb - sa
    names = dict(marks.get("names", {}))
    names[threading.get_native_id()] = "training thread"
    rows = []
    for tid, (name, vol, invol, cpu) in sorted(b.items()):
        v0, i0, c0 = a[tid][1:] if tid in a else (0, 0, 0.0)
        label = names.get(int(tid), name)
        rows.append({"thread": label, "voluntary_per_step": (vol - v0) / n, "involuntary_per_step": (invol - i0) / n,
                     "cpu_us_per_step": 1e6 * (cpu - c0) / n})
    return rows


_HOOKS: list = []


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated: {', '.join(VARIANTS)}, or an ablation: {', '.join(ABLATIONS)}")
    p.add_argument("--no-calls", action="store_true", help="skip the cProfile call counts (timings only)")
    p.add_argument("--data", choices=("samples", "batches"), default="samples",
                   help="samples: TensorDataset, batch_size=64; batches: pre-made batches, batch_size=None")
    p.add_argument("--callgrind", action="store_true",
                   help="also count machine instructions per step under valgrind (slow: minutes per variant)")
    p.add_argument("--callgrind-steps", type=int, default=300)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads-of", default=None, metavar="VARIANT",
                   help="print every thread's context switches and CPU time per step for one variant, and exit")
    args = p.parse_args()
    global DATA
    DATA = args.data
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.warmup, args.profile)))
        return
    if args.threads_of:
        print(f"| thread ({args.threads_of}, {args.steps} steps, after step {args.warmup}) | voluntary switches/step "
              "| involuntary/step | CPU µs/step |\n|---|---:|---:|---:|")
        for r in thread_report(args.threads_of, args.steps, args.warmup):
            print(f"| {r['thread']} | {r['voluntary_per_step']:.4f} | {r['involuntary_per_step']:.4f} "
                  f"| {r['cpu_us_per_step']:.1f} |")
        return
    variants = args.variants.split(",")
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    def run(v, *extra):
        out = subprocess.run([sys.executable, __file__, "--child", v, "--steps", str(args.steps),
                              "--warmup", str(args.warmup), "--data", args.data, *extra], capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"{v} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    rates = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    proc = {v: [] for v in variants}
    for r in range(args.reps):
        for v in variants:   # interleaved
            res = run(v)
            rates[v].append(res["steps_per_s"])
            cpu[v].append(res["main_cpu_us_per_step"])
            proc[v].append(res["proc_cpu_us_per_step"])
        print(f"rep {r + 1}/{args.reps}: " + ", ".join(f"{v} {rates[v][-1]:.0f}" for v in variants), file=sys.stderr)
    # marginal calls per step: profile a run of N and of 2N steps, so one-time setup
    # (imports of tensorboard, the summary table, the final checkpoint) cancels out
    calls, calls_total = {v: float("nan") for v in variants}, {v: float("nan") for v in variants}
    for v in ([] if args.no_calls else variants):
        c1 = run(v, "--profile")["calls_per_step"] * args.steps
        c2 = json.loads(subprocess.run([sys.executable, __file__, "--child", v, "--steps", str(2 * args.steps),
                                        "--warmup", str(args.warmup), "--data", args.data, "--profile"], capture_output=True, text=True,
                                       env=env).stdout.strip().splitlines()[-1])["calls_per_step"] * 2 * args.steps
        calls[v] = (c2 - c1) / args.steps
        calls_total[v] = c1 / args.steps
    instr = callgrind_instructions(variants, args, env) if args.callgrind else {}
    raw = statistics.median(rates["raw"]) if "raw" in rates else None
    print(f"\ndata={args.data}: tiny MLP 32-64-10, batch 64, {args.steps} steps, torch.set_num_threads(1), "
          f"{args.reps} interleaved reps, median steady-state steps/s after step {args.warmup}\n")
    print("ratio vs raw: of the medians | median of the per-repetition ratios (each variant against the raw run "
          "of its own repetition, which cancels slow drifts of the machine) | of the best repetitions\n")
    print("main-thread CPU: time.thread_time() of the training thread per step (median); wall time per step "
          "beyond it is time the thread was off the CPU (other threads, other processes)\n")
    print("| variant | steps/s (median) | ratio vs raw | per-rep ratio (median) | best vs best "
          "| main-thread CPU µs/step | process CPU µs/step | Python calls/step, steady state | incl. setup |"
          + (" instructions/step (callgrind) |" if instr else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if instr else ""))
    for v in variants:
        med = statistics.median(rates[v])
        ratio = pair = best = "-"
        if raw:
            ratio = f"{med / raw:.3f}"
            pair = f"{statistics.median(a / b for a, b in zip(rates[v], rates['raw'])):.3f}"
            best = f"{max(rates[v]) / max(rates['raw']):.3f}"
        extra = ""
        if instr:
            extra = f" {instr[v] / 1e6:.3f} M" + (f" ({instr[v] / instr['raw']:.3f}x)" if "raw" in instr else "") + " |"
        print(f"| {v} | {med:.0f} | {ratio} | {pair} | {best} | {statistics.median(cpu[v]):.0f} "
              f"| {statistics.median(proc[v]):.0f} | {calls[v]:.0f} "
              f"| {calls_total[v]:.0f} |{extra}")


def callgrind_instructions(variants, args, env) -> dict:
    """Machine instructions per training step under valgrind's callgrind: a run of N and
    of 2N steps, difference / N. Deterministic, unlike timings (OPENBLAS_NUM_THREADS=1:
    numpy's idle OpenBLAS worker otherwise spins a varying number of instructions)."""
    import re
    import shutil
    from concurrent.futures import ThreadPoolExecutor
    if shutil.which("valgrind") is None:
        print("callgrind: valgrind not found, skipped", file=sys.stderr)
        return {}
    n = args.callgrind_steps
    env = dict(env, OPENBLAS_NUM_THREADS="1")

    def count(job):
        v, steps = job
        with tempfile.TemporaryDirectory() as tmp:
            res = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
                                  sys.executable, __file__, "--child", v, "--steps", str(steps),
                                  "--warmup", "0", "--data", args.data], capture_output=True, text=True, env=env)
        m = re.search(r"Collected : (\d+)", res.stderr)
        if res.returncode or not m:
            sys.exit(f"callgrind run of {v} failed:\n{res.stderr[-2000:]}")
        return int(m.group(1))

    jobs = [(v, steps) for v in variants for steps in (n, 2 * n)]
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        totals = dict(zip(jobs, pool.map(count, jobs)))
    out = {v: (totals[(v, 2 * n)] - totals[(v, n)]) / n for v in variants}
    for v in variants:
        print(f"callgrind {v}: {out[v] / 1e6:.3f} M instructions/step", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
