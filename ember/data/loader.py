"""The dataloader :meth:`ember.Accelerator.prepare` hands back: sharded over the
processes, resumable mid-pass, moving batches to the device, and telling the
accelerator when a pass ends."""
from __future__ import annotations

from typing import Any


from ember.data import resume
from ember.data import sampling as edata

_END = object()


# -- dataloader ------------------------------------------------------------------------------
class DataLoaderShard:
    """A prepared DataLoader: sharded over processes, resumable, moves batches to the
    device, and tells the accelerator when the last batch is out
    (:attr:`end_of_dataloader`). Each pass is one epoch: :attr:`epoch` advances at the
    end of a pass, and at the start of a new pass when the last one was left before its
    end (a loop that breaks after N batches), unless :meth:`set_epoch` chose the epoch
    since; :attr:`batches_done` counts the batches of the current pass.

    ``draw_order``: the user's ``DataLoader(shuffle=True)`` shuffles, as it would, with a
    seed drawn from the global torch RNG at the start of each pass (its ``RandomSampler``'s
    draw; rank 0's under several processes): the order follows the seed in force when the
    iteration starts (``set_seed`` before or after the Accelerator) and equals the plain
    loader's on one process. Otherwise the order is the run seed's ``(seed, epoch)``."""

    def __init__(self, loader: Any, accelerator: Any, original: Any = None, draw_order: bool = False) -> None:
        self.base, self._acc, self._strategy = loader, accelerator, accelerator.strategy
        self.end_of_dataloader = False
        self._skip = self.batches_done = self.epoch = 0
        # what the user's DataLoader takes from the global RNG per pass (none when it is used as it is)
        self._draws = edata.global_rng_draws(original) if original is not None and original is not loader else 0
        s = edata.sampler_of(loader)
        self._draw_order = bool(draw_order and self._draws and type(s) is edata.ResumableSampler and s.shuffle
                                and original is not None and edata.draws_sampler_seed(original))
        self._epoch_set = False   # set_epoch was called since the last pass started
        self._left = False        # the last pass was left before its end (the next one is a new epoch)
        self._open: object | None = None   # the pass started and not over yet (its token)
        #: read one batch ahead, to know the last batch when it is handed out
        #: (:attr:`end_of_dataloader`, the Accelerator's gradient sync on it, as Accelerate);
        #: False (``Fabric``'s loaders, as Lightning Fabric): never read past what the loop
        #: asked for; the end is then known from the loader's length (after the last batch
        #: for a stream without one)
        self.read_ahead = True
        self._restored = False
        self._ahead: edata.LookAhead | None = None
        self._saved: dict | None = None   # the position load_state_dict read, for the next pass
        self._pass: Any = None            # what the current (or last) pass iterates (ember.data.resume)

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
        """Use the data order of ``epoch`` for the next pass (otherwise each new pass is
        the next epoch, also after a pass left before its end)."""
        self.epoch = int(epoch)
        self._epoch_set = True

    def skip(self, num_batches: int) -> None:
        """The next pass starts after ``num_batches`` batches (a map-style loader skips
        indices; a stream reads them and drops them)."""
        self._skip = int(num_batches)

    def __iter__(self):
        acc, base = self._acc, self.base
        skip, self._skip = self._skip, 0
        resumed = self._restored
        if (self._left or self._open is not None) and not self._epoch_set and not resumed:
            self.epoch += 1   # the last pass was left before its end: this one is the next epoch
        self._left = self._epoch_set = False
        me = self._open = object()   # an older iterator closed later does not speak for this pass
        if not resumed:   # a pass resumed by load_state continues the saved RNG stream as is
            drawn = edata.draw_like_a_dataloader(self._draws)   # what the user's DataLoader takes per pass
            if self._draw_order:   # its RandomSampler's seed (the last draw), rank 0's on every rank
                seed = drawn[-1] if self._strategy.world_size == 1 else int(self._strategy.broadcast(drawn[-1]))
                edata.sampler_of(base).pass_seed = seed
        self._restored = False
        edata.set_epoch(base, self.epoch)
        saved, self._saved = self._saved, None
        gas = acc.gradient_accumulation_steps
        ahead = self.read_ahead
        look_ahead = ahead and gas > 1 and self.num_batches is None
        # from batch ``skip`` (ember/data/resume.py); a stream read again is warned about on a
        # resume, not for skip_first_batches
        src = self._pass = resume.begin_pass(base, skip, saved, read_ahead=int(ahead) + (gas - 1 if look_ahead else 0),
                                             warn=resumed and acc.is_main_process)
        self.batches_done = skip
        self.end_of_dataloader = False
        strategy = self._strategy
        to_device = strategy.batch_to_device if strategy.root_device.type != "cpu" else None
        prev = acc._active_loader
        acc._active_loader = self
        acc._finished_pass = None
        source = None
        complete = False
        try:
            source = it = iter(src)
            self._ahead = None
            if look_ahead:
                # no length: read gas - 1 batches ahead, so the last accumulation window's size
                # is known when it starts (known_length), as in the Trainer
                self._ahead = edata.LookAhead(it, gas - 1, start=skip)
                it = iter(self._ahead)
            if not ahead:   # read only what the loop asks for: the end is known from the length
                n = self.num_batches
                for cur in it:
                    self.batches_done += 1
                    self.end_of_dataloader = n is not None and self.batches_done >= n
                    yield cur if to_device is None else to_device(cur)
                self.end_of_dataloader = True
            nxt = next(it, _END) if ahead else _END
            while nxt is not _END:
                cur = nxt
                nxt = next(it, _END)
                if nxt is _END:
                    self.end_of_dataloader = True
                self.batches_done += 1
                yield cur if to_device is None else to_device(cur)
            self.epoch += 1
            self.batches_done = 0
            complete = True
            acc._finished_pass = self   # an epoch-end gather_for_metrics drops this pass's padding
            if acc.step_rules.scheduler_step_pending:
                acc.step_rules.flush()   # the pass's last scheduler step (its skip flag is read now)
        finally:
            if self._open is me:
                self._open = None
                self._left = not complete   # left before its end (a break): the next pass is a new epoch
            acc._active_loader = prev
            resume.release(base, source)   # a StatefulDataLoader left mid-pass keeps its workers otherwise

    def state_dict(self) -> dict:
        """Where the pass stands (epoch, batches done, the sampler's state) and, under
        ``"position"``, this process's position in the loader beyond the batch count (a
        stateful loader's ``state_dict()``: :func:`ember.data.resume.position`; None for an
        index-based one), for a resume."""
        s = edata.sampler_of(self.base)
        if self._left:   # the pass was left: the next one starts a new epoch, at its first batch
            epoch = self.epoch + (0 if self._epoch_set else 1)
            return {"epoch": epoch, "batches_done": 0,
                    "sampler": {**s.state_dict(), "epoch": epoch} if isinstance(s, edata.ResumableSampler) else {},
                    **edata.generator_checkpoint_state(self.base), "position": resume.position(self.base, None, 0)}
        out = {"epoch": self.epoch, "batches_done": self.batches_done,
               "sampler": s.state_dict() if isinstance(s, edata.ResumableSampler) else {}}
        out.update(edata.generator_checkpoint_state(self.base))   # a user sampler's own generator
        out.update(resume.shape(self.base))   # what the position is right for (check_state)
        if self._saved is not None:   # restored and not used yet: as it was loaded
            out["position"] = resume.as_saved(self._saved)
        else:
            out["position"] = resume.position(self.base, self._pass, self.batches_done)
        return out

    def check_state(self, state: dict, where: str) -> None:
        """Refuse a :meth:`state_dict` saved mid-pass over other data (another batch size,
        dataset length, or a Hugging Face stream's shards: :func:`ember.data.resume.check_shape`;
        ``EMBER_ALLOW_DATA_CHANGE=1`` accepts the first two with a warning)."""
        done, n = int(state.get("batches_done", 0)), self.num_batches
        if n is not None and done >= n:
            done = 0   # saved on the last batch: the next pass starts afresh
        resume.check_shape(self.base, state, done, where, resume.allow_data_change())

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next pass starts after the batches already
        done (skipping indices, loading a stateful loader's state, or reading a stream
        again, with a warning)."""
        s = edata.sampler_of(self.base)
        if state.get("sampler") and isinstance(s, edata.ResumableSampler):
            s.load_state_dict(state["sampler"])
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        saved = state.get("position")
        n = self.num_batches
        if n is not None and done >= n:  # saved on the last batch: resume at the next epoch
            epoch, done = epoch + 1, 0   # (a stateful loader's state after its last batch still applies)
        # written before generator_epoch was recorded: the epoch start's state mid-pass, else
        # the state the next pass starts from
        edata.restore_generator(self.base, state, legacy_epoch=epoch, where="load_state (dataloader state)")
        self.epoch, self.batches_done, self._skip = epoch, done, done
        self._left = self._epoch_set = False
        self._open = None
        # a stateful loader's state is loaded now: a state it refuses raises inside load_state,
        # where the processes agree on the outcome
        self._saved = resume.apply_position(self.base, saved, done, "load_state (dataloader state)")
        self._restored = done > 0

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.__dict__["base"], name)
