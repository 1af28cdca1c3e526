"""``python -m hvdlite.spark``: one rank of hvdlite.spark.run (see rank.py)."""
import sys

from hvdlite.spark.rank import main

sys.exit(main())
