"""The exchanges of the demo: a DCPComm of one policy (or the bare ops), recording which path
served each call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .model import Model


class Exchanges:
    """The exchanges of one path, recording which path served each op's last call.

    ``target`` is a :class:`~dcpkit.manager.DCPComm` (policy ``auto``, ``direct`` or
    ``nccl``), a :class:`dcpkit.torch.TorchOps` over one, or, where the manager is not
    available, a namespace of direct or NCCL ops. Calls take no ``stream``: they run on the
    current stream (CuPy's, or torch's for a ``TorchOps`` target).
    """

    def __init__(
        self,
        label: str,
        target: Any,
        path_of: Callable[[], str],
        owned: Sequence[Any],
        description: str,
        base: Exchanges | None = None,
    ):
        self.label = label
        self.target = target
        self.description = description
        self.paths: dict[str, str] = {}
        self._path_of = path_of
        self._owned = list(owned)
        self._base = base  # the exchanges this one fronts (torch), if any

    def _record(self, op: str, result):
        self.paths[op] = self._path_of()
        return result

    def q_gather(self, q, **kw):
        """``q [B, H_r, D_qk]`` -> ``[B, H, D_qk]``."""
        return self._record("q_gather", self.target.q_gather(q, **kw))

    def lse_reduce(self, out_partial, lse_partial, **kw):
        """``[B, H, D_v]``, ``[B, H]`` -> ``[B, H_r, D_v]``."""
        return self._record("lse_reduce", self.target.lse_reduce(out_partial, lse_partial, **kw))

    def kv_gather(self, kv, **kw):
        """``[T_local, D_kv]`` -> ``[world_size*T_local, D_kv]``."""
        return self._record("kv_gather", self.target.kv_gather(kv, **kw))

    def synchronize(self) -> None:
        """Sync the current CuPy stream, then raise ``CollectiveTimeout`` if a wait expired."""
        if self._base is not None:
            self._base.synchronize()
        for r in self._owned:
            sync = getattr(r, "synchronize", None)
            if sync is not None:
                sync()

    def close(self) -> None:
        """Close what this object owns, last built first (collective)."""
        while self._owned:
            self._owned.pop().close()


class OpSet:
    """A namespace of op objects with the DCPComm call names (used without dcpkit.manager)."""

    def __init__(self, **ops):
        self.__dict__.update(ops)


def build_exchanges(
    comm,
    *,
    model: Model,
    batch: int,
    dtype,
    policy: str,
    with_kv: bool,
    timeout_ms: float | None = None,
) -> Exchanges:
    """Collective: the decode exchanges of ``policy`` (``"auto"``, ``"direct"``, ``"nccl"``):
    a DCPComm, or the direct / NCCL ops where ``dcpkit.manager`` cannot be imported."""
    H, D_qk, D_v = model.num_heads, model.qk_dim, model.v_dim
    deadline = {} if timeout_ms is None else {"timeout_ms": timeout_ms}
    try:
        from ..manager import DCPComm
    except ImportError:
        DCPComm = None
    if DCPComm is not None:
        dcp = DCPComm(
            comm,
            max_tokens=batch,
            num_heads=H,
            q_head_dim=D_qk,
            v_head_dim=D_v,
            kv_row_dim=D_qk if with_kv else None,
            dtype=dtype,
            policy=policy,
            **deadline,
        )
        return Exchanges(policy, dcp, lambda: str(dcp.last_path), [dcp], dcp.describe())
    H_r = H // comm.world_size
    made: list[Any] = []
    try:
        if policy in ("auto", "direct"):
            from ..ops import LseReduce, QGather

            extra: dict[str, Any] = {}
        else:
            from ..nccl import NcclGroup
            from ..nccl import NcclLseReduce as LseReduce
            from ..nccl import NcclQGather as QGather

            made.append(NcclGroup(comm))
            extra = {"nccl_group": made[-1]}
        made.append(
            QGather(
                comm,
                max_tokens=batch,
                heads_per_rank=H_r,
                head_dim=D_qk,
                dtype=dtype,
                **extra,
                **deadline,
            )
        )
        made.append(
            LseReduce(
                comm, max_tokens=batch, num_heads=H, head_dim=D_v, dtype=dtype, **extra, **deadline
            )
        )
    except BaseException:
        for r in reversed(made):
            r.close()
        raise
    qg, lr = made[-2], made[-1]
    path = "nccl" if extra else f"direct-{getattr(qg, 'transport', 'unicast')}"
    return Exchanges(
        policy,
        OpSet(q_gather=qg, lse_reduce=lr),
        lambda: path,
        made,
        f"{path} ops (dcpkit.manager not available)",
    )


def nccl_unavailable(decode: Exchanges) -> str | None:
    """Why the NCCL path cannot run, as the ``auto`` DCPComm of ``decode`` agreed at
    construction (equal on every rank); None when it is available or was not tried (the
    ops without dcpkit.manager: the NCCL timings then find out for themselves)."""
    target = decode.target
    if isinstance(target, OpSet):
        return None
    return getattr(target, "nccl_reason", None)


def build_kv_exchange(
    comm, decode: Exchanges, *, rows: int, model: Model, dtype, timeout_ms: float | None = None
) -> Exchanges:
    """Collective: the kv_gather that collects every rank's KV shard for the check.

    The decode DCPComm is sized for decode (``max_tokens`` = batch), so a shard of ``rows``
    rows would go to NCCL there. Where the manager has a direct kv_gather (one NVLink domain),
    a direct :class:`~dcpkit.ops.KVGather` sized for ``rows`` serves it instead; otherwise the
    manager's kv_gather (NCCL) does.
    """
    target = decode.target
    reason = (getattr(target, "direct_reason", None) or {}).get("kv_gather")
    if reason is not None:
        return Exchanges(
            "auto",
            target,
            decode._path_of,
            [],
            f"DCPComm kv_gather (no direct path: {reason})",
            base=decode,
        )
    from ..ops import KVGather

    deadline = {} if timeout_ms is None else {"timeout_ms": timeout_ms}
    kg = KVGather(comm, max_tokens=rows, row_dim=model.qk_dim, dtype=dtype, **deadline)
    path = f"direct-{getattr(kg, 'transport', 'unicast')}"
    return Exchanges(
        "direct",
        OpSet(kv_gather=kg),
        lambda: path,
        [kg],
        f"KVGather(max_tokens={rows}, row_dim={model.qk_dim})",
    )
