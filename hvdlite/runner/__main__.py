"""``python -m hvdlite.runner``: the same as the ``hvdliterun`` command."""
import sys

from hvdlite.runner.launch import main

if __name__ == "__main__":
    sys.exit(main())
