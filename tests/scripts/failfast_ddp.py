"""Error paths that must not wait for the process-group timeout, and decisions rank 0
alone makes (2 CPU processes, gloo, ember's own launcher), run by tests/distributed/test_fail_fast.py.

    python failfast_ddp.py MODE ROOT

MODE ``save_enospc``: rank 0's checkpoint write fails with ENOSPC; every rank must raise
the real error within seconds (process-group timeout 60 s).
MODE ``agree_timeout``: rank 1 sleeps 8 s in a batch hook just before a log point (where
the ranks agree on stopping) under a 4 s process-group timeout: rank 0's error names rank 1.
MODE ``peer_fails`` (under ``ember launch``): rank 1 raises in training_step while rank 0
is blocked in a call that does not return to Python (process-group timeout 20 s); rank 1
writes ROOT/failed_at (the time) just before it raises.
MODE ``peer_killed`` (under ``ember launch``): the same, but rank 1 is SIGKILLed (no error
file): rank 0 must still stop at the agent's SIGTERM, not after its grace period.
MODE ``no_sync_exception``: an exception inside a micro-batch that skips the gradient
all-reduce (accumulation 2), in the Trainer's step and in ``Accelerator.accumulate``: DDP's
sync flag is restored on both paths.
MODE ``collective_timeout`` (under ``ember launch``): rank 1 sleeps 20 s after its first
step while rank 0 waits in ModelCheckpoint's save-point broadcast (not an agreement
point) under a 4 s process-group timeout; the error is not caught: the report must name
rank 1 as the rank that never arrived.
MODE ``precision_differs``: the Trainer is given no precision and the module chooses
bf16-mixed on rank 0's device and float32 on rank 1's (as on two machines, one with
bfloat16 hardware): every rank raises at setup, naming both; then a module that chooses
bf16-mixed on both trains in it.
MODE ``ckpt_last``: ``ckpt_path="last"`` where rank 1's view of the run folder (its
``default_root_dir``, a separate folder) holds no checkpoint: both ranks restore rank 0's.
Every rank writes ROOT/<MODE>_<rank>.json.
"""
import errno
import functools
import os
import signal
import sys
import time
from datetime import timedelta

import torch

import ember
from ember.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, ddp_trainer, loader, write_result  # noqa: E402

# two processes, a 60 s process-group timeout, one epoch, no checkpoint unless a case asks
trainer = functools.partial(ddp_trainer, devices=2, timeout=60, max_epochs=1, enable_checkpointing=False)


def save_enospc(root):
    t = trainer(root)
    t.fit(Regressor(), loader())
    if t.global_rank == 0:
        from ember.checkpoint import io as cio
        real_save = cio.save_torch

        def full_disk(obj, f, *a, **kw):   # what the kernel answers when the disk fills mid-write
            real_save(obj, f, *a, **kw)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        cio.save_torch = full_disk
    start = time.monotonic()
    try:
        t.save_checkpoint(os.path.join(root, "ckpt"))
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start, "rank": t.global_rank}


def ckpt_last(root):
    from ember.callbacks import ModelCheckpoint
    t = trainer(root, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)], max_steps=3,
                max_epochs=5)
    t.fit(Regressor(), loader())
    # rank 1 sees a run folder without any checkpoint (as a node whose view of a shared
    # filesystem lags); rank 0 sees the real one
    rank = t.global_rank
    mine = root if rank == 0 else os.path.join(root, "empty_view")
    os.makedirs(mine, exist_ok=True)
    t2 = trainer(mine, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)], max_steps=5,
                 max_epochs=5)
    try:
        t2.fit(Regressor(), loader(), ckpt_path="last")
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "resumed": getattr(t2, "ckpt_path", None), "global_step": t2.global_step, "rank": rank,
            "weights": [p.detach().flatten().tolist() for p in t2.module.parameters()]}


