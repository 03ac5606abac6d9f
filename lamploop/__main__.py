"""``python -m lamploop``: the ``lamploop`` command (:mod:`lamploop.cli`), for an environment
whose scripts directory is not on ``PATH``."""

from __future__ import annotations

import sys

from lamploop.cli import main

if __name__ == "__main__":
    sys.exit(main())
