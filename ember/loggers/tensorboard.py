"""TensorBoard logger: scalars and hparams in one run folder."""

from __future__ import annotations

import os
import time
from typing import Any

from ember.loggers.base import DEFAULT_NAME, FileLogger, add_prefix, check_status, flatten_params, to_scalar


#: the ``SummaryWriter`` keywords a TensorBoardLogger passes on (``log_dir`` is the logger's own)
_WRITER_KWARGS = frozenset({"comment", "purge_step", "max_queue", "flush_secs", "filename_suffix"})


class TensorBoardLogger(FileLogger):
    """Writes TensorBoard event files to ``save_dir/name/version_N``.

    Args:
        save_dir: root folder (``tensorboard --logdir save_dir`` shows every run).
        name: experiment folder under ``save_dir`` (``""``: none).
        version: ``None`` (next free ``version_N``), an int, or a folder name.
        default_hp_metric: also log ``hp_metric = -1`` with the hparams so the
            HPARAMS tab has a metric column (the Lightning default is True).
        prefix: prepended to every metric name as ``"{prefix}-{name}"``.
        handoff_secs: scalars are kept here and handed to the writer at most every this
            many seconds (and at every ``save``/``finalize``), each with the wall time it
            was logged at. The SummaryWriter's thread then wakes once per hand-off instead
            of once per scalar, and takes the GIL from the training thread that rarely
            (docs/benchmarks.md). ``0``: hand each call's scalars over at once.
        **writer_kwargs: passed to ``torch.utils.tensorboard.SummaryWriter``
            (``max_queue``, ``flush_secs``, ``filename_suffix``...).
    """

    def __init__(self, save_dir: str | os.PathLike, name: str | None = DEFAULT_NAME, version: int | str | None = None,
                 default_hp_metric: bool = False, prefix: str = "", handoff_secs: float = 5.0, **writer_kwargs: Any):
        unknown = sorted(set(writer_kwargs) - _WRITER_KWARGS)
        if unknown:   # never dropped silently (Fabric's root_dir= here would be lost)
            hint = (" (root_dir= is the Fabric logger's: ember.fabric.loggers.TensorBoardLogger(root_dir=...), "
                    "or save_dir= here)") if "root_dir" in unknown else ""
            raise TypeError(f"TensorBoardLogger: unexpected keyword argument(s) {unknown}{hint}; the SummaryWriter "
                            f"takes {sorted(_WRITER_KWARGS)}")
        super().__init__(save_dir, name=name, version=version, prefix=prefix)
        self._default_hp_metric = default_hp_metric
        self._writer_kwargs = writer_kwargs
        self._experiment = None
        self._hp_metric_names: dict[str, None] = {}   # the HPARAMS tab's metric columns (ordered)
        self._session: dict | None = None   # the hparams session waiting to be written, None when up to date
        self._session_written: dict | None = None   # what the run's event file first got (TensorBoard shows it)
        self._handoff_secs = float(handoff_secs)
        self._pending: list[tuple[str, Any, int, float]] = []
        self._handed_at = time.monotonic()

    @property
    def experiment(self):
        """The ``torch.utils.tensorboard.SummaryWriter`` (created on first use)."""
        if self._experiment is None:
            from ember.checkpoint.rng import keep_rng_states
            with keep_rng_states():   # a first import leaves the user's random streams as they were
                from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._writer_kwargs)
        return self._experiment

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write_session()   # the hparams session goes before the first metrics
        self._keep(metrics, step)

    def _keep(self, metrics: dict[str, float], step: int) -> None:
        """Keep scalars with their step and time; hand them to the writer every
        ``handoff_secs`` (its thread then wakes once for many)."""
        wall = time.time()
        self._pending.extend((k, to_scalar(v), step, wall) for k, v in add_prefix(metrics, self._prefix).items())
        if time.monotonic() - self._handed_at >= self._handoff_secs or len(self._pending) >= 1000:
            self._hand_off()

    def _hand_off(self) -> None:
        """Give the kept scalars to the SummaryWriter (its thread writes them)."""
        self._handed_at = time.monotonic()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        writer = self.experiment
        for k, v, step, wall in pending:
            if isinstance(v, dict):
                writer.add_scalars(k, v, step, walltime=wall)
            else:
                writer.add_scalar(k, v, step, walltime=wall)

    def log_hyperparams(self, params, metrics: dict[str, float] | None = None) -> None:
        """Merge ``params`` with the hyperparameters logged before (by hand or by the
        Trainer at the start of fit: neither replaces the other; a name logged twice takes
        the later value), write them all to ``hparams.yaml`` in ``log_dir`` and record
        them, flattened, in this run's event file, where TensorBoard's HPARAMS tab finds them.

        TensorBoard shows the first hyperparameter set an event file holds, so the set is
        written just before the first metrics (or at ``save()`` / ``finalize()``): what was
        logged by hand before ``fit`` and the module's hparams logged at its start appear
        together. Hyperparameters logged after the first metrics reach ``hparams.yaml``
        (and the event file), but the HPARAMS tab keeps the earlier set: a warning says so.

        ``metrics`` (optional) are logged as scalars at step 0 and registered as
        the hparams metrics; with ``default_hp_metric=True`` and no metrics,
        ``hp_metric = -1`` is used."""
        before = flatten_params(self._hparams)
        self._merge_hparams(params)
        self._write_hparams_yaml()
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        self._hp_metric_names.update(dict.fromkeys(metrics or {}))
        flat = flatten_params(self._hparams)
        if self._session is None and self._session_written is not None and flat == before \
                and not (set(metrics or {}) - set(self._session_written["metrics"])):
            pass   # nothing new for the HPARAMS tab
        else:
            self._session = {"hparams": flat, "metrics": list(self._hp_metric_names)}
        if metrics:
            self._keep(metrics, 0)
        if self._session_written is not None:
            self._write_session()   # TensorBoard keeps the first set: warned there

    def _write_session(self) -> None:
        """Write the pending hparams session into the event file."""
        session, self._session = self._session, None
        if session is None:
            return
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from torch.utils.tensorboard.summary import hparams
        if self._session_written is not None and not getattr(self, "_warned_late", False):
            import warnings
            new = sorted(set(session["hparams"]) - set(self._session_written["hparams"]) |
                         {k for k, v in session["hparams"].items() if self._session_written["hparams"].get(k, v) != v})
            warnings.warn(f"TensorBoardLogger: hyperparameters logged after the first metrics of {self.log_dir} "
                          f"({', '.join(new) or 'hp metrics'}) are in hparams.yaml, but TensorBoard's HPARAMS tab "
                          "shows the set the run's event file got first. Log them before the first metrics "
                          "(before fit, or in setup / on_fit_start)", UserWarning, stacklevel=3)
            self._warned_late = True
        exp, ssi, sei = hparams(session["hparams"], dict.fromkeys(session["metrics"], 0.0))
        file_writer = self.experiment._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)
        if self._session_written is None:
            self._session_written = session

    def save(self) -> None:
        self._write_session()
        self._hand_off()
        if self._experiment is not None:
            self._experiment.flush()

    def finalize(self, status: str) -> None:
        check_status(status)
        self._write_session()
        self._hand_off()
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
            # a later log call (e.g. trainer.test after fit) opens a new event
            # file in the same log_dir
            self._experiment = None
