"""Decisions that read per-rank inputs, and writes rank 0 alone makes, agreed across 2 CPU
processes (gloo, ember's own launcher or ``ember launch``), run by tests/distributed/test_agree_paths.py.

    python agree_paths_ddp.py MODE ROOT

MODE ``es_strict`` / ``es_lenient``: the metric EarlyStopping monitors is logged on rank 0
only (``self.log`` without sync_dist, under ``if self.global_rank == 0``): with strict=True
every rank raises the same error naming rank 1, with strict=False every rank skips the
check; neither waits for the process-group timeout (20 s).
MODE ``topk_view``: ModelCheckpoint(save_top_k=1, mode="max") resumed where rank 1's
checkpoint folder holds none of the earlier checkpoints (a node-local folder): rank 1
restores an empty top-k, rank 0 the real one; the save / keep decisions must still be rank
0's on both ranks (a rank saving alone would wait in the save's collective).
MODE ``weights_enospc``: ModelCheckpoint(save_weights_only=True) whose write fails on rank 0
(ENOSPC after the bytes): every rank raises within seconds, naming the disk error.
MODE ``lock_enospc``: ModelCheckpoint's setup on rank 0 fails writing the folder's lock file
(ENOSPC, an OSError, not a CheckpointError): every rank raises within seconds, naming it.
MODE ``save_model_enospc`` (under ``ember launch``): Accelerator.save_model whose write fails
on the main process: the same.
MODE ``find_bs_sym`` / ``find_bs_asym`` (under ``ember launch``): ember.utils.find_executable_batch_size
from 32 over a DDP model whose step runs out of memory (torch.OutOfMemoryError raised, as CUDA
does) above batch size 8: on both ranks (both retry together and settle on 8), or on rank 1
only (rank 1 must not retry alone: it raises, naming itself, and the run ends).
MODE ``elastic_view``: a group restarted by the elastic agent (``EMBER_ELASTIC_RESUME=1``,
``TORCHELASTIC_RESTART_COUNT=1``, set by the script after a first fit) where rank 1's run
folder (a separate ``default_root_dir``) shows no checkpoint: both ranks resume rank 0's.
MODE ``acc_auto_dir`` (under ``ember launch``): automatic checkpoint naming; the main process
alone saves ``checkpoint_0`` (``if is_main_process: save_state()``, after 2 s of other work),
then every process builds a second Accelerator on the same project folder (rank 1 first,
before that save is in place) and calls save_state(): both must write the same folder.
MODE ``nan_rank1``: rank 1's training loss is NaN at its fourth batch (a log point, with
log_every_n_steps=2): every rank raises NonFiniteLossError at that step, within seconds.
MODE ``lr_find_oom``: ember.tuner.lr_find where rank 1 runs out of memory at its sixth step
(rank 0 does not): lr_find does not catch it, so rank 1's error ends the run (the launcher
stops rank 0, blocked in the gradient all-reduce); no rank writes a result.
MODE ``uneven_batches``: use_distributed_sampler=False and a train loader of 8 batches on rank
0, 6 on rank 1 (val_check_interval=0.5, 2 epochs): every rank runs 6 batches per epoch and
validates at the same batches; the same weights on both ranks.
MODE ``export_refused``: ExportBestPretrained whose dirpath rank 0 refuses at setup (a file;
rank 1 is given a folder): every rank raises within seconds, before training (rank 1 did
not reach the training's first all-reduce alone).
MODE ``uneven_stream``: a Hugging Face stream whose shards give rank 0 4 batches an epoch
and rank 1 3: every rank trains 3 (its shards' lengths are known), with one warning.
MODE ``prepare_data_fails``: the module's prepare_data (run by local rank 0 only) raises:
every rank raises within seconds, rank 0 its own error, rank 1 one naming rank 0 (no rank
waits in a barrier for it).
Every rank writes ROOT/<MODE>_<rank>.json. ``python agree_paths_ddp.py many ROOT m1,m2,...`` runs
several modes that end normally in the same two processes, each in ROOT/<mode>/.
"""
import errno
import functools
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torch.nn import functional as F

