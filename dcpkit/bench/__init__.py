"""``python -m dcpkit bench``: one harness for every dcpkit op, a floor kernel beside each row,
NVSHMEM and NCCL measured beside it, and the machine's own ceilings (nccl-tests style).

Usage (one process per GPU, or ranks sharing one GPU under MPS)::

    mpirun -np 4 python -m dcpkit bench --json out/bench_4.json --plot out/bench_4.png
    mpirun -np 2 python -m dcpkit bench --quick                      # ~30 s smoke run
    mpirun -np 4 python -m dcpkit bench --ops kv_gather --min-bytes 1M --max-bytes 64M
    python -m dcpkit.bench --render-md out/bench_2.json out/bench_4.json --md-out BENCHMARKS.md

What one run does, in order:

1. **Ceilings**, measured by dcpkit's own kernels (``kernels/ceilings.cu``) over a
   :class:`~dcpkit.symmetric.SymmetricHeap`: the one-way signal latency (a signal bounced
   between ranks 0 and 1, ~20k round trips in one launch), the unicast egress bandwidth (every
   rank stores a slice into every peer at once with 16-byte stores; GB/s per GPU, max over ranks
   per iteration), and the cost of an empty kernel launch, eager and inside a CUDA graph.
2. **Sweeps** of ``q_gather`` (H=128, D=576, bf16, T in {1, 8, 32, 128}), ``lse_reduce``
   (H=128, D_v=512, bf16 output, float32 lse), the composite ``decode_layer`` (q_gather +
   lse_reduce at T=8) and ``kv_gather`` (4 KiB to 256 MiB per rank, rows of D_kv=576 bf16), over
   the paths ``direct`` (and ``direct-pull``, ``multicast`` where allowed) = dcpkit's kernels;
   ``floor`` = the floor kernel moving the same egress bytes with the op's CTAs and the minimal
   protocol (:mod:`dcpkit.bench.floor`); ``nvshmem`` = NVSHMEM's on-stream collectives
   (:mod:`dcpkit.bench.peers`); ``nccl`` = :mod:`dcpkit.fallback` and ``torch`` =
   torch.distributed (both NCCL, one GPU per rank only). Each **eager** (host launch included:
   ``n`` back-to-back calls between two events, time per call = total / n) and in a **graph**
   (20 calls captured into one CUDA graph, replays timed, time per call = replay time / 20).
   q_gather and lse_reduce at T=1 also run in a graph without self-checking signals (the ops'
   private ``_self_check=False``) where the op has that keyword.

Method (STYLE.md rule 12):

* Correct first. For every size and path, before timing: fresh random inputs
  (:func:`dcpkit.reference.make_inputs`, including empty and non-finite lse entries for
  lse_reduce; a fresh pattern for the floor kernel), outputs poisoned (all bits set), one call,
  compared with :mod:`dcpkit.reference` (bit-exact for data movement, ``lse_reduce_tolerance``
  for the merge). The timed inputs (a second fresh set) are checked again after the eager loop,
  after the first graph replay (graph output poisoned first) and after the last. ``#wrong``
  counts the elements that differed, summed over ranks and checks.
* Timing. Before every timed region a device barrier lines the ranks up and the host waits for
  it. Warm-up calls first; then many samples, each timed with CUDA events; an iteration's time
  is the maximum over ranks; the table shows the median and the p90.
* Every row carries its physical floor (:func:`dcpkit.bench.stats.floor_us`) and the median of
  the floor kernel of the same case, mode and grid (``floor_kernel_us``). The floor row takes
  the push kv_gather's grid; where the pull path's grid differs, a second floor row runs on it
  (variant ``pull_grid``) and the pull rows are compared with that one.

Where ranks share a GPU, the NCCL paths are ``n/a (NCCL unavailable: ...)`` (NCCL refuses
them), the NVLink targets read "n/a (ranks share a GPU)", and NVSHMEM needs each rank's MPS share
set (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/W``; ``scripts/gpu_suite.sh`` sets it).

Robustness. Every step that can fail runs as a *stage* (:mod:`dcpkit.bench.stages`): all ranks
run it, wait for their GPU, then exchange (error, result) with one allgather, so every rank
takes the same branch; a failed size or path is recorded in the JSON and the table (``ERROR``)
and the run goes on. Every device wait has a deadline; a host wait that outlives ``--hang-s``
aborts the job after rank 0 has saved the JSON of everything measured so far.

JSON (``--json``, schema ``dcpkit-bench/2``): ``meta`` (GPU, driver, versions, world size,
whether ranks share a GPU, host, commit, command), ``config``, ``ceilings``, ``rows`` (one per
op, case, path, variant and mode: :class:`~dcpkit.bench.row.BenchRow`), ``targets``
(:mod:`dcpkit.bench.targets`, judged on this run), ``errors``.

The package, by concern: ``args`` (command line), ``common`` (names, errors), ``row`` (the row),
``stats`` and ``targets`` (numbers), ``device`` and ``ceilings`` (GPU side), ``cases``,
``runners``, ``floor``, ``peers`` and ``factory`` (what is measured), ``stages`` and ``sweep``
(the run), ``report`` and ``markdown`` (output), ``command`` (entry points).
"""

from __future__ import annotations

from .args import build_parser, parse_size, resolve_config
from .command import main, render_md_main
from .common import ALL_MODES, ALL_OPS, ALL_PATHS, SCHEMA, BenchHang, StageFailed
from .device import CupyDevice
from .row import BenchRow
from .sweep import run_bench

__all__ = [
    "main",
    "build_parser",
    "resolve_config",
    "run_bench",
    "render_md_main",
    "CupyDevice",
    "StageFailed",
    "BenchHang",
    "parse_size",
    "BenchRow",
    "SCHEMA",
    "ALL_OPS",
    "ALL_PATHS",
    "ALL_MODES",
]
