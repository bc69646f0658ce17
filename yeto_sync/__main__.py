"""``python -m yeto_sync``: the ``yeto-sync`` daemon."""

import sys

from .cli import main

sys.exit(main())