import ember
from ember.callbacks import EarlyStopping, ModelCheckpoint
from ember.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, ddp_trainer, loader, sum_data, write_result  # noqa: E402


class Net(Regressor):
    def __init__(self, val_on_rank0_only=False):
        super().__init__()
        self.val_on_rank0_only = val_on_rank0_only

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.val_on_rank0_only:
            if self.global_rank == 0:
                self.log("val_loss", loss)
        else:
            self.log("val_loss", loss, sync_dist=True)


# two processes, a 20 s process-group timeout, two epochs, no checkpoint unless a case asks
trainer = functools.partial(ddp_trainer, devices=2, timeout=20, max_epochs=2, enable_checkpointing=False)


def _fit(t, module, *loaders, **kw):
    start = time.monotonic()
    try:
        t.fit(module, *loaders, **kw)
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return err, time.monotonic() - start


def early_stopping(root, strict):
    es = EarlyStopping(monitor="val_loss", patience=100, strict=strict)
    t = trainer(root, callbacks=[es])
    err, seconds = _fit(t, Net(val_on_rank0_only=True), loader(), loader(8))
    return {"error": err, "seconds": seconds, "rank": t.global_rank, "stop_reason": t.stop_reason,
            "epoch": t.current_epoch, "wait_count": es.wait_count}


def topk_view(root):
    # 1. one epoch, one checkpoint, in the shared folder
    ck = ModelCheckpoint(dirpath=os.path.join(root, "ck"), monitor="val_loss", mode="max", save_top_k=1)
    t = trainer(root, enable_checkpointing=True, callbacks=[ck], max_epochs=1)
    err, _ = _fit(t, Net(), loader(), loader(8))
    assert err is None, err
    first = ck.best_model_path
    # 2. resumed: rank 1's folder (node-local) holds no checkpoint, so it restores an empty
    # top-k; the validation loss falls, so in mode "max" no later epoch beats the first
    rank = t.global_rank
    mine = os.path.join(root, "ck" if rank == 0 else "rank1_view")
    ck2 = ModelCheckpoint(dirpath=mine, monitor="val_loss", mode="max", save_top_k=1)
    t2 = trainer(root, enable_checkpointing=True, callbacks=[ck2], max_epochs=3)
    err, seconds = _fit(t2, Net(), loader(), loader(8), ckpt_path=first)
    return {"error": err, "seconds": seconds, "rank": rank, "first": first, "epoch": t2.current_epoch,
            "topk": sorted(ck2.best_k_models), "best": ck2.best_model_path,
            "files": sorted(os.listdir(os.path.join(root, "ck"))),
            "rank1_files": sorted(os.listdir(os.path.join(root, "rank1_view")))
            if os.path.isdir(os.path.join(root, "rank1_view")) else []}


def _full_disk(real):
    def write(*a, **kw):   # what the kernel answers when the disk fills mid-write
        real(*a, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def weights_enospc(root):
    from ember.checkpoint import io as cio
    ck = ModelCheckpoint(dirpath=os.path.join(root, "ck"), save_weights_only=True)
    t = trainer(root, enable_checkpointing=True, callbacks=[ck], max_epochs=1)
    if int(os.environ.get("RANK", "0")) == 0:
        cio.save_weights_file = _full_disk(cio.save_weights_file)
    err, seconds = _fit(t, Net(), loader())
    return {"error": err, "seconds": seconds, "rank": t.global_rank}


def lock_enospc(root):
    from ember.checkpoint import lock
    ck = ModelCheckpoint(dirpath=os.path.join(root, "ck"))
    t = trainer(root, enable_checkpointing=True, callbacks=[ck], max_epochs=1)
    if int(os.environ.get("RANK", "0")) == 0:
        lock.DirLock._write = _full_disk(lock.DirLock._write)
    err, seconds = _fit(t, Net(), loader())
    return {"error": err, "seconds": seconds, "rank": t.global_rank}


def save_model_enospc(root):
    from ember.checkpoint import io as cio
    acc = ember.Accelerator(strategy=DDPStrategy(timeout=20))
    model = acc.prepare(Net())
    if acc.is_main_process:
        cio.save_model_sharded = _full_disk(cio.save_model_sharded)
    start = time.monotonic()
    try:
        acc.save_model(model, os.path.join(root, "export"))
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start, "rank": acc.process_index}


