"""`python -m omnickpt ...` runs the command line (same as the `omnickpt` script)."""
import sys

from omnickpt.cli import main

sys.exit(main())
