"""The one loop-state object (``trainer.state``, ember/trainer/state.py): what a
checkpoint holds of it, and checkpoints written by the previous release."""
from __future__ import annotations

import shutil

import torch
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback
from ember.trainer.state import LOOP_FIELDS, TrainerState

from helpers import TESTS, LinearModule, regression_data

FIXTURES = TESTS / "fixtures"


class Module(LinearModule):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}}


class AtStep(Callback):
    """At the first batch after optimizer step ``step``: the weights and momentum buffers
    of ``ckpt`` (written on another machine, whose float arithmetic may round the first
    steps differently in the last bit), so the run goes on from exactly the checkpoint's
    numbers and only what a resume restores besides them (batch order, learning rate,
    accumulation) can tell the runs apart."""

    def __init__(self, ckpt, step):
        from ember.checkpoint import io as cio
        weights, state, _ = cio.read_checkpoint(str(ckpt))
        self.weights, self.optim, self.step = weights, state["optimizers"][0]["state"], step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step != self.step or self.weights is None:
            return
        opt = trainer.optimizers[0]
        with torch.no_grad():
            for i, (name, p) in enumerate(module.named_parameters()):
                p.copy_(self.weights[name])
                opt.state[p]["momentum_buffer"].copy_(self.optim[i]["momentum_buffer"])
        self.weights = None


def _fit(root, max_steps, ckpt_path=None, callbacks=()):
    torch.manual_seed(0)
    module = Module()
    t = ember.Trainer(max_steps=max_steps, accumulate_grad_batches=2, seed=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root, num_sanity_val_steps=0, callbacks=list(callbacks))
    t.fit(module, DataLoader(regression_data(64), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return module, t


def test_a_checkpoint_of_the_previous_release_resumes_exactly(tmp_path):
    """tests/fixtures/release-0.1.0-step3 was written by ember 0.1.0 (the release before the
    state object): 3 optimizer steps of 2 micro-batches into a shuffled epoch of 8 batches,
    SGD with momentum and a step-interval StepLR. Resumed by this release it continues
    exactly as an uninterrupted run of this release (one that takes the checkpoint's
    weights and momentum at step 3: they may differ from this machine's in the last bit)."""
    ckpt = tmp_path / "old"
    shutil.copytree(FIXTURES / "release-0.1.0-step3", ckpt)
    ref, ref_t = _fit(tmp_path / "ref", 8, callbacks=[AtStep(ckpt, 3)])
    resumed, t = _fit(tmp_path / "resumed", 8, ckpt_path=str(ckpt))
    assert t.state.resumed and t.ckpt_path == str(ckpt)
    for p, q in zip(ref.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert t.global_step == ref_t.global_step == 8 and t.current_epoch == ref_t.current_epoch
    assert t.lr_scheduler_configs[0]["scheduler"].get_last_lr() == ref_t.lr_scheduler_configs[0]["scheduler"].get_last_lr()


def test_state_dict_round_trip_and_epoch_end_form():
    st = TrainerState()
    st.epoch, st.batch_idx, st.batches_done, st.global_step, st.grads_pending = 2, 4, 5, 11, True
    st.stop_request, st.stop_agreed, st.stop_reason = "timer", True, "timer"
    saved = st.state_dict()
    assert set(saved) == set(LOOP_FIELDS)
    assert (saved["stop_request"], saved["stop_agreed"]) == (None, False)   # a resumed fit runs on
    back = TrainerState()
    back.load_state_dict(saved)
    assert (back.epoch, back.batch_idx, back.batches_done, back.global_step) == (2, 4, 5, 11)
    assert back.stop_reason is None and not back.grads_pending   # gradients come back with their own state
    st.epoch_finished = True   # saved during the epoch-end work: the next epoch's start
    end = st.state_dict()
    assert (end["epoch"], end["batches_done"], end["batch_idx"], end["grads_pending"]) == (3, 0, 0, False)


def test_trainer_reads_its_state_through_one_object(tmp_path):
    module, t = _fit(tmp_path, 3)
    st = t.state
    assert t.loop_state is st and st.step_rules is t.step_rules
    assert (t.current_epoch, t.global_step, t.batches_done, t.batch_idx) == (st.epoch, st.global_step,
                                                                              st.batches_done, st.batch_idx)
    assert (st.fn, st.stage, st.status, st.finished) == ("fit", None, "finished", True)
    assert t.stop_reason == st.stop_reason == "max_steps"
    assert t.train_dataloader is st.train_dataloader and t.num_training_batches == st.num_training_batches == 8
    t.should_stop = True
    assert st.stop_request == "should_stop"
