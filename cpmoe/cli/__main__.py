"""`python -m cpmoe.cli ...`, the same as the `cpmoe` command."""

import sys

from cpmoe.cli.main import main

sys.exit(main())
