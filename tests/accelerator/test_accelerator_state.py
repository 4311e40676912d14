"""Accelerator state on disk, one process: save_state/load_state (bit-identical
resume in a new process, layout, errors), resumable dataloaders, save_model
sharding, trackers writing real TensorBoard/CSV files, the GAN example."""
from __future__ import annotations

import csv
import glob
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ember import Accelerator
from ember.checkpoint import io as cio
from ember.errors import CheckpointError, MisconfigurationError
from ember.loggers import CSVLogger, TensorBoardLogger

from helpers import (ROOT, SCRIPTS, compare_finals, run_python, wandb_config, wandb_history, wandb_offline,
                     wandb_records)


@pytest.mark.parametrize("precision", ["16-mixed"])
def test_save_load_state_resumes_bit_identically_in_a_new_process(tmp_path, precision):
    run_python(SCRIPTS / "acc_resume.py", tmp_path, "full", "--precision", precision)
    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["meta.json", "model.safetensors", "model_1.safetensors", "trainer_state.pt"]
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)   # the safe format
    assert state["dataloaders"][0]["epoch"] == 1 and state["dataloaders"][0]["batches_done"] == 4
    assert "scaler" in state["precision"] and len(state["optimizers"]) == 2 and len(state["rng"]) == 1
    assert state["custom_objects"][0]["batches"] == 13 + 4
    weights, _, meta = cio.read_checkpoint(ckpt)
    assert meta["kind"] == "accelerator" and meta["precision"] == precision and "0.weight" in weights
    run_python(SCRIPTS / "acc_resume.py", tmp_path, "resume", "--precision", precision)
    final = compare_finals(tmp_path)
    assert final["skipped"] > 0          # the GradScaler skipped steps and its state was resumed
    assert final["sched_epoch"] == 2 * 7 - final["skipped"]


class CountingDataset(Dataset):
    def __init__(self, n):
        self.n, self.reads = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads.append(i)
        return torch.tensor(i)


def test_load_state_resumes_mid_epoch_by_skipping_indices(tmp_path):
    acc = Accelerator(seed=3)
    loader = acc.prepare(DataLoader(CountingDataset(20), batch_size=4, shuffle=True))
    seen = []
    for b in loader:
        seen.append(b.tolist())
        if loader.batches_done == 2:
            acc.save_state(tmp_path / "mid")
            break
    loader.set_epoch(0)                   # (a new pass after a left one is the next epoch, unless set)
    full = [b.tolist() for b in loader]   # an uninterrupted epoch 0, for reference
    acc2 = Accelerator(seed=99)           # a different seed: the sampler's seed comes from the checkpoint
    ds = CountingDataset(20)
    loader2 = acc2.prepare(DataLoader(ds, batch_size=4, shuffle=True))
    acc2.load_state(tmp_path / "mid")
    rest = [b.tolist() for b in loader2]
    assert seen == full[:2] and rest == full[2:]
    assert sorted(ds.reads) == sorted(i for b in full[2:] for i in b)   # skipped samples were never read
    assert loader2.epoch == 1 and [b.tolist() for b in loader2] != full   # then epoch 1, reshuffled


def test_state_saved_on_the_last_batch_resumes_at_the_next_epoch(tmp_path):
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=2))
    for _ in loader:
        if loader.end_of_dataloader:
            acc.save_state(tmp_path / "end")
    acc2 = Accelerator()
    loader2 = acc2.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=2))
    acc2.load_state(tmp_path / "end")
    assert loader2.epoch == 1 and len([b for b in loader2]) == 3


def test_skip_first_batches():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    assert acc.skip_first_batches(loader, 3) is loader
    assert [b.tolist() for (b,) in loader] == [[6, 7], [8, 9]]
    assert len([b for b in loader]) == 5                       # only the next pass skips
    raw = acc.skip_first_batches(DataLoader(TensorDataset(torch.arange(10)), batch_size=2), 4)
    assert len(raw) == 1 and [b.tolist() for (b,) in raw] == [[8, 9]]


