"""The three ops on NCCL (through CuPy's ``cupy.cuda.nccl``): the fallback of
:class:`~dcpkit.manager.DCPComm` and the baseline of the benchmark. One module per op
(:mod:`dcpkit.nccl.q_gather`, :mod:`~dcpkit.nccl.kv_gather`, :mod:`~dcpkit.nccl.lse_reduce`)
plus the group (:mod:`dcpkit.nccl.group`) and what the ops share (:mod:`dcpkit.nccl.base`); the
strided copy they use is :mod:`dcpkit._strided`.

Each class takes the constructor keywords and the call signature of its direct op
(:class:`~dcpkit.ops.QGather`, :class:`~dcpkit.ops.KVGather`, :class:`~dcpkit.ops.LseReduce`) and
returns the same result: bit for bit for the gathers, within
:func:`dcpkit.reference.lse_reduce_tolerance` for ``lse_reduce``. Usage, on every rank::

    group = NcclGroup(comm)                         # one NCCL communicator, shared (optional)
    qg = NcclQGather(comm, max_tokens=128, heads_per_rank=32, head_dim=576,
                     dtype="bfloat16", nccl_group=group)
    lr = NcclLseReduce(comm, max_tokens=128, num_heads=128, head_dim=512, dtype="bfloat16",
                       algorithm="all_to_all", nccl_group=group)
    q_all = qg(q)                                   # [T, H_r, D] -> [T, H, D]
    out = lr(out_partial, lse_partial)              # [T, H, D_v], [T, H] -> [T, H_r, D_v]
    ...
    lr.close(); qg.close(); group.close()           # collective

What runs per call (``W = world_size``, rank ``r``; kernels in ``kernels/fallback.cu``):

* ``NcclQGather``: ``q`` (copied to a contiguous buffer first if it is strided) is all-gathered
  into ``[W, T, H_r, D]``, then one strided copy puts it in ``[T, H, D]`` order. For ``T == 1``
  the two layouts coincide and NCCL gathers straight into the result.
* ``NcclKVGather``: one all-gather into ``[W*T, D_kv]``.
* ``NcclLseReduce``, ``algorithm=``

  - ``"all_to_all"`` (default): the lse is converted to float32 natural log and masked (NaN,
    +inf and masked rows become -inf) into ``[W, T, H_r]`` in owner order, the owner's head slice
    of ``out_partial`` is packed into ``[W, T, H_r, D_v]``; one NCCL group of send/recv pairs
    (two per peer: payload and lse) is the all-to-all; then
    :func:`dcpkit.ops.lse_reduce.lse_combine` (the direct op's merge) produces
    ``out [T, H_r, D_v]``. Needs ``D_v * itemsize`` to be a multiple of 16.
  - ``"allgather_reduce_scatter"``: the masked lse ``[T, H]`` is all-gathered into
    ``[W, T, H]``; every rank computes the weights of all heads and scales its own
    ``out_partial`` by its weight in fp32 (exactly 0 where the weight is 0, whatever the payload)
    into ``[W, T, H_r, D_v]`` owner order; a fp32 sum reduce-scatter leaves the own heads
    ``[T, H_r, D_v]``, cast to the dtype.
  - ``"allgather_all_reduce"``: the same, with an all-reduce over ``[T, H, D_v]``: every rank
    ends with **all** heads, ``out [T, H, D_v]`` and ``out_lse [T, H]`` (prefill context
    parallelism).

Buffers and lifetime. Every buffer is allocated at construction for ``max_tokens``; a call
allocates nothing, so calls are capture-safe (NCCL calls are graph-capturable). Results without
``out=`` are views of workspace buffers with the lifetime rule of the direct ops: two eager
buffers alternate by a host counter, so the view of call ``n`` stays valid while it is consumed
on the same stream before call ``n + 2`` of the same ubatch; a call captured in a CUDA graph
writes the ubatch's graph buffer, valid until the next replay. ``T > max_tokens`` is served too:
the call then allocates its scratch and output from CuPy's pool on the call's stream (the
returned array is freshly allocated); that is refused while capturing.

No timeouts: NCCL waits are not bounded by ``timeout_ms`` (accepted for signature compatibility).
A rank that raises on bad arguments before its NCCL call leaves its peers waiting inside NCCL:
with ``DCPKIT_DEBUG=1`` every call first compares its arguments across ranks.
"""

from .base import PATH_NCCL, NcclOp
from .group import NcclGroup, nccl_module
from .kv_gather import NcclKVGather
from .lse_reduce import LSE_ALGORITHMS, LseLayout, NcclLseReduce, lse_layout
from .q_gather import NcclQGather

__all__ = [
    "NcclGroup",
    "NcclQGather",
    "NcclKVGather",
    "NcclLseReduce",
    "NcclOp",
    "LSE_ALGORITHMS",
    "PATH_NCCL",
    "nccl_module",
    "lse_layout",
    "LseLayout",
]
