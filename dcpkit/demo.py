"""``python -m dcpkit demo``: one MLA decode attention layer with decode context parallelism,
checked against a reference and timed against NCCL.

Run it with one process per GPU (N = 2, 4 or 8)::

    mpirun -np 4 python -m dcpkit demo              # DeepSeek-V3 geometry, bf16, batch 8, 16k

The layer (MLA with absorbed weights, as a decode step sees it): ``H`` query heads of width
``D_qk = 576`` (512 latent + 64 rope), one latent KV head of width 576 shared by every query
head, values = the first ``D_v = 512`` columns of the latent KV. Softmax scale
``1/sqrt(576)`` (the width attention runs over here; the real model scales by ``1/sqrt(192)``,
the q_nope + q_rope width before absorption, times a YaRN factor: only the value differs).

What every rank ``r`` of ``N`` does, ``B`` sequences, ``H_r = H / N`` heads per rank:

1. Inputs, rebuilt from ``--seed`` and the rank alone (:func:`dcpkit.reference.make_inputs`):
   its head shard of the queries ``q [B, H_r, 576]`` and its shard of the latent KV. Token ``i``
   of every sequence lives on rank ``i mod N`` (interleaved), at local row ``i // N``; the
   sequences have different lengths, one of them shorter than ``N`` tokens so that some ranks
   hold no KV for it. Local rows past a sequence's local length hold NaN: they must never be read.
2. ``q_gather``: ``q [B, H_r, 576]`` -> ``[B, H, 576]``, every head on every rank.
3. Partial attention of all ``H`` heads over the local KV shard, fp32 (CuPy): ``scores = q K^T *
   scale``, ``m = max``, ``p = exp(scores - m)``, ``out = p V / sum p`` rounded to the dtype
   ``[B, H, 512]``, ``lse = m + log(sum p)`` float32 ``[B, H]``. A sequence with no local KV
   gives ``lse = -inf`` and an output full of NaN (proof that ``lse_reduce`` never reads it).
4. ``lse_reduce``: ``[B, H, 512]`` partials of every rank -> the exact output of its own heads
   ``[B, H_r, 512]``.
5. Check: ``kv_gather`` of every rank's KV shard, sequence by sequence (rank-major rows
   ``[N*T_local, 576]``, de-interleaved back to token order), then reference attention of its own
   heads over the whole KV in fp32 from the same inputs; ``q_gather`` and ``kv_gather`` are also
   checked bit for bit against every peer's regenerated input (q) or shard checksum (KV).
   Every rank checks its own heads; the verdict is agreed across ranks.
6. Timing of the communication alone (the partial attention is not the point and is not timed):
   ``q_gather``, ``lse_reduce`` and a layer (both), on the direct path and on the NCCL path,
   eager and inside a CUDA graph (20 layers captured in one graph on a non-default stream).

Where NCCL cannot start (ranks sharing a GPU with ``--allow-shared-gpu``: NCCL needs one GPU per
rank; NCCL missing or failing), the checked step runs on the direct path all the same (the
``auto`` DCPComm is then direct-only, and the check's kv_gather is a direct op), the report says
``NCCL path: unavailable (<reason>)`` (JSON ``nccl_path``, ``nccl_unavailable_reason``), the NCCL
timings are skipped, and the verdict is the direct path's.

The exchanges go through :class:`~dcpkit.manager.DCPComm` (``policy="auto"`` for the checked
step, which records the path that served each op; ``"direct"`` and ``"nccl"`` for the timings);
without ``dcpkit.manager`` the direct ops and the NCCL ops are used as they are. ``--torch`` runs
the same with torch tensors through :class:`dcpkit.torch.TorchOps`, the partial attention in
torch, and checks against ``torch.nn.functional.scaled_dot_product_attention``.

Exit status: 0 PASS, 1 FAIL (wrong result), 2 the demo could not run (no GPU, too many ranks for
the GPUs of a host, bad arguments, a missing dependency, a setup error). Errors are agreed
across ranks before any collective, so no rank is left waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import DcpkitError, MissingDependency

__all__ = [
    "main", "run", "parse_args", "Model", "PRESETS", "context_lengths", "local_lengths",
    "deinterleave", "interleave", "attention", "to_float32", "from_float32",
    "tolerance", "unit_roundoff", "environment_error", "summarize_times", "format_report",
    "verdict",
]

#: Layers captured in one CUDA graph for the graph timings.
GRAPH_LAYERS = 20
#: Scale of the queries: q ~ N(0, Q_STD^2), so the scores q.K^T/sqrt(576) have a standard
#: deviation of Q_STD. A power of two keeps the scaled queries exact in bf16/fp16. With 4 the
#: softmax is peaked (each head attends to a handful of tokens, like a trained model), outputs
#: have magnitudes 0.3 to 1 and an error in the LSE weights shows up at once.
Q_STD = 4.0
EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 2

_PREFIX = "[dcpkit demo]"


# ============================================================================= geometry
@dataclass(frozen=True)
class Model:
    """MLA attention geometry of one model, as a decode step with absorbed weights sees it.

    Attributes
    ----------
    name : str
        Preset name.
    num_heads : int
        H, query heads of one layer (all ranks).
    kv_lora_rank : int
        Latent width (512): also the value width D_v.
    rope_dim : int
        Width of the rope part of queries and keys (64).
    """

    name: str
    num_heads: int
    kv_lora_rank: int = 512
    rope_dim: int = 64

    @property
    def qk_dim(self) -> int:
        """D_qk = D_kv: query width and latent KV row width (latent + rope)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def v_dim(self) -> int:
        """D_v: value width (the first ``kv_lora_rank`` columns of the latent KV)."""
        return self.kv_lora_rank

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(D_qk)``."""
        return 1.0 / math.sqrt(self.qk_dim)


#: --model presets.
PRESETS: Dict[str, Model] = {
    "deepseek-v3": Model("deepseek-v3", num_heads=128),
    "kimi-k2": Model("kimi-k2", num_heads=64),
}


def context_lengths(batch: int, context: int, world_size: int, seed: int) -> np.ndarray:
    """Per-sequence context lengths ``[B]`` int64, equal on every rank (drawn from ``seed``).

    Sequence 0 has ``context`` tokens; the last one (when ``B > 1``) has
    ``min(context, max(1, world_size - 1))`` tokens, fewer than ``world_size``, so that the
    ranks ``>= length`` hold no KV for it; the others are uniform in ``[context // 2, context]``.
    """
    rng = np.random.default_rng([int(seed), 0xDC9])
    lo = max(1, context // 2)
    lengths = rng.integers(lo, context + 1, size=batch).astype(np.int64)
    lengths[0] = context
    if batch > 1:
        lengths[-1] = min(context, max(1, world_size - 1))
    return lengths


def local_lengths(lengths: Sequence[int], world_size: int, rank: int) -> np.ndarray:
    """Tokens of each sequence held by ``rank`` when token ``i`` lives on rank ``i mod N``.

    ``#{i < L : i mod N == rank} = max(0, ceil((L - rank) / N))``; ``[B]`` int64.
    """
    L = np.asarray(lengths, dtype=np.int64)
    return np.maximum(0, (L - rank + world_size - 1) // world_size)


def interleave(full, world_size: int, rank: int, capacity: int, xp=np):
    """Rank ``rank``'s shard of one sequence's KV ``[L, D]``: rows ``rank, rank + N, ...``,
    padded with NaN to ``[capacity, D]`` (the layout every rank holds; used by the tests)."""
    rows = full[rank::world_size]
    out = xp.full((capacity,) + tuple(full.shape[1:]), np.nan, dtype=full.dtype)
    out[: rows.shape[0]] = rows
    return out


def deinterleave(gathered, world_size: int, length: int):
    """Token-ordered KV ``[L, D]`` from the rank-major result of ``kv_gather`` ``[N*T_local, D]``.

    Row ``s*T_local + j`` of ``gathered`` is token ``j*N + s``, so token order is the transpose
    of the ``[N, T_local]`` row grid. Works on NumPy and CuPy arrays and torch tensors (returns
    a copy).
    """
    NT, D = gathered.shape
    T_local = NT // world_size
    grid = gathered.reshape(world_size, T_local, D).swapaxes(0, 1)   # [T_local, N, D]
    return grid.reshape(NT, D)[:length]


# ============================================================================= math helpers
def _is_bf16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def to_float32(x, xp=np):
    """``x`` as float32 (exact). bfloat16 is widened by bits (``u16 << 16``), so this needs no
    bfloat16 arithmetic from the array library."""
    if _is_bf16(x.dtype):
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float32)


def from_float32(x, dtype, xp=np):
    """float32 ``x`` rounded to ``dtype`` (round to nearest even). bfloat16 is rounded by bits;
    NaN and infinities are kept."""
    from .reference import resolve_dtype

    dt = resolve_dtype(dtype)
    if _is_bf16(dt):
        u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        nan = xp.isnan(x)
        r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
        r = xp.where(nan, xp.uint16(0x7FC0), r)
        return r.view(dt)
    return x.astype(dt)


def attention(q, kv, scale: float, v_dim: int, xp=np) -> Tuple[Any, Any]:
    """Attention of ``H`` query heads over one sequence's latent KV, in float32.

    Naive equivalent::

        s   = (q @ kv.T) * scale                     # [H, L]
        out = softmax(s, axis=1) @ kv[:, :v_dim]     # [H, D_v]
        lse = log(sum(exp(s), axis=1))               # [H], natural log

    Parameters
    ----------
    q : float32 [H, D_qk]
    kv : float32 [L, D_qk]
        Latent KV rows; values are the first ``v_dim`` columns. ``L = 0`` is allowed.
    scale : float
        Softmax scale.
    v_dim : int
        D_v.
    xp : module
        ``numpy`` or ``cupy``.

    Returns
    -------
    out : float32 [H, D_v]
        NaN everywhere when ``L == 0`` (an output that must never be read).
    lse : float32 [H]
        ``-inf`` when ``L == 0``.
    """
    H = q.shape[0]
    if kv.shape[0] == 0:
        return (xp.full((H, v_dim), np.nan, dtype=xp.float32),
                xp.full((H,), -np.inf, dtype=xp.float32))
    s = (q @ kv.T) * xp.float32(scale)
    m = s.max(axis=1, keepdims=True)
    p = xp.exp(s - m)
    denom = p.sum(axis=1)
    out = (p @ kv[:, :v_dim]) / denom[:, None]
    lse = m[:, 0] + xp.log(denom)
    return out.astype(xp.float32), lse.astype(xp.float32)


def unit_roundoff(dtype) -> float:
    """Unit roundoff ``u`` of a float dtype: ``|fl(x) - x| <= u |x|`` (bf16 2^-8, fp16 2^-11,
    fp32 2^-24)."""
    from .reference import resolve_dtype

    dt = resolve_dtype(dtype)
    if _is_bf16(dt):
        return 2.0 ** -8
    return float(np.finfo(dt).eps) / 2.0


def tolerance(dtype, v_max: float) -> float:
    """Max abs error allowed between the demo's output and the fp32 reference.

    Every output and every partial output is a convex combination of value rows, so its
    magnitude is at most ``v_max = max |V|``. The result is rounded to ``dtype`` twice (each
    partial output, then the merged output), each rounding off by at most ``u * v_max``;
    the fp32 sums add far less than ``1e-3``. Hence ``2 * u * v_max + 1e-3``.
    """
    return 2.0 * unit_roundoff(dtype) * float(v_max) + 1e-3


# ============================================================================= arguments
def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {v})")
    return v


def _nonnegative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {v})")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dcpkit demo",
        description="One MLA decode attention layer with decode context parallelism "
                    "(q_gather -> partial attention -> lse_reduce), checked against a reference "
                    "over the whole KV and timed against NCCL. Run it as "
                    "'mpirun -np N python -m dcpkit demo' with N GPUs (N = 2, 4 or 8).",
    )
    p.add_argument("--model", choices=sorted(PRESETS), default="deepseek-v3",
                   help="geometry preset: deepseek-v3 = 128 query heads, kimi-k2 = 64; both with "
                        "a latent KV row of 576 (512 latent + 64 rope) and values of 512 "
                        "(default: deepseek-v3)")
    p.add_argument("--batch", type=_positive_int, default=8,
                   help="sequences decoded together, one query token each (default: 8)")
    p.add_argument("--context", type=_positive_int, default=16384,
                   help="context tokens of the longest sequence; the others are shorter "
                        "(default: 16384)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                   help="dtype of queries, KV and outputs (default: bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default: 0)")
    p.add_argument("--iters", type=_nonnegative_int, default=200,
                   help="timed repeats per measurement; 0 skips the timings (default: 200)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the report as JSON to PATH (written by rank 0)")
    p.add_argument("--allow-shared-gpu", action="store_true",
                   help="let several ranks share one GPU (functional checks on a machine with "
                        "fewer GPUs than ranks; the ranks' kernels then time-slice the GPU, so "
                        "the timings mean nothing)")
    p.add_argument("--torch", action="store_true",
                   help="run the layer with torch tensors through dcpkit.torch and check it "
                        "against torch.nn.functional.scaled_dot_product_attention")
    return p


def _env_rank() -> int:
    """This process's rank from the launcher's environment, before MPI is initialised."""
    for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK"):
        v = os.environ.get(k)
        if v is not None and v.isdigit():
            return int(v)
    return 0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the demo's arguments. Raises ``SystemExit`` (2 on bad arguments, 0 on --help);
    ranks other than 0 print nothing."""
    p = _parser()
    if _env_rank() != 0:
        p.print_help = lambda file=None: None          # type: ignore[method-assign]
        p.print_usage = lambda file=None: None         # type: ignore[method-assign]
        p.exit = lambda status=0, message=None: sys.exit(status)  # type: ignore[method-assign]
    return p.parse_args(None if argv is None else list(argv))


# ============================================================================= environment
def _gpu_count() -> Tuple[int, str]:
    """(GPUs visible to this process, why none when 0)."""
    try:
        import cupy  # noqa: WPS433

        return int(cupy.cuda.runtime.getDeviceCount()), ""
    except ImportError as e:
        return 0, f"CuPy is not installed ({e})"
    except Exception as e:  # noqa: BLE001 - no driver, no device: both mean "no GPU"
        # Without libcuda CuPy says cudaErrorInsufficientDriver (a version mismatch): name the
        # real cause with dcpkit info's driver probe.
        from .info import no_driver_reason  # noqa: WPS433

        why = no_driver_reason()
        if why:
            return 0, why
        return 0, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def environment_error(*, num_gpus: int, gpu_error: str, world_size: int, local_world_size: int,
                      num_heads: int) -> Optional[str]:
    """Why the demo cannot run on this rank, or ``None``. Pure function of its arguments."""
    if num_gpus == 0:
        why = f": {gpu_error}" if gpu_error else ""
        return (f"no CUDA GPU is visible on this host{why}. The demo needs one GPU per rank: "
                "run it on a machine with NVIDIA GPUs as 'mpirun -np N python -m dcpkit demo'")
    if world_size < 2:
        return (f"the demo needs at least 2 ranks (got {world_size}): run it as "
                f"'mpirun -np N python -m dcpkit demo' with N = 2, 4 or 8 "
                f"(this host has {num_gpus} GPU{'s' if num_gpus != 1 else ''})")
    if local_world_size > num_gpus:
        return (f"asked for {local_world_size} ranks on this host but it has {num_gpus} "
                f"GPU{'s' if num_gpus != 1 else ''}: start at most {num_gpus} ranks per host "
                f"(one per GPU)")
    if num_heads % world_size:
        return (f"num_heads {num_heads} must be divisible by world_size {world_size}: use a "
                f"world size that divides {num_heads}")
    return None


def _pci_bus_id(device: int) -> str:
    import cupy  # noqa: WPS433

    return str(cupy.cuda.runtime.deviceGetPCIBusId(device))


def _distinct_gpus(comm) -> int:
    """How many GPUs the ranks use (collective); world_size when a GPU cannot be identified."""
    try:
        import cupy  # noqa: WPS433

        bus = _pci_bus_id(cupy.cuda.runtime.getDevice())
    except Exception:  # noqa: BLE001 - only used for the report
        bus = None
    every = comm.allgather((comm.host, bus))
    if any(b is None for _, b in every):
        return comm.world_size
    return len(set(every))


def _environment_problem(comm, args, model: Model) -> Optional[str]:
    """Why the demo cannot run on this rank, or ``None``. Collective (one allgather), so
    that every rank counts the GPUs its host's ranks would use: rank ``r`` takes visible GPU
    ``local_rank % visible``; ranks of one host that land on the same GPU (by PCI bus id) mean
    more ranks than GPUs, also when each rank sees a different subset of the GPUs."""
    num_gpus, gpu_error = _gpu_count()
    bus = None
    if num_gpus:
        try:
            bus = _pci_bus_id(comm.local_rank % num_gpus)
        except Exception as e:  # noqa: BLE001 - reported as "no usable GPU"
            num_gpus, gpu_error = 0, _err_text(e)
    seen = comm.allgather((comm.host, bus))
    host_gpus = len({b for h, b in seen if h == comm.host and b is not None})
    if getattr(args, "allow_shared_gpu", False) and host_gpus:
        host_gpus = max(host_gpus, comm.local_world_size)
    problem = environment_error(num_gpus=host_gpus if num_gpus else 0, gpu_error=gpu_error,
                                world_size=comm.world_size,
                                local_world_size=comm.local_world_size,
                                num_heads=model.num_heads)
    if problem is None and args.torch:
        problem = _torch_problem()
    return problem


# ============================================================================= exchanges
class _Exchanges:
    """The exchanges of one path, recording which path served each op's last call.

    ``target`` is a :class:`~dcpkit.manager.DCPComm` (policy ``auto``, ``direct`` or
    ``nccl``), a :class:`dcpkit.torch.TorchOps` over one, or, where the manager is not
    available, a namespace of direct or NCCL ops. Calls take no ``stream``: they run on the
    current stream (CuPy's, or torch's for a ``TorchOps`` target).
    """

    def __init__(self, label: str, target: Any, path_of: Callable[[], str],
                 owned: Sequence[Any], description: str,
                 base: Optional["_Exchanges"] = None):
        self.label = label
        self.target = target
        self.description = description
        self.paths: Dict[str, str] = {}
        self._path_of = path_of
        self._owned = list(owned)
        self._base = base               # the exchanges this one fronts (torch), if any

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


class _Ops:
    """A namespace of op objects with the DCPComm call names (used without dcpkit.manager)."""

    def __init__(self, **ops):
        self.__dict__.update(ops)


def _build_exchanges(comm, *, model: Model, batch: int, dtype, policy: str,
                     with_kv: bool) -> _Exchanges:
    """Collective: the decode exchanges of ``policy`` (``"auto"``, ``"direct"``, ``"nccl"``):
    a DCPComm, or the direct / NCCL ops where ``dcpkit.manager`` cannot be imported."""
    H, D_qk, D_v = model.num_heads, model.qk_dim, model.v_dim
    try:
        from .manager import DCPComm  # noqa: WPS433
    except ImportError:
        DCPComm = None
    if DCPComm is not None:
        dcp = DCPComm(comm, max_tokens=batch, num_heads=H, q_head_dim=D_qk, v_head_dim=D_v,
                      kv_row_dim=D_qk if with_kv else None, dtype=dtype, policy=policy)
        return _Exchanges(policy, dcp, lambda: str(dcp.last_path), [dcp], dcp.describe())
    H_r = H // comm.world_size
    made: List[Any] = []
    try:
        if policy in ("auto", "direct"):
            from .ops import LseReduce, QGather  # noqa: WPS433

            extra: Dict[str, Any] = {}
        else:
            from .nccl import NcclGroup  # noqa: WPS433
            from .nccl import NcclLseReduce as LseReduce  # noqa: WPS433
            from .nccl import NcclQGather as QGather  # noqa: WPS433

            made.append(NcclGroup(comm))
            extra = {"nccl_group": made[-1]}
        made.append(QGather(comm, max_tokens=batch, heads_per_rank=H_r, head_dim=D_qk,
                            dtype=dtype, **extra))
        made.append(LseReduce(comm, max_tokens=batch, num_heads=H, head_dim=D_v, dtype=dtype,
                              **extra))
    except BaseException:
        for r in reversed(made):
            r.close()
        raise
    qg, lr = made[-2], made[-1]
    path = "nccl" if extra else f"direct-{getattr(qg, 'transport', 'unicast')}"
    return _Exchanges(policy, _Ops(q_gather=qg, lse_reduce=lr), lambda: path, made,
                      f"{path} ops (dcpkit.manager not available)")


def _nccl_unavailable(decode: _Exchanges) -> Optional[str]:
    """Why the NCCL path cannot run, as the ``auto`` DCPComm of ``decode`` agreed at
    construction (equal on every rank); None when it is available or was not tried (the
    ops without dcpkit.manager: the NCCL timings then find out for themselves)."""
    target = decode.target
    if isinstance(target, _Ops):
        return None
    return getattr(target, "nccl_reason", None)


def _build_kv_exchange(comm, decode: _Exchanges, *, rows: int, model: Model,
                       dtype) -> _Exchanges:
    """Collective: the kv_gather that collects every rank's KV shard for the check.

    The decode DCPComm is sized for decode (``max_tokens`` = batch), so a shard of ``rows``
    rows would go to NCCL there. Where the manager has a direct kv_gather (one NVLink domain),
    a direct :class:`~dcpkit.ops.KVGather` sized for ``rows`` serves it instead; otherwise the
    manager's kv_gather (NCCL) does.
    """
    target = decode.target
    reason = (getattr(target, "direct_reason", None) or {}).get("kv_gather")
    if reason is not None:
        return _Exchanges("auto", target, decode._path_of, [],
                          f"DCPComm kv_gather (no direct path: {reason})", base=decode)
    from .ops import KVGather  # noqa: WPS433

    kg = KVGather(comm, max_tokens=rows, row_dim=model.qk_dim, dtype=dtype)
    path = f"direct-{getattr(kg, 'transport', 'unicast')}"
    return _Exchanges("direct", _Ops(kv_gather=kg), lambda: path, [kg],
                      f"KVGather(max_tokens={rows}, row_dim={model.qk_dim})")


# ============================================================================= array sides
class _CupySide:
    """The demo's arrays and math with CuPy (the default)."""

    name = "cupy"

    def __init__(self):
        import cupy  # noqa: WPS433

        self.cupy = cupy

    def upload(self, a: np.ndarray):
        """A host array on the current GPU (bfloat16 travels as its 16-bit words)."""
        if _is_bf16(a.dtype):
            return self.cupy.asarray(a.view(np.uint16)).view(a.dtype)
        return self.cupy.asarray(a)

    def to_cupy(self, x):
        return x

    def empty(self, shape, like):
        return self.cupy.empty(shape, dtype=like.dtype)

    def wrap(self, ex: _Exchanges) -> _Exchanges:
        return ex

    def decode(self, ex: _Exchanges, q, kv, local_lens: np.ndarray, model: Model, dtype):
        """q_gather -> partial attention of all heads over the local KV shard (fp32) ->
        lse_reduce. Returns ``(out [B, H_r, D_v], q_full [B, H, D_qk] (a copy), out_partial
        [B, H, D_v], lse_partial [B, H] float32)``."""
        cp = self.cupy
        B, H, D_v = q.shape[0], model.num_heads, model.v_dim
        q_full = ex.q_gather(q)                   # a view: consumed right here, same stream
        q_f = to_float32(q_full, cp)              # [B, H, D_qk]
        q_full = q_full.copy()
        kv_f = to_float32(kv, cp)                 # [B, T_local, D_qk]
        out_f = cp.empty((B, H, D_v), dtype=cp.float32)
        lse_partial = cp.empty((B, H), dtype=cp.float32)
        for b in range(B):
            out_f[b], lse_partial[b] = attention(q_f[b], kv_f[b, :int(local_lens[b])],
                                                 model.softmax_scale, D_v, cp)
        out_partial = from_float32(out_f, dtype, cp)
        out = ex.lse_reduce(out_partial, lse_partial).copy()
        return out, q_full, out_partial, lse_partial

    def reference(self, q_own, full, model: Model):
        """Attention of this rank's heads ``q_own [H_r, D_qk]`` over one sequence's whole KV
        ``full [L, D_qk]``, fp32 -> ``[H_r, D_v]``."""
        return attention(to_float32(q_own, self.cupy), to_float32(full, self.cupy),
                         model.softmax_scale, model.v_dim, self.cupy)[0]

    def new_ref(self, shape):
        return self.cupy.empty(shape, dtype=self.cupy.float32)

    def timing(self) -> "_CupyTiming":
        return _CupyTiming()


class _TorchSide:
    """The same with torch tensors: the ops through :class:`dcpkit.torch.TorchOps`, the
    partial attention in torch, the reference by ``scaled_dot_product_attention``."""

    name = "torch"

    def __init__(self):
        import cupy  # noqa: WPS433
        import torch  # noqa: WPS433

        from . import torch as dcp_torch  # noqa: WPS433

        self.torch = torch
        self.dcp_torch = dcp_torch
        self.device = torch.device("cuda", cupy.cuda.Device().id)
        torch.cuda.set_device(self.device)

    def upload(self, a: np.ndarray):
        t = self.torch
        if _is_bf16(a.dtype):
            return t.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(t.bfloat16) \
                .to(self.device)
        return t.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def to_cupy(self, x):
        return self.dcp_torch.to_cupy(x)

    def empty(self, shape, like):
        return self.torch.empty(shape, dtype=like.dtype, device=self.device)

    def wrap(self, ex: _Exchanges) -> _Exchanges:
        """``ex`` with torch tensors in and out: :class:`dcpkit.torch.TorchOps` over its
        DCPComm (or over each of its ops). ``TorchOps.close`` is local; ``ex`` stays open."""
        TorchOps = self.dcp_torch.TorchOps
        if isinstance(ex.target, _Ops):
            fronts = {k: TorchOps(v) for k, v in vars(ex.target).items()}
            target: Any = _Ops(**{k: getattr(f, k) for k, f in fronts.items()})
            owned = list(fronts.values())
        else:
            target = TorchOps(ex.target)
            owned = [target]
        return _Exchanges(ex.label, target, ex._path_of, owned,
                          ex.description + "\n(torch tensors through dcpkit.torch.TorchOps)",
                          base=ex)

    def decode(self, ex: _Exchanges, q, kv, local_lens: np.ndarray, model: Model, dtype):
        """As :meth:`_CupySide.decode`, in torch."""
        t = self.torch
        B, H, D_v = q.shape[0], model.num_heads, model.v_dim
        q_full = ex.q_gather(q)
        q_f = q_full.float()
        q_full = q_full.clone()
        kv_f = kv.float()
        out_f = t.empty((B, H, D_v), dtype=t.float32, device=self.device)
        lse_partial = t.empty((B, H), dtype=t.float32, device=self.device)
        for b in range(B):
            n = int(local_lens[b])
            if n == 0:                            # no KV here: an output never to be read
                out_f[b] = float("nan")
                lse_partial[b] = float("-inf")
                continue
            k = kv_f[b, :n]
            s = (q_f[b] @ k.T) * model.softmax_scale
            m = s.amax(dim=1, keepdim=True)
            p = t.exp(s - m)
            denom = p.sum(dim=1)
            out_f[b] = (p @ k[:, :D_v]) / denom[:, None]
            lse_partial[b] = m[:, 0] + t.log(denom)
        out_partial = out_f.to(q.dtype)
        out = ex.lse_reduce(out_partial, lse_partial).clone()
        return out, q_full, out_partial, lse_partial

    def reference(self, q_own, full, model: Model):
        """``scaled_dot_product_attention`` (math backend, fp32) of this rank's heads over one
        sequence's whole KV -> ``[H_r, D_v]``.

        One KV head shared by every query head (MQA), one query token per head: the ``H_r``
        heads are passed as ``H_r`` query rows of a single head, which is the same attention
        and never materialises the KV once per head."""
        t = self.torch
        F = t.nn.functional
        qq = q_own.float()[None, None]                        # [1, 1, H_r, D_qk]
        k = full.float()[None, None]                          # [1, 1, L, D_qk]
        v = k[..., :model.v_dim]                              # [1, 1, L, D_v]
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: WPS433

            ctx = sdpa_kernel(SDPBackend.MATH)
        except ImportError:                                   # older torch: its default
            ctx = contextlib.nullcontext()
        with ctx:
            o = F.scaled_dot_product_attention(qq, k, v, scale=model.softmax_scale)
        return o[0, 0]

    def new_ref(self, shape):
        return self.torch.empty(shape, dtype=self.torch.float32, device=self.device)

    def timing(self) -> "_TorchTiming":
        return _TorchTiming(self.torch)


# ============================================================================= timing
class _CupyTiming:
    """Streams, events and graphs of CuPy."""

    def __init__(self):
        import cupy  # noqa: WPS433

        self.cupy = cupy

    def stream(self):
        return self.cupy.cuda.Stream(non_blocking=True)

    def on(self, stream):
        return stream                       # `with stream:` makes it CuPy's current stream

    def event(self):
        return self.cupy.cuda.Event()

    def elapsed_ms(self, start, end) -> float:
        return self.cupy.cuda.get_elapsed_time(start, end)

    def capture(self, fn: Callable[[], Any], layers: int, stream):
        with stream:
            stream.begin_capture()
            try:
                for _ in range(layers):
                    fn()
            finally:
                graph = stream.end_capture()
        return graph

    def replay(self, graph, stream) -> None:
        graph.launch(stream)


class _TorchTiming:
    """Streams, events and graphs of torch (the ops follow torch's current stream)."""

    def __init__(self, torch):
        self.torch = torch

    def stream(self):
        return self.torch.cuda.Stream()

    def on(self, stream):
        return self.torch.cuda.stream(stream)

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def capture(self, fn: Callable[[], Any], layers: int, stream):
        graph = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.graph(graph, stream=stream):
            for _ in range(layers):
                fn()
        return graph

    def replay(self, graph, stream) -> None:
        with self.torch.cuda.stream(stream):
            graph.replay()


def summarize_times(per_rank_us: Sequence[Sequence[float]]) -> Dict[str, float]:
    """nccl-tests style: the max over ranks of every repeat, then the median (and spread) of
    those maxima, in microseconds."""
    arr = np.asarray(per_rank_us, dtype=np.float64)
    worst = arr.max(axis=0)
    return {"median_us": float(np.median(worst)), "p10_us": float(np.percentile(worst, 10)),
            "p90_us": float(np.percentile(worst, 90)), "repeats": int(worst.size)}


def _agreed_loop(comm, what: str, body: Callable[[], float], iters: int) -> List[float]:
    """``iters`` repeats of ``body`` on every rank, returning its values.

    Before each repeat the ranks allgather whether they are still healthy: that is the host
    barrier that lines them up, and it stops every rank at the same repeat when one fails
    (then :class:`~dcpkit.errors.PeerError` on every rank), so no rank is left waiting."""
    values: List[float] = []
    err: Optional[BaseException] = None
    for _ in range(iters):
        if not all(comm.allgather(err is None)):
            break
        try:
            values.append(body())
        except Exception as e:  # noqa: BLE001 - agreed across ranks
            err = e
    comm.all_ok(what, err)
    return values


def _timed(comm, what: str, tm, stream, run_once: Callable[[], Any], iters: int,
           warmups: int, per: int) -> Dict[str, float]:
    """Repeats of ``run_once`` on ``stream``, events around each, the GPU idle before each
    (so an eager time includes the host's launch cost, as an eager framework pays it).
    Microseconds per call (``per`` calls per repeat), median of the max over ranks."""
    start, end = tm.event(), tm.event()

    def warm() -> float:
        run_once()
        stream.synchronize()
        return 0.0

    def once() -> float:
        start.record(stream)
        run_once()
        end.record(stream)
        end.synchronize()
        return tm.elapsed_ms(start, end) * 1e3 / per

    with tm.on(stream):
        _agreed_loop(comm, what, warm, warmups)
        times = _agreed_loop(comm, what, once, iters)
    return summarize_times(comm.allgather(times))


def _err_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _time_path(comm, ex: _Exchanges, side, inputs: Dict[str, Any], iters: int,
               say: "_Say") -> Dict[str, Any]:
    """Collective: q_gather, lse_reduce and a layer (both) on one path, eager and in a CUDA
    graph of :data:`GRAPH_LAYERS` calls. Every repeat is agreed across ranks."""
    q, out_partial, lse_partial = inputs["q"], inputs["out_partial"], inputs["lse_partial"]
    def buffers():
        tm = side.timing()
        return (tm, tm.stream(), side.empty(inputs["q_full_shape"], q),
                side.empty(inputs["out_shape"], out_partial))

    tm, stream, q_out, o_out = _step(comm, f"demo: timing the {ex.label} path: buffers",
                                     buffers)

    def qg(out=None):
        return ex.q_gather(q) if out is None else ex.q_gather(q, out=out)

    def lr(out=None):
        return ex.lse_reduce(out_partial, lse_partial) if out is None else \
            ex.lse_reduce(out_partial, lse_partial, out=out)

    # eager: the ops' own outputs (views of workspace memory on the direct path);
    # graph: out= buffers, so that nothing is allocated during the capture.
    steps = {
        "q_gather": (lambda: qg(), lambda: qg(q_out)),
        "lse_reduce": (lambda: lr(), lambda: lr(o_out)),
        "layer": (lambda: (qg(), lr()), lambda: (qg(q_out), lr(o_out))),
    }
    tag = f"demo: timing the {ex.label} path"
    result: Dict[str, Any] = {"eager": {}, "graph": {}}
    for name, (eager_fn, _) in steps.items():
        result["eager"][name] = _timed(comm, f"{tag}, eager {name}", tm, stream, eager_fn,
                                       iters, warmups=3, per=1)
    result["paths"] = {op: ex.paths.get(op, "?") for op in ("q_gather", "lse_reduce")}
    for name, (_, graph_fn) in steps.items():
        err: Optional[BaseException] = None
        graph = None
        try:
            graph = tm.capture(graph_fn, GRAPH_LAYERS, stream)
        except Exception as e:  # noqa: BLE001 - reported, agreed across ranks
            err = e
        errs = comm.allgather(None if err is None else _err_text(err))
        bad = {r: m for r, m in enumerate(errs) if m}
        if bad:                       # a capture launches nothing: the other ranks go on
            result["graph"][name] = {"error": "; ".join(f"rank {r}: {m}"
                                                        for r, m in sorted(bad.items()))}
            say(f"  {ex.label}: CUDA graph of {name} not captured: "
                f"{result['graph'][name]['error']}")
            continue
        result["graph"][name] = _timed(comm, f"{tag}, graph {name}", tm, stream,
                                       lambda g=graph: tm.replay(g, stream), iters, warmups=2,
                                       per=GRAPH_LAYERS)
    stream.synchronize()
    _step(comm, f"{tag}: synchronize", ex.synchronize)
    return result


def _run_timings(comm, args, model: Model, side, inputs: Dict[str, Any],
                 say: "_Say", nccl_unavailable: Optional[str] = None) -> Dict[str, Any]:
    """Collective: the direct and the NCCL paths, each built for the purpose, then closed.
    ``nccl_unavailable`` (equal on every rank): why the NCCL path cannot run; its timings are
    then skipped (``{"skipped": ...}``)."""
    timing: Dict[str, Any] = {}
    for policy in ("direct", "nccl"):
        if policy == "nccl" and nccl_unavailable is not None:
            timing[policy] = {"skipped": f"NCCL unavailable: {nccl_unavailable}"}
            say(f"NCCL timings skipped: NCCL unavailable ({nccl_unavailable})")
            continue
        with say.timed(f"timing the {policy} path ({args.iters} repeats, eager and in a CUDA "
                       f"graph of {GRAPH_LAYERS} layers)"):
            try:
                base = _step(comm, f"demo: building the {policy} ops", lambda: _build_exchanges(
                    comm, model=model, batch=args.batch, dtype=inputs["dtype"], policy=policy,
                    with_kv=False))
            except DcpkitError as e:
                timing[policy] = {"error": _err_text(e)}
                say(f"  {policy} path unavailable: {_err_text(e)}")
                continue
            try:
                ex = side.wrap(base)
                try:
                    timing[policy] = _time_path(comm, ex, side, inputs, args.iters, say)
                finally:
                    if ex is not base:
                        ex.close()
            except DcpkitError as e:
                timing[policy] = {"error": _err_text(e)}
                say(f"  {policy} path failed: {_err_text(e)}")
            finally:
                base.close()
    return timing


TIMING_NOTES = (
    "microseconds per call of the communication alone (the partial attention is not timed); "
    "median over repeats of the max over ranks; eager = one call with the GPU idle before it, "
    f"the host's launch cost included; graph = {GRAPH_LAYERS} calls captured in one CUDA graph "
    f"on a non-default stream, replay time / {GRAPH_LAYERS}; layer = q_gather + lse_reduce; "
    "speedup = nccl / direct")


# ============================================================================= the run
class _Say:
    """Progress lines on rank 0, flushed."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(f"{_PREFIX} {msg}", flush=True)

    @contextlib.contextmanager
    def timed(self, msg: str):
        """``msg ...`` before the block, ``done in x s`` after it (when it succeeded)."""
        self(f"{msg} ...")
        t0 = time.perf_counter()
        yield
        self(f"  done in {time.perf_counter() - t0:.1f} s")


def _step(comm, what: str, fn: Callable[[], Any]) -> Any:
    """Run one step on every rank and agree on its success (``PeerError`` on every rank when
    any rank failed), so that no rank enters a later collective alone."""
    err: Optional[BaseException] = None
    value = None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - agreed across ranks below
        err = e
    comm.all_ok(what, err)
    return value


def _checksums(xp, blocks) -> List[int]:
    """Order-independent 64-bit checksum of each block's bytes (position-weighted sum of the
    16-bit words, wrapping modulo 2^64): equal iff the bits are equal, with overwhelming
    probability."""
    out = []
    for blk in blocks:
        w = blk.reshape(-1).view(xp.uint16).astype(xp.uint64)
        pos = xp.arange(1, w.size + 1, dtype=xp.uint64) * xp.uint64(0x9E3779B97F4A7C15)
        out.append(int((w * pos + (w << xp.uint64(17))).sum()))
    return out


def _make_host_inputs(args, model: Model, rank: int, world_size: int) -> Dict[str, Any]:
    """This rank's queries ``q [B, H_r, D_qk]`` and KV shard ``kv [B, T_local, D_qk]`` (host
    arrays, from ``--seed`` and the rank), and every rank's queries ``q_all [B, H, D_qk]``
    (for the bit-exact q_gather check)."""
    from .reference import make_inputs, resolve_dtype

    dt = resolve_dtype(args.dtype)
    B, H, D = args.batch, model.num_heads, model.qk_dim

    def queries(r: int) -> np.ndarray:
        q = make_inputs(r, world_size, args.seed, op="q_gather", tokens=B, num_heads=H,
                        head_dim=D, dtype=dt)["q"]
        return (q.astype(np.float32) * np.float32(Q_STD)).astype(dt)   # exact: power of two

    lengths = context_lengths(B, args.context, world_size, args.seed)
    T_local = max(1, int(local_lengths([lengths.max()], world_size, 0)[0]))  # ceil(max L / N)
    mine = local_lengths(lengths, world_size, rank)
    kv = make_inputs(rank, world_size, args.seed, op="kv_gather", tokens=B * T_local,
                     row_dim=D, dtype=dt)["kv"].reshape(B, T_local, D)
    for b in range(B):
        kv[b, int(mine[b]):] = np.nan                     # rows that must never be read
    return {
        "q": queries(rank),
        "q_all": np.concatenate([queries(r) for r in range(world_size)], axis=1),
        "kv": kv, "lengths": lengths, "local_lengths": mine, "T_local": T_local, "dtype": dt,
    }


def _reference(side, kv_ex: _Exchanges, q, kv, lengths: np.ndarray, world_size: int,
               T_local: int, shard_sums: List[List[int]], model: Model):
    """kv_gather of every rank's KV shard, sequence by sequence (rank-major rows), de-interleaved
    to token order; then the reference attention of this rank's heads over the whole KV.

    Returns ``(ref [B, H_r, D_v] float32, kv_gather bit-exact (bool), max |V| (float))``."""
    import cupy  # noqa: WPS433

    B, H_r, D_v = q.shape[0], q.shape[1], model.v_dim
    ref = side.new_ref((B, H_r, D_v))
    exact, v_max = True, 0.0
    for b in range(B):
        gathered = kv_ex.kv_gather(kv[b])               # [W*T_local, D_qk]; consumed here
        g = side.to_cupy(gathered)
        got = _checksums(cupy, [g[s * T_local:(s + 1) * T_local] for s in range(world_size)])
        exact &= got == [shard_sums[s][b] for s in range(world_size)]
        full = deinterleave(gathered, world_size, int(lengths[b]))     # a copy
        ref[b] = side.reference(q[b], full, model)
        v = to_float32(side.to_cupy(full), cupy)[:, :D_v]
        if v.size:
            v_max = max(v_max, float(cupy.abs(v).max()))
    return ref, bool(exact), v_max


def _local_stats(out, ref, rank: int, heads_per_rank: int) -> Dict[str, Any]:
    """Errors of this rank's output ``[B, H_r, D_v]`` against its reference (float32)."""
    xp = _array_module(out)
    got = to_float32(out, xp)
    nonfinite = int((~xp.isfinite(got)).sum())
    diff = xp.abs(got - ref)
    diff = xp.where(xp.isfinite(diff), diff, xp.float32(np.inf))
    flat = int(diff.argmax())
    b, h, c = np.unravel_index(flat, diff.shape)
    return {"max_abs": float(diff.reshape(-1)[flat]), "ref_max": float(xp.abs(ref).max()),
            "nonfinite": nonfinite, "worst": [int(b), int(rank * heads_per_rank + h), int(c)]}


