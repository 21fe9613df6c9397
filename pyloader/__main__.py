"""``python -m pyloader``: the ``pyloader`` command."""

import sys

from .cli import main

sys.exit(main())
