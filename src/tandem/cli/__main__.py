"""``python -m tandem.cli``: the ``tandem`` command, with this interpreter."""

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main())