def find_bs(root, asym):
    from ember.utils import find_executable_batch_size
    acc = ember.Accelerator(strategy=DDPStrategy(timeout=10 if asym else 20))   # asym waits out the timeout
    rank = acc.process_index
    tried = []

    @find_executable_batch_size(starting_batch_size=32)
    def train(batch_size):
        tried.append(batch_size)
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
        x = torch.randn(64, 4)
        for i in range(0, 64, batch_size):
            if batch_size > 8 and (rank == 1 or not asym):
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} MiB (rank {rank})")
            loss = model(x[i:i + batch_size]).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        return batch_size

    start = time.monotonic()
    got = train()
    return {"rank": rank, "batch_size": got, "tried": tried, "seconds": time.monotonic() - start}


def elastic_view(root):
    t = trainer(root, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)], max_steps=3,
                max_epochs=5)
    err, _ = _fit(t, Net(), loader())
    assert err is None, err
    rank = t.global_rank
    mine = root if rank == 0 else os.path.join(root, "empty_view")
    os.makedirs(mine, exist_ok=True)
    os.environ.update(EMBER_ELASTIC_RESUME="1", TORCHELASTIC_RESTART_COUNT="1")   # the restarted group
    t2 = trainer(mine, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)], max_steps=5,
                 max_epochs=5)
    err, seconds = _fit(t2, Net(), loader())
    return {"error": err, "seconds": seconds, "rank": rank, "resumed": t2.ckpt_path, "global_step": t2.global_step,
            "weights": [p.detach().flatten().tolist() for p in t2.module.parameters()]}


def acc_auto_dir(root):
    from ember.utils import ProjectConfiguration

    def make():
        acc = ember.Accelerator(strategy=DDPStrategy(timeout=20), project_dir=os.path.join(root, "proj"),
                                project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
        net = nn.Linear(4, 1)
        acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
        return acc

    acc = make()
    if acc.is_main_process:
        time.sleep(2)
        first = acc.save_state()
    acc2 = make()
    start = time.monotonic()
    second = acc2.save_state()
    acc2.wait_for_everyone()
    out = {"rank": acc.process_index, "second": os.path.basename(second), "seconds": time.monotonic() - start,
           "files": sorted(os.listdir(second))}
    if acc.is_main_process:
        out["first"] = os.path.basename(first)
    return out


class NaNOnRank1(Net):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_rank == 1 and batch_idx == 3 else loss


def nan_rank1(root):
    t = trainer(root, log_every_n_steps=2, max_epochs=1)
    err, seconds = _fit(t, NaNOnRank1(), loader())
    return {"error": err, "seconds": seconds, "rank": t.global_rank, "global_step": t.global_step}


class OOMOnRank1(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 5:
            with open(os.path.join(ROOT, "failed_at"), "w") as f:
                f.write(repr(time.time()))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 1)")
        return super().training_step(batch, batch_idx)


class PrepareFails(Net):
    def prepare_data(self):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/cache")


def prepare_data_fails(root):
    t = trainer(root, max_epochs=1)
    err, seconds = _fit(t, PrepareFails(), loader())
    return {"error": err, "seconds": seconds, "rank": t.global_rank}


def lr_find_oom(root):
    import ember.tuner
    t = trainer(root, max_epochs=1)
    result = ember.tuner.lr_find(t, OOMOnRank1(), loader(64), num_training=20)
    return {"rank": t.global_rank, "lrs": len(result.lrs)}


def uneven_batches(root):
    import warnings
    rank = int(os.environ.get("RANK", "0"))

    class Count(Net):
        vals = 0

        def validation_step(self, batch, batch_idx):
            self.vals += 1
            return super().validation_step(batch, batch_idx)

    t = trainer(root, use_distributed_sampler=False, val_check_interval=0.5, log_every_n_steps=2)
    module = Count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        err, seconds = _fit(t, module, loader(32 if rank == 0 else 24), loader(8))
    return {"error": err, "seconds": seconds, "rank": t.global_rank, "global_step": t.global_step,
            "batches": t.num_training_batches, "val_batches": module.vals,
            "warnings": [str(w.message) for w in caught if "different number of batches" in str(w.message)],
            "weights": [p.detach().flatten().tolist() for p in module.parameters()]}


def uneven_stream(root):
    """A Hugging Face stream of 31 samples in 2 shards (16 and 15), batches of 5: rank 0
    reads 4 batches an epoch, rank 1 3."""
    import warnings
    from datasets import Dataset
    from torch.utils.data import DataLoader
    data = sum_data(31)
    ds = Dataset.from_dict({"x": data.tensors[0].tolist(), "y": data.tensors[1].tolist()})
    stream = ds.with_format("torch").to_iterable_dataset(num_shards=2)

    class Dicts(Regressor):
        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch["x"]), batch["y"])

    t = trainer(root, log_every_n_steps=2)
    module = Dicts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        err, seconds = _fit(t, module, DataLoader(stream, batch_size=5))
    return {"error": err, "seconds": seconds, "rank": t.global_rank, "global_step": t.global_step,
            "batches": t.num_training_batches,
            "warnings": [str(w.message) for w in caught if "different number of batches" in str(w.message)],
            "weights": [p.detach().flatten().tolist() for p in module.parameters()]}