def test_automatic_checkpoint_names_and_load_latest(tmp_path):
    acc = Accelerator(project_dir=tmp_path)
    net = nn.Linear(2, 1)
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    first = acc.save_state()
    with torch.no_grad():
        net.weight.fill_(2.0)
    second = acc.save_state()
    assert [os.path.basename(p) for p in (first, second)] == ["checkpoint_0", "checkpoint_1"]
    with torch.no_grad():
        net.weight.fill_(0.0)
    acc.load_state()
    assert torch.all(net.weight == 2.0)
    assert not glob.glob(str(tmp_path / "checkpoints" / "*.ember-tmp"))


def test_load_state_errors(tmp_path):
    acc = Accelerator()
    a = nn.Linear(2, 1)
    a, opt = acc.prepare(a, torch.optim.SGD(a.parameters(), lr=0.1))
    acc.save_state(tmp_path / "one")
    with pytest.raises(CheckpointError, match="not found"):
        acc.load_state(tmp_path / "missing")
    two = Accelerator()
    two.prepare(nn.Linear(2, 1), nn.Linear(2, 1))
    with pytest.raises(CheckpointError, match="holds 1 models, but 2 are prepared"):
        two.load_state(tmp_path / "one")
    wrong = Accelerator()
    w = nn.Linear(3, 1)
    wrong.prepare(w, torch.optim.SGD(w.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        wrong.load_state(tmp_path / "one")

    class Unsafe:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, s):
            pass

    acc.register_for_checkpointing(Unsafe())
    with pytest.raises(CheckpointError, match="fn"):
        acc.save_state(tmp_path / "unsafe")
    assert not os.path.exists(tmp_path / "unsafe") and not os.path.exists(tmp_path / "unsafe.ember-tmp")


def test_save_model_shards_with_index(tmp_path):
    acc = Accelerator()
    model = acc.prepare(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)))
    files = acc.save_model(model, tmp_path / "sharded", max_shard_size=4300)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 3 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    loaded = cio.load_model_sharded(tmp_path / "sharded")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert acc.save_model(model, tmp_path / "single") == ["model.safetensors"]
    with pytest.raises(MisconfigurationError, match="safe_serialization"):
        acc.save_model(model, tmp_path / "x", safe_serialization=False)


def test_trackers_write_tensorboard_and_csv(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = Accelerator(log_with=["tensorboard", "csv"], project_dir=tmp_path)
    acc.init_trackers("gan", config={"lr": 0.1, "layers": [2, 3]})
    acc.log({"loss": torch.tensor(0.5), "acc": 0.75}, step=2)
    acc.log({"loss": 0.25})                                    # step 3: one after the last
    tb = acc.get_tracker("tensorboard")
    assert isinstance(tb, TensorBoardLogger) and isinstance(acc.get_tracker("csv"), CSVLogger)
    assert hasattr(acc.get_tracker("tensorboard", unwrap=True), "add_scalar")
    with pytest.raises(MisconfigurationError, match="initialised"):
        acc.get_tracker("wandb")
    acc.end_training()
    ea = EventAccumulator(tb.log_dir)
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("loss")] == [(2, 0.5), (3, 0.25)]
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "gan" / "version_0" / "metrics.csv"))[0])))
    assert [(r["step"], r["loss"], r["acc"]) for r in rows] == [("2", "0.5", "0.75"), ("3", "0.25", "")]
    assert "lr: 0.1" in (tmp_path / "gan" / "version_0" / "hparams.yaml").read_text()


def test_gan_example_runs(tmp_path):
    out = run_python(ROOT / "examples" / "gan_digits.py", "--steps", "20", "--log-every", "10")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("step")]
    assert [ln.split()[1] for ln in lines] == ["10", "20"]
    assert all(float(ln.split()[3]) > 0 and float(ln.split()[5]) > 0 for ln in lines)


def test_docs_examples_run(tmp_path, monkeypatch, capsys):
    """The complete scripts in docs/accelerator.md (blocks that start with an import) run as written."""
    import re
    text = (ROOT / "docs" / "accelerator.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("import")]
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "docs/accelerator.md", "exec"), {"__name__": "__docs__"})
    assert "accuracy" in capsys.readouterr().out


