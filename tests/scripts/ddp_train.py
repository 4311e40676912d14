"""Trainer-level DDP scenarios, run as subprocesses by tests/strategies/test_ddp_multiproc.py.

    python ddp_train.py SCENARIO OUT_DIR

(plain, under torchrun, or with SLURM_* variables). Every rank writes
OUT_DIR/<scenario>_rank<R>.json; the tests compare those with single-process runs
of the same modules (imported from this file).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ember import Trainer, TrainModule
from ember.callbacks import GatherMetrics
from ember.errors import MisconfigurationError

N_EVAL = 1001


def regression_data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 5, generator=g)
    y = x @ torch.randn(5, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Regressor(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_regressor(devices, batch_size, accumulate, root):
    """Two epochs over 64 shuffled samples; returns the final weights."""
    trainer = Trainer(devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2, seed=7,
                      accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    module = Regressor()
    trainer.fit(module, DataLoader(regression_data(), batch_size=batch_size, shuffle=True))
    return trainer, {k: v.tolist() for k, v in module.state_dict().items()}


def eval_data():
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(N_EVAL, 6, generator=g), torch.randint(0, 3, (N_EVAL,), generator=g),
                         torch.arange(N_EVAL))


def accuracy(preds, target):
    return (preds == target).float().mean()


def ids_in_order(ids):
    return float(torch.equal(ids.cpu(), torch.arange(N_EVAL)))


def make_gather_metrics():
    return [GatherMetrics({"acc": accuracy, "n": lambda p, t: p.numel()}, stages=("validate", "test")),
            GatherMetrics({"ids_in_order": ids_in_order}, keys=("ids",), stages=("validate", "test")),
            GatherMetrics(stages=("predict",))]


class Classifier(TrainModule):
    def __init__(self, log_rank_key=False):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Linear(6, 3)
        self.log_rank_key = log_rank_key
        self.by_hand = None

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self(x), y)

    def _eval_step(self, batch):
        x, y, i = batch
        preds = self(x).argmax(1)
        self.log("rank", float(self.trainer.global_rank), sync_dist=True)
        if self.log_rank_key:
            self.log(f"only_on_rank{self.trainer.global_rank}", 1.0, sync_dist=True)
        self._parts.append((preds, y, i))
        return {"preds": preds, "target": y, "ids": i}

    def on_validation_epoch_start(self):
        self._parts = []

    def validation_step(self, batch, batch_idx):
        return self._eval_step(batch)

    def on_validation_epoch_end(self):
        if not self._parts or len(self._parts) != len(self.trainer.current_dataloader):
            if self.trainer.sanity_checking or not self._parts:
                return  # the sanity check sees only a few batches
            # a pass cut short by limit_val_batches: no sampler padding to drop
            g = self.gather_for_metrics({"ids": torch.cat([p[2] for p in self._parts])})
            self.partial = {"n": int(g["ids"].numel()), "ids": g["ids"].tolist()}
            return
        p, t, i = (torch.cat(x) for x in zip(*self._parts))
        g = self.gather_for_metrics({"preds": p, "target": t, "ids": i})
        self.by_hand = {"acc": accuracy(g["preds"], g["target"]).item(), "n": int(g["preds"].numel()),
                        "ids_in_order": ids_in_order(g["ids"])}

    on_test_epoch_start = on_validation_epoch_start

    def test_step(self, batch, batch_idx):
        return self._eval_step(batch)

    def predict_step(self, batch, batch_idx):
        x, y, i = batch
        return {"ids": i, "preds": self(x).argmax(1), "names": [f"sample-{int(k)}" for k in i]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def eval_trainer(devices, root, callbacks=None, **kw):
    return Trainer(devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=1, seed=5,
                   limit_train_batches=2, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                   callbacks=callbacks if callbacks is not None else make_gather_metrics(), **kw)


def run_metrics(devices, root, batch_size=16):
    """fit (with validation), validate, test, predict; returns what the tests compare."""
    res = {}
    callbacks = make_gather_metrics()
    trainer = eval_trainer(devices, root, callbacks)
    module = Classifier()
    loader = DataLoader(eval_data(), batch_size=batch_size)
    # global training batch 32 whatever the number of processes (same updates)
    trainer.fit(module, DataLoader(eval_data(), batch_size=32 // devices, shuffle=True), loader)
    res["fit_val"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("acc", "n", "rank")}
    res["validate"] = {k: float(v) for k, v in trainer.validate(module, loader)[0].items()}
    res["validate_gather"] = {k: float(trainer.callback_metrics[k]) for k in ("acc", "n", "ids_in_order")}
    res["by_hand"] = module.by_hand
    trainer.test(module, loader)
    res["test"] = {k: float(trainer.callback_metrics[k]) for k in ("acc", "n", "ids_in_order")}
    preds = trainer.predict(module, loader)
    res["predict_ids"] = torch.cat([b["ids"] for b in preds]).tolist()
    res["predict_preds"] = torch.cat([b["preds"] for b in preds]).tolist()
    res["predict_names"] = [name for b in preds for name in b["names"]]
    res["callback_predict_ids"] = callbacks[2].predictions[0]["ids"].tolist()
    # limit_val_batches=3: 3 batches of 16 per rank, none of them padding
    partial = eval_trainer(devices, root, limit_val_batches=3)
    res["partial_gather_metrics_n"] = float(partial.validate(module, loader)[0]["n"])
    res["partial"] = module.partial
    res["world_size"] = trainer.world_size
    res["env"] = getattr(getattr(trainer.strategy, "cluster_environment", None), "name", "single")
    return trainer, res


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    devices = int(os.environ.get("EMBER_TEST_DEVICES", "2"))
    res = {}
    if scenario == "equiv":
        for acc in (1, 2):
            trainer, res[f"acc{acc}"] = fit_regressor(devices, 8, acc, out)
    elif scenario == "metrics":
        trainer, res = run_metrics(devices, out)
        try:  # ranks logging different names with sync_dist=True: an error, not a hang
            trainer.validate(Classifier(log_rank_key=True), DataLoader(eval_data(), batch_size=16))
        except MisconfigurationError as e:
            res["different_keys_error"] = str(e)
    elif scenario == "fail":
        class Failing(Regressor):
            def training_step(self, batch, batch_idx):
                if self.trainer.global_rank == 1 and batch_idx == 3:
                    raise RuntimeError("boom on rank 1 at step 3")
                return super().training_step(batch, batch_idx)
        trainer = Trainer(devices=devices, strategy="ddp", max_epochs=50, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=out)
        trainer.fit(Failing(), DataLoader(regression_data(), batch_size=4))
        res["finished"] = True  # never reached
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    res["rank"], res["world"] = trainer.global_rank, trainer.world_size
    res["env"] = getattr(getattr(trainer.strategy, "cluster_environment", None), "name", "single")
    with open(os.path.join(out, f"{scenario}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
