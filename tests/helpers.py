"""What the tests share, imported as ``from helpers import ...`` from any folder under
``tests/`` (pytest puts ``tests/`` on ``sys.path`` for ``conftest.py``):

- paths: ``ROOT`` (the repository), ``TESTS``, ``SCRIPTS`` (the subprocess scripts),
  ``PORTS`` (the ported examples), ``EXAMPLES``;
- environments for child processes: ``clean_env`` (no ``EMBER_`` setting and no launcher
  variable; ``quiet_env``: the same without Python's warnings), ``child_env`` (the test's ``EMBER_`` settings kept, the variables of a running
  process group or of ember's launcher removed);
- subprocess runners: ``run_python`` (a Python script from the repository root, exit 0
  asserted), ``run_ranks`` and ``rank_results`` (a script that starts its own ranks, and
  what each rank wrote), ``import_script`` (a script's module in the test's process), ``run_ember`` / ``start_ember`` / ``finish`` (``python -m ember ...``, every
  process's stacks shown and all killed on a hang), with ``launch_env``; ``run_job``
  (a job of several processes, output in files, stacks shown and all killed on a hang or
  when a process it started outlives it); ``in_process_cli`` (``ember.cli.main`` in the
  test's process: conftest.py's ``cli`` fixture) and ``one_line_error`` (a run that ended in one
  ``ember: error:`` line);
- ``compare_finals`` (a full run's and a resumed run's final state, bit for bit);
  ``passes_left_early`` (the batches of passes over a loader that a loop leaves early);
- W&B offline in a test's folder (``wandb_offline``); readers of what loggers wrote:
  ``wandb_records`` and ``wandb_history`` / ``wandb_config`` / ``wandb_artifacts`` (an
  offline W&B run file), and ``CaptureLogger`` (a real Logger that
  keeps what the Trainer sends it);
- the small data sets and modules (also re-exported by ``conftest.py``):
  ``regression_data``, ``LinearModule``, and ``reseal`` for crafted checkpoints.

The subprocess scripts share their own tiny regressor in ``tests/scripts/common.py``.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ember
from ember.loggers import Logger

# -- paths -----------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SCRIPTS = TESTS / "scripts"
PORTS = TESTS / "ports"
EXAMPLES = ROOT / "examples"


# -- environments for child processes -----------------------------------------------------------
# the variables of a running process group and of ember's launcher: a child that inherited
# them would take itself for one rank of the test's own (nonexistent) group
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "EMBER_LAUNCHER_PID", "EMBER_STRATEGY", "EMBER_PRECISION", "EMBER_TEST_DEVICES")


def clean_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without any ``EMBER_`` setting, torchelastic or SLURM variable or
    process-group address, one OpenMP thread, then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EMBER_", "TORCHELASTIC_", "SLURM_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def quiet_env(**extra: str) -> dict[str, str]:
    """``clean_env`` with Python's warnings off (the sharded strategies' scripts: the
    libraries' own warnings would bury an error in the captured output)."""
    return clean_env(PYTHONWARNINGS="ignore", **extra)


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without ``RANK_VARS`` and the torchelastic and SLURM variables, one
    OpenMP thread, then ``extra``. The test's other ``EMBER_`` settings (such as the suite's
    ``EMBER_CHECKPOINT_FSYNC=0``) reach the child."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


