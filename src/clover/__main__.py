"""`python -m clover ...` is the `clover` command."""

import sys

from .cli import main

sys.exit(main())