def test_wandb_tracker_offline(tmp_path, monkeypatch):
    wandb_offline(monkeypatch, tmp_path)
    acc = Accelerator(log_with="wandb", project_dir=tmp_path / "proj")
    acc.init_trackers("acc-project", config={"lr": 0.1}, init_kwargs={"wandb": {"offline": True, "name": "r1"}})
    acc.log({"loss": torch.tensor(0.5)}, step=1)
    acc.log({"loss": 0.25})
    assert acc.get_tracker("wandb", unwrap=True).project == "acc-project"
    run_dir = acc.get_tracker("wandb").log_dir
    acc.end_training()
    import wandb
    wandb.teardown()   # flush the offline transaction log
    records = wandb_records(run_dir)
    assert [{k: v for k, v in row.items() if k == "loss"} for row in wandb_history(records)] == [
        {"loss": 0.5}, {"loss": 0.25}]
    assert wandb_config(records) == {"lr": 0.1}


@pytest.mark.parametrize("stop_at", [2, 5])   # mid-pass, and on the last batch of the pass
def test_user_sampler_generator_is_kept_and_load_state_resumes_it_exactly(tmp_path, stop_at):
    def loader():
        return DataLoader(TensorDataset(torch.arange(20)), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(7))
    plain = loader()   # the user's generator and seed decide the order, as in plain PyTorch
    expected = [sum((b[0].tolist() for b in plain), []) for _ in range(3)]
    acc = Accelerator(seed=3)
    dl = acc.prepare(loader())
    full = [[b[0].tolist() for b in dl] for _ in range(3)]
    assert [sum(e, []) for e in full] == expected
    acc = Accelerator(seed=3)
    dl = acc.prepare(loader())
    [b for b in dl]   # epoch 0
    for b in dl:
        if dl.batches_done == stop_at:
            acc.save_state(tmp_path / f"s{stop_at}")
            break
    acc2 = Accelerator(seed=99)
    dl2 = acc2.prepare(loader())
    acc2.load_state(tmp_path / f"s{stop_at}")
    rest = [b[0].tolist() for b in dl2] + ([b[0].tolist() for b in dl2] if stop_at < 5 else [])
    assert rest == (full[1][stop_at:] + full[2] if stop_at < 5 else full[2])


@pytest.mark.parametrize("persistent", [False, True])
def test_user_generator_with_workers_load_state_resumes_mid_pass_exactly(tmp_path, persistent):
    """num_workers=2, DataLoader(shuffle=True, generator=g) (g draws the workers' base seed;
    with persistent workers only at the first pass): a run stopped mid-pass 1 (save_state) and
    resumed in new objects (load_state) trains the rest of the uninterrupted 3-pass run in its
    order, per pass, to bit-identical weights; also when saved on the last batch of pass 1."""
    data = TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1))

    def setup(seed):
        acc = Accelerator(seed=seed)
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        dl = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7),
                        num_workers=2, persistent_workers=persistent)
        return (acc, *acc.prepare(model, opt, dl))

    def train(acc, model, opt, dl, passes, stop=None):
        seen = []
        for _ in range(passes):
            seen.append([])
            for (x,) in dl:
                seen[-1] += x.reshape(-1).int().tolist()
                opt.zero_grad()
                acc.backward(model(x).pow(2).mean())
                opt.step()
                if stop is not None and len(seen) == 2 and dl.batches_done == stop:
                    acc.save_state(str(tmp_path / f"s{stop}"))
                    return seen
        return seen

    acc, model, opt, dl = setup(3)
    full = train(acc, model, opt, dl, 3)
    weights = [p.detach().clone() for p in model.parameters()]
    assert all(sorted(p) == list(range(40)) for p in full) and full[0] != full[1] != full[2]
    for stop in (4, 10):   # mid-pass, and on the last batch of the pass
        acc, model, opt, dl = setup(3)
        assert train(acc, model, opt, dl, 2, stop=stop) == [full[0], full[1][:4 * stop]]
        acc, model2, opt, dl = setup(99)
        acc.load_state(str(tmp_path / f"s{stop}"))
        rest = train(acc, model2, opt, dl, 2 if stop < 10 else 1)
        assert rest == ([full[1][4 * stop:]] if stop < 10 else []) + [full[2]], stop
        assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), weights)), stop
