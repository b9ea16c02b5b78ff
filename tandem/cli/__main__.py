"""``python -m tandem.cli`` is ``tandem``."""

import sys

from tandem.cli.main import main

sys.exit(main())
