"""Communicator: the host-side group every collective setup step agrees through.

A :class:`Communicator` moves small Python objects between the ranks of a group (allgather,
broadcast, barrier). It never touches GPU data; dcpkit's ops move that through symmetric
memory or NCCL. Build one with :meth:`Communicator.from_mpi` (``mpirun``-launched scripts),
:meth:`Communicator.from_torch` (an existing ``torch.distributed`` process group) or
:meth:`Communicator.single` (a group of one rank).

Usage::

    comm = Communicator.from_mpi()          # MPI.COMM_WORLD, or one rank outside mpirun
    print(comm.rank, comm.world_size, comm.local_rank)
    sizes = comm.allgather(nbytes)          # list, one entry per rank
    comm.agree("nbytes", nbytes)            # ConfigMismatch on every rank if they differ
"""

from __future__ import annotations

import atexit
import numbers
import os
import pickle
import socket
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ._lifecycle import Resource
from .errors import (
    ConfigMismatch,
    DcpkitError,
    InvalidArgument,
    InvalidType,
    MissingDependency,
    PeerError,
)

__all__ = [
    "Communicator",
    "canonical",
    "host_identity",
    "launcher_library_mismatch",
    "launcher_world_size",
    "launcher_world_size_mismatch",
    "mpi_init_may_join_a_job",
]


def host_identity() -> str:
    """A string equal for processes on the same host (same kernel boot), different otherwise.

    The hostname alone is not enough (containers share hostnames); the kernel boot id tells
    machines apart where it exists.
    """
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


#: Variables in which launchers publish the number of processes they started
#: (Open MPI / PMIx, and PMI-1/PMI-2 launchers such as MPICH's hydra and Intel MPI).
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launcher_world_size(env) -> tuple[str, int] | None:
    """``(variable, n)`` when an MPI launcher in ``env`` says it started ``n > 1`` processes.

    The count must be written in ASCII digits, as launchers write it (``int()`` would also take
    ``1_6`` and the digits of other scripts)."""
    for var in _LAUNCHER_SIZE_VARS:
        raw = env.get(var, "").strip(" \t\n\r\f\v")
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:  # no count has more digits
            continue
        n = int(raw)
        if n > 1:
            return var, n
    return None


#: Variables through which MPI_Init joins the job a launcher started (PMI-1/2 and PMIx
#: clients, MPICH's hydra, Slurm, Open MPI's older ORTE runtime), beside every ``PMI_*`` and
#: ``PMIX_*`` variable.
_JOB_CONNECT_VARS = (
    "HYDI_CONTROL_FD",
    "HYDRA_CONTROL_FD",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_MCA_ess_base_jobid",
)


def mpi_init_may_join_a_job(env) -> bool:
    """Whether ``MPI_Init`` in a process of ``env`` may join a job of several processes, and
    so wait for its peers: a variable through which an MPI library finds its launcher is set.
    Where none is, ``MPI_Init`` starts a one-process world at once (what ``dcpkit info``
    relies on before it initialises MPI to ask :func:`launcher_world_size_mismatch`)."""
    return any(k.startswith(("PMI_", "PMIX_")) or k in _JOB_CONNECT_VARS for k in env)


def library_line(text: str) -> str:
    """The first line of ``MPI.Get_library_version()``, blanks collapsed, without the NUL byte
    Open MPI's string ends in (which makes a terminal or a grep of a log read it as binary);
    "" for an empty string."""
    lines = text.replace("\x00", "").strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


def launcher_world_size_mismatch(env, MPI) -> str | None:
    """Why MPI.COMM_WORLD is not the launcher's job, or None: a launcher in ``env`` says it
    started several processes but the initialised ``MPI`` has a one-rank world.

    That happens when mpi4py loads a different MPI library than the one whose ``mpirun``
    started the job (for example MPICH from pip under the system's Open MPI ``mpirun``): every
    process would silently run alone. :meth:`Communicator.from_mpi` refuses to start then;
    ``dcpkit info`` warns.
    """
    found = launcher_world_size(env)
    if found is None or MPI.COMM_WORLD.Get_size() != 1:
        return None
    var, n = found
    try:
        lib = library_line(MPI.Get_library_version()) or "unknown"
    except Exception:  # noqa: BLE001 - only used in the message
        lib = "unknown"
    return (
        f"the launcher started {n} processes ({var}={n}) but MPI.COMM_WORLD has 1 rank: "
        f"mpi4py loaded an MPI library ({lib}) other than the one of this mpirun"
    )


