"""What makes an untrusted checkpoint safe to open, and a save safe to start: every such
check, once. The threat model and what each check guarantees: docs/checkpoint_format.md,
"Threat model".

Also here: ember's one YAML reader (:func:`load_yaml`: configs, command-line values,
launch files, run folders), where a single output file may be written
(:func:`check_output_path`), and how an ``OSError`` while writing is reported
(:func:`write_error`).
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
import stat
import warnings
from typing import Any

from ember.checkpoint import format as cio
from ember.checkpoint.format import FORMAT_VERSION, META_NAME
from ember.errors import CheckpointError, MisconfigurationError

#: meta.json larger than this is refused before it is parsed
MAX_META_BYTES = 4 * 2**20
#: nesting deeper than this (objects/arrays) is refused before it is parsed
MAX_META_DEPTH = 32
#: one file mode for every checkpoint file (``umask`` still applies to it)
FILE_MODE = 0o644
SHARDED_STRATEGIES = ("fsdp", "model_parallel", "deepspeed")
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"')


# -- paths ----------------------------------------------------------------------------
def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True when ``path``, all symlinks resolved, is ``root`` or lies under it."""
    real, rroot = os.path.realpath(path), os.path.realpath(root)
    try:
        return os.path.commonpath([real, rroot]) == rroot
    except ValueError:   # different drives
        return False


def member(root: str | os.PathLike, name: Any, where: str = "") -> str:
    """``root/name`` for a plain relative name that stays inside ``root`` (symlinks
    resolved); CheckpointError otherwise. ``where`` names the file that listed it."""
    root = os.fspath(root)
    bad = None
    if not isinstance(name, str) or not name:
        bad = "is not a file name"
    elif os.path.isabs(name) or "\\" in name or ":" in name:
        bad = "is not a relative path"
    elif any(p in ("", ".", "..") for p in name.split("/")):
        bad = "leaves the checkpoint directory (or has empty/'.'/'..' parts)"
    full = os.path.join(root, *name.split("/")) if bad is None else ""
    if bad is None and os.path.lexists(full) and not inside(full, root):
        bad = f"is a symlink to {os.path.realpath(full)}, outside the checkpoint"
    if bad:
        raise CheckpointError(f"refusing checkpoint {root}: {where + ' lists ' if where else ''}"
                              f"{name!r}, which {bad}")
    return full


def member_file(root: str | os.PathLike, name: Any, where: str = "") -> str:
    """:func:`member`, and it must be a regular file (symlinks resolved, inside ``root``):
    a FIFO, a device or a folder is refused before it is opened (opening a FIFO blocks)."""
    full = member(root, name, where)
    try:
        st = os.stat(full)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {os.fspath(root)} is incomplete: "
                              f"{where + ' lists ' if where else ''}{name!r}, which is missing") from None
    except OSError as err:
        raise CheckpointError(f"refusing checkpoint {os.fspath(root)}: {name!r} cannot be read "
                              f"({type(err).__name__}: {err})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"refusing checkpoint {os.fspath(root)}: {where + ' lists ' if where else ''}"
                              f"{name!r}, which is not a regular file ({_kind(st.st_mode)})")
    return full


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a plain file"


def check_tree(root: str | os.PathLike) -> None:
    """Every entry under ``root`` (a DCP folder) stays inside it (no symlink out) and
    every file is a regular file (no FIFO or device, which would block or never end)."""
    root = os.fspath(root)
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            rel = os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/")
            if n in files:
                member_file(root, rel)
            else:
                member(root, rel)


# -- meta.json ------------------------------------------------------------------------
def read_meta(meta_file: str | os.PathLike) -> dict:
    """Parse a checkpoint's ``meta.json`` within size and depth limits."""
    meta_file = os.fspath(meta_file)
    try:
        size = os.path.getsize(meta_file)
        if size > MAX_META_BYTES:
            raise CheckpointError(f"{meta_file} is {size} bytes, more than the {MAX_META_BYTES} ember reads; "
                                  "it is not an ember meta.json")
        with open(meta_file, encoding="utf-8") as f:
            text = f.read(MAX_META_BYTES + 1)
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_file} cannot be read ({type(err).__name__}: {err})") from err
    depth = deepest = 0
    for ch in _STRINGS.sub("", text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_META_DEPTH:
                raise CheckpointError(f"{meta_file} nests deeper than {MAX_META_DEPTH} levels; "
                                      "it is not an ember meta.json")
        elif ch in "]}":
            depth -= 1
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{meta_file} is truncated or corrupt ({type(err).__name__}: {err})") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} is corrupt: expected a JSON object, got {type(meta).__name__}")
    return meta


