"""``python -m studies compare | sweep | data | report`` (`studies.cli`), from the repository root."""

import sys

from studies.cli import main

sys.exit(main())