#: Variables of PMIx launchers (Open MPI's ``mpirun``, PRRTE, Slurm's ``--mpi=pmix``).
#: MPICH's PMI client aborts ``MPI_Init`` when it finds them without PMI-1/2 variables;
#: Open MPI's ``OMPI_COMM_WORLD_*`` alone does not, and is left to the one-rank check.
_PMIX_LAUNCHER_VARS = ("PMIX_RANK", "PMIX_NAMESPACE")
#: Variables of PMI-1/PMI-2 launchers (MPICH's hydra, Intel MPI, Slurm's ``--mpi=pmi2``).
_PMI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "HYDI_CONTROL_FD")
#: Variables that only MPICH's hydra launcher sets.
_HYDRA_LAUNCHER_VARS = ("HYDI_CONTROL_FD", "HYDRA_CONTROL_FD")


def _first_set(env, names) -> str | None:
    """``"NAME=value"`` of the first of ``names`` set in ``env``, or None."""
    for name in names:
        if name in env:
            return f"{name}={env[name]}"
    return None


def launcher_library_mismatch(env, library_version: str) -> str | None:
    """Why the MPI library cannot start under the launcher of ``env``, or None when it can.

    Pure: reads ``env`` (a mapping) and ``library_version`` (``MPI.Get_library_version()``,
    which MPI-3 allows before ``MPI_Init``), so the check runs before MPI is initialised:

    * an MPICH library built without PMIx, under a PMIx launcher (``PMIX_RANK`` or
      ``PMIX_NAMESPACE``, as Open MPI's ``mpirun`` sets) and no PMI-1/PMI-2 variables:
      MPICH's ``MPI_Init`` aborts the process ("unsupported PMI version PMIx");
    * an Open MPI library under MPICH's hydra (``HYDI_CONTROL_FD``) without PMIx variables:
      every process would start alone.

    Other pairs (Intel MPI, Slurm's ``srun``, PMIx-enabled MPICH) are left to MPI itself and
    to the one-rank check after ``MPI_Init``.
    """
    text = library_version.strip()
    first = " ".join(text.splitlines()[0].split()) if text else "unknown"
    if text.startswith(("MPICH", "MVAPICH")) and "pmix" not in text.lower():
        found = _first_set(env, _PMIX_LAUNCHER_VARS)
        if found is not None and _first_set(env, _PMI_LAUNCHER_VARS) is None:
            return (
                f"a PMIx launcher (such as Open MPI's mpirun) started this process ({found}) but "
                f"mpi4py loaded {first}, built without PMIx: MPI_Init would abort"
            )
    if text.startswith("Open MPI"):
        found = _first_set(env, _HYDRA_LAUNCHER_VARS)
        if found is not None and _first_set(env, _PMIX_LAUNCHER_VARS) is None:
            return (
                f"MPICH's hydra launcher started this process ({found}) but mpi4py loaded "
                f"{first}: every process would start alone"
            )
    return None


_MISMATCH_ADVICE = (
    "Launch with the mpirun of that library, or install mpi4py against the MPI of this "
    "mpirun (see README, Known limits)"
)


