"""The position and control of the fit loop, in one object.

:class:`LoopState` is all the Trainer knows about where a fit stands (epoch, batch,
global step, accumulation phase, whether the epoch finished) and why it stopped. It
is saved whole in ``trainer_state.pt`` (``"loop"``) and restored whole, so a resumed
fit continues exactly where the saved one was. Callbacks and the module read it
through the Trainer's public properties (``current_epoch``, ``global_step``,
``batch_idx``, ``batches_done``, ``is_last_batch``, ``epoch_finished``,
``should_stop``, ``stop_reason``); the loop reads its fields directly (plain
attribute access, no call per step).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

#: why a fit stopped (``trainer.stop_reason``); None while it runs
STOP_REASONS = ("max_epochs", "max_steps", "max_time", "early_stopping", "timer", "should_stop",
                "preempted", "interrupted", "exception")

#: the stop requests ranks agree on, in priority order (the highest code any rank asks for wins)
REQUESTS = ("should_stop", "early_stopping", "timer", "max_time")
REQUEST_CODE = {r: i + 1 for i, r in enumerate(REQUESTS)}


@dataclass
class LoopState:
    """Where the fit loop stands.

    Attributes:
        epoch: the current epoch (0-based).
        batch_idx: index in the epoch of the current (or last) training batch.
        batches_done: training batches finished in the current epoch; a resumed
            epoch starts at this batch.
        global_step: optimizer steps taken.
        grads_pending: a gradient accumulation window is open (gradients are
            accumulated but the optimizer has not stepped).
        epoch_finished: the current epoch's batches are all done and its epoch-end
            work has started (a checkpoint saved then records the next epoch).
        stop_request: this rank's request to stop (``trainer.should_stop = True``,
            EarlyStopping, Timer, max_time), not yet agreed by the other ranks.
        stop_agreed: the request is the same on every rank (made after a collective,
            as EarlyStopping's): the ranks act on it at the next optimizer step.
        stop_reason: why the fit stopped, agreed by every rank (see ``STOP_REASONS``);
            None while it runs.
    """

    epoch: int = 0
    batch_idx: int = 0
    batches_done: int = 0
    global_step: int = 0
    grads_pending: bool = False
    epoch_finished: bool = False
    stop_request: str | None = None
    stop_agreed: bool = False
    stop_reason: str | None = None

    def state_dict(self) -> dict:
        """The checkpoint form. A checkpoint saved after an epoch's last batch records the
        start of the next epoch (an epoch stopped mid-way records its next batch)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.epoch_finished:
            out.update(epoch=self.epoch + 1, batch_idx=0, batches_done=0, epoch_finished=False,
                       grads_pending=False)
        out["stop_request"], out["stop_agreed"] = None, False   # a resumed fit runs on
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict` (older checkpoints hold only ``epoch``,
        ``global_step`` and ``batches_done``)."""
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.batches_done = int(state.get("batches_done", 0))
        self.batch_idx = int(state.get("batch_idx", max(self.batches_done - 1, 0)))
        self.grads_pending = False   # set again when the saved gradients are restored
        self.epoch_finished = False
        self.stop_request, self.stop_agreed = None, False
        self.stop_reason = None   # the saved one says why that fit stopped; this one runs on

    def reset_epoch(self) -> None:
        """After an exception: a later ``fit()`` restarts the broken epoch at its first batch."""
        self.batches_done, self.batch_idx, self.epoch_finished, self.grads_pending = 0, 0, False, False


def agree_stop(t, force: bool = False) -> bool:
    """Decide, once for every rank, whether the fit stops here; True when it does.

    Called by the loop at check points only (see ``ember/trainer/loops.py``): on one
    process after an optimizer step where a stop was asked for (and at epoch ends);
    under several processes at log points, after a validation and at epoch ends, where
    one all-reduce (``strategy.agree``) of ``[stop request, signal]`` makes every rank
    take the same decision at the same step. A preemption signal wins over a request
    (the fit saves ``last`` and ends); otherwise the highest request any rank made wins.
    """
    ls = t.loop_state
    req = ls.stop_request
    deadline = t._deadline
    if req is None and deadline is not None:
        import time
        if time.monotonic() >= deadline:
            req = "max_time"
    code, signum = REQUEST_CODE.get(req, 0), t._signal_received or 0
    if t.world_size > 1:
        code, signum = t.strategy.agree([code, signum], "max")
    if signum:
        from ember.trainer.state import save_for_preemption
        ls.stop_reason = "preempted"   # recorded in the checkpoint saved now
        save_for_preemption(t, int(signum))
        return True
    if code:
        ls.stop_request = ls.stop_reason = REQUESTS[int(code) - 1]
        return True
    return False
