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


class LoopProperties:
    """The Trainer's public view of its :class:`LoopState` (``self.loop_state``)."""

    loop_state: LoopState
    num_training_batches: "int | float"

    @property
    def current_epoch(self) -> int:
        """The current epoch (0-based); after a fit that finished its epochs, their number."""
        return self.loop_state.epoch

    @current_epoch.setter
    def current_epoch(self, v: int) -> None:
        self.loop_state.epoch = v

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        return self.loop_state.global_step

    @global_step.setter
    def global_step(self, v: int) -> None:
        self.loop_state.global_step = v

    @property
    def batch_idx(self) -> int:
        """Index in the epoch of the current (or last) training batch."""
        return self.loop_state.batch_idx

    @property
    def batches_done(self) -> int:
        """Training batches finished in the current epoch."""
        return self.loop_state.batches_done

    @property
    def is_last_batch(self) -> bool:
        """Whether the current training batch is the last one of the epoch."""
        return self.loop_state.batch_idx + 1 >= self.num_training_batches

    @property
    def epoch_finished(self) -> bool:
        """Whether every batch of the current epoch is done and its epoch-end work runs."""
        return self.loop_state.epoch_finished

    @property
    def stop_reason(self) -> str | None:
        """Why the last fit stopped, agreed by every rank: one of ``max_epochs``, ``max_steps``,
        ``max_time``, ``early_stopping``, ``timer``, ``should_stop``, ``preempted``,
        ``interrupted``, ``exception``; None while it runs."""
        return self.loop_state.stop_reason

    @property
    def should_stop(self) -> bool:
        """Set it to True (in any hook) to stop the fit. The request takes effect at the next
        optimizer step that is a check point: every step on one process; under several
        processes the ranks agree every ``log_every_n_steps`` steps, after a validation and
        at epoch ends (see ``ember/trainer/loops.py``). A stop mid-epoch is recorded as
        mid-epoch: a resume continues at the next batch."""
        return self.loop_state.stop_request is not None

    @should_stop.setter
    def should_stop(self, v: bool) -> None:
        if not v:
            self.loop_state.stop_request, self.loop_state.stop_agreed = None, False
        elif self.loop_state.stop_request is None:
            self.loop_state.stop_request = "should_stop"

    def request_stop(self, reason: str = "should_stop", agreed: bool = False) -> None:
        """Ask the fit to stop for ``reason`` (``should_stop``, ``early_stopping``, ``timer`` or
        ``max_time``): as ``trainer.should_stop = True``, with the reason recorded in
        :attr:`stop_reason`. Agreed with the other ranks as described under :attr:`should_stop`;
        ``agreed=True`` says every rank makes this same request at the same step (it was decided
        after a collective), so the ranks act on it at the next optimizer step."""
        if reason not in REQUEST_CODE:
            from ember.errors import invalid_choice
            raise invalid_choice("request_stop(reason)", reason, list(REQUEST_CODE))
        self.loop_state.stop_request = reason
        self.loop_state.stop_agreed = agreed


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
        req = REQUESTS[int(code) - 1]
        if req in ("should_stop", "early_stopping") and (t.min_epochs is not None or t.min_steps is not None):
            from ember.trainer.arguments import min_reached
            if not min_reached(t):   # min_epochs / min_steps: the request waits (every rank alike)
                ls.stop_request, ls.stop_agreed = req, False
                return False
        ls.stop_request = ls.stop_reason = req
        return True
    return False
