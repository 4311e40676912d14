"""One Ctrl-C during a fit with the TensorBoard logger (tests/trainer/test_interrupt.py).

The SIGINT arrives at the moment that lost it under load: the main thread, logging a step's
scalars, is inside TensorBoard's event-queue ``put`` -> ``threading.Condition.notify``,
after ``waiter.release()`` woke the writer thread and before the waiter was removed. A
KeyboardInterrupt raised there (Python's default handler) leaves a stale waiter in the
condition: the next ``notify()`` (``SummaryWriter.close()`` in the Trainer's exception path)
wakes it instead of the writer thread, which sleeps until its ``flush_secs`` (120 s), and
``close()`` waits for it. ember's handler only records the press; the loop raises at the
next batch boundary. A line-trace function on the main thread sends the SIGINT at exactly
that line, after the 4th optimizer step.

usage: ctrl_c_tensorboard.py OUT_DIR
"""

import faulthandler, inspect, os, signal, sys, threading
faulthandler.register(signal.SIGUSR2, all_threads=True)   # the parent asks for the stacks on a timeout
# a test runner started with '&' from a non-interactive shell has SIGINT ignored, and an ignored
# signal stays ignored across fork/exec: give this process Python's default Ctrl-C handling
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import ember  # noqa: F401  (PYTHONPATH decides which ember)
from ember import Trainer, TrainModule
from ember.callbacks import Callback, ModelCheckpoint

out = sys.argv[1]
src, first = inspect.getsourcelines(threading.Condition.notify)
AFTER_RELEASE = first + next(i for i, l in enumerate(src) if l.strip() == "n -= 1")

def sigint_after_release(cond):
    """From now on, in this thread: at the first notify() on ``cond`` that has woken a waiter
    (waiter.release() done, the waiter not yet removed), send this process one SIGINT."""
    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == AFTER_RELEASE and frame.f_locals.get("self") is cond:
            sys.settrace(None)
            print("SIGINT", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return local
    sys.settrace(lambda frame, event, arg: local if frame.f_code is threading.Condition.notify.__code__ else None)

class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

class Arm(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 4:
            writer = trainer.logger.experiment.file_writer.event_writer._async_writer
            sigint_after_release(writer._byte_queue.not_empty)

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g))
trainer = Trainer(max_epochs=10_000, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                  devices="cpu", default_root_dir=out,   # logger=True: TensorBoardLogger (flush_secs=120)
                  callbacks=[Arm(), ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=2,
                                                    save_top_k=-1)])
trainer.fit(Net(), DataLoader(data, batch_size=8))
print("fit returned", flush=True)
