"""``python -m envace.eval``."""

import sys

from envace.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
