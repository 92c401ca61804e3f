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

The package, by what its parts do: :mod:`~dcpkit.demo.model` (geometry presets, context
lengths, inputs), :mod:`~dcpkit.demo.numerics` (the fp32 attention reference and the verdict),
:mod:`~dcpkit.demo.exchanges` (the DCPComm of each policy), :mod:`~dcpkit.demo.cupy_side` and
:mod:`~dcpkit.demo.torch_side` (arrays and math of each framework), :mod:`~dcpkit.demo.timing`,
:mod:`~dcpkit.demo.environment` (what the machine must offer), :mod:`~dcpkit.demo.runner`,
:mod:`~dcpkit.demo.report` and :mod:`~dcpkit.demo.cli` (arguments and the entry point).

Exit status: 0 PASS, 1 FAIL (wrong result), 2 the demo could not run (no GPU, too many ranks for
the GPUs of a host, bad arguments, a missing dependency, a setup error). Errors are agreed
across ranks before any collective, so no rank is left waiting.
"""

from .cli import main, parse_args
from .environment import environment_error
from .model import PRESETS, Model, context_lengths, deinterleave, interleave, local_lengths
from .numerics import attention, from_float32, to_float32, tolerance, unit_roundoff, verdict
from .report import format_report
from .runner import run
from .timing import summarize_times

__all__ = [
    "main",
    "run",
    "parse_args",
    "Model",
    "PRESETS",
    "context_lengths",
    "local_lengths",
    "deinterleave",
    "interleave",
    "attention",
    "to_float32",
    "from_float32",
    "tolerance",
    "unit_roundoff",
    "environment_error",
    "summarize_times",
    "format_report",
    "verdict",
]
