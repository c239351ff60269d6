"""`python -m decodelab ...` is the `decodelab` console script."""
import sys

from decodelab.suite.cli import main

sys.exit(main())
