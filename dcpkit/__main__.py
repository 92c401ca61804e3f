"""``python -m dcpkit {info,demo,bench}``."""

from .cli import main

raise SystemExit(main())
