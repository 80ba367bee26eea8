"""`python -m clover.bench {decode,sweep,kernels,roofline} ...` (same as `clover bench ...`)."""

import sys

from .cli import main

sys.exit(main())
