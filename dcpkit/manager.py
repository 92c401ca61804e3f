"""DCPComm: the three DCP exchanges of one geometry, each served per call by the direct op or
by its NCCL version.

Usage, on every rank::

    dcp = DCPComm(comm, max_tokens=128, num_heads=128, q_head_dim=576, v_head_dim=512,
                  kv_row_dim=576, dtype="bfloat16")           # policy="auto"
    q_all = dcp.q_gather(q)                      # [T, H_r, D_q] -> [T, H, D_q]
    out = dcp.lse_reduce(out_partial, lse)       # [T, H, D_v], [T, H] -> [T, H_r, D_v]
    kv_all = dcp.kv_gather(kv)                   # [T, D_kv] -> [world_size*T, D_kv]
    print(dcp.last_path, dcp.counters)           # "direct-unicast", {"q_gather": {...}, ...}
    print(dcp.describe())
    dcp.close()                                  # collective

Selection (per call, :func:`select_path`): the direct op serves a call when

1. the group is one NVLink domain: every rank on one host and peer access between every pair
   of GPUs (decided once at construction, agreed across ranks);
2. the geometry suits the direct kernel (dtype, row bytes a multiple of 16; decided once);
3. the call suits it: ``T <= max_tokens``, and for ``lse_reduce`` an lse dtype the kernel
   reads (bfloat16, float16, float32);

otherwise the NCCL op (:mod:`dcpkit.fallback`) serves it. ``policy="direct"`` forces the direct
op (a call it cannot serve raises, never falls back silently); ``policy="nccl"`` forces NCCL.
Every input of the decision is equal on every rank (``T``, dtypes, shapes, the policy, the
topology agreed at setup), never a pointer or a stride, so ranks never take different paths.
An input whose layout the direct kernel cannot read (misaligned pointer, odd strides: these may
differ per rank) is copied to a contiguous array instead (an allocation: refused while a CUDA
graph is being captured), and an ``out=`` it cannot write receives a copy of the result.

Every call records its path: :attr:`DCPComm.last_path` (``"direct-unicast"``,
``"direct-multicast"`` or ``"nccl"``) and :attr:`DCPComm.counters` (op -> path -> calls).

NCCL unavailable. NCCL needs one GPU per rank (``ncclCommInitRank`` refuses two ranks of one
host on one GPU with ``ncclInvalidUsage``), and it may be missing or fail to start. Before any
rank enters ``ncclCommInitRank`` (collective, with no deadline) the ranks agree on its
preconditions (every rank read its GPU's PCI bus id; no two ranks of a host share a GPU); then
they build the NCCL group and ops and agree on the outcome with one allgather. With
``policy="auto"`` a failure on any rank leaves every rank direct-only, with the reason in
:attr:`DCPComm.nccl_reason` and :meth:`DCPComm.describe`; a later call that needs NCCL
(``T > max_tokens``, an lse dtype the direct kernel does not read) raises
:class:`~dcpkit.errors.InvalidArgument` naming that reason. ``policy="nccl"`` raises at
construction, on every rank.
"""

from __future__ import annotations

import math
import warnings

from . import _cuda
from ._arrays import dtype_name
from ._checks import (
    INT32_MAX,
    check_bool,
    check_comm,
    check_lse_base,
    check_positive_int,
    check_timeout_ms,
    resolve_dtype,
)
from ._dcp_calls import DCPCalls
from ._launch import check_programmatic_launch
from ._lifecycle import Resource
from ._setup import collective_step, error_text, guarded, share_outcome
from ._strided import load_copy_kernels
from .comm import Communicator
from .errors import ClosedError, ConfigMismatch, InvalidArgument, InvalidType, PeerError
from .nccl import LSE_ALGORITHMS
from .selection import (
    DIRECT_LSE_DTYPES,
    OPS,
    PATH_DIRECT_MULTICAST,
    PATH_DIRECT_UNICAST,
    PATH_NCCL,
    PATHS,
    POLICIES,
    direct_call_blocker,
    direct_geometry_blocker,
    failure_reason,
    select_path,
    shared_gpu_blocker,
    topology_blocker,
)

