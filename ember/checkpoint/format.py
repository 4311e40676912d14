"""The names and version of ember's checkpoint format (docs/checkpoint_format.md).

A checkpoint is a directory ``NAME/`` holding :data:`WEIGHTS_NAME` (or a DCP folder
:data:`DCP_WEIGHTS_DIR`), :data:`STATE_NAME` (loadable with ``weights_only=True``) and
:data:`META_NAME` (written last), staged in ``NAME`` + :data:`TMP_SUFFIX` (``NAME.ember-tmp``)."""
from __future__ import annotations

import os

WEIGHTS_NAME = "model.safetensors"
DCP_WEIGHTS_DIR = "model"
STATE_NAME = "trainer_state.pt"
META_NAME = "meta.json"
INDEX_NAME = "model.safetensors.index.json"
#: an index larger than this is refused before it is parsed (a 70B model's is ~100 KB)
MAX_INDEX_BYTES = 64 * 2**20
FORMAT_VERSION = 1
#: safetensors metadata key holding ``{alias: stored_name}`` for tensors that share memory
ALIAS_KEY = "ember.aliases"
#: the end of a staging folder's name: a save to ``NAME`` writes ``NAME.ember-tmp`` (next to
#: ``NAME``, so the commit is one rename on one filesystem) and renames it to ``NAME``. The
#: name is ember's own, so that a user's ``NAME.tmp`` never collides with it; it is fixed
#: (no per-save token), so every rank of a sharded save finds the same folder without a
#: collective. Checkpoint discovery ignores names ending in it
TMP_SUFFIX = ".ember-tmp"
#: the staging suffix of earlier ember versions (``NAME.tmp``): no save makes, replaces or
#: deletes such a folder any more (a user's ``run.tmp`` is theirs); discovery still ignores
#: names ending in it, as a folder left by an older version's killed save may lie there
LEGACY_TMP_SUFFIX = ".tmp"
#: the empty file ember creates first in every staging folder it makes (and removes just
#: before the commit): a ``NAME.ember-tmp`` without it, without a ``meta.json`` and not
#: empty was not made by an ember save, and no save deletes it
STAGING_MARKER = ".ember-staging"


def tmp_path(path: str | os.PathLike) -> str:
    """The staging directory ``NAME.ember-tmp`` that :func:`atomic_directory` writes into."""
    return os.path.normpath(os.fspath(path)) + TMP_SUFFIX


def is_unfinished_name(name: str) -> bool:
    """Whether a file or folder name is one of an unfinished save (a staging folder of this
    version, ``*.ember-tmp``, or of an earlier one, ``*.tmp``): checkpoint discovery skips it."""
    name = name.rstrip("/\\")
    return name.endswith(TMP_SUFFIX) or name.endswith(LEGACY_TMP_SUFFIX)
