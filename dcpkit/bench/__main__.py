"""``python -m dcpkit.bench``."""

import sys

from ..cli import pipe_safe
from .command import main

sys.exit(pipe_safe(main, prog="dcpkit bench"))
