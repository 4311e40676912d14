"""The dataloader :meth:`ember.Accelerator.prepare` hands back: sharded over the
processes, resumable mid-pass, moving batches to the device, and telling the
accelerator when a pass ends."""
from __future__ import annotations

from typing import Any


from ember.data import sampling as edata

_END = object()


# -- dataloader ------------------------------------------------------------------------------
class DataLoaderShard:
    """A prepared DataLoader: sharded over processes, resumable, moves batches to the
    device, and tells the accelerator when the last batch is out
    (:attr:`end_of_dataloader`). Each full pass is one epoch (:attr:`epoch` advances
    and reshuffles); :attr:`batches_done` counts the batches of the current pass."""

    def __init__(self, loader: Any, accelerator: Any, original: Any = None) -> None:
        self.base, self._acc, self._strategy = loader, accelerator, accelerator.strategy
        self.end_of_dataloader = False
        self._skip = self.batches_done = self.epoch = 0
        # what the user's DataLoader takes from the global RNG per pass (none when it is used as it is)
        self._draws = edata.global_rng_draws(original) if original is not None and original is not loader else 0
        self._restored = False
        self._ahead: edata.LookAhead | None = None

    def __len__(self) -> int:
        return len(self.base)

    @property
    def num_batches(self) -> int | None:
        """Batches per pass, or None when the loader has no length (IterableDataset)."""
        try:
            return len(self.base)
        except TypeError:
            return None

    @property
    def known_length(self) -> int | None:
        """Batches in the current pass as far as known now: the loader's length, or (no
        length: an IterableDataset) the count once the pass's end is within the read-ahead
        that gradient accumulation keeps (enough to size the last, shorter window)."""
        n = self.num_batches
        if n is not None:
            return n
        ahead = self._ahead
        return ahead.length if ahead is not None else None

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all processes (the loader's batch size times the processes)."""
        return (getattr(self.base, "batch_size", None) or 1) * self._strategy.world_size

    def set_epoch(self, epoch: int) -> None:
        """Use the data order of ``epoch`` for the next pass."""
        self.epoch = int(epoch)

    def skip(self, num_batches: int) -> None:
        """The next pass starts after ``num_batches`` batches (indices are skipped)."""
        self._skip = int(num_batches)

    def __iter__(self):
        acc, base = self._acc, self.base
        skip, self._skip = self._skip, 0
        if not self._restored:   # a pass resumed by load_state continues the saved RNG stream as is
            edata.draw_like_a_dataloader(self._draws)   # what the user's DataLoader takes per pass
        self._restored = False
        edata.set_epoch(base, self.epoch)
        drop = skip if skip and not edata.skip_batches(base, skip) else 0  # iterable: read and drop
        self.batches_done = skip
        self.end_of_dataloader = False
        strategy = self._strategy
        to_device = strategy.batch_to_device if strategy.root_device.type != "cpu" else None
        prev = acc._active_loader
        acc._active_loader = self
        acc._finished_pass = None
        try:
            it = iter(base)
            for _ in range(drop):
                next(it, None)
            gas = acc.gradient_accumulation_steps
            self._ahead = None
            if gas > 1 and self.num_batches is None:
                # no length: read gas - 1 batches ahead, so the last accumulation window's size
                # is known when it starts (known_length), as in the Trainer
                self._ahead = edata.LookAhead(it, gas - 1, start=skip)
                it = iter(self._ahead)
            nxt = next(it, _END)
            while nxt is not _END:
                cur = nxt
                nxt = next(it, _END)
                if nxt is _END:
                    self.end_of_dataloader = True
                self.batches_done += 1
                yield cur if to_device is None else to_device(cur)
            self.epoch += 1
            self.batches_done = 0
            acc._finished_pass = self   # an epoch-end gather_for_metrics drops this pass's padding
            if acc.step_rules.scheduler_step_pending:
                acc.step_rules.flush()   # the pass's last scheduler step (its skip flag is read now)
        finally:
            acc._active_loader = prev

    def state_dict(self) -> dict:
        """Where the pass stands (epoch, batches done, the sampler's state), for a resume."""
        s = edata.sampler_of(self.base)
        out = {"epoch": self.epoch, "batches_done": self.batches_done,
               "sampler": s.state_dict() if isinstance(s, edata.ResumableSampler) else {}}
        out.update(edata.generator_checkpoint_state(self.base))   # a user sampler's own generator
        return out

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next pass skips the batches already done."""
        s = edata.sampler_of(self.base)
        if state.get("sampler") and isinstance(s, edata.ResumableSampler):
            s.load_state_dict(state["sampler"])
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        n = self.num_batches
        if n is not None and done >= n:  # saved on the last batch: resume at the next epoch
            epoch, done = epoch + 1, 0
        # written before generator_epoch was recorded: the epoch start's state mid-pass, else
        # the state the next pass starts from
        edata.restore_generator(self.base, state, legacy_epoch=epoch, where="load_state (dataloader state)")
        self.epoch, self.batches_done, self._skip = epoch, done, done
        self._restored = done > 0

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.__dict__["base"], name)
