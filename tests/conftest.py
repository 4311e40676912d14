"""Shared fixtures for the tests: quiet Trainer arguments, a Trainer factory, the tiny
module and data loaders (from helpers.py, re-exported here), one torch thread
(``one_thread``), the in-process ``ember`` command (``cli``), and the process-wide torch
state put back after every test. Kept small and generic on purpose."""
from __future__ import annotations

import os

# The suite's checkpoints are throwaway: no fsync (a busy disk stalled fsync for tens of
# seconds and made timing-bound tests flaky). Subprocesses inherit it.
# tests/checkpoint/test_checkpoint_io.py::test_fsync_reaches_every_file_and_folder keeps that path tested.
os.environ.setdefault("EMBER_CHECKPOINT_FSYNC", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import ember  # noqa: E402
# the small modules and data sets live in helpers.py; `from conftest import LinearModule` keeps working
from helpers import EXAMPLES, LinearModule, in_process_cli, regression_data, reseal  # noqa: E402,F401


@pytest.fixture
def quiet(tmp_path) -> dict:
    """Trainer arguments without logger, checkpoints, progress bar or summary, on CPU
    (the core tests compare against plain CPU loops, also on a machine with a GPU)."""
    return dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path, devices="cpu")


@pytest.fixture
def make_trainer(quiet):
    """``make_trainer(**kw)`` -> a quiet Trainer (``kw`` overrides)."""
    def make(**kw):
        return ember.Trainer(**{**quiet, **kw})
    return make


@pytest.fixture
def linear_module():
    return LinearModule


@pytest.fixture
def data():
    """``data(n=64, batch_size=8, shuffle=False, dim=4, seed=0)`` -> DataLoader of regression_data."""
    def make(n: int = 64, batch_size: int = 8, shuffle: bool = False, dim: int = 4, seed: int = 0):
        return DataLoader(regression_data(n, dim, seed), batch_size=batch_size, shuffle=shuffle)
    return make


@pytest.fixture
def one_thread():
    """One intra-op torch thread for the test, the previous number after it: tiny models on a
    shared 2-core machine (a file opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``cli(*args)`` -> ``ember.cli.main(args)`` in this process as a ``CompletedProcess``
    (``helpers.in_process_cli``: working directory ``tmp_path``, a private config folder, no
    ``EMBER_`` or launcher variable), with examples/cli (toy.py) importable as PYTHONPATH in
    the docs makes it. A file that needs more (another folder on ``sys.path``, fixed leading
    arguments) wraps it in its own ``cli(cli, ...)`` fixture."""
    return in_process_cli(tmp_path, monkeypatch, capsys, path=[EXAMPLES / "cli"])


@pytest.fixture
def frozen_heap():
    """``gc.freeze()`` for the test: the objects that exist before it (in a pytest worker,
    every module and object the suite has made so far, hundreds of thousands) are left out of
    the full collections that the batch-size searches run on every retry (as Accelerate's
    do), which took a second or two each there. The collections still run, over what the
    test makes; ``gc.unfreeze()`` after it."""
    import gc
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _restore_global_torch_state():
    """Trainer(seed=..., deterministic=True) and some precisions change process-wide
    settings; put them back after every test."""
    seed_env = os.environ.get("EMBER_GLOBAL_SEED")
    workers_env = os.environ.get("EMBER_SEED_WORKERS")
    dtype = torch.get_default_dtype()
    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    if seed_env is None:
        os.environ.pop("EMBER_GLOBAL_SEED", None)
    else:
        os.environ["EMBER_GLOBAL_SEED"] = seed_env
    if workers_env is None:
        os.environ.pop("EMBER_SEED_WORKERS", None)
    else:
        os.environ["EMBER_SEED_WORKERS"] = workers_env
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(det, warn_only=det_warn)


def pytest_configure(config) -> None:
    """Compile ember's and the tests' sources to bytecode once, before any test starts a
    process. Much of the suite's time is Python processes starting (each rank of each
    multi-process test imports ember and the test script); where PYTHONDONTWRITEBYTECODE is
    set (as on the machines this suite was measured on) each of them would compile every ember module from source
    again. Python still reads __pycache__ under that setting; compileall writes it."""
    if hasattr(config, "workerinput"):      # a pytest-xdist worker: the controller did it
        return
    import compileall
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for folder in ("ember", "tests", "examples", "benchmarks"):
        if (root / folder).is_dir():
            compileall.compile_dir(root / folder, quiet=2, workers=0)


def pytest_collection_modifyitems(session, config, items) -> None:
    """The slowest files first (``tests/durations.json``), each file's tests in their
    order: pytest-xdist hands whole files to its workers in this order (with
    ``--no-loadscope-reorder``, as ``make test`` passes; by default xdist reorders the
    files by their number of tests), so the long ones start early instead of finishing
    alone at the end of the run."""
    from durations import load
    seconds = load()
    if not seconds:
        return
    root = config.rootpath

    def weight(item) -> float:
        try:
            rel = item.path.relative_to(root).as_posix()
        except ValueError:
            return 0.0
        return seconds.get(rel, 0.0)

    items.sort(key=lambda item: -weight(item))    # stable: each file keeps its order


@pytest.fixture(scope="session")
def ds_ops():
    """Compile DeepSpeed's CPU op once per machine (a no-op when already built), before any
    test launches DeepSpeed processes: their process groups' short timeouts are not sized
    for a first compile."""
    import subprocess
    import sys

    from helpers import quiet_env
    pytest.importorskip("deepspeed")
    r = subprocess.run([sys.executable, "-c", "from ember.strategies.deepspeed import prebuild_ops; "
                        "print(prebuild_ops())"], env=quiet_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