def import_mpi():
    """``mpi4py.MPI``, initialised, after checking that its library suits the launcher.

    mpi4py initialises MPI when ``mpi4py.MPI`` is first imported; an MPI library that does not
    speak the launcher's protocol aborts the process inside ``MPI_Init``. So the first import
    here happens with ``mpi4py.rc.initialize = False``, the library is checked
    (:func:`launcher_library_mismatch`), and MPI is then initialised as mpi4py would have done
    (``rc.threads`` / ``rc.thread_level``), finalised at exit unless ``rc.finalize`` is False.
    Where the caller imported ``mpi4py.MPI`` already and MPI runs, it is used as it is.
    """
    import mpi4py

    with warnings.catch_warnings():
        # mpi4py's multi-line warning when another MPI library's launcher started this
        # process: the checks here and after MPI_Init raise that mismatch in one line
        warnings.filterwarnings("ignore", "suspicious MPI execution environment")
        if "mpi4py.MPI" not in sys.modules:
            rc_initialize = mpi4py.rc.initialize
            mpi4py.rc.initialize = False
            try:
                from mpi4py import MPI
            finally:
                mpi4py.rc.initialize = rc_initialize
        from mpi4py import MPI

        if MPI.Is_initialized() or MPI.Is_finalized():
            return MPI
        why = launcher_library_mismatch(os.environ, MPI.Get_library_version())
        if why is not None:
            raise DcpkitError(f"Communicator.from_mpi: {why}. {_MISMATCH_ADVICE}")
        rc = mpi4py.rc
        if getattr(rc, "threads", True):
            level = {
                "single": MPI.THREAD_SINGLE,
                "funneled": MPI.THREAD_FUNNELED,
                "serialized": MPI.THREAD_SERIALIZED,
            }.get(str(getattr(rc, "thread_level", "multiple")).lower(), MPI.THREAD_MULTIPLE)
            MPI.Init_thread(level)
        else:
            MPI.Init()
    if getattr(mpi4py.rc, "finalize", None) is not False:
        atexit.register(_finalize_mpi, MPI)
    return MPI


def _finalize_mpi(MPI) -> None:
    """At exit: finalise MPI that :func:`import_mpi` initialised, unless already done."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def _is_torch_non_member(dist, group) -> bool:
    """Whether ``group`` is ``torch.distributed.GroupMember.NON_GROUP_MEMBER``, what
    ``new_group`` returns on the ranks it leaves out (an int in torch 2)."""
    marker = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    if marker is None or group is None:
        return False
    return group is marker or (type(group) is type(marker) and group == marker)


def _is_int(x) -> bool:
    """True for Python and NumPy integers, False for bools and everything else."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def canonical(value: Any) -> Any:
    """A hashable form of ``value`` that is equal on two ranks exactly when the values agree.

    What :meth:`Communicator.agree` compares. Deterministic (no ``hash()``, no ``id()``, no
    dependence on insertion order) and linear in the size of ``value``.

    * Numbers compare by value, NumPy scalars included: ``np.int64(3) == 3 == 3.0``,
      ``np.float32(0.5) == 0.5``; every NaN equals every NaN, and ``-0.0 == 0.0``.
    * Booleans (``bool``, ``np.bool_``) are their own kind: ``True`` differs from ``1``, since
      a flag and a count that happen to share a value are different settings.
    * ``str`` and ``bytes`` are their own kinds: ``"3"`` differs from ``3`` and from ``b"3"``.
    * Lists and tuples compare elementwise (a list equals the tuple of the same items); dicts
      by their items whatever the key order; sets and frozensets by their members.
    * NumPy dtypes by their name and byte order; NumPy arrays by dtype, shape and bytes.
    * Anything else by its type and pickled bytes (the strict comparison).

    Raises
    ------
    pickle.PicklingError, TypeError
        ``value`` holds an object that is none of the above and does not pickle.
    """
    if value is None:
        return ("none",)
    if isinstance(value, (bool, *_np_bool())):
        return ("bool", bool(value))
    if isinstance(value, numbers.Number):
        return _canonical_number(value)
    if isinstance(value, str):
        return ("str", str(value))
    if isinstance(value, (bytes, bytearray)):
        return ("bytes", bytes(value))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(canonical(v) for v in value))
    if isinstance(value, dict):
        items = [(canonical(k), canonical(v)) for k, v in value.items()]
        return ("dict", tuple(sorted(items, key=repr)))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((canonical(v) for v in value), key=repr)))
    np = _numpy()
    if np is not None:
        if isinstance(value, np.dtype):
            return ("dtype", value.name, value.str)
        if isinstance(value, np.ndarray):
            a = np.ascontiguousarray(value)
            return ("array", a.dtype.name, a.dtype.str, a.shape, a.tobytes())
    cls = type(value)
    return (
        "object",
        f"{cls.__module__}.{cls.__qualname__}",
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL),
    )


