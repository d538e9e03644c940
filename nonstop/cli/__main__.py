"""``python -m nonstop.cli``: the ``nonstop`` command."""

import sys

from nonstop.cli import main

sys.exit(main())
