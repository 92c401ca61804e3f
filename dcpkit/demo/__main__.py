"""``python -m dcpkit.demo`` (the same as ``python -m dcpkit demo``)."""

from ..cli import pipe_safe
from .cli import main

raise SystemExit(pipe_safe(main))
