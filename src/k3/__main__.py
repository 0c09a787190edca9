"""`python -m k3 ...`: the `k3` command line (`k3.cli`), for environments without the console script."""

import sys

from k3.cli import main

if __name__ == "__main__":
    sys.exit(main())