# -- YAML (configs, launch files, run folders) -------------------------------------------------
#: a YAML document larger than this, its aliases expanded (mapping keys and values, list
#: items and scalars each count one), is refused while it is read: a "billion laughs" file
MAX_YAML_NODES = 200_000
#: a YAML document nested deeper than this (its aliases expanded) is refused while it is read
MAX_YAML_DEPTH = 64
_YAML_LOADER: Any = None


class YAMLLimitError(ValueError):
    """A YAML document beyond :data:`MAX_YAML_NODES` or :data:`MAX_YAML_DEPTH` (or with an
    alias to the node that holds it). ``problem`` says which; ``line`` / ``column``
    (1-based, or None) where it was found."""

    def __init__(self, problem: str, mark: Any = None) -> None:
        self.problem = problem
        self.line = mark.line + 1 if mark is not None else None
        self.column = mark.column + 1 if mark is not None else None
        where = f" (line {self.line}, column {self.column})" if mark is not None else ""
        super().__init__(problem + where)


def _keep_rng_states_if_torch():
    """``keep_rng_states()`` in a process that has torch (a training process: the user's
    random streams are kept across a first import); a null context in one without it
    (``ember launch`` reads YAML through this module and stays torch-free)."""
    import contextlib
    import sys
    if "torch" not in sys.modules:
        return contextlib.nullcontext()
    from ember.checkpoint.rng import keep_rng_states
    return keep_rng_states()


