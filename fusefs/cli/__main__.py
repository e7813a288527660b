"""`python -m fusefs.cli`: the same entry point as the `ckptfs` script."""

import sys

from fusefs.cli.main import main

sys.exit(main())