def _array_module(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy  # noqa: WPS433

    return cupy.get_array_module(x)


def verdict(stats: Sequence[Dict[str, Any]], dtype) -> Dict[str, Any]:
    """The agreed check from every rank's statistics (``stats[r]`` from rank ``r``): max abs
    error, max relative error (max abs error / max |reference|), tolerance, PASS/FAIL."""
    W = len(stats)
    v_max = max(s["v_max"] for s in stats)
    tol = tolerance(dtype, v_max)
    worst_rank = max(range(W), key=lambda r: stats[r]["max_abs"])
    max_abs = stats[worst_rank]["max_abs"]
    ref_max = max(s["ref_max"] for s in stats)
    max_rel = max_abs / ref_max if ref_max > 0 else float("inf")
    nonfinite = sum(s["nonfinite"] for s in stats)
    q_exact = all(s["q_gather_exact"] for s in stats)
    kv_exact = all(s["kv_gather_exact"] for s in stats)
    ok = nonfinite == 0 and max_abs <= tol and q_exact and kv_exact
    w = stats[worst_rank]["worst"]
    return {
        "max_abs_error": max_abs, "max_rel_error": max_rel,
        "max_rel_error_definition": "max abs error / max |reference|",
        "tolerance_abs": tol,
        "tolerance_definition": "2 * u * max|V| + 1e-3, u = unit roundoff of the dtype",
        "v_max": v_max, "nonfinite_outputs": nonfinite,
        "q_gather_bit_exact": q_exact, "kv_gather_bit_exact": kv_exact,
        "worst": {"rank": worst_rank, "sequence": w[0], "head": w[1], "column": w[2]},
        "per_rank_max_abs_error": [s["max_abs"] for s in stats],
        "verdict": "PASS" if ok else "FAIL",
    }


def _gpu_name() -> str:
    import cupy  # noqa: WPS433

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def run(args: argparse.Namespace, comm, say: "_Say") -> Dict[str, Any]:
    """The demo on every rank, after the environment checks; ``args.torch`` selects torch
    tensors. Returns the report, equal on every rank. Collective."""
    import cupy  # noqa: WPS433

    model = PRESETS[args.model]
    W, rank = comm.world_size, comm.rank
    H_r = model.num_heads // W
    side = _step(comm, "demo: importing torch and dcpkit.torch",
                 _TorchSide) if args.torch else _CupySide()
    with say.timed(f"building inputs (from --seed {args.seed} and the rank)"):
        host = _step(comm, "demo: building inputs",
                     lambda: _make_host_inputs(args, model, rank, W))
    dt, T_local, lengths = host["dtype"], host["T_local"], host["lengths"]
    say(f"context lengths {', '.join(str(int(x)) for x in lengths)} tokens; {T_local} KV rows "
        f"per sequence per rank")
    report: Dict[str, Any] = {
        "demo": "one MLA decode attention layer with decode context parallelism",
        "model": model.name, "num_heads": model.num_heads, "heads_per_rank": H_r,
        "qk_dim": model.qk_dim, "kv_lora_rank": model.kv_lora_rank, "rope_dim": model.rope_dim,
        "v_dim": model.v_dim, "softmax_scale": model.softmax_scale, "q_std": Q_STD,
        "dtype": np.dtype(dt).name, "batch": args.batch, "context": args.context,
        "context_lengths": [int(x) for x in lengths], "kv_rows_per_rank": T_local,
        "layout": "token i on rank i mod world_size", "seed": args.seed, "world_size": W,
        "gpus": comm.allgather(_gpu_name()), "tensors": side.name,
        "distinct_gpus": _distinct_gpus(comm),
    }

    def upload():
        q, kv = side.upload(host["q"]), side.upload(host["kv"])   # [B, H_r, D], [B, T_l, D]
        kv_c = side.to_cupy(kv)
        sums = _checksums(cupy, [kv_c[b] for b in range(args.batch)])
        return q, kv, sums, _CupySide().upload(host["q_all"])

    q, kv, own_sums, q_all = _step(comm, "demo: uploading the inputs", upload)
    shard_sums = comm.allgather(own_sums)                  # [W][B], for the kv_gather check

    owned: List[_Exchanges] = []
    agreed = True          # False: an error not agreed across ranks; closing could hang then
    try:
        with say.timed("building the ops (NVRTC compiles the kernels on the first run, CuPy "
                       "caches them on disk)"):
            base = _step(comm, "demo: building the ops", lambda: _build_exchanges(
                comm, model=model, batch=args.batch, dtype=dt, policy="auto", with_kv=True))
            owned.append(base)
            kv_base = _step(comm, "demo: building the kv_gather of the check",
                            lambda: _build_kv_exchange(comm, base, rows=T_local, model=model,
                                                       dtype=dt))
            owned.append(kv_base)
            ex = _step(comm, "demo: torch front end", lambda: side.wrap(base))
            if ex is not base:
                owned.append(ex)
            kv_ex = _step(comm, "demo: torch front end", lambda: side.wrap(kv_base))
            if kv_ex is not kv_base:
                owned.append(kv_ex)
        indent = "\n" + " " * (len(_PREFIX) + 6)
        say("ops: " + ex.description.replace("\n", indent))
        say(f"kv_gather of the check: {kv_ex.description}".replace("\n", indent))
        nccl_unavailable = _nccl_unavailable(base)
        report["nccl_unavailable_reason"] = nccl_unavailable
        report["nccl_path"] = ("available" if nccl_unavailable is None
                               else f"unavailable ({nccl_unavailable})")
        if nccl_unavailable is not None:
            say(f"NCCL path: {report['nccl_path']}; the check and the verdict are the direct "
                f"path's")

        with say.timed("decode step: q_gather -> partial attention (fp32) -> lse_reduce"):
            def decode():
                res = side.decode(ex, q, kv, host["local_lengths"], model, dt)
                base.synchronize()
                return res

            out, q_full, out_partial, lse_partial = _step(comm, "demo: decode step", decode)

        what = ("torch scaled_dot_product_attention" if args.torch else "attention in fp32")
        with say.timed(f"reference: kv_gather of the whole KV, then {what} of each rank's "
                       f"{H_r} heads over it"):
            def reference():
                res = _reference(side, kv_ex, q, kv, lengths, W, T_local, shard_sums, model)
                kv_base.synchronize()
                return res

            ref, kv_exact, v_max = _step(comm, "demo: reference", reference)

        def check():
            mine = _local_stats(side.to_cupy(out), side.to_cupy(ref), rank, H_r)
            q_exact = bool(cupy.array_equal(side.to_cupy(q_full).view(cupy.uint16),
                                            q_all.view(cupy.uint16)))
            mine.update({"q_gather_exact": q_exact, "kv_gather_exact": kv_exact,
                         "v_max": v_max, "paths": {
                             "q_gather": ex.paths.get("q_gather", "?"),
                             "lse_reduce": ex.paths.get("lse_reduce", "?"),
                             "kv_gather": kv_ex.paths.get("kv_gather", "?")}})
            return mine

        stats = comm.allgather(_step(comm, "demo: check", check))
        report["ops"] = base.description
        report["kv_gather_op"] = kv_base.description
        report["paths"] = stats[0]["paths"]
        report["paths_agree"] = all(s["paths"] == stats[0]["paths"] for s in stats)
        report["check"] = verdict(stats, dt)
        c = report["check"]
        say(f"check: max abs error {c['max_abs_error']:.3e} (tolerance "
            f"{c['tolerance_abs']:.3e}) -> {c['verdict']}")
    except DcpkitError:
        raise                  # agreed (PeerError from _step): every rank closes below
    except BaseException:
        agreed = False         # a bug outside the agreed steps: main ends the job
        raise
    finally:
        while agreed and owned:
            owned.pop().close()

    report["timing"] = {}
    if args.iters > 0:
        inputs = {"q": q, "out_partial": out_partial, "lse_partial": lse_partial, "dtype": dt,
                  "q_full_shape": (args.batch, model.num_heads, model.qk_dim),
                  "out_shape": (args.batch, H_r, model.v_dim)}
        report["timing"] = _run_timings(comm, args, model, side, inputs, say,
                                        report["nccl_unavailable_reason"])
        report["timing_notes"] = TIMING_NOTES
    return report


# ============================================================================= report
def _fmt_us(entry: Any) -> str:
    if isinstance(entry, dict) and "median_us" in entry:
        return f"{entry['median_us']:.1f}"
    return "n/a"


def _speedup(direct: Any, nccl: Any) -> str:
    try:
        return f"{nccl['median_us'] / direct['median_us']:.1f}x"
    except (KeyError, TypeError, ZeroDivisionError):
        return "n/a"


def format_report(report: Dict[str, Any]) -> str:
    """The report as text (what rank 0 prints)."""
    c = report["check"]
    lengths = report["context_lengths"]
    W = report["world_size"]
    gpus = report["gpus"]
    n_gpus = report.get("distinct_gpus", W)
    gpu_text = (f"{n_gpus} x {gpus[0]}" if all(g == gpus[0] for g in gpus)
                else ", ".join(gpus))
    if n_gpus < W:
        gpu_text += " (ranks share GPUs: a functional run, timings mean nothing)"
    paths = report["paths"]
    u_exp = -int(round(math.log2(unit_roundoff(report["dtype"]))))
    tensors = " (torch tensors)" if report.get("tensors") == "torch" else ""
    reference = ("torch scaled_dot_product_attention (fp32)" if report.get("tensors") == "torch"
                 else "fp32 attention")
    lines = [
        "dcpkit demo: one MLA decode attention layer with decode context parallelism" + tensors,
        f"  model      {report['model']}: {report['num_heads']} query heads "
        f"({report['heads_per_rank']} per rank), one latent KV head of width {report['qk_dim']}",
        f"             ({report['kv_lora_rank']} latent + {report['rope_dim']} rope), values = "
        f"its first {report['v_dim']} columns",
        f"  dtype      {report['dtype']}; softmax scale 1/sqrt({report['qk_dim']}) = "
        f"{report['softmax_scale']:.6f}; partial attention in fp32",
        f"  batch      {report['batch']} sequences of {', '.join(map(str, lengths))} context "
        f"tokens;",
        f"             token i on rank i mod {W} ({report['kv_rows_per_rank']} KV rows per "
        f"sequence per rank)",
        f"  world      {W} ranks on {gpu_text}",
        "  paths      " + "   ".join(f"{op}: {paths.get(op, '?')}"
                                     for op in ("q_gather", "lse_reduce", "kv_gather"))
        + ("" if report.get("paths_agree", True) else "   (ranks disagree!)"),
    ]
    if report.get("nccl_path"):
        lines.append(f"             NCCL path: {report['nccl_path']}")
    lines += [
        f"  check      q_gather bit-exact: {'yes' if c['q_gather_bit_exact'] else 'NO'}   "
        f"kv_gather bit-exact: {'yes' if c['kv_gather_bit_exact'] else 'NO'}   "
        f"non-finite outputs: {c['nonfinite_outputs']}",
        f"             output vs {reference} over the whole KV:",
        f"             max abs error {c['max_abs_error']:.2e}   tolerance "
        f"{c['tolerance_abs']:.2e} (= 2 u max|V| + 1e-3, u = 2^-{u_exp}, max|V| = "
        f"{c['v_max']:.2f})",
        f"             max rel error {c['max_rel_error']:.2e} (max abs error / max |reference|)",
    ]
    if c["verdict"] != "PASS":
        w = c["worst"]
        lines.append(f"             worst: rank {w['rank']}, sequence {w['sequence']}, head "
                     f"{w['head']}, column {w['column']}")
    lines.append(f"  verdict    {c['verdict']}")
    timing = report.get("timing") or {}
    if timing:
        d, n = timing.get("direct", {}), timing.get("nccl", {})
        reps = next((e.get("repeats") for t in (d, n) for e in (t.get("eager") or {}).values()
                     if isinstance(e, dict) and "repeats" in e), None)
        lines.append("  timing     µs per call, communication only (the partial attention is not "
                     "timed);")
        lines.append(f"             median over {reps if reps else 'the'} repeats of the max over "
                     f"ranks; speedup = nccl / direct")
        graph_head = f"CUDA graph ({GRAPH_LAYERS} layers)"
        lines.append(f"             {'':<12}{'eager':^27}   {graph_head:^27}")
        lines.append(f"             {'step':<12}{'direct':>9}{'nccl':>9}{'speedup':>9}   "
                     f"{'direct':>9}{'nccl':>9}{'speedup':>9}")
        for step in ("q_gather", "lse_reduce", "layer"):
            de, ne = d.get("eager", {}).get(step), n.get("eager", {}).get(step)
            dg, ng = d.get("graph", {}).get(step), n.get("graph", {}).get(step)
            label = "layer (both)" if step == "layer" else step
            lines.append(f"             {label:<12}{_fmt_us(de):>9}{_fmt_us(ne):>9}"
                         f"{_speedup(de, ne):>9}   {_fmt_us(dg):>9}{_fmt_us(ng):>9}"
                         f"{_speedup(dg, ng):>9}")
        for policy in ("direct", "nccl"):
            t = timing.get(policy, {})
            if "error" in t:
                lines.append(f"             {policy} path unavailable: {t['error']}")
            if "skipped" in t:
                lines.append(f"             {policy} path not timed: {t['skipped']}")
            for step, g in (t.get("graph") or {}).items():
                if isinstance(g, dict) and "error" in g:
                    lines.append(f"             {policy} graph of {step} failed: {g['error']}")
            tp = t.get("paths")
            if tp and any(not str(v).startswith(policy) for v in tp.values()):
                lines.append(f"             note: the {policy} timings ran on paths {tp}")
    return "\n".join(line.rstrip() for line in lines)


def _versions() -> Dict[str, Any]:
    v: Dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import cupy  # noqa: WPS433

        v["cupy"] = cupy.__version__
        v["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        v["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        from . import __version__  # noqa: WPS433

        v["dcpkit"] = __version__
    except ImportError:  # pragma: no cover
        pass
    return v


# ============================================================================= entry point
def main(argv: Optional[Sequence[str]] = None, *, comm=None) -> int:
    """``python -m dcpkit demo [options]``; returns the exit status (0 PASS, 1 FAIL, 2 the demo
    could not run). Every rank of the MPI job calls it with the same arguments.

    Parameters
    ----------
    argv : list of str, optional
        The demo's arguments (default ``sys.argv[1:]``).
    comm : Communicator, optional
        The group to run on (default: ``Communicator.from_mpi()``, the ``mpirun`` world).

    Collective
    ----------
    Every rank calls it. Errors on any rank are agreed before any later collective, so all
    ranks return the same status and none is left waiting.
    """
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_CANNOT_RUN
    model = PRESETS[args.model]

    owns_comm = comm is None
    if comm is None:
        try:
            from .comm import Communicator  # noqa: WPS433

            comm = Communicator.from_mpi()
        except MissingDependency as e:
            print(f"dcpkit demo: {e}", file=sys.stderr, flush=True)
            return EXIT_CANNOT_RUN
    say = _Say(comm.rank)

    # ---------------------------------------------------------------- environment, agreed
    problems = comm.allgather(_environment_problem(comm, args, model))
    if any(problems):
        if comm.rank == 0:
            seen: Dict[str, List[int]] = {}
            for r, p in enumerate(problems):
                if p:
                    seen.setdefault(p, []).append(r)
            for p, ranks in seen.items():
                where = "" if len(ranks) == comm.world_size else f" (rank {ranks})"
                print(f"dcpkit demo: {p}{where}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN
    try:
        # every setting but --json (only rank 0 writes it) must be equal on every rank
        comm.agree("demo arguments", sorted((k, v) for k, v in vars(args).items()
                                            if k != "json"))
    except DcpkitError as e:
        if comm.rank == 0:
            print(f"dcpkit demo: {e}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN

    import cupy  # noqa: WPS433

    cupy.cuda.Device(comm.local_rank % _gpu_count()[0]).use()
    say(f"{comm.world_size} ranks; model {model.name} (H = {model.num_heads}, D_qk = "
        f"{model.qk_dim}, D_v = {model.v_dim}), {args.dtype}, batch {args.batch}, context up to "
        f"{args.context}" + (", torch tensors" if args.torch else ""))

    try:
        report = run(args, comm, say)
    except DcpkitError as e:
        cause = e.__cause__
        if cause is not None and not isinstance(cause, DcpkitError):
            # a bug, not a refused input: the rank that hit it shows where
            traceback.print_exception(type(cause), cause, cause.__traceback__)
        if comm.rank == 0:
            print(f"dcpkit demo: {e}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN
    except Exception:
        if not owns_comm or comm.world_size == 1:
            raise
        # an error outside the agreed steps: the peers may be inside a collective already;
        # end the whole job rather than leave them waiting
        traceback.print_exc()
        print(f"dcpkit demo: rank {comm.rank} failed outside an agreed step; aborting the MPI "
              "job so that no rank is left waiting", file=sys.stderr, flush=True)
        comm.handle.Abort(EXIT_CANNOT_RUN)
        raise
    report["versions"] = _versions()
    report["argv"] = list(sys.argv[1:] if argv is None else argv)
    json_error = None
    if comm.rank == 0:
        print(format_report(report), flush=True)
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=2, default=str)
                    f.write("\n")
                say(f"report written to {args.json}")
            except OSError as e:
                json_error = f"could not write {args.json}: {e}"
                print(f"dcpkit demo: {json_error}", file=sys.stderr, flush=True)
    # the JSON exists before any rank returns
    if comm.broadcast(json_error, root=0) is not None:
        return EXIT_CANNOT_RUN
    return EXIT_PASS if report["check"]["verdict"] == "PASS" else EXIT_FAIL


def _torch_problem() -> Optional[str]:
    """Why ``--torch`` cannot run here, or ``None``."""
    try:
        import torch  # noqa: WPS433
    except ImportError as e:
        return (f"--torch needs torch, which is not installed ({e}): install it with "
                "`pip install 'dcpkit[torch]'`")
    if not torch.cuda.is_available():
        return (f"--torch needs a CUDA build of torch that sees the GPUs (torch "
                f"{torch.__version__}: torch.cuda.is_available() is False)")
    try:
        from . import torch as dcp_torch  # noqa: WPS433
    except ImportError as e:
        return f"--torch needs dcpkit.torch, which is not available here ({e})"
    if not hasattr(dcp_torch, "TorchOps"):
        return "--torch needs dcpkit.torch.TorchOps, which this dcpkit lacks"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