#: Alignment of each direct op's region in the shared heap (the ops' own reservation rule).
_ALIGN = 256

__all__ = [
    "DCPComm",
    "select_path",
    "direct_call_blocker",
    "direct_geometry_blocker",
    "topology_blocker",
    "shared_gpu_blocker",
    "POLICIES",
    "OPS",
    "PATH_DIRECT_UNICAST",
    "PATH_DIRECT_MULTICAST",
    "PATH_NCCL",
    "DIRECT_LSE_DTYPES",
]


# ----------------------------------------------------------------------------- manager
#: The constructor arguments of :class:`DCPComm` that every rank must pass equal (checked and
#: agreed in one exchange, :meth:`DCPComm._init_geometry`'s parameters).
GEOMETRY_ARGUMENTS = (
    "max_tokens, num_heads, q_head_dim, v_head_dim, kv_row_dim, dtype, num_ubatches, lse_base, "
    "nccl_lse_algorithm, nccl_max_tokens, return_lse, timeout_ms, programmatic_launch"
)


class DCPComm(DCPCalls, Resource):
    """The three DCP exchanges of one geometry, each served by its direct op or its NCCL op.

    Naive equivalent::

        q_gather(q)          = torch.cat(all_gather(q), dim=1)
        lse_reduce(o, lse)   = all_to_all of head slices + LSE-weighted merge (own heads)
        kv_gather(kv)        = all_gather_into_tensor(kv)

    Builds, once, the direct ops (:class:`~dcpkit.ops.QGather`,
    :class:`~dcpkit.ops.LseReduce`, and :class:`~dcpkit.ops.KVGather` when ``kv_row_dim`` is
    given; each in its own symmetric heap) and their NCCL versions (:mod:`dcpkit.fallback`,
    sharing one NCCL communicator), and picks one per call (module docstring, "Selection").

    Parameters
    ----------
    comm : Communicator
    max_tokens : int
        ``T_max`` of the direct ops: calls with ``T > max_tokens`` go to NCCL.
    num_heads : int
        ``H``, a multiple of ``world_size``; rank ``r`` owns heads ``[r*H_r, (r+1)*H_r)``.
    q_head_dim : int
        ``D_q``, the head width of ``q``.
    v_head_dim : int
        ``D_v``, the head width of the attention output.
    kv_row_dim : int, optional
        ``D_kv``: builds ``kv_gather`` when given.
    dtype : str or dtype
        Dtype of ``q``, ``kv``, ``out_partial`` and the outputs (bfloat16, float16, float32;
        the gathers also take other dtypes, then served by the direct op where row bytes allow).
    num_ubatches : int
        Independent epochs / buffers per op (micro-batches that overlap).
    lse_base : float
        ``math.e`` or ``2``: base of ``lse_partial``.
    policy : str
        ``"auto"`` (default), ``"direct"`` or ``"nccl"``; must be equal on every rank.
    nccl_lse_algorithm : str
        The NCCL ``lse_reduce`` algorithm: ``"all_to_all"`` (default) or
        ``"allgather_reduce_scatter"`` (same result shape). (``"allgather_all_reduce"`` returns
        all heads and so cannot stand in for the direct op: use
        :class:`~dcpkit.fallback.NcclLseReduce` directly.)
    timeout_ms : float, optional
        Deadline of every wait of the direct ops, in [0.001, 3600000] milliseconds, any real
        number type (default ``DCPKIT_TIMEOUT_MS`` or 5000).
    programmatic_launch : bool
        The direct ops launch with programmatic dependent launch (see
        :class:`~dcpkit.ops.QGather`; needs compute capability 9.0+ and cuda.bindings; default
        False). The NCCL path launches as NCCL does.
    nccl_max_tokens : int, optional
        Buffer capacity of the NCCL ops (default ``max_tokens``). Calls with larger ``T`` still
        work eagerly (the NCCL op then allocates per call); inside a CUDA graph capture ``T``
        must stay ``<= nccl_max_tokens``.
    return_lse : bool
        ``lse_reduce`` also returns the merged lse from every call (as with ``out_lse=``).

    Attributes
    ----------
    last_path : str or None
        Path of the last call: ``"direct-unicast"``, ``"direct-multicast"`` or ``"nccl"``.
    counters : dict
        op -> path -> number of calls served.
    direct_ops, nccl_ops : dict
        op -> the op object (None where not built).
    direct_reason : dict
        op -> why no direct op serves it at all (None where one is available).
    nccl_reason : str or None
        Why the NCCL ops are unavailable (None when available): ``"policy is 'direct'"``, or,
        with ``policy="auto"``, why they could not be built (ranks sharing a GPU, NCCL missing
        or failing to start on some rank); equal on every rank. Then the direct ops serve
        every call they can, and a call that needs NCCL raises naming this reason.

    Collective: construction, every call, :meth:`close`.

    Raises
    ------
    ConfigMismatch
        Ranks passed different policies (naming the ranks) or geometries.
    InvalidArgument, InvalidType
        A bad argument, also one that an op the policy may build rejects (sizes past the ops'
        limits, a dtype no path serves): never silently routed to another path;
        ``policy="direct"`` where the direct ops cannot exist (multi-host, no peer access,
        unsupported geometry); ``policy="nccl"`` where ranks share a GPU.
    MissingDependency
        CuPy is not installed; ``policy="nccl"`` and NCCL is not usable (names the cuda12 /
        cuda13 extra).
    DcpkitError
        No CUDA GPU is visible.
    PeerError
        Another rank failed a check or a setup step (with ``policy="nccl"``: building the NCCL
        group or ops; the failing rank raises its own error).

    With ``policy="auto"`` only environment failures (CUDA, NVRTC, memory, NCCL missing or
    failing) of one path leave the other path serving the calls; wrong arguments always raise.
    """

    _resource_name = "DCPComm"

    def __init__(
        self,
        comm: Communicator,
        *,
        max_tokens: int,
        num_heads: int,
        q_head_dim: int,
        v_head_dim: int,
        kv_row_dim: int | None = None,
        dtype,
        num_ubatches: int = 1,
        lse_base: float = math.e,
        policy: str = "auto",
        nccl_lse_algorithm: str = "all_to_all",
        timeout_ms: float | None = None,
        nccl_max_tokens: int | None = None,
        return_lse: bool = False,
        programmatic_launch: bool = False,
    ):
        self.direct_ops: dict[str, object] = dict.fromkeys(OPS)
        self.nccl_ops: dict[str, object] = dict.fromkeys(OPS)
        self.nccl_group = None
        self.heap = None
        self.comm = check_comm(comm, "DCPComm")
        self.rank, self.world_size = comm.rank, comm.world_size
        # 1. the policy: the first collective, before anything touches a GPU
        err = None
        if policy not in POLICIES:
            err = InvalidArgument(
                f"DCPComm: policy must be one of {list(POLICIES)} (got {policy!r})"
            )
        policies = [p for (p,) in share_outcome(comm, "DCPComm: policy", err, policy)]
        if any(p != policy for p in policies):
            raise ConfigMismatch("DCPComm: policy", policies)
        self.policy = policy

        # 2. every argument (also as the ops will see them), CuPy and the GPU: one exchange
        given = locals()
        geometry = {name: given[name] for name in GEOMETRY_ARGUMENTS.split(", ")}
        comm.agree_setup(
            "DCPComm",
            guarded("DCPComm", lambda: self._init_geometry(**geometry)),
            f"geometry ({GEOMETRY_ARGUMENTS})",
        )
        self.last_path: str | None = None
        self.counters: dict[str, dict[str, int]] = {op: dict.fromkeys(PATHS, 0) for op in self.ops}
        self.direct_reason: dict[str, str | None] = dict.fromkeys(OPS)
        self.nccl_reason: str | None = None
        self._direct_path: dict[str, str | None] = dict.fromkeys(OPS)
        try:
            self._build()
        except BaseException:
            self._close_all()
            raise
        self._closed = False

    # ------------------------------------------------------------------ construction
    def _init_geometry(
        self,
        max_tokens,
        num_heads,
        q_head_dim,
        v_head_dim,
        kv_row_dim,
        dtype,
        num_ubatches,
        lse_base,
        nccl_lse_algorithm,
        nccl_max_tokens,
        return_lse,
        timeout_ms,
        programmatic_launch,
    ) -> tuple:
        """Check every argument (no collective), also as each op that the policy may build
        will check it, then CuPy and the GPU; returns the geometry tuple."""
        op = "DCPComm"
        W = self.world_size
        self.max_tokens = check_positive_int(max_tokens, op, "max_tokens", maximum=INT32_MAX)
        self.num_heads = check_positive_int(num_heads, op, "num_heads")
        if self.num_heads % W:
            raise InvalidArgument(
                f"{op}: num_heads must be a multiple of world_size {W} (got {self.num_heads})"
            )
        self.heads_per_rank = self.num_heads // W
        self.q_head_dim = check_positive_int(q_head_dim, op, "q_head_dim")
        self.v_head_dim = check_positive_int(v_head_dim, op, "v_head_dim")
        self.kv_row_dim = (
            None if kv_row_dim is None else check_positive_int(kv_row_dim, op, "kv_row_dim")
        )
        try:
            self.dtype = resolve_dtype(dtype)
        except (TypeError, ValueError, AttributeError, ImportError):
            raise InvalidType(
                f"{op}: dtype must be a NumPy dtype or dtype name (got {dtype!r})"
            ) from None
        self.num_ubatches = check_positive_int(num_ubatches, op, "num_ubatches")
        self.lse_base = check_lse_base(lse_base, op)
        usable = [a for a in LSE_ALGORITHMS if a != "allgather_all_reduce"]
        if nccl_lse_algorithm not in usable:
            raise InvalidArgument(
                f"{op}: nccl_lse_algorithm must be one of {usable} (got {nccl_lse_algorithm!r})"
            )
        self.nccl_lse_algorithm = nccl_lse_algorithm
        self.nccl_max_tokens = (
            self.max_tokens
            if nccl_max_tokens is None
            else check_positive_int(nccl_max_tokens, op, "nccl_max_tokens", maximum=INT32_MAX)
        )
        self.return_lse = check_bool(return_lse, op, "return_lse")
        self.timeout_ms = check_timeout_ms(timeout_ms, op)
        self.programmatic_launch = check_bool(programmatic_launch, op, "programmatic_launch")
        self.ops = tuple(o for o in OPS if o != "kv_gather" or self.kv_row_dim is not None)
        # The ops' own limits (sizes, dtypes), with DCPComm's arguments: a user error raises
        # here, on every rank, instead of sending every call to another path. The direct ops'
        # symmetric regions (the last value each agrees on) size the one heap they share.
        self._region_bytes: dict[str, int] = {}
        self._nccl_checked: dict[str, object] = {}
        for o in self.ops:
            if (
                self.policy != "nccl"
                and direct_geometry_blocker(
                    o, dtype=self.dtype, row_bytes=self._row_bytes(o), world_size=W
                )
                is None
            ):
                cls, kwargs = self._direct_spec(o)
                agreed = self._check_op_arguments(o, cls.check_arguments, kwargs, "direct")
                self._region_bytes[o] = int(agreed[-1])
            if self.policy != "direct":  # checked once here, built from it (no second exchange)
                cls, kwargs = self._nccl_spec(o)
                self._nccl_checked[o] = self._check_op_arguments(o, cls.prepare, kwargs, "NCCL")
        self.device = self._current_device()  # CuPy and a visible GPU
        if self.programmatic_launch:  # refused alike whichever path the policy may take
            import cupy

            check_programmatic_launch(cupy, self.device, "DCPComm")
        return (
            self.max_tokens,
            self.num_heads,
            self.q_head_dim,
            self.v_head_dim,
            self.kv_row_dim,
            str(self.dtype),
            self.num_ubatches,
            self.lse_base,
            self.nccl_lse_algorithm,
            self.nccl_max_tokens,
            self.return_lse,
            self.timeout_ms,
            self.programmatic_launch,
        )

    def _check_op_arguments(self, op: str, check, kwargs: dict, which: str):
        """``check(world_size, **kwargs)`` (an op class's ``check_arguments`` or ``prepare``: no
        GPU, no collective) on the keywords DCPComm gives the op; returns its result. An error
        names DCPComm and the op."""
        try:
            return check(self.world_size, **kwargs)
        except (InvalidArgument, InvalidType) as e:
            msg = str(e)
            if msg.startswith(f"{op}: "):
                msg = msg[len(op) + 2 :]
            raise type(e)(f"DCPComm: {which} {op} op: {msg}") from None

    def _direct_spec(self, op: str):
        """The direct op class of ``op`` and the constructor keywords DCPComm gives it."""
        from .ops import KVGather, LseReduce, QGather

        # return_lse as asked: a merged lse nobody reads would take a graph output buffer
        # of the op's bounded pool for every call captured with out= alone.
        lse = {"return_lse": self.return_lse}
        common = dict(
            max_tokens=self.max_tokens,
            timeout_ms=self.timeout_ms,
            heap=self.heap,
            programmatic_launch=self.programmatic_launch,
        )
        classes = {"q_gather": QGather, "lse_reduce": LseReduce, "kv_gather": KVGather}
        return classes[op], self._op_keywords(op, lse, **common)

    def _nccl_spec(self, op: str):
        """The NCCL op class of ``op`` and the constructor keywords DCPComm gives it (without
        ``nccl_group``)."""
        from .nccl import NcclKVGather, NcclLseReduce, NcclQGather

        lse = {"return_lse": True, "algorithm": self.nccl_lse_algorithm}
        classes = {"q_gather": NcclQGather, "lse_reduce": NcclLseReduce, "kv_gather": NcclKVGather}
        return classes[op], self._op_keywords(op, lse, max_tokens=self.nccl_max_tokens)

    def _op_keywords(self, op: str, lse: dict, **common) -> dict:
        """The constructor keywords of either path's ``op``: its geometry, dtype and
        num_ubatches, the path's ``common`` ones, and ``lse`` for ``lse_reduce``."""
        common.update(dtype=self.dtype, num_ubatches=self.num_ubatches)
        if op == "q_gather":
            return dict(heads_per_rank=self.heads_per_rank, head_dim=self.q_head_dim, **common)
        if op == "lse_reduce":
            return dict(
                num_heads=self.num_heads,
                head_dim=self.v_head_dim,
                lse_base=self.lse_base,
                **lse,
                **common,
            )
        return dict(row_dim=self.kv_row_dim, **common)

    def _row_bytes(self, op: str) -> int:
        isz = self.dtype.itemsize
        return {
            "q_gather": self.heads_per_rank * self.q_head_dim * isz,
            "kv_gather": (self.kv_row_dim or 0) * isz,
            "lse_reduce": self.v_head_dim * isz,
        }[op]

    def _build(self) -> None:
        """Topology, direct ops, NCCL group and ops (collective; consistent on every rank)."""
        self.topology_reason = self._probe_topology()
        # the one symmetric heap of the direct ops, sized for every op that will be built
        heap_reason = None
        if self.policy != "nccl" and self.topology_reason is None and self._region_bytes:
            nbytes = sum(-(-n // _ALIGN) * _ALIGN for n in self._region_bytes.values())
            heap_reason = self._agreed_build(
                "the symmetric heap of the direct ops",
                lambda: setattr(self, "heap", self._build_heap(nbytes)),
            )
        # direct ops
        for op in self.ops:
            reason = None
            if self.policy == "nccl":
                reason = "policy is 'nccl'"
            elif self.topology_reason is not None:
                reason = self.topology_reason
            else:
                reason = (
                    direct_geometry_blocker(
                        op,
                        dtype=self.dtype,
                        row_bytes=self._row_bytes(op),
                        world_size=self.world_size,
                    )
                    or heap_reason
                )
            if reason is None:
                reason = self._agreed_build(
                    f"the direct {op} op",
                    lambda op=op: self.direct_ops.__setitem__(op, self._build_direct(op)),
                    "the direct op",
                )
            if reason is not None and self.policy == "direct":
                raise InvalidArgument(f"DCPComm: policy 'direct' cannot serve {op}: {reason}")
            self.direct_reason[op] = reason
            if self.direct_ops[op] is not None:
                transport = getattr(self.direct_ops[op], "transport", "unicast")
                self._direct_path[op] = (
                    PATH_DIRECT_MULTICAST if transport == "multicast" else PATH_DIRECT_UNICAST
                )
        # NCCL group and ops
        if self.policy == "direct":
            self.nccl_reason = "policy is 'direct'"
        else:
            self.nccl_reason = self._build_nccl_all()
            if self.nccl_reason is not None and self.rank == 0:
                warnings.warn(
                    f"DCPComm: NCCL is unavailable, the direct ops serve every call "
                    f"they can: {self.nccl_reason}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        collective_step(
            self.comm,
            "DCPComm: loading the copy kernel",  # also the barrier
            self._load_copy_kernel,
        )

    def _agreed_build(
        self,
        what: str,
        build,
        reason: str | None = None,
        *,
        strict: str = "direct",
        on_failure=None,
    ) -> str | None:
        """Run ``build()`` on every rank; returns None, or why it failed (equal on every rank).

        The build fails on every rank or on none. A user error on any rank
        (:class:`InvalidArgument` / :class:`InvalidType`: the arguments are wrong) raises on
        every rank, as does any failure under the ``strict`` policy; an environment failure
        (CUDA, compile, memory, a missing package, a peer's such failure) becomes the reason
        with ``policy="auto"`` (the NCCL op serves the calls). ``what`` names the build in a
        PeerError, ``reason`` (default ``what``) in the reason returned; ``on_failure`` runs on
        every rank before anything is raised or returned after a failure."""
        err: BaseException | None = None
        try:
            build()
        except Exception as e:  # noqa: BLE001 - classified and agreed below
            err = e
        user = isinstance(err, (InvalidArgument, InvalidType))
        every = self.comm.allgather(None if err is None else (user, error_text(err)))
        failed = {r: v for r, v in enumerate(every) if v is not None}
        if not failed:
            return None
        if on_failure is not None:
            on_failure()
        if err is not None and (self.policy == strict or any(u for u, _ in failed.values())):
            raise err
        if self.policy == strict or any(u for u, _ in failed.values()):
            raise PeerError(f"DCPComm: building {what}", {r: m for r, (_, m) in failed.items()})
        return failure_reason(
            f"building {reason or what}", {r: m for r, (_, m) in failed.items()}, self.world_size
        )

    def _build_nccl_all(self) -> str | None:
        """The NCCL group and ops (collective). Returns why NCCL is unavailable (None when
        built), equal on every rank; with ``policy="nccl"`` raises instead, on every rank.

        ``ncclCommInitRank`` is collective and has no deadline: a rank that failed before it
        would leave its peers waiting inside it. So the ranks first agree on its
        preconditions (one allgather: every rank's GPU and whether reading it failed), and
        enter NCCL only when every rank can; then they agree on the outcome (one allgather)."""
        # 1. preconditions, agreed before any rank calls NCCL
        err: BaseException | None = None
        bus = None
        try:
            bus = self._pci_bus_id()
        except Exception as e:  # noqa: BLE001 - agreed below
            err = e
        every = self.comm.allgather((None if err is None else error_text(err), bus))
        failed = {r: m for r, (m, _) in enumerate(every) if m is not None}
        if failed:
            reason = str(PeerError("reading the PCI bus id of the GPU", failed))
        else:
            reason = shared_gpu_blocker(hosts=self.comm.hosts, bus_ids=[b for _, b in every])
        if reason is not None:
            if self.policy == "nccl":
                if err is not None:
                    raise err
                raise InvalidArgument(
                    f"DCPComm: policy 'nccl' cannot be served: NCCL is unavailable ({reason})"
                )
            return reason

        # 2. the group and the ops; the outcome agreed (NcclError, torch, MissingDependency)
        def build():
            self.nccl_group = self._build_nccl_group()
            for op in self.ops:
                self.nccl_ops[op] = self._build_nccl(op, self.nccl_group)

        return self._agreed_build(
            "the NCCL group and ops", build, strict="nccl", on_failure=self._close_nccl
        )

    def _close_nccl(self) -> None:
        """Close the NCCL ops and group built so far on this rank (after a failed build, which
        every rank agreed on); errors of the close are dropped: the build error is reported."""
        for o in [self.nccl_ops.get(op) for op in OPS] + [self.nccl_group]:
            if o is not None:
                try:
                    o.close()
                except Exception:  # noqa: BLE001 - the build error is what matters
                    pass
        self.nccl_ops = dict.fromkeys(OPS)
        self.nccl_group = None

    # Hooks (a CPU test subclass replaces them with fakes).
    def _current_device(self) -> int:
        """This rank's GPU (CuPy's current device); MissingDependency without CuPy,
        DcpkitError without a visible GPU (runs inside the agreed argument check)."""
        _cuda.require_cupy()
        return _cuda.require_device("DCPComm")

    def _pci_bus_id(self) -> str | None:
        """The PCI bus id of this rank's GPU (None where unknown)."""
        import cupy

        return str(cupy.cuda.runtime.deviceGetPCIBusId(self.device))

    def _probe_topology(self) -> str | None:
        """Why the group is not one NVLink domain (None when it is); equal on every rank. A
        runtime failure on any rank raises on every rank (two agreed steps)."""
        import cupy

        rt = cupy.cuda.runtime
        buses = collective_step(
            self.comm,
            "DCPComm: reading the PCI bus id of the GPU",
            lambda: rt.deviceGetPCIBusId(self.device),
            gather=True,
        )
        bus = buses[self.rank]

        def peer_access() -> list[tuple[int, int]]:
            missing: list[tuple[int, int]] = []
            if self.comm.spans_hosts:
                return missing
            for s, b in enumerate(buses):
                if s == self.rank or b == bus:
                    continue
                try:
                    peer = rt.deviceGetByPCIBusId(b)
                except rt.CUDARuntimeError:
                    continue  # not visible to this process: the heap setup tests that pair
                if not rt.deviceCanAccessPeer(self.device, peer):
                    missing.append((min(self.rank, s), max(self.rank, s)))
            return missing

        every = collective_step(self.comm, "DCPComm: peer access check", peer_access, gather=True)
        return topology_blocker(
            hosts=self.comm.hosts, p2p_missing=[p for lst in every for p in lst]
        )

    def _build_heap(self, nbytes: int):
        """The one symmetric heap the direct ops share (collective)."""
        from .symmetric import SymmetricHeap

        return SymmetricHeap(self.comm, nbytes)

    def _build_direct(self, op: str):
        cls, kwargs = self._direct_spec(op)
        return cls(self.comm, **kwargs)

    def _build_nccl_group(self):
        from .nccl import NcclGroup

        return NcclGroup(self.comm)

    def _build_nccl(self, op: str, group):
        cls, _ = self._nccl_spec(op)
        return cls.from_checked(self.comm, self._nccl_checked[op], group)

    def _load_copy_kernel(self) -> None:
        """Load the strided-copy kernel now (layout normalisation must not compile later)."""
        load_copy_kernels(self.device)

    # ------------------------------------------------------------------ per call
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"DCPComm.{what}: DCPComm is closed")

    # ------------------------------------------------------------------ info
    def describe(self) -> str:
        """A multi-line description: geometry, paths available and why, counters."""
        lines = [
            f"DCPComm rank {self.rank}/{self.world_size} on GPU {getattr(self, 'device', '?')}, "
            f"policy {self.policy!r}{' (closed)' if self._closed else ''}",
            f"  geometry: max_tokens={self.max_tokens} num_heads={self.num_heads} "
            f"(heads_per_rank={self.heads_per_rank}) q_head_dim={self.q_head_dim} "
            f"v_head_dim={self.v_head_dim} kv_row_dim={self.kv_row_dim} "
            f"dtype={dtype_name(self.dtype)} num_ubatches={self.num_ubatches} "
            f"lse_base={'e' if self.lse_base == math.e else 2}",
            f"  topology: {getattr(self, 'topology_reason', None) or 'one NVLink domain'}",
            "  heap: "
            + (
                f"one SymmetricHeap of {self.heap.nbytes} bytes shared by the direct ops"
                if self.heap is not None
                else "none (no direct op)"
            ),
            "  nccl: "
            + (
                f"available (nccl_max_tokens={self.nccl_max_tokens}, lse_reduce "
                f"algorithm {self.nccl_lse_algorithm!r})"
                if self.nccl_reason is None
                else f"unavailable: {self.nccl_reason}"
            ),
        ]
        for op in OPS:
            if op not in self.ops:
                lines.append(f"  {op}: not built (kv_row_dim not given)")
                continue
            d = self._direct_path[op]
            direct = (
                f"{d} (T <= {self.max_tokens})"
                if d is not None
                else f"none: {self.direct_reason[op]}"
            )
            nccl = (
                getattr(self.nccl_ops[op], "algorithm", "nccl")
                if self.nccl_ops[op] is not None
                else "none"
            )
            counts = ", ".join(f"{p}={n}" for p, n in self.counters[op].items() if n) or "none"
            lines.append(f"  {op}: direct {direct}; nccl {nccl}; calls: {counts}")
        lines.append(f"  last_path: {self.last_path}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"DCPComm(rank={self.rank}, world_size={self.world_size}, policy={self.policy!r}, "
            f"last_path={self.last_path!r})"
        )

    # ------------------------------------------------------------------ sync and teardown
    def release_graph_outputs(self) -> None:
        """Give the graph output buffers of every direct op back to its pool
        (:meth:`dcpkit.ops.QGather.release_graph_outputs`): only once no graph that captured a
        call of this object without ``out=`` will be replayed again, and never during such a
        capture. Local to this rank, no GPU work."""
        self._check_open("release_graph_outputs")
        for o in self.direct_ops.values():
            if o is not None:
                o.release_graph_outputs()

    def synchronize(self, stream=None) -> None:
        """Wait for ``stream`` (default: the current CuPy stream), then raise
        :class:`~dcpkit.errors.CollectiveTimeout` if a direct op timed out, or
        :class:`~dcpkit.errors.CudaError` if NCCL reported an error.

        Stream: synchronises the host with ``stream``.
        """
        self._check_open("synchronize")
        stream = self._stream(stream)
        stream.synchronize()
        for o in self.direct_ops.values():
            if o is not None:
                o.synchronize(stream)
        if self.nccl_group is not None:
            self.nccl_group.check_async_error()

    def _close_all(self) -> None:
        first = None
        objs = (
            [self.direct_ops.get(op) for op in OPS]
            + [self.heap]
            + [self.nccl_ops.get(op) for op in OPS]
            + [self.nccl_group]
        )
        for o in objs:
            if o is None:
                continue
            try:
                o.close()
            except BaseException as e:  # noqa: BLE001 - close everything, then raise the first
                first = first or e
        self.direct_ops = dict.fromkeys(OPS)
        self.nccl_ops = dict.fromkeys(OPS)
        self.nccl_group = None
        self.heap = None
        if first is not None:
            raise first

    def close(self) -> None:
        """Close every op, the heap of the direct ops and the NCCL group (collective,
        idempotent)."""
        super().close()

    def _close(self) -> None:
        self._close_all()