def _canonical_number(x) -> tuple:
    """Real numbers as ``("num", int)`` when integral, ``("num", float)`` otherwise, NaN as
    ``("nan",)``; complex numbers with a non-zero imaginary part as ``("complex", re, im)``."""
    if isinstance(x, numbers.Integral):
        return ("num", int(x))
    if not isinstance(x, numbers.Real):
        c = complex(x)
        if c.imag != 0 or c.imag != c.imag:
            return ("complex", _canonical_number(c.real), _canonical_number(c.imag))
        x = c.real
    f = float(x)
    if f != f:
        return ("nan",)
    if f in (float("inf"), float("-inf")) or not f.is_integer():
        return ("num", f)
    return ("num", int(f))


def _numpy():
    """NumPy when it is already imported (a value cannot hold a NumPy object otherwise)."""
    return sys.modules.get("numpy")


def _np_bool() -> tuple:
    np = _numpy()
    return (np.bool_,) if np is not None else ()


class _Unpicklable:
    """Sent in place of an object that cannot be pickled, so that every rank learns of it and
    raises (instead of the other ranks waiting in the collective)."""

    def __init__(self, message: str):
        self.message = message


def _pickle_problem(obj) -> str | None:
    """None when ``obj`` pickles, else the error as ``"Type: message"``."""
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - PicklingError, TypeError, AttributeError, ...
        return f"{type(e).__name__}: {e}"
    return None


