"""Every kind of train data resumed mid-epoch under two processes (gloo, CPU) with
DataLoader workers, against the uninterrupted run, all in one launch (each process start
costs seconds). Run by tests/data/test_stateful_ddp.py:

    python -m torch.distributed.run --nproc_per_node 2 stateful_ddp.py OUT_DIR

For each case of :data:`CASES` (tests/scripts/stateful_cases.py), the Trainer trains two
epochs saving every 3 steps, then a new Trainer resumes a checkpoint in the second epoch;
the Accelerator cases stop after 5 steps with save_state and resume with load_state.
Every rank writes OUT_DIR/rank<R>.pt: per case the uninterrupted and resumed weights,
the samples of each step and the replay warnings."""
import faulthandler
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stateful_cases as sc  # noqa: E402

# a rank the agent stops (SIGTERM, after the other rank failed) prints where it was first
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
print(f"rank {os.environ.get('RANK')} pid {os.getpid()}", file=sys.stderr, flush=True)

WORKERS = 2
STUCK = 35   # s: a case this long is stuck (a few seconds each; the process group times out at 45)
#: the Trainer's cases: a plain stream (replayed), a stateful stream (each worker's state),
#: Hugging Face datasets (an IterableDataset split by shards over ranks and workers, one with a
#: shuffle buffer (replayed), a map-style one), StatefulDataLoaders (map-style, a stateful stream),
#: and several loaders in each CombinedLoader mode (each sharded: a map-style one and a stream)
CASES = ["stream", "stateful", "stateful_sampler", "hf_iter", "hf_shuffle", "hf_map", "sdl_map", "sdl_stateful",
         "combined_max_size_cycle", "combined_min_size", "combined_max_size", "combined_sequential"]
ACC_CASES = ["stateful", "stream"]


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for case in CASES:
        print(f"case {case}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(STUCK, exit=False)   # a rank stuck in this case shows where
        root = os.path.join(out, case)
        full_w, full_seen, _ = sc.fit(case, root, WORKERS, devices=2)
        step = sc.resume_points(full_seen)[-1]   # in the second epoch
        w, seen, replays = sc.fit(case, os.path.join(root, "resumed"), WORKERS, devices=2,
                                  ckpt_path=sc.checkpoint(root, step))
        results[case] = {"full_w": full_w, "full_seen": full_seen, "w": w, "seen": seen, "step": step,
                         "replays": replays}
    for case in ACC_CASES:
        print(f"case acc_{case}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(STUCK, exit=False)
        root = os.path.join(out, "acc_" + case)
        workers = WORKERS if case != "stream" else 0   # the stream as given: its RNG draws on a resumed pass
        full_w, full_seen, full_rand = sc.acc_run(case, root, workers)
        dist.barrier()
        sc.acc_run(case, root, workers, stop=5)
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            w, seen, rand = sc.acc_run(case, root, workers, resume=True)
        results["acc_" + case] = {"full_w": full_w, "full_seen": full_seen, "w": w, "seen": seen, "step": 5,
                                  "full_rand": full_rand, "rand": rand,
                                  "replays": [str(c.message) for c in caught if "replayed" in str(c.message)]}
    faulthandler.cancel_dump_traceback_later()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