def precision_differs(root):
    class Chooses(Regressor):
        def __init__(self, per_rank):
            super().__init__()
            self.per_rank = per_rank

        def configure_precision(self, device):
            return self.per_rank[int(os.environ.get("LOCAL_RANK", "0"))]

    t = trainer(root, max_steps=2)
    start = time.monotonic()
    try:
        t.fit(Chooses(["bf16-mixed", None]), loader())
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    agreed = trainer(root, max_steps=2)
    agreed.fit(Chooses(["bf16-mixed", "bf16-mixed"]), loader())
    return {"error": err, "seconds": seconds, "rank": agreed.global_rank, "agreed": agreed.precision,
            "agreed_step": agreed.global_step}


def agree_timeout(root):
    from ember.callbacks import Callback

    class SleepBeforeLogPoint(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_rank == 1 and batch_idx == 1:   # global_step 2: a log point
                time.sleep(8)

    t = trainer(root, timeout=4, log_every_n_steps=2, callbacks=[SleepBeforeLogPoint()])
    start = time.monotonic()
    try:
        t.fit(Regressor(), loader())
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start, "rank": t.global_rank}


def collective_timeout(root):
    from ember.callbacks import Callback, ModelCheckpoint

    class SleepOnRank1(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_rank == 1 and batch_idx == 0:
                time.sleep(20)

    t = trainer(root, timeout=4, log_every_n_steps=50, enable_checkpointing=True,
                callbacks=[SleepOnRank1(), ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=1)])
    t.fit(Regressor(), loader())      # raises on rank 0: not caught


class FailsOnRank1WhileRank0Waits(Regressor):
    """Rank 0 blocks in a call that does not return to Python (a wait on the launcher's
    store, as a rank stuck in a collective whose peer is alive), rank 1 raises."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0 and batch_idx == 1:
            _store().wait(["failfast/never"], timedelta(seconds=90))

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            with open(os.path.join(ROOT, "failed_at"), "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError("boom on rank 1")
        return super().training_step(batch, batch_idx)


class KilledOnRank1WhileRank0Waits(FailsOnRank1WhileRank0Waits):
    """As above, but rank 1 is killed (SIGKILL: no Python error, no torchrun error file)."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            with open(os.path.join(ROOT, "failed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return Regressor.training_step(self, batch, batch_idx)


def peer_killed(root):
    t = trainer(root, timeout=20)
    t.fit(KilledOnRank1WhileRank0Waits(), loader())
    return {"error": None, "rank": t.global_rank}


def peer_fails(root):
    t = trainer(root, timeout=20)
    t.fit(FailsOnRank1WhileRank0Waits(), loader())
    return {"error": None, "rank": t.global_rank}


class RaisesInWindow(Regressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:      # the first micro-batch of the second window: under no_sync
            raise ValueError("raised under no_sync")
        return super().training_step(batch, batch_idx)


def no_sync_exception(root):
    t = trainer(root, accumulate_grad_batches=2)
    try:
        t.fit(RaisesInWindow(), loader())
        err = None
    except ValueError as e:
        err = str(e)
    out = {"error": err, "rank": t.global_rank, "trainer_sync": t.model.require_backward_grad_sync}
    acc = ember.Accelerator(strategy=DDPStrategy(timeout=60), gradient_accumulation_steps=2)
    net = Regressor()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = acc.prepare(net, opt)
    try:
        with acc.accumulate(model):      # the first micro-batch of a window: under no_sync
            assert not model.require_backward_grad_sync
            raise ValueError("raised in accumulate")
    except ValueError as e:
        out["acc_error"] = str(e)
    out["acc_sync"] = model.require_backward_grad_sync
    return out


def _store():
    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=60))


def ready(rank):
    """Under ``ember launch``: wait (up to 60 s) until both processes got here, so the short
    process-group timeout is not spent on one process importing slower than the other."""
    store = _store()
    store.add("failfast/ready", 1)
    deadline = time.monotonic() + 60
    while int(store.add("failfast/ready", 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    ROOT = root
    if "TORCHELASTIC_RUN_ID" in os.environ:
        ready(int(os.environ["RANK"]))
    out = {"save_enospc": save_enospc, "ckpt_last": ckpt_last, "agree_timeout": agree_timeout,
           "no_sync_exception": no_sync_exception, "collective_timeout": collective_timeout,
           "peer_fails": peer_fails, "peer_killed": peer_killed, "precision_differs": precision_differs}[mode](root)
    write_result(root, f"{mode}_{out['rank']}", out)