def export_refused(root):
    import hf_tiny
    from ember.integrations.transformers import ExportBestPretrained, TextClassificationData, TransformersModule
    rank = int(os.environ.get("RANK", "0"))
    target = os.path.join(root, "export" if rank else "a_file")
    if rank == 0:
        open(target, "w").close()
    tok = hf_tiny.make_tokenizer()
    data = TextClassificationData(tok, train=hf_tiny.sentiment_rows(64), batch_size=8)
    t = trainer(root, max_epochs=1, callbacks=[ExportBestPretrained(target)])
    err, seconds = _fit(t, TransformersModule(hf_tiny.tiny_bert()), datamodule=data)
    return {"error": err, "seconds": seconds, "rank": t.global_rank, "step": t.global_step}


def ready():
    """Under ``ember launch``: wait (up to 60 s) until both processes got here, so the short
    process-group timeout is not spent on one process importing slower than the other."""
    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    store.add("agree_paths/ready", 1)
    deadline = time.monotonic() + 60
    while int(store.add("agree_paths/ready", 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)


MODES = {"es_strict": lambda r: early_stopping(r, True), "es_lenient": lambda r: early_stopping(r, False),
         "topk_view": topk_view, "weights_enospc": weights_enospc,
         "lock_enospc": lock_enospc,
         "save_model_enospc": save_model_enospc, "find_bs_sym": lambda r: find_bs(r, False),
         "find_bs_asym": lambda r: find_bs(r, True), "elastic_view": elastic_view,
         "acc_auto_dir": acc_auto_dir, "nan_rank1": nan_rank1,
         "lr_find_oom": lr_find_oom, "uneven_batches": uneven_batches,
         "prepare_data_fails": prepare_data_fails, "export_refused": export_refused,
         "uneven_stream": uneven_stream}


def run_mode(mode, root):
    from ember.checkpoint import io as cio
    from ember.checkpoint import lock
    patched = {name: getattr(cio, name) for name in ("save_weights_file", "save_model_sharded")}
    lock_write = lock.DirLock._write
    try:
        out = MODES[mode](root)
    finally:   # a mode's injected disk error stays in that mode
        for name, fn in patched.items():
            setattr(cio, name, fn)
        lock.DirLock._write = lock_write
    write_result(root, f"{mode}_{out['rank']}", out)


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    ROOT = root
    if "TORCHELASTIC_RUN_ID" in os.environ:
        ready()
    # ``many ROOT m1,m2,...``: several modes that end normally, one after the other in the same
    # two processes (one process start for all of them), each in ROOT/<mode>/
    for m in (sys.argv[3].split(",") if mode == "many" else [mode]):
        d = os.path.join(root, m) if mode == "many" else root
        os.makedirs(d, exist_ok=True)
        ROOT = d
        run_mode(m, d)
