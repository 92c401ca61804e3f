"""The collective setup step: every rank shares its outcome, and a transaction that unwinds.

Every collective constructor of dcpkit (symmetric heaps, multicast objects, the ops, the NCCL
group, :class:`~dcpkit.manager.DCPComm`) builds its resource in steps. After each step the ranks
exchange whether it succeeded, so that a rank that failed never leaves its peers waiting in a
later collective:

* :func:`share_outcome` is that exchange (one allgather). If any rank failed, every rank raises:
  the failing rank its own error (with a note naming every failing rank when there are several),
  the others :class:`~dcpkit.errors.PeerError` naming the failing ranks and their messages.
* :func:`collective_step` runs one local step, shares its outcome, and on failure runs the
  caller's clean-up before raising.
* :class:`Transaction` chains steps that each register their undo; a failure anywhere unwinds
  everything everywhere, in reverse (the cuda.core style). ``commit()`` hands the undo list to
  the finished resource, whose ``close()`` runs it with :func:`run_undo`.
* :func:`guarded` wraps the argument check of a constructor for
  :meth:`~dcpkit.comm.Communicator.agree_setup`, which shares only dcpkit errors.

This module needs nothing but a Communicator-like object with ``rank`` and ``allgather``; it
imports no other dcpkit module than :mod:`dcpkit.errors`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from .errors import DcpkitError, InvalidArgument, PeerError

__all__ = [
    "share_outcome",
    "collective_step",
    "Transaction",
    "run_undo",
    "guarded",
    "error_text",
    "debug_enabled",
    "FAULT_POINT",
]

log = logging.getLogger("dcpkit")

#: Fault injection for tests: when this equals ``"after_<step>"`` (for example
#: ``"after_create"``, ``"after_export"``, ``"after_exchange"``, ``"after_map"``), the
#: :class:`Transaction` step ``<step>`` raises ``RuntimeError("injected fault at after_<step>
#: ...")`` on this rank right after it succeeded. Steps of the cumem heap: context, p2p_check,
#: granularity, fabric_create, create, export, exchange, import, reserve, map, access, zero;
#: multicast objects add mc_device ... mc_map; the nvshmem heap: nvshmem_state, nvshmem_method,
#: nvshmem_uid, nvshmem_init, nvshmem_alloc, nvshmem_peers, zero.
FAULT_POINT: Any | None = None

Undo = list[tuple[str, Callable[[], object]]]


def error_text(err: BaseException) -> str:
    """``"Type: message"``: how an error travels to the other ranks."""
    return f"{type(err).__name__}: {err}"


#: ``DCPKIT_DEBUG`` values that leave the check off (compared stripped and lower-cased), the
#: false spellings ``DCPKIT_MULTICAST`` reads; so do the empty value and any integer 0.
_DEBUG_OFF = frozenset({"", "0", "false", "no", "off", "n", "f"})


def debug_enabled() -> bool:
    """True when ``DCPKIT_DEBUG`` is set to anything but empty, 0 or a false word
    (``false``, ``no``, ``off``, ``n``, ``f``, any case)."""
    v = os.environ.get("DCPKIT_DEBUG", "").strip().lower()
    if v in _DEBUG_OFF:
        return False
    digits = v[1:] if v[:1] in "+-" else v
    if digits.isascii() and digits.isdigit():  # an integer in decimal digits (not 0_0)
        return digits.strip("0") != ""  # not int(): it refuses more than 4300 digits
    return True


def share_outcome(comm, what: str, err: BaseException | None, *extra) -> list[tuple]:
    """One collective step: every rank shares whether its step failed (plus ``extra``, values
    every rank wants from every other).

    Parameters
    ----------
    comm : Communicator
    what : str
        The step, named in the PeerError (``"QGather: warm-up"``).
    err : BaseException or None
        The exception this rank's step raised, or None.
    *extra
        Picklable values to hand to every rank.

    Returns
    -------
    list of tuple
        Every rank's ``extra``, indexed by rank (only when no rank failed).

    Collective: one allgather, every rank.

    Raises
    ------
    BaseException
        On a failing rank, its own ``err`` (with a note naming every failing rank when there
        are several).
    PeerError
        On every other rank, when some rank failed (naming the ranks and their messages).
    """
    every = comm.allgather((None if err is None else error_text(err),) + tuple(extra))
    failed = {r: v[0] for r, v in enumerate(every) if v[0] is not None}
    if err is not None:
        if len(failed) > 1 and hasattr(err, "add_note"):
            err.add_note(str(PeerError(what, failed)))
        raise err.with_traceback(err.__traceback__)
    if failed:
        raise PeerError(what, failed)
    return [tuple(v[1:]) for v in every]


def collective_step(
    comm,
    what: str,
    fn: Callable[[], Any],
    *,
    on_failure: Callable[[], None] | None = None,
    gather: bool = False,
) -> Any:
    """Run ``fn()`` on this rank, then :func:`share_outcome`; returns ``fn()``'s result, or with
    ``gather=True`` every rank's result (a list indexed by rank: the result must pickle).

    ``on_failure`` (if given) runs on every rank when any rank failed, before the error is
    raised (the clean-up of what this rank set up so far; its own errors are logged, never
    raised over the step's error).

    Collective: one allgather, every rank.
    """
    err: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - shared with every rank, then re-raised
        err = e
    try:
        every = share_outcome(comm, what, err, *((result,) if gather else ()))
    except BaseException:
        if on_failure is not None:
            try:
                on_failure()
            except Exception as e:  # noqa: BLE001 - the step's error is what matters
                log.warning("%s: clean-up after a failed step failed: %s", what, error_text(e))
        raise
    return [v for (v,) in every] if gather else result


def run_undo(undo: Undo, what: str) -> list[BaseException]:
    """Run undo actions in reverse order; keep going past failures, return them (empties
    ``undo``)."""
    errors: list[BaseException] = []
    for name, fn in reversed(undo):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - undo must go on; report at the end
            log.warning("%s: undo step %s failed: %s", what, name, error_text(e))
            errors.append(e)
    undo.clear()
    return errors


class Transaction:
    """Collective setup with undo.

    ``step(name, fn)`` runs ``fn`` on this rank, then every rank checks that every rank
    succeeded (:func:`share_outcome`); on failure everything registered so far is undone in
    reverse order and the error is raised on every rank. ``commit()`` hands the undo list to the
    new resource.

    Collective: every :meth:`step`.
    """

    def __init__(self, comm, what: str):
        self.comm = comm
        self.what = what
        self._undo: Undo = []

    def add_undo(self, name: str, fn: Callable[[], object]) -> None:
        """Register the undo of something this rank just created."""
        self._undo.append((name, fn))

    def undo_last(self) -> None:
        """Run and drop the most recent undo action now (a resource given up on purpose)."""
        name, fn = self._undo.pop()
        run_undo([(name, fn)], self.what)

    def step(self, name: str, fn: Callable[[], object]):
        """Run one step on this rank; every rank learns whether every rank succeeded."""

        def checked():
            result = fn()
            if FAULT_POINT == f"after_{name}":
                raise RuntimeError(f"injected fault at after_{name} (rank {self.comm.rank})")
            return result

        return collective_step(
            self.comm, f"{self.what}: setup step {name!r}", checked, on_failure=self.rollback
        )

    def rollback(self) -> None:
        """Undo everything registered so far, in reverse (this rank only)."""
        run_undo(self._undo, f"{self.what}: unwinding setup")

    def commit(self) -> Undo:
        """Hand the undo list over (the transaction is then empty)."""
        undo, self._undo = self._undo, []
        return undo


def guarded(op: str, init: Callable[[], Any]) -> Callable[[], Any]:
    """``init`` for :meth:`Communicator.agree_setup`, which shares only dcpkit errors
    (:class:`~dcpkit.errors.DcpkitError`): any other exception of a check (a ``TypeError``
    from an odd argument value) becomes :class:`InvalidArgument`, so that it is shared too and
    no rank is left waiting."""

    def checked():
        try:
            return init()
        except DcpkitError:
            raise
        except Exception as e:
            raise InvalidArgument(
                f"{op}: checking the constructor arguments failed ({type(e).__name__}: {e})"
            ) from e

    return checked
