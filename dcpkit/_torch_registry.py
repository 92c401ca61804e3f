"""Process-wide state of :mod:`dcpkit.torch`'s custom ops (no torch import here).

The ``dcpkit::*`` operators are registered with torch once per process, and torch keeps their
kernels for the life of the process; the registry of live :class:`~dcpkit.torch.TorchOps`
handles that those kernels look up must be just as process-wide. It lives here rather than in
``dcpkit.torch`` so that a second import of that module (a reload, a test that imports it
afresh) shares it instead of registering the operators again.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

#: handle -> weak reference to a live TorchOps (each adds itself and removes itself at close).
REGISTRY: dict[int, Any] = {}
NEXT_HANDLE = itertools.count(1)
LOCK = threading.Lock()
#: op name -> torch.ops.dcpkit.<name>, once registered; and the torch.library.Library that
#: holds the definitions (kept alive for the life of the process).
state: dict[str, Any | None] = {"custom_ops": None, "library": None, "increment_version": None}
