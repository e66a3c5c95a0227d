"""`python -m edgekit.daemon` runs edgekitd (what the console script does)."""

import sys

from .main import main

sys.exit(main())
