"""``python -m mlfabric`` is the ``mlfabric`` command."""

import sys

from mlfabric.cli import main

sys.exit(main())
