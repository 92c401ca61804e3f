"""MLADCPManager: picks and owns the DCP collectives of one MLA attention layer, as vLLM's does,
with the vLLM config turned into explicit keywords."""

from __future__ import annotations

import functools

from ..errors import ClosedError, InvalidArgument, InvalidType
from ._collectives import GroupCollectives
from ._common import (
    UnsupportedDtype,
    agree,
    check_bool,
    check_int,
    check_tensor,
    device_index,
    log_once,
    movable_view_dtype,
    require_torch,
    resolve_device,
    resolve_group,
    resolve_torch_dtype,
)
from ._gathers import DirectDCPKVGatherWorkspace, DirectDCPQGatherWorkspace
from ._paths import CollectivePaths, CombineCall
from ._workspaces import A2A_DTYPES, KV_GATHER_DTYPES, DirectDCPA2AWorkspace

__all__ = ["MLADCPManager", "COMM_BACKENDS"]

#: vLLM's ``dcp_comm_backend`` values.
COMM_BACKENDS = ("a2a", "ag_rs")

_WHAT = "MLADCPManager"


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class MLADCPManager(CollectivePaths):
    """Select and own the DCP collectives of an MLA attention layer: the output combine, the
    query gather and the chunked-context KV gather.

    The choice is vLLM's, with one difference: where vLLM asks for multicast symmetric memory,
    dcpkit's direct ops run unicast (multicast only where dcpkit's guard allows it):

    * combine: ``comm_backend="a2a"`` -> :class:`DirectDCPA2AWorkspace` (``"direct-a2a"``) when
      the group is on one host with at least two ranks, the output dtype is float16 / bfloat16
      and ``output_head_dim * itemsize % 16 == 0``; otherwise, and for calls with
      ``T > max_num_tokens``, the all-to-all on the group plus dcpkit's merge (``"a2a"``).
      ``comm_backend="ag_rs"`` -> all-gather of the lse + reduce-scatter of the weighted
      partial outputs (``"ag-rs"``), or all-reduce with ``use_pcp`` (``"ag-ar"``).
    * query gather: ``None`` with ``use_pcp`` (as vLLM); else
      :class:`DirectDCPQGatherWorkspace` (``"direct"``) where it can serve (one host, >= 2 ranks,
      16-byte rows), otherwise (and for ``T > max_num_tokens``) an all-gather on the group into
      storage padded to ``padded_num_heads`` (``"all-gather"``).
    * KV gather (:meth:`init_kv_gather`): :class:`DirectDCPKVGatherWorkspace` where it can
      serve, else ``all_gather_into_tensor`` on the group.

    The choice depends only on values equal on every rank, is logged once per distinct choice
    (logger ``"dcpkit.vllm"``, level INFO, with the reason) and is in :attr:`paths` /
    :attr:`reasons`; :attr:`counters` counts the calls of each path. The collective paths
    run NCCL groups on the GPU (capturable) and other backends (gloo) through host copies
    (not capturable; refused inside a capture), see :mod:`dcpkit.vllm._collectives`.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or dcpkit.Communicator
        The DCP group (vLLM: ``get_dcp_group()``).
    device : torch.device
        This rank's GPU.
    num_heads : int
        ``H_r``, the query heads of this rank; attention sees ``world_size * H_r``.
    query_head_dim, output_head_dim : int
        ``D_q`` of the queries, ``D_v`` of the attention output.
    query_dtype, output_dtype : torch.dtype
        Of the queries and of the attention output.
    padded_num_heads : int or None
        Heads of storage per token of the gathered query (None: ``world_size * H_r``).
    is_lse_base_on_e : bool
        Base of the lse attention returns (natural log if True, else base 2).
    use_pcp : bool
        Prefill context parallelism: no query gather; the ``ag_rs`` backend all-reduces.
    max_num_tokens : int
        ``T_max`` of the direct workspaces (vLLM: ``get_dcp_workspace_max_num_tokens``).
    num_ubatches : int
        Ubatch slots (vLLM: ``max(parallel_config.num_ubatches, 1)``: values below 1 mean 1).
    comm_backend : {"a2a", "ag_rs"}
        vLLM's ``parallel_config.dcp_comm_backend``.

    Attributes
    ----------
    combine : callable
        ``combine(partial_output, partial_lse, *, seq_lens=None, query_start_loc=None,
        return_lse=False, out=None, out_lse=None)``: ``partial_output [T, H, D_v]``
        (output_dtype; ``H = world_size * num_heads`` for ``"direct-a2a"`` / ``"a2a"``, a
        multiple of ``world_size`` for ``"ag-rs"``, any for ``"ag-ar"``), ``partial_lse [T, H]``
        (float32, float16 or bfloat16, base per ``is_lse_base_on_e``), masks as
        :meth:`DirectDCPA2AWorkspace.lse_reduce` -> ``[T, H / world_size, D_v]`` (``[T, H,
        D_v]`` for ``"ag-ar"``), plus the merged lse (input's base) with ``return_lse=True``;
        ``out`` / ``out_lse``: contiguous destinations. The result is exact (fp32, rounded
        once) and padding rows are 0 on every path.
    query_gather : callable or None
        ``query_gather(local_query) -> [T, world_size * H_r, D_q]``; None with ``use_pcp``.
    use_a2a, num_ubatches, max_num_tokens, padded_num_heads, group, device, world_size, rank
        As vLLM's (``group`` is what was passed).
    paths, reasons : dict
        The path chosen for ``"combine"``, ``"query_gather"``, ``"kv_gather"`` and why.
    counters : dict
        Calls per ``"<op>:<path>"``.

    Collective: construction, every call, :meth:`init_kv_gather`, :meth:`close`.

    Stream: every call runs on torch's current stream. The direct paths never block the host
    and are capture-safe once each workspace has made one eager call (dcpkit refuses to capture
    a workspace's first call: warm up before ``torch.cuda.graph``, as torch recommends); the
    collective paths on an NCCL group are capturable; on other backends they copy through the
    host (synchronising) and refuse a capture.

    Raises
    ------
    InvalidArgument, InvalidType, UnsupportedDtype
        A bad argument (``comm_backend`` not one of :data:`COMM_BACKENDS`, a non-positive
        size, an output dtype that is not a float type), before anything is allocated; the
        errors of the workspaces it builds.
    PeerError, ConfigMismatch
        Another rank rejected its arguments; the ranks passed different ones.
    """

    def __init__(
        self,
        group,
        device,
        num_heads: int,
        query_head_dim: int,
        output_head_dim: int,
        query_dtype,
        output_dtype,
        padded_num_heads: int | None,
        is_lse_base_on_e: bool,
        use_pcp: bool,
        *,
        max_num_tokens: int,
        num_ubatches: int = 1,
        comm_backend: str = "a2a",
    ) -> None:
        self._closed = True
        self._a2a = self._qg = self._kv = None
        torch = self._torch = require_torch(_WHAT)
        comm, tgroup = resolve_group(group, _WHAT)
        W = comm.world_size
        one_host = not comm.spans_hosts
        holder: dict = {}

        def check():
            dev = resolve_device(device, _WHAT)
            H_r = check_int(num_heads, _WHAT, "num_heads")
            Dq = check_int(query_head_dim, _WHAT, "query_head_dim")
            Dv = check_int(output_head_dim, _WHAT, "output_head_dim")
            T = check_int(max_num_tokens, _WHAT, "max_num_tokens")
            for name, v in (
                ("num_heads", H_r),
                ("query_head_dim", Dq),
                ("output_head_dim", Dv),
                ("max_num_tokens", T),
            ):
                if v < 1:
                    raise InvalidArgument(f"{_WHAT}: {name} must be >= 1 (got {v})")
            qdt = resolve_torch_dtype(query_dtype, _WHAT, "query_dtype")
            odt = resolve_torch_dtype(output_dtype, _WHAT, "output_dtype")
            if odt not in (torch.float16, torch.bfloat16, torch.float32):
                raise UnsupportedDtype(
                    f"{_WHAT}: output_dtype must be one of [torch.float16, "
                    f"torch.bfloat16, torch.float32] (got {odt})"
                )
            pad = (
                None
                if padded_num_heads is None
                else check_int(padded_num_heads, _WHAT, "padded_num_heads")
            )
            if pad is not None and pad < W * H_r:
                raise InvalidArgument(
                    f"{_WHAT}: padded_num_heads must be >= world_size * "
                    f"num_heads = {W * H_r} (got {pad})"
                )
            base_e = check_bool(is_lse_base_on_e, _WHAT, "is_lse_base_on_e")
            pcp = check_bool(use_pcp, _WHAT, "use_pcp")
            U = max(check_int(num_ubatches, _WHAT, "num_ubatches"), 1)
            if comm_backend not in COMM_BACKENDS:
                raise InvalidArgument(
                    f"{_WHAT}: comm_backend must be one of "
                    f"{list(COMM_BACKENDS)} (got {comm_backend!r})"
                )
            holder["device"] = torch.device("cuda", device_index(dev, _WHAT))
            return (
                H_r,
                Dq,
                Dv,
                _name(qdt),
                _name(odt),
                pad,
                base_e,
                pcp,
                T,
                U,
                comm_backend,
                qdt,
                odt,
            )

        (H_r, Dq, Dv, _, _, pad, base_e, pcp, T, U, backend, qdt, odt) = agree(comm, _WHAT, check)
        self.group, self.comm, self.world_size, self.rank = group, comm, W, comm.rank
        self.device = holder["device"]
        self.num_heads, self.query_head_dim, self.output_head_dim = H_r, Dq, Dv
        self.query_dtype, self.output_dtype = qdt, odt
        self.padded_num_heads, self.is_lse_base_on_e, self.use_pcp = pad, base_e, pcp
        self.max_num_tokens, self.num_ubatches = T, U
        self.comm_backend = backend
        self.use_a2a = backend == "a2a"
        self.paths: dict[str, str | None] = {"kv_gather": None}
        self.reasons: dict[str, str] = {"kv_gather": "init_kv_gather not called yet"}
        self.counters: dict[str, int] = {}
        self._coll = GroupCollectives(comm, tgroup, self.device)
        try:
            self._init_combine(W, one_host)
            self._init_query_gather(W, one_host)
        except BaseException:
            self.close()
            raise
        self._closed = False
        log_once(
            f"{_WHAT}: combine: {self.paths['combine']} ({self.reasons['combine']}); "
            f"query_gather: {self.paths['query_gather']} "
            f"({self.reasons['query_gather']})"
        )

    # ------------------------------------------------------------------ selection
    def _init_combine(self, W: int, one_host: bool) -> None:
        odt, Dv = self.output_dtype, self.output_head_dim
        if not self.use_a2a:
            path = "ag-ar" if self.use_pcp else "ag-rs"
            why = (
                f"comm_backend='ag_rs' with use_pcp={self.use_pcp}: all-gather of the lse, "
                f"{'all-reduce' if self.use_pcp else 'reduce-scatter'} of the weighted "
                f"partial outputs on the {self._coll.backend} group"
            )
            self.combine = self._combine_ag_ar if self.use_pcp else self._combine_ag_rs
        else:
            bad = self._direct_refusal(
                W,
                one_host,
                (
                    _name(odt) not in A2A_DTYPES,
                    f"output_dtype {odt} is not one of {list(A2A_DTYPES)}",
                ),
                (
                    (Dv * odt.itemsize) % 16,
                    f"output_head_dim * itemsize = {Dv * odt.itemsize} is not a multiple of 16",
                ),
            )
            if bad is None:
                self._a2a = DirectDCPA2AWorkspace(
                    self.comm,
                    self.device,
                    self.max_num_tokens,
                    self.num_heads,
                    Dv,
                    odt,
                    self.num_ubatches,
                )
                path = "direct-a2a"
                why = (
                    f"comm_backend='a2a', one host, {W} ranks: dcpkit LseReduce "
                    f"({self._a2a.transport}); T > max_num_tokens={self.max_num_tokens} "
                    f"takes the all-to-all on the {self._coll.backend} group"
                )
                self.combine = self._combine_direct
            else:
                path = "a2a"
                why = (
                    f"comm_backend='a2a' but the direct A2A cannot serve ({bad}): "
                    f"all-to-all on the {self._coll.backend} group plus dcpkit's merge"
                )
                self.combine = self._combine_a2a
            self._warm_merge()
        self.paths["combine"], self.reasons["combine"] = path, why

    def _init_query_gather(self, W: int, one_host: bool) -> None:
        if self.use_pcp:
            self.query_gather = None
            self.paths["query_gather"], self.reasons["query_gather"] = None, "use_pcp=True"
            return
        qdt, Dq, H_r = self.query_dtype, self.query_head_dim, self.num_heads
        storage = W * H_r if self.padded_num_heads is None else self.padded_num_heads
        bad = self._direct_refusal(
            W,
            one_host,
            (movable_view_dtype(qdt) is None, f"query_dtype {qdt} cannot be moved by dcpkit"),
            (
                (H_r * Dq * qdt.itemsize) % 16 or (storage * Dq * qdt.itemsize) % 16,
                "query rows are not multiples of 16 bytes",
            ),
        )
        if bad is None:
            self._qg = DirectDCPQGatherWorkspace(
                self.comm,
                self.device,
                self.max_num_tokens,
                H_r,
                Dq,
                qdt,
                self.num_ubatches,
                self.padded_num_heads,
            )
            path = "direct"
            why = (
                f"one host, {W} ranks: dcpkit QGather ({self._qg.transport}); "
                f"T > max_num_tokens={self.max_num_tokens} takes the all-gather"
            )
            self.query_gather = self._query_gather_direct
        else:
            path = "all-gather"
            why = (
                f"the direct q-gather cannot serve ({bad}): all-gather on the "
                f"{self._coll.backend} group"
            )
            self.query_gather = self._gather_query
        self.paths["query_gather"], self.reasons["query_gather"] = path, why

    def _direct_refusal(self, W: int, one_host: bool, *checks: tuple[object, str]) -> str | None:
        """Why a direct workspace cannot serve (None when it can): fewer than 2 ranks, a group
        that spans hosts, else the reason of the first ``(refused, reason)`` of ``checks``
        whose ``refused`` is true."""
        if W < 2:
            return f"world_size {W} < 2"
        if not one_host:
            return "the group spans hosts"
        return next((reason for refused, reason in checks if refused), None)

    def _warm_merge(self) -> None:
        """Load dcpkit's merge kernel now, so that no compile or module load can fall inside a
        CUDA-graph capture of the all-to-all fallback."""
        if (
            _name(self.output_dtype) not in ("float16", "bfloat16", "float32")
            or (self.output_head_dim * self.output_dtype.itemsize) % 16
        ):
            return
        torch = self._torch
        src = torch.zeros(
            (1, 1, 1, self.output_head_dim), dtype=self.output_dtype, device=self.device
        )
        lse = torch.zeros((1, 1, 1), dtype=torch.float32, device=self.device)
        out = torch.empty((1, 1, self.output_head_dim), dtype=self.output_dtype, device=self.device)
        self._lse_combine(src, lse, out, None)

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: the manager is closed")

    # ------------------------------------------------------------------ combine
    #: The direct A2A combine; calls with ``T > max_num_tokens`` take the all-to-all.
    _combine_direct = functools.partialmethod(CollectivePaths._combine_on, "direct")

    def _direct_combine(self, call: CombineCall):
        self._check_open("MLADCPManager.combine")
        po = call.partial_output
        if getattr(po, "ndim", 0) >= 1 and po.shape[0] > self.max_num_tokens:
            log_once(
                f"{_WHAT}.combine: calls with T > max_num_tokens={self.max_num_tokens} "
                f"use the all-to-all on the {self._coll.backend} group"
            )
            return self._a2a_combine(call)
        res = self._a2a.lse_reduce(
            po,
            call.partial_lse,
            self.is_lse_base_on_e,
            call.seq_lens,
            call.query_start_loc,
            return_lse=call.return_lse,
            out=call.out,
            out_lse=call.out_lse,
        )
        self._count("combine:direct-a2a")
        return res

    # ------------------------------------------------------------------ query gather
    def _query_gather_direct(self, local_query):
        """The direct q-gather; calls with ``T > max_num_tokens`` take the all-gather."""
        self._check_open("MLADCPManager.query_gather")
        if getattr(local_query, "ndim", 0) >= 1 and local_query.shape[0] > self.max_num_tokens:
            log_once(
                f"{_WHAT}.query_gather: calls with T > max_num_tokens="
                f"{self.max_num_tokens} use the all-gather on the {self._coll.backend} "
                f"group"
            )
            return self._gather_query(local_query)
        res = self._qg.gather(local_query)
        self._count("query_gather:direct")
        return res

    # ------------------------------------------------------------------ kv gather
    def init_kv_gather(self, workspace, max_gathered_tokens: int) -> None:
        """Prepare :meth:`kv_gather` for chunks of up to ``max_gathered_tokens`` gathered rows.

        vLLM's checks, as errors (vLLM asserts): ``max_gathered_tokens > 0`` and a multiple of
        the world size; ``workspace`` 2-D, contiguous, with ``max_gathered_tokens +
        max_gathered_tokens // world_size`` rows and a positive width. The workspace's dtype and
        width size the direct KV gather (:class:`DirectDCPKVGatherWorkspace`) where it can serve
        (one host, >= 2 ranks, float16 / bfloat16 / float8_e4m3fn, 16-byte rows); otherwise
        :meth:`kv_gather` runs ``all_gather_into_tensor`` on the group. A second call replaces
        the first (collective).

        Parameters
        ----------
        workspace : torch.Tensor [M + M // world_size, D_kv]
            vLLM's chunked-prefill workspace (rows ``[0, M / W)`` hold the local chunk, the
            rest the gathered one). Only its shape, dtype and device are used here.
        max_gathered_tokens : int
            ``M``.

        Collective: every rank, same arguments.

        Stream: no device work here (the direct KV gather's setup synchronises its GPU once).

        Raises
        ------
        InvalidGeometry
            One of the checks above fails (a ``ValueError``); before anything is allocated.
        InvalidArgument, InvalidType
            ``workspace`` is not a tensor on this manager's GPU.
        """
        from ._common import InvalidGeometry

        what = "MLADCPManager.init_kv_gather"
        self._check_open(what)
        W = self.world_size

        def check():
            M = check_int(max_gathered_tokens, what, "max_gathered_tokens")
            if M <= 0:
                raise InvalidGeometry(f"{what}: max_gathered_tokens must be > 0 (got {M})")
            if M % W:
                raise InvalidGeometry(
                    f"{what}: max_gathered_tokens must be a multiple of world_size {W} (got {M})"
                )
            if not isinstance(workspace, self._torch.Tensor):
                raise InvalidType(
                    f"{what}: workspace must be a torch.Tensor (got {type(workspace).__name__})"
                )
            if workspace.dim() != 2:
                raise InvalidGeometry(
                    f"{what}: workspace must be 2-D [rows, D_kv] (got shape "
                    f"{list(workspace.shape)})"
                )
            if not workspace.is_contiguous():
                raise InvalidGeometry(
                    f"{what}: workspace must be contiguous (got strides "
                    f"{tuple(workspace.stride())})"
                )
            rows = M + M // W
            if workspace.shape[0] != rows:
                raise InvalidGeometry(
                    f"{what}: workspace rows must be max_gathered_tokens + "
                    f"max_gathered_tokens // world_size = {rows} (got "
                    f"{workspace.shape[0]})"
                )
            if workspace.shape[1] <= 0:
                raise InvalidGeometry(
                    f"{what}: workspace width must be > 0 (got {workspace.shape[1]})"
                )
            check_tensor(workspace, what, "workspace", device=self.device)
            return M, int(workspace.shape[1]), _name(workspace.dtype)

        M, D, _ = agree(self.comm, what, check)
        dt = workspace.dtype
        if self._kv is not None:
            self._kv.close()
            self._kv = None
        bad = self._direct_refusal(
            W,
            not self.comm.spans_hosts,
            (
                _name(dt) not in KV_GATHER_DTYPES,
                f"dtype {dt} is not one of {list(KV_GATHER_DTYPES)}",
            ),
            ((D * dt.itemsize) % 16, f"rows of {D * dt.itemsize} bytes are not a multiple of 16"),
        )
        if bad is None:
            self._kv = DirectDCPKVGatherWorkspace(
                self.comm, self.device, M, D, dt, self.num_ubatches
            )
            path, why = "direct", (f"one host, {W} ranks: dcpkit KVGather ({self._kv.transport})")
        else:
            path, why = (
                "all-gather",
                (
                    f"the direct KV gather cannot serve ({bad}): "
                    f"all_gather_into_tensor on the {self._coll.backend} "
                    f"group"
                ),
            )
        self._kv_max, self._kv_dim, self._kv_dtype = M, D, dt
        self.paths["kv_gather"], self.reasons["kv_gather"] = path, why
        log_once(f"{_WHAT}: kv_gather: {path} ({why})")

    def kv_gather(self, gathered_kv, local_kv) -> None:
        """Gather every rank's ``local_kv [T, D_kv]`` into ``gathered_kv [W*T, D_kv]``,
        rank-major (``all_gather_into_tensor(gathered_kv, local_kv)``), on the path
        :meth:`init_kv_gather` chose. Both contiguous, of the workspace's dtype, ``W*T <=
        max_gathered_tokens``.

        Collective: every rank, same ``T`` and ubatch, in the same order.

        Stream: torch's current stream; the direct path is one dcpkit kernel (capture-safe).

        Raises
        ------
        InvalidArgument, InvalidType
            :meth:`init_kv_gather` was not called, or a tensor of the wrong type, device,
            dtype, shape or layout.
        UbatchOutOfRange
            The current ubatch is outside ``[0, num_ubatches)``.
        """
        what = "MLADCPManager.kv_gather"
        self._check_open(what)
        path = self.paths["kv_gather"]
        if path is None:
            raise InvalidArgument(
                f"{what}: init_kv_gather must be called first (got no KV gather set up)"
            )
        if path == "direct":
            self._kv.gather(gathered_kv, local_kv)
        else:
            W, D = self.world_size, self._kv_dim
            for name, t in (("local_kv", local_kv), ("gathered_kv", gathered_kv)):
                check_tensor(
                    t,
                    what,
                    name,
                    device=self.device,
                    dtypes=(self._kv_dtype,),
                    ndim=2,
                    contiguous=True,
                )
            T = local_kv.shape[0]
            if (
                local_kv.shape[1] != D
                or tuple(gathered_kv.shape) != (W * T, D)
                or W * T > self._kv_max
            ):
                raise InvalidArgument(
                    f"{what}: local_kv [T, {D}] and gathered_kv [world_size*T, {D}] with "
                    f"world_size*T <= {self._kv_max} (got {list(local_kv.shape)} and "
                    f"{list(gathered_kv.shape)})"
                )
            self._coll.check_not_capturing(what)
            self._coll.all_gather_into(gathered_kv, local_kv)
        self._count(f"kv_gather:{path}")
        return None

    # ------------------------------------------------------------------ teardown
    @property
    def workspaces(self) -> dict[str, object]:
        """The direct workspaces in use (``"combine"``, ``"query_gather"``, ``"kv_gather"``)."""
        return {
            k: v
            for k, v in (
                ("combine", self._a2a),
                ("query_gather", self._qg),
                ("kv_gather", self._kv),
            )
            if v is not None
        }

    def close(self) -> None:
        """Close the direct workspaces (collective, idempotent)."""
        self._closed = True
        for ws in (self._kv, self._qg, self._a2a):
            if ws is not None:
                ws.close()
        self._a2a = self._qg = self._kv = None

    def __enter__(self) -> MLADCPManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
