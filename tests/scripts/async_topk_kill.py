"""kill -9 during a background checkpoint write with ModelCheckpoint(save_top_k=1,
save_last=True) and SingleDeviceStrategy(async_save=True), run by
tests/checkpoint/test_async_topk_kill.py.

    python async_topk_kill.py ROOT TIMING [TIMING ...]

One interpreter: the uninterrupted reference run (MAX_STEPS steps, a checkpoint every
step) runs in it, every other fit in a forked child (no import or warm-up per run); for each
TIMING a run SIGKILLed during the save of step KILL_STEP: ``gate`` kills it from inside
the writer thread while it serialises the trainer state (the new checkpoint half
written), a number of seconds kills it that long after the save started (the write, its
commit, the deletion of the superseded checkpoint, the move of ``last``: wherever it is
then). After each kill a fresh process resumes with ``ckpt_path="last"`` and trains to
MAX_STEPS. ROOT/result.json: per timing, the checkpoints left by the kill, the step
resumed from (or the error) and whether the final weights and optimizer state equal the
reference bit for bit.
"""
import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.checkpoint import io as cio
from ember.strategies.base import SingleDeviceStrategy

MAX_STEPS, KILL_STEP, WIDTH = 5, 3, 1024


class Wide(ember.TrainModule):
    """8 MB of weights and 8 MB of momentum: a write that takes a while."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch, batch_idx):
        return (self.lin(batch[0]) - batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class KillGate:
    """A trainer-state entry that SIGKILLs the process when the writer thread pickles it."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)


torch.serialization.add_safe_globals([KillGate])


class Killer(Callback):
    def __init__(self, timing):
        self.timing = timing

    def on_save_checkpoint(self, trainer, module, checkpoint):
        if trainer.global_step != KILL_STEP or self.timing is None:
            return
        if self.timing == "gate":
            checkpoint["gate"] = KillGate()
            return
        delay = float(self.timing)

        def kill():
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()


def fit(root, timing=None, ckpt_path=None):
    ember.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, WIDTH, generator=g)), batch_size=8, shuffle=True)
    module = Wide()
    trainer = ember.Trainer(max_steps=MAX_STEPS, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            strategy=SingleDeviceStrategy("cpu", async_save=True),
                            callbacks=[Killer(timing),
                                       ModelCheckpoint(every_n_train_steps=1, save_top_k=1, save_last=True)])
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, trainer


def _state(module, trainer) -> dict:
    opt = trainer.optimizers[0].state_dict()
    out = {f"p.{n}": p.detach().clone() for n, p in module.named_parameters()}
    out.update({f"m.{k}": v["momentum_buffer"].clone() for k, v in opt["state"].items()})
    return out


def in_child(fn, error_file=None) -> int:
    """Run ``fn`` in a forked child; its exit status (negative: killed by that signal). An
    exception's traceback goes to stderr and to ``error_file``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException:   # noqa: BLE001 - reported through the result file
            import traceback
            text = traceback.format_exc()
            print(f"child error: {text}", file=sys.stderr, flush=True)
            if error_file:
                with open(error_file, "w") as f:
                    f.write(text)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _steps(ckdir) -> list:
    """global_step of each complete checkpoint directory (symlinks not counted)."""
    out = []
    for p in cio.list_checkpoints(ckdir):
        if not os.path.islink(p):
            with open(os.path.join(p, cio.META_NAME)) as f:
                out.append(json.load(f)["global_step"])
    return sorted(out)


def main(root, timings):
    torch.set_num_threads(1)        # no thread pool across the forks
    ref_file = os.path.join(root, "reference.safetensors")
    module, trainer = fit(os.path.join(root, "reference"))
    cio.save_safetensors(_state(module, trainer), ref_file)
    del module, trainer
    out = {}
    for timing in timings:
        run = os.path.join(root, f"kill_{timing}")
        status = in_child(lambda: fit(run, timing))
        ckdir = os.path.join(run, "checkpoints")
        left = sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else []
        complete = _steps(ckdir)
        res_file = os.path.join(root, f"resumed_{timing}.json")

        def resume():
            module, trainer = fit(run, None, ckpt_path="last")
            ref = cio.load_safetensors(ref_file)
            got = _state(module, trainer)
            with open(res_file, "w") as f:
                json.dump({"global_step": trainer.global_step,
                           "equal": sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref)},
                          f)
        err_file = os.path.join(root, f"resume_error_{timing}.txt")
        code = in_child(resume, err_file)
        resumed = json.load(open(res_file)) if os.path.exists(res_file) else None
        out[timing] = {"status": status, "left": left, "complete": complete, "resume_code": code,
                       "resumed": resumed,
                       "resume_error": open(err_file).read()[-3000:] if os.path.exists(err_file) else None}
    with open(os.path.join(root, "result.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
