"""Several loaders iterated together: :class:`CombinedLoader`, with Lightning's modes and
iteration, which ``trainer.fit`` uses for a dict or list of train loaders."""
from __future__ import annotations

import collections
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

from torch.utils._pytree import MappingKey, SequenceKey, tree_flatten, tree_flatten_with_path, tree_unflatten

from ember.data import resume as _resume
from ember.data.sampling import set_epoch as _set_epoch

MODES = ("min_size", "max_size_cycle", "max_size", "sequential")


def _names(tree: Any) -> list[str]:
    """The path of each flattened loader in the structure (``a``, ``x[1]``, ``[0]``)."""
    out = []
    for path, _ in tree_flatten_with_path(tree)[0]:
        name = ""
        for k in path:
            if isinstance(k, SequenceKey):
                name += f"[{k.idx}]"
            else:
                key = k.key if isinstance(k, MappingKey) else k.name
                name += f".{key}" if name else str(key)
        out.append(name or "[0]")
    return out


def _known_mappings(tree: Any) -> Any:
    """``tree`` with every mapping torch's pytree does not know (a dict subclass such as
    ``datasets.DatasetDict``) made a plain dict, so its loaders are walked, not taken as one."""
    if isinstance(tree, Mapping):
        items = {k: _known_mappings(v) for k, v in tree.items()}
        return collections.OrderedDict(items) if type(tree) is collections.OrderedDict else items
    if type(tree) in (list, tuple):
        return type(tree)(_known_mappings(v) for v in tree)
    return tree


