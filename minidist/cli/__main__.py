"""``python -m minidist.cli``: the ``minidist`` command."""
import sys

from minidist.cli import main

sys.exit(main())
