"""`python -m spmd.cli ...` runs the `spmd` console script."""

import sys

from spmd.cli.main import main

sys.exit(main())