# -- subprocess runners -------------------------------------------------------------------------
def run_python(*args, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository root under ``clean_env(**env)``; asserts exit 0."""
    out = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=clean_env(**env),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def import_script(name: str):
    """Module ``name`` of tests/scripts/ imported in this process (its functions and classes
    run here too), ``SCRIPTS`` on ``sys.path`` only while it is imported (its own ``from common
    import ...`` included)."""
    import importlib
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))


def run_ranks(script: str, out: Path, *args, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """``python tests/scripts/SCRIPT OUT ARGS`` (a script that starts its own ranks) in ``out``
    under ``child_env(**env)``; asserts exit 0 (stderr's tail shown otherwise)."""
    p = subprocess.run([sys.executable, str(SCRIPTS / script), str(out), *map(str, args)], cwd=out,
                       env=child_env(**env), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def rank_results(out: Path, ranks: int = 2, name: str = "result_{}") -> list[dict]:
    """What each of ``ranks`` processes wrote to ``out/NAME.json``, ``{}`` in ``name`` standing
    for the rank (by default ``result_<rank>.json``: scripts/common.py's ``write_result``)."""
    return [json.loads((Path(out) / f"{name.format(r)}.json").read_text()) for r in range(ranks)]


def launch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """For ``python -m ember``: no ``EMBER_`` setting, a private config folder, ``OUT_FILE``
    in ``tmp_path``, one OpenMP thread, stacks printed on SIGABRT; then ``extra``."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "xdg"), OUT_FILE=str(tmp_path / "out.json"),
               OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    for key in list(env):
        if key.startswith("EMBER_"):
            del env[key]
    env.update(extra)
    return env


def start_ember(*args, env: dict[str, str], **kw) -> subprocess.Popen:
    """`python -m ember ARGS`, output captured."""
    return subprocess.Popen([sys.executable, "-m", "ember", *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts each worker in its own session)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``proc``; on a hang every process below it prints its Python stacks
    (PYTHONFAULTHANDLER), all are killed, and the test fails with their output."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pids = [proc.pid, *descendants(proc.pid)]
        for sig in (signal.SIGABRT, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                out, err = proc.communicate(timeout=10)
        pytest.fail(f"{proc.args} did not finish in {timeout} s\nstdout:\n{out[-3000:]}\n"
                    f"stderr:\n{err[-8000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _marked(mark: str) -> list[int]:
    """The live processes whose environment holds ``EMBER_TEST_RUN=<mark>``."""
    needle = f"EMBER_TEST_RUN={mark}".encode()
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as st:
                        if st.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                            out.append(int(entry))
        except (OSError, IndexError):
            continue
    return out


def run_job(cmd: list, *, out_dir: Path, env: dict[str, str], timeout: float, linger: float = 15,
            _port_retries: int = 2, **kw) -> subprocess.CompletedProcess:
    """Run a job of several processes (torchrun and its ranks) to its end, its output in
    ``out_dir/stdout.txt`` and ``stderr.txt`` (a pipe would keep the test waiting while
    any process of the job holds it). On a hang, and when a process the job started
    (every one carries a mark in its environment: a rank, a DataLoader worker) outlives it
    by more than ``linger`` seconds, each prints its Python stacks (PYTHONFAULTHANDLER) into
    the output, all are killed, and the test fails showing the output."""
    import uuid
    mark = uuid.uuid4().hex
    env = dict(env, EMBER_TEST_RUN=mark, PYTHONFAULTHANDLER="1")
    out_dir.mkdir(parents=True, exist_ok=True)
    so, se = out_dir / "stdout.txt", out_dir / "stderr.txt"
    with open(so, "w") as fo, open(se, "w") as fe:
        proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=fo, stderr=fe, **kw)
        problem = ""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            problem = f"did not finish in {timeout} s"
        end = time.monotonic() + linger
        while not problem and _marked(mark) and time.monotonic() < end:
            time.sleep(0.2)
        left = _marked(mark)
        if left and not problem:
            problem = f"ended (exit code {proc.returncode}) but processes it started outlived it by {linger} s: {left}"
        if problem:
            for sig in (signal.SIGABRT, signal.SIGKILL):
                for pid in [proc.pid, *_marked(mark)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                time.sleep(2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    out, err = so.read_text(errors="replace"), se.read_text(errors="replace")
    if problem:
        pytest.fail(f"{cmd} {problem}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-12000:]}")
    args = [str(c) for c in cmd]
    if proc.returncode and "EADDRINUSE" in err and "--master_port" in args and _port_retries > 0:
        # the port was free when the test picked it, and another test's job took it before torchrun's
        # store listened (nothing of the job ran): the same job on another port
        from ember.strategies.environments import find_free_port
        i = args.index("--master_port") + 1
        retry = [*args[:i], str(find_free_port()), *args[i + 1:]]
        return run_job(retry, out_dir=out_dir, env=env, timeout=timeout, linger=linger,
                       _port_retries=_port_retries - 1, **kw)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_ember(*args, env: dict[str, str], timeout: float = 90, **kw) -> subprocess.CompletedProcess:
    """`python -m ember ARGS` to its end (``finish``)."""
    return finish(start_ember(*args, env=env, **kw), timeout)


# -- resumed runs -------------------------------------------------------------------------------
def in_process_cli(tmp_path: Path, monkeypatch, capsys, *, path=()):
    """``run(*args)`` -> ``ember.cli.main(args)`` in this process (fast; what the ``ember``
    console script and ``python -m ember`` run) as a ``CompletedProcess`` with its exit code
    and captured output. For the test: the working directory is ``tmp_path``, ``path`` (such
    as ``examples/cli`` for toy.py, as PYTHONPATH does) comes first on ``sys.path``, a private
    config folder (``tmp_path/xdg``), and no ``EMBER_`` setting, SLURM, torchelastic or
    process-group variable (``RANK_VARS``). conftest.py's ``cli`` fixture is this runner."""
    from ember.cli import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*map(str, path), *sys.path])
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for key in [k for k in os.environ if k.startswith(("EMBER_", "SLURM_", "TORCHELASTIC_")) or k in RANK_VARS]:
        monkeypatch.delenv(key)

    def run(*args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return run


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """Asserts that ``r`` (an ``ember`` run) failed as a usage error: exit code 2 and one
    ``ember: error: ...`` line on stderr, no traceback; returns that line."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: error: "), r.stderr[-3000:]
    return lines[0]


def passes_left_early(loader, passes: int = 3, stop: int = 2) -> tuple[list, list]:
    """The first ``stop`` batches (as lists) of each of ``passes`` passes over a loader of
    ``(tensor,)`` batches, the loop leaving each pass early; then two draws from torch's
    global random stream (which the passes must leave as the reference library does)."""
    out = []
    for _ in range(passes):
        got = []
        for i, (b,) in enumerate(loader):
            got.append(b.tolist())
            if i + 1 == stop:
                break
        out.append(got)
    return out, torch.rand(2).tolist()


def compare_finals(out: Path) -> dict:
    """``out/final_full.pt`` and ``out/final_resume.pt`` (a run and the same run stopped and
    resumed) hold the same keys and bit-identical values; returns the first."""
    a = torch.load(out / "final_full.pt", weights_only=True)
    b = torch.load(out / "final_resume.pt", weights_only=True)
    assert a.keys() == b.keys() and len(a) > 20
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    return a


# -- what loggers wrote ---------------------------------------------------------------------------
def wandb_offline(monkeypatch, root: Path) -> None:
    """W&B for the test (through ``monkeypatch``): offline, silent, no console capture, no API
    key, and its run, data, cache and config folders under ``root``."""
    for var, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_records(run_dir) -> list:
    """Every record of an offline run's ``run-*.wandb`` file (W&B's
    LevelDB-style log: 7-byte file header, 32 KiB blocks, 7-byte chunk
    headers, protobuf ``Record`` payloads)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            out.append(pb.Record.FromString(buf))
            buf = b""
    return out


def _wandb_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_history(records) -> list[dict]:
    """The logged rows (W&B's own ``_`` keys left out)."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {_wandb_key(i): json.loads(i.value_json) for i in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def wandb_config(records) -> dict:
    """The run's config as it ends (W&B's own ``_wandb`` entry left out)."""
    cfg = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for u in updates:
            cfg[_wandb_key(u)] = json.loads(u.value_json)
    cfg.pop("_wandb", None)
    return cfg


def wandb_artifacts(records) -> list:
    return [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]


class CaptureLogger(Logger):
    """A real ember Logger that keeps what the Trainer sends it."""

    def __init__(self):
        self.calls: list[tuple[int, dict]] = []
        self.hparams: list[dict] = []
        self.status = None

    @property
    def experiment(self):
        return self

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params):
        self.hparams.append(dict(params))

    def finalize(self, status):
        self.status = status


# -- small data sets and modules ----------------------------------------------------------------
def reseal(ckpt) -> None:
    """Record the current size and content digest of every file ``meta.json`` lists, as a
    crafter of a consistent (but malicious or mismatched) checkpoint would."""
    from ember.checkpoint.trust import file_digest
    meta_file = os.path.join(ckpt, "meta.json")
    with open(meta_file) as f:
        meta = json.load(f)
    for name in meta.get("files", {}):
        fp = os.path.join(ckpt, name)
        meta["files"][name] = os.path.getsize(fp)
        if name in meta.get("digests", {}):
            meta["digests"][name] = file_digest(fp, meta["digests"][name].split(":")[0])
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def regression_data(n: int = 64, dim: int = 4, seed: int = 0) -> TensorDataset:
    """y = x @ w + 0.5 with a fixed w: an easy task every precision can learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.arange(1, dim + 1, dtype=torch.float32).unsqueeze(1) / dim
    return TensorDataset(x, x @ w + 0.5)


class LinearModule(ember.TrainModule):
    """Linear regression trained with SGD; logs ``train/loss`` per step and
    ``val/loss`` per epoch."""

    def __init__(self, dim: int = 4, lr: float = 0.1):
        super().__init__()
        self.lr = lr
        self.net = nn.Linear(dim, 1)

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# -- what a TensorBoard logger wrote --------------------------------------------------------
def tensorboard_events(log_dir):
    """TensorBoard's reader of the event files in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    return ea


def tensorboard_scalars(ea, tag):
    """``[(step, value)]`` of scalar ``tag``."""
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def tensorboard_hparams(ea):
    """The hparams session TensorBoard shows: ``(values, metric tags)``."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = ea.PluginTagToContent("hparams")
    ssi = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    exp = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    values = {k: getattr(v, v.WhichOneof("kind")) for k, v in ssi.hparams.items()}
    return values, [m.name.tag for m in exp.metric_infos]
