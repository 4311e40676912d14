"""``python -m ember ...``: the same as the ``ember`` command.

``python -m`` puts the working directory first on ``sys.path``; it is taken off again, so
that a file in the folder a run starts in cannot shadow a module ember imports later (as
under the ``ember`` command). A config that names the user's own module found only there
still imports it (:func:`ember.cli.types._check_importable`)."""
import os
import sys

if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from ember.cli.main import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
