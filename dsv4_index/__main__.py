"""``python -m dsv4_index``: the command line lives in :mod:`dsv4_index.tools.cli`."""

from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
