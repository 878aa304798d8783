import sys

from cispo.cli import main

sys.exit(main())
