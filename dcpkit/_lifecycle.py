"""The lifetime of a dcpkit resource: ``close()`` once, a context manager, a warning when a
resource is dropped open.

A class that owns something with a lifetime (GPU memory, a multicast object, an NCCL
communicator) derives from :class:`Resource` and implements :meth:`Resource._close`. Closing is
explicit and often collective, so it never happens from garbage collection: ``__del__`` only
warns (``ResourceWarning``) about a resource that was not closed.
"""

from __future__ import annotations

import warnings

from .errors import ClosedError

__all__ = ["Resource"]


class Resource:
    """Mixin: idempotent :meth:`close`, ``with`` support, :attr:`closed`, and a
    ``ResourceWarning`` from ``__del__`` for a resource that was never closed.

    A subclass sets ``self._closed = False`` once it holds the resource, and implements
    :meth:`_close` (called once, with ``_closed`` already True). ``_resource_name`` names it in
    the warning; ``_unclosed_hint`` says what to do; ``_noun`` is what :meth:`_check_open`
    calls it.
    """

    _closed = True
    _resource_name = "resource"
    _unclosed_hint = "call close() on every rank"
    _noun = "resource"

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (or when construction did not complete)."""
        return self._closed

    def _check_open(self, what: str) -> None:
        """Raise :class:`~dcpkit.errors.ClosedError` ``"<what>: the <noun> is closed"`` once the
        resource is closed (``what`` names the method called)."""
        if self._closed:
            raise ClosedError(f"{what}: the {self._noun} is closed")

    def close(self) -> None:
        """Release the resource (idempotent; collective where the class says so)."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def _close(self) -> None:
        """Release what the resource holds (``_closed`` is already True)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _left_open(self) -> bool:
        """Whether a dropped object still holds its resource (then ``__del__`` warns)."""
        return self.__dict__.get("_closed", True) is False

    def __del__(self):  # never collective work here: warn only
        if self._left_open():
            try:
                warnings.warn(
                    f"dcpkit {self._resource_name} was not closed; {self._unclosed_hint}",
                    ResourceWarning,
                    stacklevel=1,
                )
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
