"""The demo's agreed steps and progress lines: a step every rank runs and whose outcome every
rank learns (so no rank enters a later collective alone), and the exit statuses."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 2


PREFIX = "[dcpkit demo]"


class Say:
    """Progress lines on rank 0, flushed."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(f"{PREFIX} {msg}", flush=True)

    @contextlib.contextmanager
    def timed(self, msg: str):
        """``msg ...`` before the block, ``done in x s`` after it (when it succeeded)."""
        self(f"{msg} ...")
        t0 = time.perf_counter()
        yield
        self(f"  done in {time.perf_counter() - t0:.1f} s")


def step(comm, what: str, fn: Callable[[], Any]) -> Any:
    """Run one step on every rank and agree on its success (``PeerError`` on every rank when
    any rank failed), so that no rank enters a later collective alone."""
    err: BaseException | None = None
    value = None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - agreed across ranks below
        err = e
    comm.all_ok(what, err)
    return value


def short_error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
