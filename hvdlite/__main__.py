"""``python -m hvdlite ...`` runs the ``hvdlite`` command (see hvdlite/cli.py)."""
import sys

from hvdlite.cli import main

sys.exit(main())
