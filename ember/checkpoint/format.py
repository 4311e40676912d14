"""The names and version of ember's checkpoint format (docs/checkpoint_format.md).

A checkpoint is a directory ``NAME/`` holding :data:`WEIGHTS_NAME` (or a DCP folder
:data:`DCP_WEIGHTS_DIR`), :data:`STATE_NAME` (loadable with ``weights_only=True``) and
:data:`META_NAME` (written last), staged in ``NAME`` + :data:`TMP_SUFFIX`."""
from __future__ import annotations

import os

WEIGHTS_NAME = "model.safetensors"
DCP_WEIGHTS_DIR = "model"
STATE_NAME = "trainer_state.pt"
META_NAME = "meta.json"
INDEX_NAME = "model.safetensors.index.json"
FORMAT_VERSION = 1
#: safetensors metadata key holding ``{alias: stored_name}`` for tensors that share memory
ALIAS_KEY = "ember.aliases"
TMP_SUFFIX = ".tmp"
#: the empty file ember creates first in every staging folder it makes (and removes just
#: before the commit): a ``NAME.tmp`` without it, without a ``meta.json`` and not empty
#: was not made by an ember save, and no save deletes it
STAGING_MARKER = ".ember-staging"


def tmp_path(path: str | os.PathLike) -> str:
    """The staging directory ``NAME.tmp`` that :func:`atomic_directory` writes into."""
    return os.path.normpath(os.fspath(path)) + TMP_SUFFIX

