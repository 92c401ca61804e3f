"""vLLM's direct DCP classes, on dcpkit: code written against ``vllm.v1.attention.ops.dcp``
runs here with its imports changed.

    # vLLM                                            # dcpkit
    from vllm.v1.attention.ops.dcp import (           from dcpkit.vllm import (
        DirectDCPA2AWorkspace,                            DirectDCPA2AWorkspace,
        DirectDCPQGatherWorkspace,                        DirectDCPQGatherWorkspace,
        DirectDCPKVGatherWorkspace,                       DirectDCPKVGatherWorkspace,
        MLADCPManager)                                    MLADCPManager, ubatch)

Same constructor arguments (names, order, defaults), methods, shapes and ``ValueError``
conditions; the differences:

* ``group`` is a ``torch.distributed.ProcessGroup`` of any backend (gloo carries the host-side
  setup exchange) or a :class:`dcpkit.Communicator`; :class:`MLADCPManager` takes the group and
  the vLLM config's values as keywords (``max_num_tokens``, ``num_ubatches``,
  ``comm_backend``) in place of ``vllm_config``.
* The ubatch comes from ``with dcpkit.vllm.ubatch(i): ...`` (default 0) in place of vLLM's
  ``dbo_current_ubatch_id()``.
* The combine is exact (dcpkit's LSE merge: fp32, rounded once, a zero-weight shard never
  read), padding rows are 0, and ``return_lse=True`` also returns the merged lse.
* The gathers run unicast by default (multicast only where dcpkit's guard allows it); vLLM's
  require multicast.
* Each class owns dcpkit resources: ``close()`` (collective) or use it as a context manager.

Usage, on every rank (a decode step as vLLM's MLA attention makes it)::

    import torch, torch.distributed as dist
    from dcpkit.vllm import MLADCPManager, ubatch

    dist.init_process_group("gloo")                  # or NCCL, one GPU per rank
    mgr = MLADCPManager(dist.group.WORLD, torch.device("cuda", local_rank), num_heads=H_r,
                        query_head_dim=576, output_head_dim=512, query_dtype=torch.bfloat16,
                        output_dtype=torch.bfloat16, padded_num_heads=None,
                        is_lse_base_on_e=True, use_pcp=False, max_num_tokens=128)
    q_all = mgr.query_gather(q)                      # [T, H_r, 576] -> [T, W*H_r, 576]
    out, lse = attention(q_all, local_kv)            # [T, W*H_r, 512], [T, W*H_r]
    out = mgr.combine(out, lse, seq_lens=local_seq_lens, query_start_loc=qsl)  # [T, H_r, 512]
    with ubatch(1):                                  # a second micro-batch
        ...
    mgr.close()

Every vLLM precondition raises before anything is allocated, as a ``ValueError`` that is also a
dcpkit error (:class:`UnsupportedDtype`, :class:`InvalidGeometry`, :class:`UbatchOutOfRange`);
a tensor on the wrong device, of the wrong dtype or layout raises an error naming the argument.
torch is imported on first use: ``import dcpkit.vllm`` works without it, the constructors
raise :class:`~dcpkit.errors.MissingDependency` naming the ``torch`` extra.
"""

from ._common import (
    BFLOAT16,
    InvalidGeometry,
    UbatchOutOfRange,
    UnsupportedDtype,
    current_ubatch,
    ubatch,
)
from ._gathers import DirectDCPKVGatherWorkspace, DirectDCPQGatherWorkspace
from ._manager import COMM_BACKENDS, MLADCPManager
from ._workspaces import A2A_DTYPES, KV_GATHER_DTYPES, DirectDCPA2AWorkspace

__all__ = [
    "DirectDCPA2AWorkspace",
    "DirectDCPQGatherWorkspace",
    "DirectDCPKVGatherWorkspace",
    "MLADCPManager",
    "ubatch",
    "current_ubatch",
    "UnsupportedDtype",
    "InvalidGeometry",
    "UbatchOutOfRange",
    "COMM_BACKENDS",
    "A2A_DTYPES",
    "KV_GATHER_DTYPES",
    "BFLOAT16",
]
