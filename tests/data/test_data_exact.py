"""Exact data handling across ranks: gather_for_metrics per batch and per epoch,
IterableDataset sharding, DataLoader worker seeds. Single-process checks here;
the two-process (gloo) runs are in test_data_multiproc.py."""
import pytest
import torch
from torch.utils.data import DataLoader

import ember.distributed.collectives as ed
from ember import data as edata

COMBOS = [(1001, 10, 2), (7, 3, 2), (5, 4, 2), (8, 4, 2), (3, 5, 2), (1, 4, 2), (10, 3, 3), (11, 2, 4),
          (100, 7, 3), (13, 1, 4)]


def _rank_loaders(size, batch, world):
    return [edata.prepare_dataloader(DataLoader(list(range(size)), batch_size=batch), seed=0, num_replicas=world,
                                     rank=r, shuffle=False) for r in range(world)]


def _gather(per_rank, pad):
    """What gather_for_metrics returns for one call: ranks' rows interleaved, padding dropped."""
    sizes = [len(x) for x in per_rank]
    padded = torch.full((len(per_rank), max(sizes)), -1)
    for r, x in enumerate(per_rank):
        padded[r, :len(x)] = x
    out = ed._interleave(padded, sizes)
    return out[:len(out) - pad]


@pytest.mark.parametrize("size, batch, world", COMBOS)
def test_per_batch_and_epoch_end_gather_give_exactly_the_dataset(size, batch, world):
    """Per batch, only the last batch of a pass carries the sampler's duplicates; the
    epoch-end form drops them from the end of the concatenation."""
    loaders = _rank_loaders(size, batch, world)
    per_rank = [list(dl) for dl in loaders]
    n = len(loaders[0])
    assert all(len(b) == n for b in per_rank)
    got = []
    for k in range(n):
        pads = {edata.batch_padding(dl, k) for dl in loaders}
        assert len(pads) == 1                 # every rank drops the same number
        got.append(_gather([b[k] for b in per_rank], pads.pop()))
    assert torch.cat(got).tolist() == list(range(size))
    pads = {edata.batch_padding(dl, None) for dl in loaders}
    cat = [torch.cat(b) for b in per_rank]
    assert _gather(cat, pads.pop()).tolist() == list(range(size))
    assert {edata.samples_per_rank(dl) for dl in loaders} == {len(cat[0])}


@pytest.mark.parametrize("size, batch, world", [(1001, 10, 2), (7, 2, 2), (11, 2, 4)])
def test_a_partial_pass_drops_nothing(size, batch, world):
    loaders = _rank_loaders(size, batch, world)
    n = len(loaders[0]) - 1                   # limit_val_batches: one batch short
    for dl in loaders:
        assert edata.batch_padding(dl, None, n) == 0
        assert all(edata.batch_padding(dl, k, n) == 0 for k in range(n))


def test_deepspeed_version_check_names_the_minimum():
    """DeepSpeed before 0.19.4 ignores managed_gradient_accumulation (steps every acc_n**2
    micro-batches), 0.19.4 refuses it with offload: setup refuses them, naming 0.19.5."""
    from importlib import metadata

    from ember.errors import MisconfigurationError
    from ember.strategies.deepspeed import MIN_VERSION, check_version
    assert MIN_VERSION == (0, 19, 5)
    for old in ("0.14.0", "0.18.9", "0.19.4", "0.19.4+cu121"):
        with pytest.raises(MisconfigurationError, match=r"deepspeed>=0\.19\.5 \(found .*managed_gradient_accumulation"):
            check_version(old)
    for ok in ("0.19.5", "0.19.8", "0.20.0rc1", "1.0"):
        check_version(ok)
    try:
        installed = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return
    check_version(installed)   # the version the project installs passes


class Stream(torch.utils.data.IterableDataset):
    """n regression samples as a stream (no __len__): the same items on every rank."""

    def __init__(self, n, dim=4):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x.sum(1, keepdim=True) * 0.3 + 0.1

    def __iter__(self):
        return iter(zip(self.x, self.y))


