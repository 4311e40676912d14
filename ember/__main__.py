"""``python -m ember ...``: the same as the ``ember`` command."""
from ember.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
