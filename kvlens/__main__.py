"""`python -m kvlens` is the `kvlens` command."""

import sys

from kvlens.cli import main

sys.exit(main())