def _by_hand(stream, batch, acc, epochs, lr=0.1):
    """Plain PyTorch: accumulation over windows of `acc` batches, the last (short) window
    divided by its true size, as over a sized loader."""
    from conftest import LinearModule
    torch.manual_seed(0)
    m = LinearModule()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    batches = list(DataLoader(stream, batch_size=batch))
    for _ in range(epochs):
        for start in range(0, len(batches), acc):
            window = batches[start:start + acc]
            for b in window:
                (m.loss(b) / len(window)).backward()
            opt.step()
            opt.zero_grad()
    return m.state_dict()


def test_iterable_dataset_with_accumulation_equals_the_plain_loop(make_trainer):
    """An IterableDataset has no length: the loop divided every loss by inf // acc_n (NaN)
    after the finite-loss check, and the weights became NaN silently. Now the last,
    shorter window is found by looking acc_n - 1 batches ahead: equal to the plain loop."""
    from conftest import LinearModule
    stream = Stream(26)                       # batches of 4: 6 full + one of 2; windows of 3: 3 + 3 + 1
    torch.manual_seed(0)
    module = LinearModule()
    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=3)
    trainer.fit(module, DataLoader(stream, batch_size=4))
    assert trainer.global_step == 2 * 3
    ref = _by_hand(stream, 4, 3, 2)
    for k, v in module.state_dict().items():
        assert torch.isfinite(v).all(), k
        torch.testing.assert_close(v, ref[k], rtol=0, atol=1e-7)
    with pytest.raises(Exception, match="infinite"):
        trainer.estimated_stepping_batches   # unknown length and no max_steps: an error, not a guess