class CombinedLoader(Iterable):
    """Iterate several loaders (a dict, list or tuple of them, nested or not) together.

    Args:
        iterables: the loaders (any iterables), or one.
        mode: as in Lightning:

            * ``"min_size"`` (the default, as Lightning's constructor): stops when the
              shortest is done;
            * ``"max_size_cycle"`` (what ``fit`` uses for a dict or list of train
              loaders): stops when the longest is done, restarting the others as they run out;
            * ``"max_size"``: stops when the longest is done, giving None for those that
              ran out;
            * ``"sequential"``: one loader after the other.

    Iterating yields ``(batch, batch_idx, dataloader_idx)``: ``batch`` has the structure
    of ``iterables`` (a dict of batches for a dict of loaders); in ``"sequential"`` mode it
    is one loader's batch, ``batch_idx`` counts within that loader and
    ``dataloader_idx`` names it. ``len()`` is the number of batches of one pass.

    In ``trainer.fit`` every mode works, and each loader is sharded over the ranks and
    resumes mid-epoch exactly by its own kind: ``training_step`` receives the batch
    (``sequential``: one loader's, with ``dataloader_idx=`` when it takes that
    argument; ``batch_idx`` counts the epoch's batches). A loader restarted within an
    epoch (``max_size_cycle``) gives that epoch's order again; the next epoch reshuffles.
    """

    ember_combined = True   # ember.data.resume: each loader resumes by its own kind

    def __init__(self, iterables: Any, mode: str = "min_size") -> None:
        if mode not in MODES:
            raise ValueError(f"Unsupported mode {mode!r}, please select one of: {list(MODES)}.")
        self._iterables = iterables
        self._flattened, self._spec = tree_flatten(_known_mappings(iterables))
        self._mode = mode
        self._limits: list | None = None
        self._iterator: _CombinedPass | None = None
        self._draws = [0] * len(self._flattened)   # per loader: what its user loader takes from the global RNG
        self._epoch = 0

    # -- Lightning's attributes ----------------------------------------------------------------
    @property
    def iterables(self) -> Any:
        """The loaders, in the structure they were given."""
        return self._iterables

    @property
    def mode(self) -> str:
        """The combination mode."""
        return self._mode

    @property
    def flattened(self) -> list:
        """The loaders as a flat list."""
        return self._flattened

    @flattened.setter
    def flattened(self, flattened: list) -> None:
        if len(flattened) != len(self._flattened):
            raise ValueError(f"Mismatch in flattened length ({len(flattened)}) and existing length "
                             f"({len(self._flattened)})")
        self._iterables = tree_unflatten(list(flattened), self._spec)
        self._flattened = list(flattened)

    @property
    def sampler(self) -> Any:
        """The loaders' samplers, in the structure of :attr:`iterables`."""
        return tree_unflatten([getattr(x, "sampler", None) for x in self._flattened], self._spec)

    @property
    def batch_sampler(self) -> Any:
        """The loaders' batch samplers, in the structure of :attr:`iterables`."""
        return tree_unflatten([getattr(x, "batch_sampler", None) for x in self._flattened], self._spec)

    @property
    def limits(self) -> list | None:
        """Optional limits per loader (``sequential`` stops each loader there; the lengths use them)."""
        return self._limits

    @limits.setter
    def limits(self, limits: Any) -> None:
        if isinstance(limits, (int, float)):
            limits = [limits] * len(self._flattened)
        elif isinstance(limits, list) and len(limits) != len(self._flattened):
            raise ValueError(f"Mismatch in number of limits ({len(limits)}) and number of iterables "
                             f"({len(self._flattened)})")
        self._limits = limits

    def __iter__(self) -> "CombinedLoader":
        self._iterator = _CombinedPass(self, lightning=True)
        return self

    def __next__(self) -> tuple[Any, int, int]:
        if self._iterator is None:
            raise RuntimeError("call iter(combined_loader) first")
        return self._iterator.next_triple()

    def __len__(self) -> int:
        """Batches of one pass (``TypeError`` when a loader has no length)."""
        lengths = [len(x) for x in self._flattened]
        limits = self._limits
        if self._mode == "sequential":
            return int(sum(min(n, lim) for n, lim in zip(lengths, limits)) if limits else sum(lengths))
        if self._mode == "min_size":
            return int(min(lengths + list(limits)) if limits else min(lengths))
        return int(max(min(n, lim) for n, lim in zip(lengths, limits)) if limits else max(lengths))

    def reset(self) -> None:
        """Drop the current iteration (and the workers of its loaders' iterators)."""
        self._iterator = None
        for dl in self._flattened:
            it = getattr(dl, "_iterator", None)
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()

    def __repr__(self) -> str:
        return f"CombinedLoader(mode={self._mode!r}, {len(self._flattened)} loader(s))"

    # -- ember: preparing, epochs, resuming (ember.data.resume) ------------------------------------
    def ember_prepared(self, prepare: Callable[[Any], tuple[Any, int]]) -> "CombinedLoader":
        """A CombinedLoader of the same structure and mode over ``prepare(loader)`` for each
        loader, which returns ``(prepared loader, what the user's loader takes from the
        global RNG per pass)``: each pass of a loader (restarts included) takes that much, as
        the user's loader would in a loop written by hand."""
        out = CombinedLoader.__new__(CombinedLoader)
        out.__dict__.update(self.__dict__)
        pairs = [prepare(dl) for dl in self._flattened]
        out._flattened = [p[0] for p in pairs]
        out._iterables = tree_unflatten(list(out._flattened), self._spec)
        out._draws = [int(p[1]) for p in pairs]
        out._iterator = None
        return out

    def ember_names(self) -> list[str]:
        """The name of each loader of :attr:`flattened`, for messages: its key in a dict
        (``"a"``, ``"x[1]"`` when nested), its index in a list (``"[0]"``)."""
        return _names(self._iterables)

    def ember_set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (each loader's data order and worker seeds follow it)."""
        self._epoch = int(epoch)
        for dl in self._flattened:
            _set_epoch(dl, self._epoch)

    def ember_begin(self, start: int, saved: dict | None, *, read_ahead: int = 0, warn: bool = True) -> "_CombinedPass":
        """A training pass from batch ``start``, each loader at the position ``saved``
        recorded (:meth:`_CombinedPass.position`); yields the batches only."""
        return _CombinedPass(self, start=start, saved=saved, read_ahead=read_ahead, warn=warn)

    def ember_boundary(self) -> dict | None:
        """What a checkpoint at an epoch's end records: each loader's (see
        :func:`ember.data.resume.boundary_position`)."""
        inner = [_resume.boundary_position(dl) for dl in self._flattened]
        return {"kind": "boundary", "inner": inner} if any(p is not None for p in inner) else None


class _CombinedPass:
    """One pass over a CombinedLoader: Lightning's iteration of each mode, with each loader's
    position (restarts, batches of its current pass, ran out) kept for a checkpoint."""

    def __init__(self, c: CombinedLoader, *, start: int = 0, saved: dict | None = None, read_ahead: int = 0,
                 warn: bool = True, lightning: bool = False) -> None:
        n = len(c._flattened)
        self.c, self.mode, self.lightning, self.warn = c, c._mode, lightning, warn
        self.start, self.saved, self.read_ahead = int(start), saved, int(read_ahead)
        self.passes: list = [None] * n
        self.iters: list = [None] * n
        self.done = [0] * n
        self.cycle = [0] * n
        self.drawn = [0] * n          # passes of each loader that took their global RNG draws (this epoch)
        self.ran_out = [False] * n
        self.current = 0              # sequential: the loader being read
        self.idx = 0                  # Lightning's batch_idx (sequential: within the current loader)
        self.produced = self.start
        self.dataloader_idx = 0
        self._records: collections.deque = collections.deque(maxlen=self.read_ahead + 4)
        if lightning:
            self._open_all(None)
        else:   # a training pass: its loaders' new passes start (and draw) now, as a single loader's
            self._start()

    # -- opening a loader's pass ------------------------------------------------------------------
    def _open(self, i: int, start: int = 0, saved: dict | None = None, resumed: bool = False) -> None:
        dl = self.c._flattened[i]
        if self.lightning:
            self.passes[i] = dl
            self.iters[i] = iter(dl)
        else:
            if not resumed and self.cycle[i] >= self.drawn[i]:
                # what the user's loader takes per pass; once per pass: a pass opened again by a
                # resume after the loop had read ahead into it drew before the checkpoint
                from ember.data.sampling import draw_like_a_dataloader
                draw_like_a_dataloader(self.c._draws[i])
                self.drawn[i] = self.cycle[i] + 1
            if self.cycle[i] and not resumed:
                _set_epoch(dl, self.c._epoch)   # a restart within the epoch: the epoch's order again
            p = _resume.begin_pass(dl, start, saved, warn=self.warn)
            self.passes[i] = p
            self.iters[i] = iter(p)
        self.done[i] = start

    def _open_all(self, saved: dict | None) -> None:
        n = len(self.c._flattened)
        if self.mode == "sequential":
            if n:
                self._open(0)
            return
        for i in range(n):
            self._open(i)

    def _resume(self, saved: dict) -> None:
        inner = saved.get("inner") or []
        self.current, self.idx = int(saved.get("current", 0)), int(saved.get("idx", self.start))
        for i, s in enumerate(inner):
            self.cycle[i], self.ran_out[i] = int(s["cycle"]), bool(s["ran_out"])
            self.drawn[i] = int(s.get("drawn", self.cycle[i] + 1))
            if self.mode == "sequential" and i != self.current:
                continue
            if self.mode == "max_size" and self.ran_out[i]:
                continue
            self._open(i, int(s["done"]), s.get("pos"), resumed=True)

    # -- the modes, as Lightning's -----------------------------------------------------------------
    def _next(self, i: int) -> Any:
        out = next(self.iters[i])
        self.done[i] += 1
        return out

    def next_triple(self) -> tuple[Any, int, int]:
        mode, n = self.mode, len(self.c._flattened)
        if mode == "sequential":
            limits = self.c._limits
            while True:
                if n == 0 or self.current >= n:
                    raise StopIteration
                if limits is not None and limits[self.current] <= self.idx:
                    self._next_loader()
                    continue
                try:
                    out = self._next(self.current)
                except StopIteration:
                    self._next_loader()
                    continue
                index = self.idx
                self.idx += 1
                return out, index, self.current
        out: list = [None] * n
        if mode == "min_size":
            for i in range(n):
                out[i] = self._next(i)
        elif mode == "max_size_cycle":
            for i in range(n):
                try:
                    out[i] = self._next(i)
                except StopIteration:
                    self.ran_out[i] = True
                    if all(self.ran_out):
                        raise
                    self.cycle[i] += 1
                    self._open(i)
                    out[i] = self._next(i)
        else:   # max_size
            exhausted = True
            for i in range(n):
                if self.ran_out[i]:
                    continue
                try:
                    out[i] = self._next(i)
                    exhausted = False
                except StopIteration:
                    self.ran_out[i] = True
            if exhausted:
                raise StopIteration
        index = self.idx
        self.idx += 1
        return tree_unflatten(out, self.c._spec), index, 0

    def _next_loader(self) -> None:
        self.current += 1
        self.idx = 0
        if self.current < len(self.c._flattened):
            self._open(self.current)

    # -- a training pass --------------------------------------------------------------------------
    def _start(self) -> None:
        saved, start = self.saved, self.start
        self.saved = None
        if start and saved and saved.get("kind") == "combined" and saved.get("mode") == self.mode \
                and len(saved.get("inner") or []) == len(self.c._flattened):
            self._resume(saved)
        elif start:
            self._replay_to(start)
        else:
            inner = (saved or {}).get("inner") if (saved or {}).get("kind") == "boundary" else None
            n = len(self.c._flattened)
            if self.mode == "sequential":
                if n:
                    self._open(0, 0, inner[0] if inner else None)
            else:
                for i in range(n):
                    self._open(i, 0, inner[i] if inner else None)

    def __iter__(self) -> Iterator[Any]:
        record = self.read_ahead > 0
        try:
            while True:
                try:
                    batch, _, self.dataloader_idx = self.next_triple()
                except StopIteration:
                    return
                self.produced += 1
                if record:
                    self._records.append((self.produced, self._snapshot(live=True)))
                yield batch
        finally:   # the pass is over (or left): its loaders' iterators and workers go (positions stay)
            for i, it in enumerate(self.iters):
                if callable(getattr(it, "close", None)):
                    it.close()
                elif it is not None:
                    _resume.release(self.passes[i], it)
            self.iters = [None] * len(self.iters)

    def _replay_to(self, start: int) -> None:
        """No position recorded for this pass: read its first ``start`` batches again."""
        import time

        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():
            self._open_all(None)
            t0 = time.perf_counter()
            got = 0
            for _ in range(start):
                try:
                    self.next_triple()
                except StopIteration:
                    break
                got += 1
            took = time.perf_counter() - t0
        if self.warn:
            warnings.warn(f"resuming mid-epoch: the checkpoint holds no position of the CombinedLoader's loaders "
                          f"(saved by another number of processes or another mode), so its first {start} batches "
                          f"were read again and discarded ({got} in {took:.2f} s). Exact only when every loader "
                          "gives the same batches on every pass", UserWarning, stacklevel=4)

    def _snapshot(self, live: bool) -> dict:
        inner = []
        for i, p in enumerate(self.passes):
            pos = None
            if isinstance(p, _resume.TrainPass) and p.holder is not None:
                pos = {"kind": _resume.STATE, "state": p.state_now()}
            inner.append({"cycle": self.cycle[i], "done": self.done[i], "ran_out": self.ran_out[i], "pos": pos,
                          "drawn": self.drawn[i]})
        return {"kind": "combined", "mode": self.mode, "current": self.current, "idx": self.idx, "inner": inner}

    def position(self, done: int) -> dict:
        """What a checkpoint records after ``done`` combined batches were trained."""
        if self.read_ahead and done != self.produced:
            rec = next((r for k, r in reversed(self._records) if k == done), None)
            if rec is None:
                return {"kind": "replay"}
            # the draws taken so far, also for the passes the loop read ahead into
            return dict(rec, inner=[dict(x, drawn=d) for x, d in zip(rec["inner"], self.drawn)])
        return self._snapshot(live=True)