class Communicator(Resource):
    """A host-side process group: rank, world size, and collectives over Python objects.

    Attributes
    ----------
    rank : int
        This process's rank in ``[0, world_size)``.
    world_size : int
        Number of ranks in the group.
    local_rank : int
        Index of this rank among the ranks on the same host (ordered by rank).
    local_world_size : int
        Number of ranks on this host.
    host : str
        This host's identity (:func:`host_identity`).
    hosts : list of str
        Every rank's host identity, indexed by rank.
    backend : str
        ``"mpi"``, ``"torch"`` or ``"single"``.

    All methods are collective: every rank of the group calls them in the same order.
    """

    _noun = "communicator"

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        allgather: Callable[[Any], list[Any]],
        broadcast: Callable[[Any, int], Any],
        barrier: Callable[[], None],
        backend: str,
        handle: Any = None,
    ):
        for name, v in (("rank", rank), ("world_size", world_size)):
            if not _is_int(v):
                raise InvalidType(
                    f"Communicator: {name} must be an int (got {type(v).__name__} {v!r})"
                )
        if world_size < 1:
            raise InvalidArgument(f"Communicator: world_size must be >= 1 (got {world_size})")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"Communicator: rank must lie in [0, {world_size}) (got {rank})")
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.backend = backend
        self.handle = handle
        self._allgather = allgather
        self._broadcast = broadcast
        self._barrier = barrier
        self._closed = False
        self.host = host_identity()
        self.hosts = list(self._allgather(self.host))
        same = [r for r in range(self.world_size) if self.hosts[r] == self.host]
        self.local_rank = same.index(self.rank)
        self.local_world_size = len(same)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_mpi(cls, comm=None) -> Communicator:
        """A Communicator over an mpi4py communicator (default ``MPI.COMM_WORLD``).

        Outside ``mpirun`` MPI starts as a singleton: the group has one rank.

        Raises
        ------
        MissingDependency
            mpi4py (or an MPI library) is not installed: install the ``mpi`` extra.
        InvalidType
            ``comm`` is neither None nor an ``mpi4py.MPI.Comm``.
        DcpkitError
            The MPI library mpi4py loaded cannot start under this launcher (MPICH under Open
            MPI's ``mpirun``, say): raised before ``MPI_Init``. Or a launcher started several
            processes (``OMPI_COMM_WORLD_SIZE`` or ``PMI_SIZE`` > 1) but ``MPI.COMM_WORLD``
            has one rank: mpi4py loaded another MPI library than the one of the ``mpirun`` used.
        """
        try:
            MPI = import_mpi()
        except ImportError as e:  # pragma: no cover - exercised by a subprocess test
            raise MissingDependency("mpi4py", "mpi", str(e)) from None
        except RuntimeError as e:  # mpi4py present but no MPI library found
            raise MissingDependency("an MPI library", "mpi", str(e)) from None
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise InvalidType(
                f"Communicator.from_mpi: comm must be None or an mpi4py.MPI.Comm "
                f"(got {type(comm).__name__} {comm!r})"
            )
        c = MPI.COMM_WORLD if comm is None else comm
        why = launcher_world_size_mismatch(os.environ, MPI) if comm is None else None
        if why is not None:
            raise DcpkitError(f"Communicator.from_mpi: {why}. {_MISMATCH_ADVICE}")
        return cls(
            c.Get_rank(),
            c.Get_size(),
            allgather=c.allgather,
            broadcast=lambda obj, root: c.bcast(obj, root=root),
            barrier=c.Barrier,
            backend="mpi",
            handle=c,
        )

    @classmethod
    def from_torch(cls, group=None) -> Communicator:
        """A Communicator over a ``torch.distributed`` process group (default: the world).

        ``torch.distributed`` must be initialised. With the NCCL backend the current CUDA
        device must be set (``torch.cuda.set_device``) before this call.

        Call it only on the ranks of ``group``: on every other rank
        ``torch.distributed.new_group`` returns ``GroupMember.NON_GROUP_MEMBER``, which is
        refused.

        Raises
        ------
        MissingDependency
            torch is not installed: install the ``torch`` extra.
        InvalidType
            ``group`` is neither None nor a ``torch.distributed.ProcessGroup``.
        InvalidArgument
            This rank is not a member of ``group`` (``NON_GROUP_MEMBER``, or a group without
            this rank), or torch does not know ``group`` (destroyed, or of another job).
        DcpkitError
            ``torch.distributed`` is not initialised.
        """
        op = "Communicator.from_torch"
        try:
            import torch.distributed as dist
        except ImportError as e:
            from ._cuda import torch_extra

            raise MissingDependency("torch", torch_extra(), str(e)) from None
        available = dist.is_available()
        outside = available and _is_torch_non_member(dist, group)
        if group is not None and available and not outside:
            if not isinstance(group, dist.ProcessGroup):
                raise InvalidType(
                    f"{op}: group must be None or a torch.distributed.ProcessGroup "
                    f"(got {type(group).__name__} {group!r})"
                )
        if not available or not dist.is_initialized():
            raise DcpkitError(
                f"{op}: torch.distributed must be initialised first "
                "(call torch.distributed.init_process_group)"
            )
        if outside:
            raise InvalidArgument(
                f"{op}: this rank (global rank {dist.get_rank()}) is not a member of group: "
                f"group must include this rank (got torch.distributed.GroupMember."
                f"NON_GROUP_MEMBER, what new_group returns on the ranks it leaves out); create "
                f"the Communicator on the ranks of the group only"
            )
        try:
            rank = dist.get_rank(group)
            world = dist.get_world_size(group)
        except (ValueError, RuntimeError) as e:  # a group torch does not know, or not ours
            raise InvalidArgument(
                f"{op}: group must be a live process group of this job that includes this rank "
                f"(global rank {dist.get_rank()}) (got {group!r}; torch.distributed: {e})"
            ) from None
        if rank < 0 or world < 1:
            raise InvalidArgument(
                f"{op}: this rank (global rank {dist.get_rank()}) is not a member of group: "
                f"group must include this rank (got rank {rank}, world size {world} from "
                f"torch.distributed); create the Communicator on the ranks of the group only"
            )

        def allgather(obj):
            out = [None] * world
            dist.all_gather_object(out, obj, group=group)
            return out

        def broadcast(obj, root):
            box = [obj if rank == root else None]
            src = root if group is None else dist.get_global_rank(group, root)
            dist.broadcast_object_list(box, src=src, group=group)
            return box[0]

        return cls(
            rank,
            world,
            allgather=allgather,
            broadcast=broadcast,
            barrier=lambda: dist.barrier(group=group),
            backend="torch",
            handle=group,
        )

    @classmethod
    def single(cls) -> Communicator:
        """A group of one rank (no MPI, no torch): every collective is local."""
        return cls(
            0,
            1,
            allgather=lambda obj: [obj],
            broadcast=lambda obj, root: obj,
            barrier=lambda: None,
            backend="single",
        )

    # ------------------------------------------------------------------ collectives
    def _check_open(self, what: str) -> None:
        super()._check_open(f"Communicator.{what}")

    def _gather(self, method: str, obj: Any, shown: Any = None) -> list[Any]:
        """allgather on behalf of ``method``: an object that does not pickle on some rank makes
        every rank raise (that rank InvalidType, the others PeerError), nobody waits. ``shown``
        is what the message names (default ``obj``)."""
        self._check_open(method)
        problem = _pickle_problem(obj)
        values = list(self._allgather(obj if problem is None else _Unpicklable(problem)))
        bad = {r: v.message for r, v in enumerate(values) if isinstance(v, _Unpicklable)}
        if bad:
            if problem is not None:
                what = obj if shown is None else shown
                raise InvalidType(
                    f"Communicator.{method}: the object must be picklable (got "
                    f"{type(what).__name__}: {problem})"
                )
            raise PeerError(f"Communicator.{method}: pickling the object", bad)
        return values

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, as a list indexed by rank.

        Raises
        ------
        InvalidType
            ``obj`` cannot be pickled on this rank (every other rank raises PeerError).
        PeerError
            ``obj`` could not be pickled on another rank.
        ClosedError
            The communicator is closed.
        """
        return self._gather("allgather", obj)

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """``obj`` of rank ``root``, on every rank.

        Raises
        ------
        InvalidType
            ``root`` is not an int (bools included), or ``obj`` cannot be pickled on the root
            (every other rank raises PeerError).
        InvalidArgument
            ``root`` is outside ``[0, world_size)``.
        ConfigMismatch
            The ranks passed different roots (on every rank, naming them): the roots are
            compared in an allgather before the broadcast.
        ClosedError
            The communicator is closed.
        """
        return self._bcast("broadcast", obj, root)

    def _bcast(self, method: str, obj: Any, root: int) -> Any:
        self._check_open(method)
        bad = None
        if not _is_int(root):
            bad = InvalidType(
                f"Communicator.{method}: root must be an int (got {type(root).__name__} {root!r})"
            )
        elif not 0 <= root < self.world_size:
            bad = InvalidArgument(
                f"Communicator.{method}: root must lie in [0, {self.world_size}) (got {root})"
            )
        # Every rank's root, compared before the broadcast: a root that differs (or is bad) on
        # some ranks only would hand some rank another rank's object, or leave the others
        # waiting in a broadcast the bad rank never enters.
        shown = int(root) if bad is None else repr(root)
        roots = list(self._allgather(shown))
        if bad is not None:
            raise bad
        root = int(root)
        if any(r != root for r in roots):
            raise ConfigMismatch(f"Communicator.{method}: root", roots)
        problem = _pickle_problem(obj) if self.rank == root else None
        got = self._broadcast(obj if problem is None else _Unpicklable(problem), root)
        if isinstance(got, _Unpicklable):
            if problem is not None:
                raise InvalidType(
                    f"Communicator.{method}: the object must be picklable (got "
                    f"{type(obj).__name__}: {problem})"
                )
            raise PeerError(f"Communicator.{method}: pickling the object", {root: got.message})
        return got

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._check_open("barrier")
        self._barrier()

    # ------------------------------------------------------------------ agreement helpers
    def agree(self, what: str, value: Any) -> list[Any]:
        """Check that ``value`` is equal on every rank.

        Naive equivalent: ``values = allgather(value); assert all(v == values[0] for v in
        values)``, with equality of the :func:`canonical` forms: by value, not by pickled bytes,
        so ``{"a": 1, "b": 2}`` equals ``{"b": 2, "a": 1}``, ``np.int64(3)`` equals ``3`` and NaN
        equals NaN, while ``3`` and ``"3"``, or ``1`` and ``True``, differ.

        Parameters
        ----------
        what : str
            What is compared, named in the error (``"T_max"``, ``"lse_reduce: call arguments"``).
        value : picklable object
            This rank's value.

        Returns
        -------
        list
            Every rank's value, indexed by rank.

        Collective: one allgather; every rank calls it with the same ``what``.

        Raises
        ------
        ConfigMismatch
            The values are not all equal (on every rank, naming the ranks that differ).
        InvalidType
            ``value`` does not pickle on this rank (the other ranks raise PeerError).
        PeerError
            ``value`` did not pickle on another rank.
        ClosedError
            The communicator is closed.
        """
        values = self._gather("agree", value)
        first = canonical(values[0])
        if any(canonical(v) != first for v in values[1:]):
            raise ConfigMismatch(what, values)
        return values

    def agree_setup(
        self,
        what: str,
        init: Callable[[], Any],
        geometry: str = "geometry",
        settings: Mapping[str, Any] | None = None,
    ) -> Any:
        """One exchange that checks a collective constructor's arguments on every rank.

        Every rank runs ``init()``, which validates its local arguments (raising a
        :class:`DcpkitError`) and returns a value that must be equal on every rank (the
        geometry). Then, in one allgather: a rank whose ``init()`` raised re-raises its own
        error, every other rank raises :class:`PeerError` naming it; values that differ raise
        :class:`ConfigMismatch` on every rank naming the ranks. Returns the value.

        ``settings`` (name -> value, read from this rank's environment, for example
        ``{"DCPKIT_DEBUG": True}``) travel in the same exchange and must be equal on every rank
        too: a setting that differs raises :class:`ConfigMismatch` naming the setting and the
        ranks (after the geometry's check), so that no rank runs a per-call collective the
        others skip.
        """
        err: DcpkitError | None = None
        value = None
        named = tuple((settings or {}).items())
        try:
            value = init()
        except DcpkitError as e:
            err = e
        every = self._gather(
            "agree_setup",
            (None if err is None else f"{type(err).__name__}: {err}", value, named),
            shown=value,
        )
        if err is not None:
            raise err
        failed = {r: m for r, (m, _, _) in enumerate(every) if m is not None}
        if failed:
            raise PeerError(f"{what}: constructor arguments", failed)
        if any(v != value for _, v, _ in every):
            raise ConfigMismatch(f"{what}: {geometry}", [v for _, v, _ in every])
        for name, mine in named:
            seen = [dict(n).get(name) for _, _, n in every]
            if any(v != mine for v in seen):
                raise ConfigMismatch(f"{what}: {name}", seen)
        return value

    def all_ok(self, what: str, error: BaseException | None) -> None:
        """One step of a collective transaction: share whether this rank's step failed.

        Every rank calls this after a step, passing the exception it caught (or ``None``).
        If any rank failed, every rank raises :class:`PeerError` naming the failing ranks and
        their messages; on a failing rank the PeerError is chained to its own exception
        (``raise PeerError(...) from error``, so ``__cause__`` is that exception). No rank is
        left waiting in a later step.

        Raises
        ------
        PeerError
            Some rank passed an exception.
        InvalidType
            ``error`` is neither None nor an exception (after the exchange, in which this rank
            counts as failed, so the others raise PeerError and nobody waits).
        ClosedError
            The communicator is closed.
        """
        bad_arg = None
        if error is not None and not isinstance(error, BaseException):
            bad_arg = InvalidType(
                f"Communicator.all_ok: error must be an exception or None "
                f"(got {type(error).__name__} {error!r})"
            )
            error = bad_arg
        msg = None if error is None else f"{type(error).__name__}: {error}"
        msgs = self._gather("all_ok", msg)
        if bad_arg is not None:
            raise bad_arg
        failed = {r: m for r, m in enumerate(msgs) if m is not None}
        if failed:
            err = PeerError(what, failed)
            if error is not None:
                raise err from error
            raise err

    def close(self) -> None:
        """Drop the references to the underlying group (idempotent; no collective work)."""
        super().close()

    def _close(self) -> None:
        self._allgather = self._broadcast = self._barrier = None  # type: ignore[assignment]

    def _left_open(self) -> bool:
        return False  # holds no resource of its own: dropping it open is fine

    def __repr__(self) -> str:
        return (
            f"Communicator(backend={self.backend!r}, rank={self.rank}, "
            f"world_size={self.world_size}, local_rank={self.local_rank}, "
            f"local_world_size={self.local_world_size})"
        )

    @property
    def spans_hosts(self) -> bool:
        """True when the ranks live on more than one host."""
        return len(set(self.hosts)) > 1

    def job_token(self) -> str:
        """A random token equal on every rank, different for every job (for socket names)."""
        tok = os.urandom(8).hex() if self.rank == 0 else None
        return self._bcast("job_token", tok, 0)