@pytest.mark.parametrize("n", [12, 13])
def test_iterable_dataset_is_sharded_over_workers_and_ranks(n):
    """Each worker of each rank reads its own items: none twice, the incomplete last round
    left out for training (even=True), kept for evaluation (even=False)."""
    seen = {}
    for even in (True, False):
        items = []
        for rank in range(2):
            dl = edata.prepare_dataloader(DataLoader(Stream(n), batch_size=2, num_workers=2), seed=0,
                                          num_replicas=2, rank=rank, even=even)
            assert isinstance(dl.dataset, edata.ShardedIterable)
            rank_items = [int(round(float(y) * 1e4)) for _, ys in dl for y in ys.view(-1)]
            assert len(rank_items) == len(set(rank_items))
            items.append(rank_items)
        seen[even] = items
    ref = [int(round(float(y) * 1e4)) for y in Stream(n).y.view(-1)]
    full_rounds = (n // 4) * 4
    assert sorted(sum(seen[True], [])) == sorted(ref[:full_rounds])
    assert len(seen[True][0]) == len(seen[True][1]) == full_rounds // 2      # ranks end together
    assert sorted(sum(seen[False], [])) == sorted(ref)
    one = edata.prepare_dataloader(DataLoader(Stream(n), batch_size=2, num_workers=2), seed=0)
    assert sorted(int(round(float(y) * 1e4)) for _, ys in one for y in ys.view(-1)) == sorted(ref[:(n // 2) * 2])


class Noisy(torch.utils.data.Dataset):
    """Each sample draws from torch, numpy and python random (as augmentation would)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        import random

        import numpy as np
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random()])


def _draws(loader):
    return [b[:, 1:].tolist() for b in loader]


def test_worker_draws_repeat_exactly_after_a_mid_epoch_resume(tmp_path):
    """seed_everything(workers=True): a run resumed mid-epoch (Accelerator save_state /
    load_state, new objects) draws in its workers exactly what the uninterrupted run drew,
    although another worker now loads each batch."""
    from ember import Accelerator, seed_everything
    seed_everything(3, workers=True)

    def run(stop=None, resume=False):
        acc = Accelerator(seed=3)
        loader = acc.prepare(DataLoader(Noisy(), batch_size=2, shuffle=True, num_workers=2))
        if resume:
            acc.load_state(str(tmp_path / "ckpt"))
        out = []
        for _ in range(1 if resume else 2):   # epochs (the resumed run finishes epoch 1)
            for b in loader:
                out.append(b[:, 1:].tolist())
                if stop is not None and len(out) == stop:
                    acc.save_state(str(tmp_path / "ckpt"))
                    return out
        return out

    full = run()
    assert len({tuple(map(tuple, b)) for b in full}) == len(full)      # no batch repeats another
    head = run(stop=15)                                                  # epoch 1, batch 3 (12 per epoch)
    tail = run(resume=True)
    assert head == full[:15] and tail == full[15:]


def test_worker_seeds_differ_per_rank_and_follow_the_run_seed():
    """The loader generator (the base of the worker seeds) was seeded with seed + epoch on
    every rank: the same worker seeds everywhere. Now (seed, epoch, rank) give it."""
    def seeds(seed, rank, epoch):
        dl = edata.prepare_dataloader(DataLoader(Noisy(), batch_size=2, num_workers=2), seed=seed,
                                      num_replicas=2, rank=rank)
        edata.set_epoch(dl, epoch)
        return dl.generator.initial_seed()
    assert seeds(1, 0, 0) != seeds(1, 1, 0)
    assert seeds(1, 0, 0) != seeds(1, 0, 1) != seeds(2, 0, 1)
    assert seeds(1, 1, 4) == seeds(1, 1, 4)




def test_trainer_resume_mid_epoch_repeats_worker_draws(tmp_path, make_trainer):
    """Trainer with 2 DataLoader workers and a random data seed (no Trainer(seed=)): a run
    stopped at step 5 of 12 (epoch 0 of 2, 6 batches each) and resumed from its checkpoint,
    after the global RNG was changed, sees exactly the worker draws of the uninterrupted run."""
    from ember import TrainModule, seed_everything
    from ember.callbacks import ModelCheckpoint
    seed_everything(11, workers=True)

    class Recorder(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 1)
            self.draws = []

        def training_step(self, batch, batch_idx):
            self.draws.append(batch[:, 1:].tolist())
            return self.net(batch[:, 1:]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(root, ckpt_path=None, **kw):
        module = Recorder()
        trainer = make_trainer(default_root_dir=root, max_epochs=2, enable_checkpointing=True,
                               callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1,
                                                          save_last=True)], **kw)
        trainer.fit(module, DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2), ckpt_path=ckpt_path)
        return module.draws

    torch.manual_seed(0)
    full = fit(tmp_path / "full")
    assert len(full) == 12
    torch.manual_seed(0)
    head = fit(tmp_path / "part", max_steps=5)
    torch.manual_seed(99)          # another random data seed would be drawn: the checkpoint's must win
    tail = fit(tmp_path / "part", ckpt_path="last")
    assert head == full[:5] and tail == full[5:]


@pytest.mark.parametrize("kind", ["user_generator", "no_batching", "sharded"])
def test_skip_survives_the_worker_iterator_calling_iter_twice(kind):
    """A DataLoader with workers calls iter() on its (batch) sampler twice and drops the first:
    the skip of a resumed pass was taken by the dropped one, and the pass started at batch 0
    (a user's sampler with its own generator, no automatic batching, a user's sampler
    sharded over ranks). It is now taken by the iteration that runs."""
    from torch.utils.data import RandomSampler, TensorDataset
    ds = TensorDataset(torch.arange(24))

    def loader():
        g = torch.Generator().manual_seed(4)
        reps = 2 if kind == "sharded" else 1
        if kind == "no_batching":
            dl = DataLoader(ds, batch_size=None, shuffle=True, num_workers=2)
        else:   # sharded: without automatic batching, the sharding sampler is the DataLoader's
            dl = DataLoader(ds, batch_size=2 if kind == "user_generator" else None,
                            sampler=RandomSampler(ds, generator=g), num_workers=2)
        return edata.prepare_dataloader(dl, seed=0, num_replicas=reps, rank=reps - 1)

    def ids(dl):
        return [b[0].reshape(-1).tolist() for b in dl]
    dl = loader()
    edata.set_epoch(dl, 0)
    full = ids(dl)
    dl = loader()
    edata.set_epoch(dl, 0)
    assert edata.skip_batches(dl, 3)
    assert ids(dl) == full[3:]
