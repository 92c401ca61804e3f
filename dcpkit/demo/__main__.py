"""``python -m dcpkit.demo`` (the same as ``python -m dcpkit demo``)."""

from .cli import main

raise SystemExit(main())
