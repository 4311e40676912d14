"""Checkpoint files: atomic directory writes, safetensors weights, safe ``torch.load``
(the layout: :mod:`ember.checkpoint.format`, docs/checkpoint_format.md).

Every write checks its target here, in :func:`make_staging`, so no caller can skip it:
no writer replaces or deletes anything that ember did not create.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import errno
import json
import os
import pathlib
import pickle
import re
import shutil
import uuid
import zipfile
from typing import Any, Callable, Iterator

import torch

from ember.checkpoint import trust as checks
from ember.checkpoint.format import (ALIAS_KEY, DCP_WEIGHTS_DIR, FORMAT_VERSION, INDEX_NAME, META_NAME,  # noqa: F401
                                     MAX_INDEX_BYTES, LEGACY_TMP_SUFFIX, STAGING_MARKER, STATE_NAME, TMP_SUFFIX, WEIGHTS_NAME,
                                     is_unfinished_name, tmp_path)
from ember.checkpoint.rng import collect_rng_states, restore_rng_states  # noqa: F401  (public here)
from ember.errors import CheckpointError, MisconfigurationError

#: set EMBER_CHECKPOINT_FSYNC=0 to skip fsync (tmpfs, throwaway runs); crash safety
#: against process kills is unaffected, against power loss it is not guaranteed then
FSYNC = os.environ.get("EMBER_CHECKPOINT_FSYNC", "1") != "0"

_TMP_SUFFIX = TMP_SUFFIX
_OLD_RE = re.compile(r"\.old-[0-9a-f]+$")


# -- atomic directories --------------------------------------------------------------
def _fsync_path(path: str, directory: bool = False) -> None:
    if not FSYNC:
        return
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:  # e.g. directories on Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    if not FSYNC:
        return
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            _fsync_path(os.path.join(dirpath, f))
        _fsync_path(dirpath, directory=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), a)


def commit_directory(tmp: str, path: str | os.PathLike, what: str = "commit_directory") -> None:
    """fsync a fully written ``tmp`` directory and move it to ``path``, replacing what is there
    only when ember may (:func:`ember.checkpoint.trust.not_replaceable`: an ember checkpoint,
    or a link of ember's); anything else raises CheckpointError and ``tmp`` is left as it is.

    On Linux an existing ``path`` is swapped with ``tmp`` in one ``renameat2``
    call, so ``path`` always holds a complete version. Elsewhere the previous one
    is first renamed to ``NAME.old-<hex>`` (ignored by checkpoint discovery): for
    a moment ``path`` is absent, but it never holds a partial directory.
    """
    path = os.path.normpath(os.fspath(path))
    checks.check_replace(path, what)
    marker = os.path.join(tmp, STAGING_MARKER)
    if os.path.lexists(marker):
        os.remove(marker)
    _fsync_tree(tmp)
    parent = os.path.dirname(path) or "."
    old = None
    if os.path.lexists(path):
        if os.path.isdir(path) and _exchange(tmp, path):
            _fsync_path(parent, directory=True)
            _remove(tmp)  # now holds the previous version
            return
        old = f"{path}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    _fsync_path(parent, directory=True)
    if old is not None:
        _remove(old)


def make_staging(path: str | os.PathLike, what: str = "write_checkpoint") -> str:
    """Check that a save may write checkpoint ``path`` and create its empty staging folder
    ``NAME.ember-tmp`` (:func:`tmp_path`, with ember's marker); return it. The target check
    (:func:`ember.checkpoint.trust.check_save_target`) comes first: a ``path`` that is not an ember checkpoint, or a ``NAME.ember-tmp`` that no ember
    save made, raises CheckpointError and nothing is touched. A stale staging folder of
    ember's (a save killed midway) is removed."""
    path = os.path.normpath(os.fspath(path))
    checks.check_save_target(path, what)
    tmp = tmp_path(path)
    if os.path.lexists(tmp):
        _remove(tmp)
    os.makedirs(tmp)
    with open(os.path.join(tmp, STAGING_MARKER), "w"):
        pass
    return tmp


def remove_staging(path: str | os.PathLike) -> None:
    """Remove the staging folder of checkpoint ``path`` after a failed save, when it is one
    that an ember save made (:func:`ember.checkpoint.trust.not_staging`); anything else
    stays."""
    tmp = tmp_path(path)
    if os.path.lexists(tmp) and not checks.not_staging(tmp):
        _remove(tmp)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, keep_existing_tmp: bool = False,
                     commit: "Callable[[str, str], None] | None" = None,
                     what: str = "write_checkpoint") -> Iterator[str]:
    """Yield ``NAME.ember-tmp`` to write into; on success fsync it and move it to ``NAME``
    (``commit(tmp, path)`` instead of :func:`commit_directory` when given).

    The target is checked first (:func:`make_staging`; ``what`` names the caller in the
    error). ``keep_existing_tmp``: other ranks already wrote shards into the staging folder
    made with :func:`make_staging` in this save, so it is kept. On an exception the staging
    directory is removed and the exception re-raised; ``NAME`` is untouched.
    """
    path = os.path.normpath(os.fspath(path))
    if keep_existing_tmp:   # the caller made it with make_staging, in this save
        checks.check_save_target(path, what, staging=False)
        tmp = tmp_path(path)
        os.makedirs(tmp, exist_ok=True)
    else:
        tmp = make_staging(path, what)
    try:
        yield tmp
        (commit or commit_directory)(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


# -- safetensors ---------------------------------------------------------------------
def _prepare_tensors(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Detach, dedupe tensors that are the same view of one storage (tied weights:
    kept once, the others become aliases), copy partial overlaps, make contiguous,
    move to CPU."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, list] = collections.defaultdict(list)  # storage -> [(view key, name, start, end)]
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise CheckpointError(f"state_dict keys must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        copy = False
        if t.device.type != "meta" and t.numel() > 0:
            skey = (str(t.device), t.untyped_storage().data_ptr())
            view = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            start = t.data_ptr()
            span = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
            end = start + span * t.element_size()
            target = None
            for v, other, s, e in seen[skey]:
                if v == view:
                    target = other
                    break
                if s < end and start < e:
                    copy = True
            if target is not None:
                aliases[name] = target
                continue
            seen[skey].append((view, name, start, end))
        if t.device.type != "cpu":
            t = t.to("cpu")
        elif copy and t.is_contiguous():
            t = t.clone()
        out[name] = t.contiguous()
    return out, aliases


def _str_metadata(metadata: dict | None) -> dict[str, str]:
    md = {"format": "pt"}  # transformers refuses safetensors metadata without it
    for k, v in (metadata or {}).items():
        md[str(k)] = v if isinstance(v, str) else json.dumps(v, default=str)
    return md


def save_safetensors(state_dict: dict, path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """Write tensors to one safetensors file (not atomic by itself: see :func:`save_weights_file`).

    Tensors that are the same view of one storage (tied weights) are stored once
    and recorded under ``metadata["ember.aliases"]``; :func:`load_safetensors`
    restores every key, tied again. Non-contiguous and non-CPU tensors are copied.
    """
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from safetensors.torch import save_file
    tensors, aliases = _prepare_tensors(state_dict)
    md = _str_metadata(metadata)
    if aliases:
        md[ALIAS_KEY] = json.dumps(aliases, sort_keys=True)
    save_file(tensors, os.fspath(path), metadata=md)


def _corrupt(path, err: BaseException) -> CheckpointError:
    return CheckpointError(f"{os.fspath(path)} is truncated or corrupt and cannot be loaded "
                           f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The text metadata of a safetensors file (without loading tensors)."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from safetensors import safe_open
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"weights file not found: {path}")
    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as err:
        raise _corrupt(path, err) from err


def load_safetensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a safetensors file written by :func:`save_safetensors` (or anyone else),
    restoring aliased (tied) keys as the same tensor."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from safetensors.torch import load_file
    path = os.fspath(path)
    md = read_safetensors_metadata(path)
    try:
        tensors = load_file(path, device=str(device))
    except Exception as err:
        raise _corrupt(path, err) from err
    if ALIAS_KEY in md:
        for alias, target in json.loads(md[ALIAS_KEY]).items():
            tensors[alias] = tensors[target]
    return tensors


def replace_file(path: str | os.PathLike, write: "Callable[[str], None]", suffix: str = ".tmp") -> None:
    """Write the file ``path`` atomically: ``write(tmp)`` fills a temporary file of a name of
    its own next to it (``<path>.<8 hex><suffix>``, never a file of the user's), which is
    fsynced and renamed over ``path``: a reader sees the old file or the new one, never a
    part. On any error the temporary file is removed and ``path`` is left as it was. The
    caller checks first that ``path`` may be replaced (:func:`ember.checkpoint.trust.check_replace`,
    ``check_output_path``). ``ember`` writes every single file this way (weights files,
    the ``last`` copy, predictions, the run report's page)."""
    path = os.fspath(path)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}{suffix}"
    try:
        write(tmp)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    _fsync_path(os.path.dirname(path) or ".", directory=True)


def save_weights_file(path: str | os.PathLike, weights: dict,
                      metadata: dict[str, str] | None = None) -> None:
    """Write a single ``.safetensors`` file atomically (:func:`replace_file`). An
    existing ``path`` is replaced only when ember wrote it (its metadata carries
    :data:`ember.checkpoint.trust.WEIGHTS_MARKER`); anything else raises CheckpointError."""
    path = os.fspath(path)
    checks.check_replace(path, "save_weights_file")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    replace_file(path, lambda tmp: save_safetensors(
        weights, tmp, {**(metadata or {}), checks.WEIGHTS_MARKER: str(FORMAT_VERSION)}), _TMP_SUFFIX)


# -- safe torch.save / torch.load ------------------------------------------------------
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray,
               torch.Size, torch.dtype, torch.device, torch.layout)


def _safe_value(obj: Any, where: str) -> Any:
    """Check that ``obj`` loads with ``torch.load(weights_only=True)``; convert numpy
    arrays/scalars to tensors/numbers and paths to strings. Raise CheckpointError
    naming the offending entry otherwise (at save time, not at resume time)."""
    tp = type(obj)
    if isinstance(obj, torch.Tensor) or tp in _LEAF_TYPES:
        return obj
    if tp in (dict, collections.OrderedDict, collections.Counter):
        return tp((_safe_value(k, f"{where} key"), _safe_value(v, f"{where}[{k!r}]")) for k, v in obj.items())
    if tp in (list, tuple, set):
        return tp(_safe_value(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if tp.__module__ == "numpy" or tp.__module__.startswith("numpy."):
        import numpy as np
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            return torch.from_numpy(np.ascontiguousarray(obj).copy())
        if isinstance(obj, np.generic):
            return obj.item()
    if tp in torch.serialization.get_safe_globals():
        return obj
    raise CheckpointError(
        f"{where} is a {tp.__module__}.{tp.__qualname__}, which torch.load(weights_only=True) cannot "
        "load; checkpoint state must hold only tensors, numbers, strings and plain "
        "dict/list/tuple/set containers (or types registered with torch.serialization.add_safe_globals)")


def savable(obj: Any, where: str = "state") -> Any:
    """``obj`` as :func:`save_torch` writes it (numpy values as tensors and numbers, paths
    as strings), or CheckpointError naming the entry (``where[...]``) that
    ``torch.load(weights_only=True)`` could not read back. Read-only: every rank of a
    save can run it before anything is written, so all raise the same error."""
    return _safe_value(obj, where)


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` an object that :func:`load_torch` can read back safely.

    Raises CheckpointError naming the entry if ``obj`` holds something that is not
    a tensor, number, string or plain container (numpy values and paths are converted).
    """
    torch.save(_safe_value(obj, "state"), os.fspath(path))


def load_torch(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True, map_location="cpu")``; never executes pickled code."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"file not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        msg = str(err)
        if "Weights only load failed" in msg or "Unsupported" in msg:
            m = re.search(r"GLOBAL ([\w.]+)", msg) or re.search(r"Unsupported[^:]*: ([^\n]+)", msg)
            what = f" ({m.group(1).strip()})" if m else ""
            raise CheckpointError(
                f"refusing to load {path}: it contains objects that are not plain tensors/containers"
                f"{what}, and unpickling them could execute arbitrary code. ember checkpoints only "
                "hold tensors, numbers, strings and containers.") from None
        raise _corrupt(path, err) from err
    except (EOFError, RuntimeError, OSError, ValueError, zipfile.BadZipFile, KeyError) as err:
        raise _corrupt(path, err) from err


# -- checkpoint directories -----------------------------------------------------------------
def write_checkpoint(path: str | os.PathLike, weights: dict | None, trainer_state: dict | None,
                     meta: dict, keep_existing_tmp: bool = False, extra_files: dict[str, int] | None = None,
                     digest_extra: tuple[str, ...] = (),
                     commit: "Callable[[str, str], None] | None" = None, what: str = "write_checkpoint") -> str:
    """Write checkpoint directory ``path`` atomically and return its path.

    ``weights=None`` writes no ``model.safetensors`` (a sharded strategy has
    already written ``model/`` into ``tmp_path(path)``: pass ``keep_existing_tmp=True``).
    ``trainer_state=None`` makes a weights-only checkpoint. ``meta.json`` goes last and
    lists every file with its size, ``extra_files`` (``{relative name: bytes}``, e.g. a
    sharded strategy's verified shard files) included, so a load checks them all, and
    the content digest of ``model.safetensors``, ``trainer_state.pt`` and the extra files
    named in ``digest_extra``, so a load refuses a swapped or corrupted file.
    ``commit``: see :func:`atomic_directory` (a background save's drop check).
    """
    import ember
    path = os.path.normpath(os.fspath(path))
    meta = dict(meta or {})
    meta.update(format_version=FORMAT_VERSION, ember_version=getattr(ember, "__version__", "unknown"),
                torch_version=torch.__version__,
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    try:
        with atomic_directory(path, keep_existing_tmp=keep_existing_tmp, commit=commit, what=what) as tmp:
            files = {}
            if weights is not None:
                save_safetensors(weights, os.path.join(tmp, WEIGHTS_NAME))
                files[WEIGHTS_NAME] = os.path.getsize(os.path.join(tmp, WEIGHTS_NAME))
            elif not os.path.isdir(os.path.join(tmp, DCP_WEIGHTS_DIR)):
                raise CheckpointError(f"write_checkpoint({path!r}): weights=None but no "
                                      f"{DCP_WEIGHTS_DIR}/ folder was written into {tmp}")
            if trainer_state is not None:
                save_torch(trainer_state, os.path.join(tmp, STATE_NAME))
                files[STATE_NAME] = os.path.getsize(os.path.join(tmp, STATE_NAME))
            digests = {n: checks.file_digest(os.path.join(tmp, n)) for n in files}
            files.update(extra_files or {})
            digests.update({n: checks.file_digest(checks.member(tmp, n)) for n in digest_extra})
            meta["files"], meta["digests"] = files, digests
            # written whole under a hidden name, then renamed: a kill leaves no half meta.json
            staged = os.path.join(tmp, ".tmpmeta")
            with open(staged, "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True, default=str)
            os.replace(staged, os.path.join(tmp, META_NAME))
            _set_modes(tmp)
    except (OSError, RuntimeError) as err:
        raise checks.write_error(err, path) from err
    return path


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete checkpoint directory ``path``, or refuse (CheckpointError naming it) when it
    is not recognisably one (:func:`ember.checkpoint.trust.not_a_checkpoint`: it holds
    other files, or a ``meta.json`` that is not ember's). ``meta.json`` goes first, so a
    deletion cut short leaves a folder that no longer counts as a checkpoint."""
    path = os.path.normpath(os.fspath(path))
    why = checks.not_a_checkpoint(path, staging=True)
    if why:
        raise CheckpointError(f"refusing to delete {path}: it is not an ember checkpoint ({why})")
    meta = os.path.join(path, META_NAME)
    if os.path.lexists(meta):
        os.remove(meta)
        _fsync_path(path, directory=True)
    shutil.rmtree(path)


def _set_modes(root: str) -> None:
    """One mode for every file of a checkpoint (safetensors writes 0600, the rest 0644)."""
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            os.chmod(os.path.join(dirpath, n), checks.FILE_MODE)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True for a complete checkpoint directory (has ``meta.json``; not a staging dir)."""
    path = os.path.normpath(os.fspath(path))
    name = os.path.basename(path)
    return (os.path.isdir(path) and not is_unfinished_name(name) and not _OLD_RE.search(name)
            and os.path.isfile(os.path.join(path, META_NAME)))


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def list_checkpoints(dirpath: str | os.PathLike) -> list[str]:
    """Paths of the complete checkpoints directly under ``dirpath``, oldest first.

    Staging (``*.ember-tmp``, and an earlier version's ``*.tmp``) and replaced (``*.old-*``)
    directories and plain files are ignored.
    """
    dirpath = os.fspath(dirpath)
    if not os.path.isdir(dirpath):
        return []
    found = []
    for name in os.listdir(dirpath):
        p = os.path.join(dirpath, name)
        if is_checkpoint(p):
            try:
                found.append((os.stat(os.path.join(p, META_NAME)).st_mtime_ns, _natural(name), p))
            except OSError:  # removed meanwhile
                continue
    return [p for _, _, p in sorted(found)]


def resolve_last(dirpath: str | os.PathLike) -> str | None:
    """The most recently written complete checkpoint under ``dirpath``, or None."""
    found = list_checkpoints(dirpath)
    return found[-1] if found else None


def _missing_message(path: str) -> str:
    parent, name = os.path.split(os.path.normpath(path))
    parent = parent or "."
    msg = f"checkpoint not found: {path} does not exist."
    if not os.path.isdir(parent):
        return msg + f" Its directory {parent} does not exist either."
    for n in os.listdir(parent):  # left by a replacement interrupted where renameat2 is missing
        if n.startswith(name + ".old-") and os.path.isfile(os.path.join(parent, n, META_NAME)):
            msg += f" An interrupted save left the previous complete version at {os.path.join(parent, n)}."
    found = [os.path.basename(p) for p in list_checkpoints(parent)]
    more = f" (the newest 10 of {len(found)})" if len(found) > 10 else ""
    return msg + (f" Checkpoints in {parent}{more}: {', '.join(found[-10:])}." if found
                  else f" There are no complete checkpoints in {parent}.")


def read_checkpoint(path: str | os.PathLike, load_state: bool = True
                    ) -> tuple[dict[str, torch.Tensor] | None, dict | None, dict]:
    """Read a checkpoint: ``(weights, trainer_state or None, meta)``, all on CPU.

    - a ``.safetensors`` file: weights only, ``(weights, None, {})``;
    - a directory with ``model.safetensors.index.json`` and no ``meta.json``
      (a sharded export): weights only;
    - a checkpoint whose weights are a DCP folder ``model/``: ``weights`` is None
      (the sharded strategy loads that folder itself);
    - ``load_state=False`` skips ``trainer_state.pt``.

    Raises CheckpointError for a missing path, an incomplete directory, truncated
    or corrupt files and files that would need arbitrary unpickling.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(_missing_message(path))
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return load_safetensors(path), None, {}
        if os.path.basename(path) == INDEX_NAME:
            return load_model_sharded(os.path.dirname(path) or "."), None, {}
        raise CheckpointError(f"{path} is a file; an ember checkpoint is a directory holding "
                              f"{META_NAME}, {WEIGHTS_NAME} and {STATE_NAME} (or pass a .safetensors file)")
    meta_file = os.path.join(path, META_NAME)
    if not os.path.isfile(meta_file):
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return load_model_sharded(path), None, {}
        hint = " (a staging directory of a save that did not finish)" if is_unfinished_name(path) else ""
        contents = sorted(os.listdir(path))
        raise CheckpointError(f"checkpoint {path} is incomplete{hint}: it has no {META_NAME}, which is "
                              f"written last when a save completes. Contents: {contents[:10] or 'nothing'}"
                              + (f" and {len(contents) - 10} more" if len(contents) > 10 else ""))
    meta = read_meta_checked(path)
    wfile = checks.member(path, WEIGHTS_NAME)
    if os.path.isfile(wfile):
        weights = load_safetensors(wfile)
    elif os.path.isdir(checks.member(path, DCP_WEIGHTS_DIR)):
        if meta.get("strategy") not in checks.SHARDED_STRATEGIES:
            raise CheckpointError(f"refusing checkpoint {path}: it has a {DCP_WEIGHTS_DIR}/ folder but "
                                  f"{META_NAME} says strategy {meta.get('strategy')!r}, not a sharded one "
                                  f"({', '.join(checks.SHARDED_STRATEGIES)})")
        checks.check_tree(os.path.join(path, DCP_WEIGHTS_DIR))
        weights = None
    else:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has neither {WEIGHTS_NAME} "
                              f"nor a {DCP_WEIGHTS_DIR}/ folder")
    state = None
    sfile = checks.member(path, STATE_NAME)
    if load_state and os.path.isfile(sfile):
        state = load_torch(sfile)
        if not isinstance(state, dict):
            raise CheckpointError(f"{sfile} holds a {type(state).__name__}, expected a dict")
    return weights, state, meta


def read_meta_checked(path: str | os.PathLike) -> dict:
    """``meta.json`` of checkpoint directory ``path``, parsed within limits and checked
    (format version, ``files`` names inside the directory, their sizes and digests)."""
    path = os.fspath(path)
    meta = checks.read_meta(checks.member(path, META_NAME))
    checks.check_sizes(path, checks.check_meta(meta, path))
    checks.check_digests(path, meta)
    return meta


def _shape(s) -> str:
    return "(" + ", ".join(str(d) for d in s) + ")"


def _listing(title: str, items: list[str], limit: int = 10) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"  {title} ({len(items)}): " + ", ".join(items[:limit]) + more


def _kind(dtype: torch.dtype) -> str:
    return ("complex" if dtype.is_complex else "float" if dtype.is_floating_point
            else "bool" if dtype == torch.bool else "int")


def check_compatible(module: torch.nn.Module, weights: dict | None, path: str | os.PathLike,
                     strict: bool = True) -> None:
    """Raise CheckpointError if ``weights`` do not fit ``module``: lists missing and
    unexpected keys (only when ``strict``), shape mismatches and dtype kind changes
    (float vs int vs bool: a header rewritten from F32 to I32 would load garbage). ``weights=None`` is a no-op."""
    if weights is None:
        return
    expected = module.state_dict()
    missing = [k for k in expected if k not in weights] if strict else []
    unexpected = [k for k in weights if k not in expected] if strict else []
    shapes = [f"{k}: checkpoint {_shape(weights[k].shape)} vs model {_shape(v.shape)}"
              for k, v in expected.items() if k in weights and tuple(weights[k].shape) != tuple(v.shape)]
    dtypes = [f"{k}: checkpoint {weights[k].dtype} vs model {v.dtype}" for k, v in expected.items()
              if k in weights and _kind(weights[k].dtype) != _kind(v.dtype)]
    if not (missing or unexpected or shapes or dtypes):
        return
    lines = [f"checkpoint {os.fspath(path)} does not match the model ({type(module).__name__}):"]
    if missing:
        lines.append(_listing("missing keys", missing))
    if unexpected:
        lines.append(_listing("unexpected keys", unexpected))
    if shapes:
        lines.append(_listing("shape mismatches", shapes))
    if dtypes:
        lines.append(_listing("dtype mismatches", dtypes))
    for prefix in ("module.", "_orig_mod.", "model."):
        if unexpected and all(k.startswith(prefix) for k in unexpected) and \
                any(k[len(prefix):] in expected for k in unexpected):
            lines.append(f"  hint: the checkpoint keys carry a '{prefix}' prefix (saved from a wrapped model)")
            break
    raise CheckpointError("\n".join(lines))


# -- sharded export (Hugging Face layout) ---------------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str, arg: str = "max_shard_size") -> int:
    """``500MB`` -> 500_000_000, ``2GiB`` -> 2 * 2**30; ints are bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if m and m.group(2).upper() in _UNITS and float(m.group(1)) > 0:
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise MisconfigurationError(f"{arg}={size!r} is not valid; give a positive number of bytes or a "
                                "string such as '500MB', '2GB' or '1GiB'")


_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def save_model_sharded(state_dict: dict, save_dir: str | os.PathLike, max_shard_size: int | str = "10GB",
                       metadata: dict[str, str] | None = None) -> list[str]:
    """Export weights as Hugging Face-style safetensors: ``model.safetensors`` when they
    fit in one shard, else the shards and ``model.safetensors.index.json`` of
    ``huggingface_hub.split_torch_state_dict_into_shards`` (what transformers' ``save_pretrained``
    writes; that package is needed then). Tied tensors stay together in one shard.
    Returns the written file names. Stale shards and index of an earlier export are removed
    when ember wrote them; a weights file or index ember did not write is never replaced
    (CheckpointError)."""
    limit = parse_size(max_shard_size)
    save_dir = os.fspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    for name in os.listdir(save_dir):    # before anything is written: only ember's weights are replaced
        if _SHARD_RE.match(name) or name in (WEIGHTS_NAME, INDEX_NAME):
            checks.check_replace(os.path.join(save_dir, name), f"save_model({save_dir!r})")
    tensors, aliases = _prepare_tensors(state_dict)
    files, index = {WEIGHTS_NAME: list(tensors)}, None
    if sum(t.numel() * t.element_size() for t in tensors.values()) > limit:
        from ember.checkpoint.rng import import_optional
        hub = import_optional("huggingface_hub", f"save_model(max_shard_size={max_shard_size!r})",
                              'pip install huggingface_hub (or "ember[transformers]")')
        split = hub.split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                       max_shard_size=limit)
        files = split.filename_to_tensors
        index = {"metadata": {**split.metadata, checks.WEIGHTS_MARKER: str(FORMAT_VERSION)},
                 "weight_map": split.tensor_to_filename} if split.is_sharded else None
    followers = collections.defaultdict(list)
    for alias, target in aliases.items():
        followers[target].append(alias)
    for fname, keys in files.items():
        save_weights_file(os.path.join(save_dir, fname),
                          {k: tensors[key] for key in keys for k in (key, *followers[key])}, metadata)
    keep = set(files)
    if index is not None:
        tmp = os.path.join(save_dir, INDEX_NAME + _TMP_SUFFIX)
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(save_dir, INDEX_NAME))
        keep.add(INDEX_NAME)
    for stale in os.listdir(save_dir):   # an earlier export's weights (ember's: checked above)
        if stale not in keep and (_SHARD_RE.match(stale) or stale in (INDEX_NAME, WEIGHTS_NAME)):
            os.remove(os.path.join(save_dir, stale))
    _fsync_path(save_dir, directory=True)
    return sorted(keep)


def read_index(index_file: str | os.PathLike) -> tuple[dict[str, str], list[str]]:
    """A sharded safetensors index (``model.safetensors.index.json``): ``(weight_map,
    shard paths)``. Every shard name must be a plain relative name of a regular file in
    the index's folder (:func:`ember.checkpoint.trust.member_file`): ``../victim/x.safetensors``,
    an absolute path or a symlink out is refused on the name, before any file is opened."""
    index_file = os.fspath(index_file)
    folder = os.path.dirname(index_file) or "."
    try:
        if os.path.getsize(index_file) > MAX_INDEX_BYTES:
            raise ValueError(f"larger than the {MAX_INDEX_BYTES} bytes ember reads")
        with open(index_file, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
    except (ValueError, KeyError, TypeError, OSError, RecursionError) as err:
        raise CheckpointError(f"{index_file} is not a safetensors index (JSON with a 'weight_map' object): "
                              f"{type(err).__name__}: {err}") from err
    names = list(dict.fromkeys(weight_map.values()))
    for name in names:      # every name first: nothing is opened when one of them is refused
        checks.member(folder, name, os.path.basename(index_file))
    return weight_map, [checks.member_file(folder, n, os.path.basename(index_file)) for n in names]


def load_model_sharded(save_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load what :func:`save_model_sharded` (or ``transformers``' ``save_pretrained``) wrote."""
    save_dir = os.fspath(save_dir)
    index_file = os.path.join(save_dir, INDEX_NAME)
    if os.path.isfile(index_file):
        weight_map, shards = read_index(index_file)
        out: dict[str, torch.Tensor] = {}
        for fp in sorted(shards):
            out.update(load_safetensors(fp))
        missing = [k for k in weight_map if k not in out]
        if missing:
            raise CheckpointError(f"{index_file} lists tensors that no shard holds: {missing[:10]}")
        return out
    single = os.path.join(save_dir, WEIGHTS_NAME)
    if os.path.isfile(single):
        return load_safetensors(single)
    raise CheckpointError(f"no weights in {save_dir}: expected {WEIGHTS_NAME} or {INDEX_NAME}")