def _bounded_loader() -> Any:
    """PyYAML's ``SafeLoader``, composing within :data:`MAX_YAML_NODES` and :data:`MAX_YAML_DEPTH`.

    The composer records, for every node it builds, the size and height it has with every
    alias expanded (an alias adds the recorded numbers of its anchor: constant work per
    node), and stops at the first node past a bound, before anything is built from it. The
    depth of the nesting being read is counted as it descends, so a deep file stops before
    Python's recursion limit is reached."""
    global _YAML_LOADER
    if _YAML_LOADER is not None:
        return _YAML_LOADER
    with _keep_rng_states_if_torch():
        import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self._ember_depth = 0
            self._ember_seen: dict[int, tuple[int, int, Any]] = {}   # id(node) -> (size, height, node)

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                anchored = self.anchors.get(event.anchor)
                if anchored is not None and id(anchored) not in self._ember_seen:
                    raise YAMLLimitError(f"the alias *{event.anchor} refers to a node that holds it "
                                         "(a structure without end)", event.start_mark)
                return super().compose_node(parent, index)
            self._ember_depth += 1
            if self._ember_depth > MAX_YAML_DEPTH:
                raise YAMLLimitError(f"it nests deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
            try:
                node = super().compose_node(parent, index)
            finally:
                self._ember_depth -= 1
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            else:
                children = []
            seen = [self._ember_seen[id(c)] for c in children]
            size = 1 + sum(s for s, _, _ in seen)
            height = 1 + max((h for _, h, _ in seen), default=0)
            if size > MAX_YAML_NODES:
                raise YAMLLimitError(f"its aliases expand to more than {MAX_YAML_NODES} values (a \"billion "
                                     "laughs\" document)", event.start_mark)
            if height > MAX_YAML_DEPTH:
                raise YAMLLimitError(f"with its aliases expanded it nests deeper than {MAX_YAML_DEPTH} levels",
                                     event.start_mark)
            self._ember_seen[id(node)] = (size, height, node)
            return node

    _YAML_LOADER = BoundedSafeLoader
    return _YAML_LOADER


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` within ember's bounds: the one YAML reader of ember (configs,
    command-line values, launch files, run folders). Raises :class:`YAMLLimitError` for a
    document past :data:`MAX_YAML_NODES` values or :data:`MAX_YAML_DEPTH` levels (aliases
    expanded), and ``yaml.YAMLError`` for one that is not YAML."""
    with _keep_rng_states_if_torch():
        import yaml
    loader = _bounded_loader()(stream)
    try:
        return loader.get_single_data()
    except RecursionError:   # a bound above should stop every deep document first
        raise YAMLLimitError(f"it nests too deep to read (more than {MAX_YAML_DEPTH} levels)") from None
    except yaml.YAMLError:
        raise
    finally:
        loader.dispose()


def _version(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", str(v).split("+")[0])[:3])


def check_meta(meta: dict, path: str | os.PathLike, require_files: bool = True) -> dict[str, int]:
    """Check a parsed ``meta.json`` of checkpoint ``path``; return its ``files`` as
    ``{name: size}``. Refuses an empty meta, an unknown ``format_version`` and bad
    ``files`` entries; warns for a newer ember or another torch."""
    import torch

    import ember
    path = os.fspath(path)
    meta_file = os.path.join(path, META_NAME)
    if not meta:
        raise CheckpointError(f"{meta_file} is empty ({{}}): it has none of the entries ember writes "
                              "(format_version, files, ...), so the checkpoint cannot be checked")
    fv = meta.get("format_version")
    if isinstance(fv, bool) or not isinstance(fv, int) or fv != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file}: format_version {fv!r} is not one this ember reads "
                              f"({FORMAT_VERSION}); " + ("a newer ember wrote it: upgrade ember"
                                                         if isinstance(fv, int) and fv > FORMAT_VERSION
                                                         else "it is not an ember checkpoint"))
    files = meta.get("files", {} if not require_files else None)
    if not isinstance(files, dict):
        raise CheckpointError(f"{meta_file}: 'files' is {type(files).__name__}, expected an object "
                              "{name: size in bytes}")
    for name, size in files.items():
        member(path, name, META_NAME)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{meta_file}: the size recorded for {name!r} is {size!r}, not a byte count")
    theirs, ours = meta.get("ember_version"), getattr(ember, "__version__", "0")
    if theirs and _version(theirs) > _version(ours):
        warnings.warn(f"{path} was written by ember {theirs}, newer than this ember {ours}; loading it anyway",
                      UserWarning, stacklevel=3)
    tv = meta.get("torch_version")
    if tv and _version(tv)[:2] != _version(torch.__version__)[:2]:
        warnings.warn(f"{path} was written with torch {tv}, this is torch {torch.__version__}; "
                      "loading it anyway", UserWarning, stacklevel=3)
    return files


#: content digests recorded in ``meta.json["digests"]`` (``{name: "<algorithm>:<hex>"}``):
#: xxh3_128 (about 8 GB/s) when the ``xxhash`` package is installed (wandb brings it),
#: else sha256 (about 1 GB/s); a load verifies with whichever the checkpoint names
DIGEST_ALGORITHMS = {"xxh3_128": 32, "sha256": 64}   # name -> hex digits
_verified: dict[tuple, str] = {}   # (real path, size, mtime_ns, inode) -> digest already checked
_warned_unverifiable: set = set()


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import xxhash
        return xxhash.xxh3_128()
    import hashlib
    return hashlib.new(algorithm)


def digest_algorithm() -> str:
    """The algorithm new checkpoints record: xxh3_128 where ``xxhash`` imports, else sha256."""
    try:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


def file_digest(fp: str | os.PathLike, algorithm: str | None = None) -> str:
    """``"<algorithm>:<hex>"`` of a file's content (docs/benchmarks.md has the cost)."""
    algorithm = algorithm or digest_algorithm()
    h = _hasher(algorithm)
    with open(fp, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return f"{algorithm}:{h.hexdigest()}"


def check_digests(path: str | os.PathLike, meta: dict) -> None:
    """Each file with a digest in ``meta.json`` has that content: a file swapped for
    another of the same size (e.g. ``trainer_state.pt`` of another checkpoint of the
    run) is refused. Checkpoints written before digests were recorded have none and
    pass. A file already verified unchanged (same size, mtime, inode) is not re-read."""
    path = os.fspath(path)
    digests = meta.get("digests")
    if digests is None:
        return
    meta_file = os.path.join(path, META_NAME)
    if not isinstance(digests, dict):
        raise CheckpointError(f"{meta_file}: 'digests' is {type(digests).__name__}, expected an object "
                              "{name: '<algorithm>:<hex>'}")
    for name, want in digests.items():
        fp = member(path, name, META_NAME)
        alg, _, hexd = want.partition(":") if isinstance(want, str) else ("", "", "")
        if alg not in DIGEST_ALGORITHMS or not re.fullmatch(rf"[0-9a-f]{{{DIGEST_ALGORITHMS[alg]}}}", hexd):
            raise CheckpointError(f"{meta_file}: the digest recorded for {name!r} is {want!r}, not "
                                  + " or ".join(f"'{a}:<{n} hex digits>'" for a, n in DIGEST_ALGORITHMS.items()))
        if alg == "xxh3_128" and digest_algorithm() != alg:
            if path not in _warned_unverifiable:
                _warned_unverifiable.add(path)
                warnings.warn(f"{path}: its file digests are xxh3_128, which needs the xxhash package "
                              "(pip install xxhash); loading it with sizes checked only", UserWarning, stacklevel=4)
            continue
        try:
            st = os.stat(fp)
        except OSError:
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing") from None
        key = (os.path.realpath(fp), st.st_size, st.st_mtime_ns, st.st_ino)
        if _verified.get(key) == want:
            continue
        have = file_digest(fp, alg)
        if have != want:
            raise CheckpointError(f"{fp} does not hold the content this checkpoint's {META_NAME} recorded "
                                  f"({alg} {have.split(':')[1][:12]}..., recorded "
                                  f"{hexd[:12]}...): it was replaced (by a file of another "
                                  "checkpoint?) or corrupted; restore the original file or use another checkpoint")
        if len(_verified) > 256:
            _verified.clear()
        _verified[key] = want


def check_sizes(path: str | os.PathLike, files: dict[str, int]) -> None:
    """Each listed file exists (inside the checkpoint) with the recorded size."""
    path = os.fspath(path)
    for name, size in files.items():
        fp = member(path, name)
        if not os.path.isfile(fp):
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        have = os.path.getsize(fp)
        if have != size:
            raise CheckpointError(f"{fp} is truncated or corrupt: it has {have} bytes, meta.json recorded {size}")


# -- DCP metadata without arbitrary unpickling ---------------------------------------------
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint._extension", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")} | {
    (m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                           "PureWindowsPath")}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata records, torch dtypes/layouts/sizes and plain containers."""

    def find_class(self, module: str, name: str):
        import torch
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")


def dcp_reader(folder: str | os.PathLike):
    """A ``FileSystemReader`` whose ``.metadata`` is read with an allow-list unpickler
    (the stock reader calls ``pickle.load``, which can run code)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    root = os.fspath(folder)

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = self._get_metadata_path(kwargs.get("rank"))
            member_file(root, os.path.basename(path))
            try:
                with self.fs.create_stream(path, "rb") as f:
                    md = _DCPMetadataUnpickler(f).load()
            except pickle.UnpicklingError as err:
                raise CheckpointError(f"refusing {path}: {err}; unpickling it could run code") from None
            check_dcp_storage(md, root)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def set_up_storage_reader(self, metadata, *args, **kwargs):
            check_dcp_storage(metadata, root)    # also metadata another rank read and sent
            return super().set_up_storage_reader(metadata, *args, **kwargs)

    check_tree(root)
    return SafeFileSystemReader(root)


def check_dcp_storage(md: Any, folder: str | os.PathLike) -> None:
    """Every storage entry of DCP metadata ``md`` names a regular file inside ``folder``
    (its ``relative_path``: not absolute, no ``..``, no symlink out, no FIFO), so a load
    reads only this checkpoint's shards. A missing file is left to the size checks
    (``meta.json``'s ``files``, the commit's ``verify_dcp_shards``), which name its rank."""
    storage = getattr(md, "storage_data", None)
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise CheckpointError(f"refusing {os.path.join(os.fspath(folder), '.metadata')}: its storage_data is a "
                              f"{type(storage).__name__}, not a mapping")
    for name in {getattr(info, "relative_path", None) for info in storage.values()}:
        if os.path.lexists(member(folder, name, ".metadata")):   # a missing shard: the size checks name it
            member_file(folder, name, ".metadata")
    check_dcp_sizes(md, folder)


#: a DCP entry written through a storage transform (compression) may claim this many times
#: the bytes it occupies; ember writes none
DCP_TRANSFORM_RATIO = 64


def check_dcp_sizes(md: Any, folder: str | os.PathLike) -> None:
    """Before anything is allocated from DCP metadata ``md``: each storage entry lies within
    its file, and each tensor claims no more bytes (shape x dtype) than its entries hold in
    the files (``DCP_TRANSFORM_RATIO`` times that for compressed entries). A ``.metadata``
    claiming a [2**20, 2**20] tensor is refused here with a CheckpointError, not by the
    allocator after it tried to find 4 TB."""
    import math
    import torch
    where = os.path.join(os.fspath(folder), ".metadata")
    storage = getattr(md, "storage_data", None) or {}
    stored: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        try:
            offset, length = int(info.offset), int(info.length)
        except (TypeError, ValueError, AttributeError):
            raise CheckpointError(f"refusing {where}: a storage entry has no integer offset/length") from None
        if offset < 0 or length < 0:
            raise CheckpointError(f"refusing {where}: a storage entry of {name!r} has a negative offset or length")
        full = os.path.join(os.fspath(folder), *str(name).split("/"))
        if os.path.isfile(full):
            if name not in sizes:
                sizes[name] = os.path.getsize(full)
            if offset + length > sizes[name]:
                raise CheckpointError(f"refusing {where}: it places an entry at bytes {offset}..{offset + length} "
                                      f"of {name}, which holds {sizes[name]} bytes")
        ratio = DCP_TRANSFORM_RATIO if getattr(info, "transform_descriptors", None) else 1
        fqn = getattr(index, "fqn", None)
        stored[fqn] = stored.get(fqn, 0) + length * ratio
    for fqn, tmd in (getattr(md, "state_dict_metadata", None) or {}).items():
        size = getattr(tmd, "size", None)
        props = getattr(tmd, "properties", None)
        if size is None or props is None:     # a bytes entry: loaded from its own bytes
            continue
        try:
            dims = [int(d) for d in size]
            itemsize = torch.empty((), dtype=props.dtype).element_size()
        except (TypeError, ValueError, AttributeError, RuntimeError):
            raise CheckpointError(f"refusing {where}: the entry {fqn!r} has no valid shape and dtype") from None
        if any(d < 0 for d in dims):
            raise CheckpointError(f"refusing {where}: the entry {fqn!r} has a negative dimension {dims}")
        claimed = math.prod(dims) * itemsize
        if claimed > stored.get(fqn, 0):
            raise CheckpointError(f"refusing {where}: it claims the tensor {fqn!r} is {dims} "
                                  f"({claimed} bytes of {props.dtype}), but its files hold {stored.get(fqn, 0)} "
                                  "bytes for it; the metadata is corrupt or crafted")


def dcp_planner(allow_partial_load: bool = False):
    """DCP's ``DefaultLoadPlanner``, loading non-tensor items with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(f"refusing a DCP item {read_item.dest_index.fqn!r}: it is not a plain "
                                      f"value ({str(err).splitlines()[0]})") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner(allow_partial_load=allow_partial_load)


# -- saving ------------------------------------------------------------------------------
#: the entries a checkpoint directory (or its ``NAME.ember-tmp`` staging folder) holds: the
#: weights, the trainer state, ``meta.json``, a sharded strategy's ``model/`` folder
#: (DCP or DeepSpeed), an Accelerator's extra models and per-rank RNG files, the
#: hidden temporary file a writer killed mid-write leaves (safetensors' ``.tmpXXXXXX``),
#: ember's staging marker, and the recovery scripts DeepSpeed copies next to its files
_CHECKPOINT_ENTRY = re.compile(r"(model\.safetensors|trainer_state\.pt|meta\.json|model|deepspeed"
                               r"|model_\d+\.safetensors|rng_state_\d+\.pt(\.tmp)?|\.tmp\w{1,16}"
                               r"|\.ember-staging|zero_to_fp32\.py|zero_to_torch\.py)")


def not_a_checkpoint(path: str | os.PathLike, staging: bool = False) -> str:
    """Why the directory ``path`` is not recognisably an ember checkpoint, or ``""`` when
    it is one, so that ember may replace or delete it: a ``meta.json`` carrying ember's
    format marker (an integer ``format_version``), and nothing but the files a checkpoint
    holds. ``staging``: a ``NAME.ember-tmp`` folder of an unfinished save (``meta.json`` is
    written last, so it may be missing, or cut short where an earlier version was killed
    while writing it). An empty directory counts as one (nothing to lose).
    This one check guards every replace and delete of a save: ``save_checkpoint``'s
    target and its staging folder, the superseded checkpoints ``ModelCheckpoint`` deletes,
    the automatic checkpoints ``Accelerator`` rotates."""
    path = os.fspath(path)
    if os.path.islink(path) or not os.path.isdir(path):
        return f"{path} is {'a symlink' if os.path.islink(path) else 'not a directory'}"
    names = sorted(os.listdir(path))
    others = [n for n in names if not _CHECKPOINT_ENTRY.fullmatch(n)]
    if others:
        return (f"{path} holds {others[:5]}{' ...' if len(others) > 5 else ''}, which no ember checkpoint "
                "holds")
    if not names or (staging and cio.META_NAME not in names):
        return ""
    if cio.META_NAME not in names:
        return f"{path} has no {cio.META_NAME}"
    meta_file = os.path.join(path, cio.META_NAME)
    try:
        if not os.path.isfile(meta_file) or os.path.islink(meta_file):
            raise CheckpointError(f"{meta_file} is not a plain file")
        fv = read_meta(meta_file).get("format_version")
    except CheckpointError as err:
        if staging and _cut_short(meta_file):
            return ""
        return f"its {cio.META_NAME} is not ember's ({err})"
    if isinstance(fv, bool) or not isinstance(fv, int):
        return f"its {cio.META_NAME} has no ember format_version (it is another program's {cio.META_NAME})"
    return ""


def _cut_short(meta_file: str) -> bool:
    """Whether ``meta_file`` is empty or the start of a JSON object that does not parse
    (a writer killed in the middle of it)."""
    try:
        with open(meta_file, "rb") as f:
            text = f.read(1 << 20).strip()
        json.loads(text)
    except ValueError:     # JSONDecodeError, UnicodeDecodeError
        return not text or text.startswith(b"{")
    except OSError:
        return False
    return False


def checkpoint_containing(path: str | os.PathLike) -> str:
    """The ember checkpoint directory that ``path`` (symlinks resolved) is or lies in,
    or ``""``: a folder with ember's ``meta.json`` (integer ``format_version``), or its
    staging folder (``NAME.ember-tmp``, or an earlier version's ``NAME.tmp``). Outputs that
    are not checkpoints never go there."""
    real = os.path.realpath(os.fspath(path))
    d = real
    while True:
        meta_file = os.path.join(d, cio.META_NAME)
        if os.path.isdir(d) and (os.path.isfile(meta_file) or cio.is_unfinished_name(d)):
            try:
                fv = read_meta(meta_file).get("format_version") if os.path.isfile(meta_file) else None
            except CheckpointError:
                fv = None
            if (isinstance(fv, int) and not isinstance(fv, bool)) or \
                    (cio.is_unfinished_name(d) and not not_a_checkpoint(d, staging=True) and os.listdir(d)):
                return d
        parent = os.path.dirname(d)
        if parent == d:
            return ""
        d = parent


def check_save_target(path: str | os.PathLike, what: str, staging: bool = True) -> None:
    """Refuse to replace anything at ``path`` that is not recognisably an ember checkpoint
    (:func:`not_a_checkpoint`): a plain file, a non-empty directory without ember's
    ``meta.json`` (a log folder), or one that holds other files too (a dataset folder
    with its own ``meta.json`` and ``images/``); and (``staging``) a ``NAME.ember-tmp``
    (:func:`ember.checkpoint.format.tmp_path`) that is not a staging folder of an ember save
    (:func:`not_staging`)."""
    path = os.path.normpath(os.fspath(path))
    if os.path.islink(path) and not os.path.isdir(path):
        raise CheckpointError(f"{what}({path!r}): {path} is a symlink that does not point to a checkpoint; "
                              "refusing to replace it. Remove it or choose another path")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{what}({path!r}): {path} is a file, not a checkpoint directory; refusing to "
                              "replace it. Remove it or choose another path")
    if os.path.isdir(path):
        why = not_a_checkpoint(os.path.realpath(path))
        if why:
            raise CheckpointError(f"{what}({path!r}): {path} is not an ember checkpoint ({why}); refusing to "
                                  "replace it. Choose another path, e.g. a subfolder")
    tmp = cio.tmp_path(path)
    why = not_staging(tmp) if staging else ""
    if why:
        raise CheckpointError(f"{what}({path!r}): {tmp} exists and is not a staging folder of an ember save "
                              f"({why}); refusing to delete it. Remove it or choose another path")


def not_staging(tmp: str | os.PathLike) -> str:
    """Why the existing ``NAME.ember-tmp`` folder ``tmp`` is not one an ember save made (so that
    no save may delete it), or ``""`` when it is absent or ember's: empty, or holding only
    checkpoint files plus ember's staging marker (:data:`~ember.checkpoint.format.STAGING_MARKER`,
    created first in every staging folder) or a ``meta.json`` of ember's (complete, or cut
    short by a kill). A folder of checkpoint-like names without either (someone's
    ``export.ember-tmp/model.safetensors``) is not ember's."""
    tmp = os.fspath(tmp)
    if not os.path.lexists(tmp):
        return ""
    why = not_a_checkpoint(tmp, staging=True)
    if why:
        return why
    names = os.listdir(tmp)
    if names and cio.STAGING_MARKER not in names and cio.META_NAME not in names:
        return (f"{tmp} holds {sorted(names)[:5]} but neither ember's staging marker {cio.STAGING_MARKER} nor a "
                f"{cio.META_NAME}")
    return ""


def not_replaceable(path: str | os.PathLike) -> str:
    """Why ember may not replace what is at ``path`` (a checkpoint folder, a ``last`` link,
    a weights file), or ``""``: nothing is there; a symlink resolving inside its own folder
    (ember's links, e.g. ``last``: replacing one loses no data); an ember checkpoint folder
    (:func:`not_a_checkpoint`); a ``.safetensors`` file ember wrote (its metadata carries
    ember's marker, or the epoch and step ``ModelCheckpoint`` records); a weights index
    ember wrote (``*.safetensors.index.json``)."""
    path = os.path.normpath(os.fspath(path))
    if not os.path.lexists(path):
        return ""
    if os.path.islink(path):
        parent = os.path.dirname(path) or "."
        if inside(path, parent) and os.path.realpath(path) != os.path.realpath(parent):
            return ""
        return f"{path} is a symlink to {os.path.realpath(path)}, outside its folder"
    if os.path.isdir(path):
        return not_a_checkpoint(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        md = safetensors_metadata(path)
        if md is not None and (WEIGHTS_MARKER in md or {"epoch", "global_step"} <= set(md)):
            return ""
        return f"{path} is a .safetensors file that ember did not write"
    if os.path.isfile(path) and path.endswith(".safetensors.index.json"):
        return _index_not_replaceable(path)
    return f"{path} is a file, not one ember wrote"


def _index_not_replaceable(path: str) -> str:
    """A sharded-weights index is ember's when its metadata carries :data:`WEIGHTS_MARKER`,
    or (an export written before the marker) when every shard it names is in its folder and
    ember's; else why not."""
    theirs = f"{path} is a weights index that ember did not write"
    folder = os.path.dirname(path) or "."
    try:
        if os.path.getsize(path) > cio.MAX_INDEX_BYTES:
            return theirs
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
        if WEIGHTS_MARKER in (index.get("metadata") or {}):
            return ""
        shards = [member(folder, name, os.path.basename(path)) for name in set(index["weight_map"].values())]
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError, CheckpointError):
        return theirs
    if shards and all(os.path.isfile(x) and not not_replaceable(x) for x in shards):
        return ""
    return theirs


#: the safetensors metadata key every weights file ember writes carries
WEIGHTS_MARKER = "ember.format_version"


def safetensors_metadata(path: str) -> "dict | None":
    """The text metadata of safetensors file ``path``, or None when it is not one (read from
    its bounded JSON header only)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            n = int.from_bytes(head, "little")
            if n > MAX_META_BYTES:
                return None
            header = json.loads(f.read(n))
        md = header.get("__metadata__", {}) if isinstance(header, dict) else None
        return md if isinstance(md, dict) else None
    except (OSError, ValueError):
        return None


def check_replace(path: str | os.PathLike, what: str) -> None:
    """Raise CheckpointError unless ember may replace what is at ``path``
    (:func:`not_replaceable`)."""
    why = not_replaceable(path)
    if why:
        raise CheckpointError(f"{what}: refusing to replace {os.fspath(path)}: {why}. Remove it or choose "
                              "another path")


def check_output_path(path: str | os.PathLike, overwrite: bool = False, inputs: Sequence = (),
                      what: str = "output") -> str:
    """Check, before anything is predicted, that predictions may be written to ``path``;
    return it (absolute). Raises MisconfigurationError naming ``what`` and the path when:

    - ``path`` is an existing folder, or lies under a file (its parent cannot be made);
    - it is or lies inside an ember checkpoint (``trust.checkpoint_containing``: a
      checkpoint's own files are never replaced by predictions, ``overwrite`` or not);
    - it is one of ``inputs`` (the weights or checkpoint being loaded) or lies inside one;
    - it exists and ``overwrite`` is False.

    Symlinks are resolved for these checks; the write itself (:func:`ember.callbacks.prediction_writer.save_predictions`)
    replaces a symlink, never the file it points to."""
    raw = os.fspath(path)
    path = os.path.abspath(raw)
    if os.path.isdir(path):
        raise MisconfigurationError(f"{what} {raw!r} is a folder; give a file name, e.g. {os.path.join(raw, 'predictions.pt')!r}")
    parent = os.path.dirname(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise MisconfigurationError(f"{what} {raw!r}: {parent} is a file, so no file can be written under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MisconfigurationError(f"{what} {raw!r}: {parent} is not writable")
    ckpt = checkpoint_containing(path)
    if ckpt:
        raise MisconfigurationError(f"{what} {raw!r} lies inside the checkpoint {ckpt}; predictions are never "
                                    "written into a checkpoint (it would no longer load). Choose a path outside it")
    real = os.path.realpath(path)
    for given in inputs:
        if given is None or not isinstance(given, (str, os.PathLike)) or not os.path.exists(given):
            continue
        src = os.path.realpath(os.fspath(given))
        if real == src or real.startswith(src.rstrip(os.sep) + os.sep):
            raise MisconfigurationError(f"{what} {raw!r} is the input {os.fspath(given)!r} (or inside it); "
                                        "predictions never replace the weights they were computed with. "
                                        "Choose another path")
    if os.path.lexists(path) and not overwrite:
        raise MisconfigurationError(f"{what} {raw!r} exists; refusing to overwrite it. Choose another path, or "
                                    "ask for it to be replaced (ember predict --overwrite, "
                                    "BasePredictionWriter(overwrite=True))")
    return path


def check_export_dir(path: str | os.PathLike, inputs: Sequence = (), what: str = "save_pretrained") -> str:
    """Check a ``save_pretrained`` folder before anything is written; return it. Like
    transformers, an export writes its files into the folder (an existing export is
    updated in place); it never writes into what it must not change. Raises
    MisconfigurationError naming ``what`` and the path when ``path`` is a file, is or lies
    inside an ember checkpoint, or is or lies inside one of ``inputs`` (the base model's
    folder, the tokenizer's: a merged export there would replace the base weights)."""
    raw = os.fspath(path)
    if os.path.lexists(raw) and not os.path.isdir(raw):
        raise MisconfigurationError(f"{what}({raw!r}): {raw} is a file, not a folder; choose a folder path")
    ckpt = checkpoint_containing(raw)
    if ckpt:
        raise MisconfigurationError(f"{what}({raw!r}) lies inside the checkpoint {ckpt}; an export never writes "
                                    "into a checkpoint (it would no longer load). Choose a folder outside it")
    for given in inputs:
        if isinstance(given, (str, os.PathLike)) and os.path.isdir(given) and inside(raw, given):
            raise MisconfigurationError(f"{what}({raw!r}) is the folder {os.fspath(given)!r} the model or tokenizer "
                                        "was loaded from (or inside it); an export never replaces its own inputs. "
                                        "Choose another folder")
    return raw


def write_error(err: BaseException, path: str | os.PathLike) -> BaseException:
    """The error to raise for ``err`` while writing checkpoint ``path``: a full disk or a
    read-only target becomes a CheckpointError saying so and naming the path."""
    code = getattr(err, "errno", None)
    msg = str(err)
    if code is None and isinstance(err, RuntimeError) and ("unexpected pos" in msg or "No space" in msg):
        code = errno.ENOSPC   # torch's zip writer reports a short write this way
    if code in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(f"the disk is full: writing checkpoint {os.fspath(path)} failed "
                               f"({type(err).__name__}: {msg.splitlines()[0] if msg else ''}). Free space or save "
                               "elsewhere; the previous checkpoints are intact")
    if code in (errno.EACCES, errno.EROFS, errno.EPERM):
        return CheckpointError(f"cannot write checkpoint {os.fspath(path)}: {os.strerror(code)}")
    return err


def check_writable(dirpath: str | os.PathLike, what: str) -> None:
    """Create ``dirpath`` if needed and check a file can be created in it (at setup,
    not at the first save)."""
    dirpath = os.fspath(dirpath)
    try:
        os.makedirs(dirpath, exist_ok=True)
        probe = os.path.join(dirpath, f".ember-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise CheckpointError(f"{what}: cannot write checkpoints to {dirpath} "
                              f"({type(err).__name__}: {err.strerror or err})") from err


# -- optimizers ------------------------------------------------------------------------------------
def _raw_optimizer(o):
    while not hasattr(o, "param_groups") or (hasattr(o, "optimizer") and hasattr(o.optimizer, "param_groups")):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            break
        o = inner
    return o


def optimizer_names(optimizers) -> list[str]:
    """``module.Class`` of each (unwrapped) optimizer, as recorded in ``meta.json``."""
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in map(_raw_optimizer, optimizers)]


_GROUP_EXTRA = {"params", "initial_lr"}   # 'initial_lr' is added by LR schedulers


def check_optimizers(optimizers, saved: Any, meta: dict, path: str | os.PathLike,
                     given: str = "configure_optimizers returned",
                     instead: str = "load only the weights (Module.load_from_checkpoint)") -> None:
    """Before anything is loaded: the checkpoint's optimizers match this run's (count,
    class recorded in ``meta.json``, parameter-group count and option keys). An AdamW
    state loaded into SGD fails at the first step; Adam into AdamW silently drops
    ``weight_decay``: both are refused here. ``given`` and ``instead`` word the error for
    the caller (the Trainer's, or ``Fabric.load``'s)."""
    path = os.fspath(path)
    names = meta.get("optimizers")
    ours = optimizer_names(optimizers)
    if isinstance(names, list) and names and len(names) == len(ours):
        for i, (theirs, mine) in enumerate(zip(names, ours)):
            if theirs != mine:
                raise CheckpointError(f"{path} holds the state of a {theirs} (optimizer {i}) but "
                                      f"{given} a {mine}; resume with the same optimizer, or {instead}")
    if not isinstance(saved, list):
        return
    for i, (opt, s) in enumerate(zip(map(_raw_optimizer, optimizers), saved)):
        groups = s.get("param_groups") if isinstance(s, dict) else None
        if not isinstance(groups, list):
            continue   # a strategy-specific record (DCP, DeepSpeed)
        if len(groups) != len(opt.param_groups):
            raise CheckpointError(f"{path}: optimizer {i} has {len(groups)} parameter group(s) in the checkpoint, "
                                  f"{len(opt.param_groups)} in this run")
        for g, (theirs, mine) in enumerate(zip(groups, opt.param_groups)):
            if not isinstance(theirs, dict):
                raise CheckpointError(f"{path}: optimizer {i} parameter group {g} is corrupt")
            a, b = set(theirs) - _GROUP_EXTRA, set(mine) - _GROUP_EXTRA
            if a != b:
                raise CheckpointError(
                    f"{path}: optimizer {i} ({type(opt).__name__}) parameter group {g} has other options than "
                    f"the checkpoint's: only in the checkpoint {sorted(a - b)}, only in this run {sorted(b - a)}; "
                    "it was saved by another optimizer class")
            n_theirs, n_mine = len(theirs.get("params") or []), len(mine["params"])
            if n_theirs != n_mine:
                raise CheckpointError(f"{path}: optimizer {i} parameter group {g} has {n_theirs} parameters in the "
                                      f"checkpoint, {n_mine} in this run")
