"""``python -m dcpkit bench``: one harness for every dcpkit op, its NCCL baselines, and the
machine's own ceilings (nccl-tests style).

Usage (one process per GPU)::

    mpirun -np 4 python -m dcpkit bench --json out/bench_4.json --plot out/bench_4.png
    mpirun -np 2 python -m dcpkit bench --quick                      # ~30 s smoke run
    mpirun -np 4 python -m dcpkit bench --ops kv_gather --min-bytes 1M --max-bytes 64M
    python -m dcpkit.bench --render-md out/bench_2.json out/bench_4.json --md-out BENCHMARKS.md

What one run does, in order:

1. **Ceilings**, measured by dcpkit's own kernels (``kernels/ceilings.cu``) over a
   :class:`~dcpkit.symmetric.SymmetricHeap`: the one-way NVLink latency (a signal bounced between
   ranks 0 and 1 with ``st.release.sys`` / ``ld.acquire.sys``, ~20k round trips in one launch,
   one-way = time / (2 * round trips)); the unicast egress bandwidth (every rank stores a 64 MiB
   slice into every peer at once with 16-byte stores; GB/s per GPU, max over ranks per
   iteration); and the cost of an empty kernel launch, eager and inside a CUDA graph.
2. **Sweeps** of ``q_gather`` (H=128, D=576, bf16, T in {1, 8, 32, 128}), ``lse_reduce``
   (H=128, D_v=512, bf16 output, float32 lse), the composite ``decode_layer`` (q_gather +
   lse_reduce at T=8) and ``kv_gather`` (4 KiB to 256 MiB per rank, rows of D_kv=576 bf16, push
   and pull), over the paths ``direct`` (and ``direct-pull``) = dcpkit's unicast kernels,
   ``multicast`` (only where NOTE [dcpkit multicast guard] allows it: never on the lent
   machines), ``nccl`` = :mod:`dcpkit.fallback` (NCCL through CuPy; lse_reduce = all_to_all +
   the same combine) and ``torch`` = torch.distributed NCCL (all_gather_into_tensor /
   all_to_all_single + :func:`~dcpkit.ops.lse_reduce.lse_combine`) when torch is installed;
   each **eager** (host launch included: ``n`` back-to-back calls between two events, time per
   call = total / n) and in a **graph** (``K`` calls captured into one CUDA graph on a
   non-default stream, replays timed, time per call = replay time / K).

Method (/work/.library/device/METHOD.md, STYLE.md rule 12):

* Correct first. For every size and path, before timing: fresh random inputs
  (:func:`dcpkit.reference.make_inputs`, including empty and non-finite lse entries for
  lse_reduce), outputs poisoned (all bits set), one call, compared with
  :mod:`dcpkit.reference` (bit-exact for the gathers, ``lse_reduce_tolerance`` for the merge).
  The timed inputs (a second fresh set) are checked again after the eager loop, after the
  first graph replay (graph output poisoned first) and after the last. ``#wrong`` counts the
  elements that differed, summed over ranks and checks.
* Timing. Before every timed region a device barrier (``barrier_kernel``) lines the ranks up and
  the host waits for it, so no rank's region includes a peer's late start and no eager call is
  queued early. Warm-up calls first; then many samples; each sample is timed with CUDA events;
  an iteration's time is the maximum over ranks; the table shows the median and the p95.
* Every row carries its physical floor (:func:`dcpkit._stats.floor_us`) and ``time / floor``.

NCCL needs one GPU per rank. Where ranks of a host share a GPU (a functional run with more ranks
than GPUs), the ``nccl`` and ``torch`` paths (both NCCL) are not run: they are reported as
``n/a (NCCL unavailable: ...)`` (log, summary, JSON ``meta.paths_not_available``), not as failed
rows, and the comparisons with NCCL read "no NCCL baseline in this run".

Robustness. Every step that can fail runs as a *stage*: all ranks run it, wait for their GPU,
then exchange (error, result) with one allgather, so every rank takes the same branch: a failed
size or path is recorded in the JSON and the table (``ERROR``) and the run goes on. Every device
wait has a deadline; a host wait that outlives ``--hang-s`` (an NCCL hang) aborts the job after
rank 0 has saved the JSON of everything measured so far (rank 0 rewrites it after every case).

JSON (``--json``): ``meta`` (GPU, driver, CUDA runtime, library versions, world size, host,
commit, command), ``config``, ``ceilings``, ``rows`` (one per op, case, path and mode, with the
iteration times), ``targets`` (issue 8, evaluated on this run), ``errors``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _report, _stats
from .errors import DcpkitError

__all__ = ["main", "build_parser", "resolve_config", "run_bench", "render_md_main",
           "CupyDevice", "StageFailed", "BenchHang", "parse_size"]

KiB = 1024
MiB = 1024 * KiB

#: The DCP decode geometry of the issue (DeepSeek-V3 style MLA): heads, q head dim, value dim,
#: compressed KV row width; decode batch of the demo.
GEOMETRY = {"H": 128, "D": 576, "D_v": 512, "D_kv": 576, "dtype": "bfloat16", "decode_T": 8}
ALL_OPS = ("q_gather", "lse_reduce", "decode_layer", "kv_gather")
ALL_PATHS = ("direct", "direct-pull", "multicast", "nccl", "torch")
ALL_MODES = ("eager", "graph")
#: Paths that run on NCCL (dcpkit.fallback, torch.distributed's NCCL backend).
NCCL_PATHS = ("nccl", "torch")
SCHEMA = "dcpkit-bench/1"

# Offsets in the small symmetric heap of the ceilings kernels.
_PP_OFF = 0      # ping-pong word (u32)
_BAR_OFF = 256   # barrier words (u32 [world_size])
_SYNC_HEAP_BYTES = 4096


class StageFailed(DcpkitError):
    """A stage failed on at least one rank; raised on every rank (same branch everywhere).

    Attributes
    ----------
    what : str
    errors : dict rank -> message
    """

    def __init__(self, what: str, errors: Dict[int, str]):
        self.what = what
        self.errors = dict(errors)
        detail = "; ".join(f"rank {r}: {_short(m)}" for r, m in sorted(self.errors.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.errors)}: {detail}")


class BenchHang(DcpkitError):
    """A host wait for the GPU outlived ``--hang-s``: a kernel (NCCL has no deadline) is stuck."""


class BarrierTimeout(DcpkitError):
    """The device barrier before a timed region expired: a peer never reached it."""


def _short(s: Any, n: int = 400) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


# ----------------------------------------------------------------------------- arguments
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"4K"``, ``"4KiB"``, ``"256M"``, ``"1G"`` (binary units).

    Raises
    ------
    argparse.ArgumentTypeError
        Not a size.
    """
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"size must look like 4096, 4K, 4KiB, 256M or 1G "
                                         f"(got {text!r})")
    mult = {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB, "t": 1024 * 1024 * MiB}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def _csv(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(allowed)} "
                                             f"(got {text!r})")
        return items
    return parse


def _int_list(text: str) -> List[int]:
    try:
        v = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        v = []
    if not v or any(x < 1 for x in v):
        raise argparse.ArgumentTypeError(f"must be a comma list of positive ints (got {text!r})")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dcpkit bench``."""
    p = argparse.ArgumentParser(
        prog="dcpkit bench",
        description="Benchmark dcpkit's ops against NCCL and the machine's measured ceilings "
                    "(run under mpirun -np N, one process per GPU).")
    p.add_argument("--ops", type=_csv(ALL_OPS), default=list(ALL_OPS),
                   help=f"comma list of {', '.join(ALL_OPS)} (default: all)")
    p.add_argument("--paths", type=_csv(ALL_PATHS), default=list(ALL_PATHS),
                   help="comma list of paths (default: all available; multicast only where "
                        "allowed)")
    p.add_argument("--modes", type=_csv(ALL_MODES), default=list(ALL_MODES),
                   help="eager, graph (default: both)")
    p.add_argument("--min-bytes", type=parse_size, default=None,
                   help="kv_gather: smallest bytes per rank (default 4K)")
    p.add_argument("--max-bytes", type=parse_size, default=None,
                   help="kv_gather: largest bytes per rank (default 256M; --quick 16M); also "
                        "caps the egress slice (64M)")
    p.add_argument("--tokens", type=_int_list, default=None,
                   help="q_gather / lse_reduce token counts T (default 1,8,32,128)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed samples per case, path and mode (default 30; --quick 8)")
    p.add_argument("--json", default=None, help="write the results as JSON here (rank 0)")
    p.add_argument("--plot", default=None, help="draw the PNG plots here (rank 0)")
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    p.add_argument("--seed", type=int, default=None,
                   help="base seed of the random inputs (default: fresh, printed)")
    p.add_argument("--kv-row-dim", type=int, default=GEOMETRY["D_kv"],
                   help="kv_gather row width D_kv in elements (default 576)")
    p.add_argument("--timeout-ms", type=float, default=10000.0,
                   help="deadline of every device wait (ops and ceilings), ms (default 10000)")
    p.add_argument("--hang-s", type=float, default=120.0,
                   help="abort the job when a host wait for the GPU exceeds this (default 120)")
    p.add_argument("--round-trips", type=int, default=None,
                   help="ping-pong round trips per launch (default 20000; --quick 2000)")
    p.add_argument("--egress-bytes", type=parse_size, default=None,
                   help="egress ceiling slice per rank (default min(64M, --max-bytes))")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed stages")
    g = p.add_argument_group("BENCHMARKS.md (no GPU, no MPI)")
    g.add_argument("--render-md", nargs="+", metavar="JSON", default=None,
                   help="render BENCHMARKS.md from these JSON files and exit")
    g.add_argument("--md-out", default=None, help="write the markdown here (default stdout)")
    g.add_argument("--notes", default=None,
                   help="a markdown file kept by hand, appended under 'Notes'")
    return p


def resolve_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Every setting of a run, defaults filled in (``--quick`` shrinks them)."""
    q = bool(args.quick)
    max_bytes = args.max_bytes if args.max_bytes is not None else (16 * MiB if q else 256 * MiB)
    min_bytes = args.min_bytes if args.min_bytes is not None else 4 * KiB
    if min_bytes > max_bytes:
        raise argparse.ArgumentTypeError(f"--min-bytes {min_bytes} must be <= --max-bytes "
                                         f"{max_bytes}")
    step = 16 if q else 4
    sizes = []
    s = min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= step
    egress = args.egress_bytes if args.egress_bytes is not None else min(64 * MiB, max_bytes)
    egress = max(16 * KiB, egress // 16 * 16)
    tokens = args.tokens or ([1, 128] if q else [1, 8, 32, 128])
    iters = args.iters if args.iters is not None else (8 if q else 30)
    if iters < 1:
        raise argparse.ArgumentTypeError(f"--iters must be >= 1 (got {iters})")
    if args.kv_row_dim < 8 or (args.kv_row_dim * 2) % 16:
        raise argparse.ArgumentTypeError(f"--kv-row-dim must be a multiple of 8 elements "
                                         f"(16-byte rows) (got {args.kv_row_dim})")
    return {
        "ops": [o for o in ALL_OPS if o in args.ops],
        "paths": [p for p in ALL_PATHS if p in args.paths],
        "modes": [m for m in ALL_MODES if m in args.modes],
        "kv_sizes": sizes, "min_bytes": min_bytes, "max_bytes": max_bytes,
        "tokens": sorted(set(tokens)), "iters": iters, "quick": q,
        "json": args.json, "plot": args.plot, "seed": args.seed,
        "geometry": dict(GEOMETRY, D_kv=int(args.kv_row_dim)),
        "timeout_ms": float(args.timeout_ms), "hang_s": float(args.hang_s),
        "round_trips": args.round_trips or (2000 if q else 20000),
        "pingpong_repeats": 3 if q else 5,
        "egress_slice_bytes": int(egress), "egress_samples": 3 if q else 10,
        "sample_target_us": 500.0 if q else 1000.0,
        "mode_budget_s": 0.05 if q else 0.3,
        "graph_calls": 20, "verbose": bool(args.verbose),
    }


# ----------------------------------------------------------------------------- facts
def _git_commit() -> Tuple[str, Optional[bool]]:
    root = Path(__file__).resolve().parent.parent
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                           text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
            return r.stdout.strip(), (bool(d.stdout.strip()) if d.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("DCPKIT_COMMIT", "unknown"), None


def _driver_version() -> Optional[str]:
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([\d.]+)", f.read())
            if m:
                return m.group(1)
    except OSError:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _pkg_version(name: str) -> Optional[str]:
    try:
        from importlib import metadata  # noqa: WPS433

        return metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def _first_version(*names: str) -> Optional[str]:
    for n in names:
        v = _pkg_version(n)
        if v:
            return f"{n} {v}"
    return None


def _command(world_size: int, argv: Sequence[str]) -> str:
    """The command line of the run, output paths shortened to their file names (the folders
    are those of a machine that is gone)."""
    out, short = [], False
    for a in argv:
        if short:
            a = os.path.basename(a)
        short = a in ("--json", "--plot")
        if a.startswith(("--json=", "--plot=")):
            k, v = a.split("=", 1)
            a = f"{k}={os.path.basename(v)}"
        out.append(shlex.quote(a))
    return f"mpirun -np {world_size} python -m dcpkit bench " + " ".join(out)


def _collect_meta(ctx: "_Ctx", argv: Sequence[str]) -> Dict[str, Any]:
    from . import __version__

    commit, dirty = _git_commit()
    try:
        dev = ctx.dev.describe()
    except Exception as e:  # noqa: BLE001 - facts are best effort; the allgather below is not
        dev = {"describe_error": f"{type(e).__name__}: {e}"}
    hosts = ctx.comm.allgather((socket.gethostname(), dev.get("gpu"), dev.get("device")))
    meta = {
        "world_size": ctx.comm.world_size,
        "hostname": socket.gethostname(),
        "hosts": sorted({h[0] for h in hosts}),
        "gpus_by_rank": [f"{h[0]}:{h[2]} {h[1]}" for h in hosts],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit, "commit_dirty": dirty,
        "command": _command(ctx.comm.world_size, argv),
        "dcpkit": __version__, "python": sys.version.split()[0],
        "numpy": np.__version__,
        "cupy": _first_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "cuda_bindings": _pkg_version("cuda-bindings") or _pkg_version("cuda-python"),
        "mpi4py": _pkg_version("mpi4py"),
        "torch": _pkg_version("torch"),
        "multicast_env": {k: os.environ.get(k) for k in (
            "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
            "DCPKIT_DISABLE_MULTICAST", "DCPKIT_MULTICAST")},
    }
    meta.update(dev)
    meta["driver"] = meta.get("driver") or _driver_version()
    meta["machine"] = os.environ.get("DCPKIT_MACHINE_KIND") or \
        f"{dev.get('gpu_count', '?')}x {dev.get('gpu', '?')}"
    return meta


# ----------------------------------------------------------------------------- context, stages
class _Ctx:
    """What one run carries around: settings, group, device, results so far."""

    def __init__(self, cfg: Dict[str, Any], comm, dev, argv: Sequence[str]):
        self.cfg = cfg
        self.comm = comm
        self.dev = dev
        self.argv = list(argv)
        self.rank = comm.rank
        self.world = comm.world_size
        self.rows: List[Dict[str, Any]] = []
        self.errors: List[str] = []
        self.ceilings: Dict[str, Any] = {}
        self.meta: Dict[str, Any] = {}
        self.torch_env = None
        self.nccl_group = None   # one NCCL communicator shared by the nccl path's ops
        self.t0 = time.monotonic()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[bench {time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    def result(self) -> Dict[str, Any]:
        rows = _stats.annotate([dict(r) for r in self.rows], self.ceilings)
        return {"schema": SCHEMA, "meta": self.meta, "config": _jsonable(self.cfg),
                "ceilings": self.ceilings, "rows": rows,
                "targets": _stats.evaluate_targets(rows), "errors": list(self.errors),
                "elapsed_s": round(time.monotonic() - self.t0, 1)}

    def save(self) -> None:
        """Rank 0 writes the JSON of everything so far (atomically)."""
        if self.rank != 0 or not self.cfg.get("json"):
            return
        path = self.cfg["json"]
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(_jsonable(self.result()), f, indent=1, allow_nan=False)
        os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    """Plain JSON values: non-finite floats become None, numpy scalars Python numbers."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def _stage(ctx: _Ctx, what: str, fn: Callable[[], Any]) -> List[Any]:
    """Run ``fn`` on every rank, wait for the GPU, and agree on the outcome.

    Returns every rank's result (a list indexed by rank). Raises :class:`StageFailed` on every
    rank when ``fn`` raised on any rank, so that all ranks take the same branch afterwards.
    ``fn`` makes no host collective of its own (a rank that failed half-way would leave its peers
    in a collective it never enters): cross-rank work inside a stage happens on the GPU, where
    every wait has a deadline. The exceptions are the collective constructors and ``close()`` of
    dcpkit resources (heaps, ops, NCCL groups), whose own setup transactions agree on failure.

    Raises
    ------
    BenchHang
        A host wait for the GPU outlived ``--hang-s`` (fatal: the caller aborts the job).
    """
    err = None
    val = None
    try:
        val = fn()
    except BenchHang:
        raise
    except Exception as e:  # noqa: BLE001 - recorded and agreed on, never swallowed silently
        err = f"{type(e).__name__}: {e}"
        tb = traceback.format_exc() if ctx.cfg.get("verbose") else ""
        print(f"[bench rank {ctx.rank}] {what}: {_short(err, 1000)}\n{tb}", file=sys.stderr,
              flush=True)
    try:
        ctx.dev.quiesce()
    except BenchHang:
        raise
    except Exception as e:  # noqa: BLE001
        if err is None:
            err = f"after {what}: {type(e).__name__}: {e}"
    gathered = ctx.comm.allgather((err, None if err else val, ctx.dev.barrier_token()))
    ctx.dev.barrier_resync(max(g[2] for g in gathered))
    failed = {r: g[0] for r, g in enumerate(gathered) if g[0] is not None}
    if failed:
        raise StageFailed(what, failed)
    return [g[1] for g in gathered]


# ----------------------------------------------------------------------------- device layer
def _uint_dtype(itemsize: int):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[int(itemsize)]


def _to_f32(xp, a):
    """float32 copy of ``a``; bfloat16 through its bits (no reliance on bf16 casts)."""
    if a.dtype.name == "bfloat16":
        return (a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float32)


class _DeviceBase:
    """Array helpers shared by the CuPy device and test doubles (``xp`` = cupy or numpy)."""

    xp = np

    def upload(self, a: np.ndarray):
        """A device copy of the host array ``a`` (any dtype, bfloat16 included)."""
        a = np.ascontiguousarray(a)
        u = _uint_dtype(a.dtype.itemsize)
        d = self.xp.asarray(a.view(u))
        return d if a.dtype == np.dtype(u) else d.view(a.dtype)

    def empty(self, shape, dtype):
        dt = np.dtype(dtype)
        d = self.xp.empty(tuple(shape), dtype=_uint_dtype(dt.itemsize))
        return d if dt == np.dtype(_uint_dtype(dt.itemsize)) else d.view(dt)

    def pci_bus_id(self) -> Optional[str]:
        """The PCI bus id of this rank's GPU; None where unknown (then it is never counted as
        shared with another rank's)."""
        return None

    def poison(self, arrays) -> None:
        """Set every bit of every array (NaN for floats), then wait for it."""
        for a in arrays:
            u = _uint_dtype(a.dtype.itemsize)
            a.view(u).fill(np.iinfo(u).max)
        self.sync_null()

    def sync_null(self) -> None:
        """Wait for work issued on the current stream (no-op for host arrays)."""

    def compare(self, outs, refs) -> Dict[str, Any]:
        """Compare op outputs with references.

        ``refs`` holds ``("bits", ref_uint_view, None)`` (bit-exact) or ``("close", ref_f32,
        tol)`` (``|out - ref| <= tol``; NaN fails) per output. Returns ``wrong`` (elements that
        differ), ``first_bad`` (flat index per output, or None), ``max_abs_err``, ``rel_err``
        (‖out − ref‖ / ‖ref‖ for the tolerance outputs).
        """
        xp = self.xp
        if len(outs) != len(refs):
            raise ValueError(f"compare: {len(outs)} outputs for {len(refs)} references")
        wrong, first, max_err, rel = 0, [], None, None
        for i, (o, (kind, ref, tol)) in enumerate(zip(outs, refs)):
            if tuple(o.shape) != tuple(ref.shape):
                raise ValueError(f"output {i} has shape {tuple(o.shape)}, the reference "
                                 f"{tuple(ref.shape)}")
            if kind == "bits":
                bad = o.view(_uint_dtype(o.dtype.itemsize)) != ref
            else:
                of = _to_f32(xp, o)
                err = xp.abs(of - ref)
                bad = ~(err <= tol)
                finite = xp.where(xp.isnan(err), xp.inf, err)
                m = float(finite.max()) if finite.size else 0.0
                max_err = m if max_err is None else max(max_err, m)
                den = float(xp.linalg.norm(ref.ravel()))
                num = float(xp.linalg.norm(xp.where(xp.isnan(of), xp.inf, of - ref).ravel()))
                r = num / den if den > 0 else (0.0 if num == 0 else math.inf)
                rel = r if rel is None else max(rel, r)
            n = int(xp.count_nonzero(bad))
            wrong += n
            first.append(int(xp.argmax(bad.ravel())) if n else None)
        return {"wrong": wrong, "first_bad": first, "max_abs_err": max_err, "rel_err": rel}

    # stages
    def quiesce(self) -> None:
        """Wait (with a deadline) until no work of this process is left on the GPU."""

    def barrier_token(self) -> int:
        return 0

    def barrier_resync(self, token: int) -> None:
        pass

    def free_memory(self) -> None:
        pass


class CupyDevice(_DeviceBase):
    """The GPU side of the harness on one rank: streams, events, the device barrier, the
    ceilings kernels, and array helpers, over CuPy.

    Construction selects GPU ``local_rank % device_count``; :meth:`setup` (collective, inside a
    stage) compiles ``kernels/ceilings.cu`` and builds the small symmetric heap of the barrier and
    the ping-pong.
    """

    def __init__(self, comm, cfg: Dict[str, Any]):
        import cupy  # noqa: WPS433

        self.cupy = cupy
        self.xp = cupy
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world_size
        self.gpu_count = cupy.cuda.runtime.getDeviceCount()
        if self.gpu_count < 1:
            raise DcpkitError("dcpkit bench: no CUDA GPU visible")
        self.device = comm.local_rank % self.gpu_count
        cupy.cuda.Device(self.device).use()
        self.timeout_ns = int(cfg["timeout_ms"] * 1e6)
        self.hang_s = float(cfg["hang_s"])
        self.sm_count = cupy.cuda.runtime.getDeviceProperties(self.device)["multiProcessorCount"]
        self._streams: List[Any] = []
        self._owners: List[Any] = []
        self._ev_b = cupy.cuda.Event(disable_timing=True)
        self._ev0 = cupy.cuda.Event()
        self._ev1 = cupy.cuda.Event()
        self._bar_value = 0
        self._pp_base = 0
        self.sync_heap = None
        self._status_ptr = 0
        self._status = np.zeros(16, dtype=np.uint32)
        self._egress = None
        self.stream = self.new_stream()

    # ------------------------------------------------------------------ facts
    def describe(self) -> Dict[str, Any]:
        cupy = self.cupy
        props = cupy.cuda.runtime.getDeviceProperties(self.device)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        rt = cupy.cuda.runtime.runtimeGetVersion()
        dv = cupy.cuda.runtime.driverGetVersion()
        out = {"gpu": name, "gpu_count": self.gpu_count, "device": self.device,
               "sm_count": self.sm_count,
               "cuda_runtime": f"{rt // 1000}.{(rt % 1000) // 10}",
               "cuda_driver_api": f"{dv // 1000}.{(dv % 1000) // 10}",
               "driver": _driver_version()}
        try:
            from cupy.cuda import nccl  # noqa: WPS433

            v = nccl.get_version()
            out["nccl"] = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v >= 10000 else \
                f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"
        except Exception:  # noqa: BLE001 - NCCL not available through CuPy
            out["nccl"] = None
        return out

    def pci_bus_id(self) -> Optional[str]:
        return str(self.cupy.cuda.runtime.deviceGetPCIBusId(self.device))

    # ------------------------------------------------------------------ streams and waits
    def new_stream(self):
        s = self.cupy.cuda.Stream(non_blocking=True)
        self._streams.append(s)
        return s

    def external_stream(self, owner):
        """A CuPy view of a stream made elsewhere (a torch stream), waited for by
        :meth:`quiesce`; ``owner`` is kept alive for the run, so the handle never dangles."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = self.cupy.cuda.ExternalStream(int(owner.cuda_stream), self.device)
        self._streams.append(s)
        self._owners.append(owner)
        return s

    def _poll(self, ev, what: str) -> None:
        if ev.done:
            return
        t0 = time.monotonic()
        n = 0
        while not ev.done:
            n += 1
            if (n & 1023) == 0 and time.monotonic() - t0 > self.hang_s:
                raise BenchHang(f"rank {self.rank}: the GPU did not finish {what} within "
                                f"{self.hang_s:g} s (a kernel without deadline, e.g. NCCL, is "
                                f"stuck)")

    def wait_stream(self, stream, what: str = "the stream") -> None:
        ev = self.cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        self._poll(ev, what)

    def sync_null(self) -> None:
        self.wait_stream(self.cupy.cuda.get_current_stream(), "the current stream")

    def quiesce(self) -> None:
        for s in self._streams + [self.cupy.cuda.get_current_stream()]:
            self.wait_stream(s, "outstanding work")

    def free_memory(self) -> None:
        self.cupy.get_default_memory_pool().free_all_blocks()

    # ------------------------------------------------------------------ setup and barrier
    def setup(self) -> None:
        """Collective (run inside a stage): compile the ceilings kernels, build the sync heap."""
        from . import jit  # noqa: WPS433
        from .symmetric import SymmetricHeap  # noqa: WPS433

        cupy = self.cupy
        # the loaded functions (what the ops launch too: the launch cost measured is theirs)
        self._k_pp = jit.get_kernel("ceilings.cu", "dcpkit::pingpong_kernel").kernel
        self._k_egress = jit.get_kernel("ceilings.cu", "dcpkit::egress_kernel").kernel
        self._k_bar = jit.get_kernel("ceilings.cu", "dcpkit::barrier_kernel").kernel
        if not self._status_ptr:
            import ctypes  # noqa: WPS433

            flags = cupy.cuda.runtime.hostAllocMapped | cupy.cuda.runtime.hostAllocPortable
            self._status_ptr = cupy.cuda.runtime.hostAlloc(64, flags)
            self._status = np.ctypeslib.as_array(
                (ctypes.c_uint32 * 16).from_address(self._status_ptr))
            self._status[:] = 0
        if self.sync_heap is None:
            self.sync_heap = SymmetricHeap(self.comm, _SYNC_HEAP_BYTES, multicast=False)
            # the heap starts zeroed: no barrier or ping-pong value is ever 0
            self._bar_peers = cupy.asarray(np.array(
                [p + _BAR_OFF for p in self.sync_heap.peer_ptrs], dtype=np.uint64))

    def close(self) -> None:
        """Collective: release the sync heap and the host status word."""
        if self.sync_heap is not None:
            self.quiesce()
            self.sync_heap.close()
            self.sync_heap = None
        if self._status_ptr:
            self.cupy.cuda.runtime.freeHost(self._status_ptr)
            self._status_ptr = 0
            self._status = np.zeros(16, dtype=np.uint32)

    def barrier(self, stream) -> None:
        """Enqueue the device barrier (every rank must enqueue it, in the same order)."""
        self._bar_value += 1
        block = max(32, -(-self.world // 32) * 32)
        self._k_bar((1,), (block,), (
            np.uint64(self.sync_heap.local_ptr + _BAR_OFF), self._bar_peers,
            np.int32(self.rank), np.int32(self.world),
            np.uint32(self._bar_value & 0xFFFFFFFF), np.uint64(self.timeout_ns),
            np.uint64(self._status_ptr)), stream=stream)

    def barrier_token(self) -> int:
        return self._bar_value

    def barrier_resync(self, token: int) -> None:
        # After a failed stage the ranks may have launched different numbers of barriers: every
        # rank continues from the largest count, so every later value is new to every word.
        self._bar_value = int(token)
        self._status[0] = 0

    def aligned(self, stream) -> None:
        """Device barrier on ``stream``, then wait for it on the host: the ranks leave together."""
        self.barrier(stream)
        self._ev_b.record(stream)
        self._poll(self._ev_b, "the device barrier")
        if self._status[0]:
            raise BarrierTimeout(f"rank {self.rank}: a peer did not reach the device barrier "
                                 f"within {self.timeout_ns / 1e6:g} ms")

    def sample(self, stream, enqueue: Callable[[], Any]) -> float:
        """One timed region: align the ranks, then time ``enqueue()`` on ``stream`` with events.
        Returns µs."""
        self.aligned(stream)
        self._ev0.record(stream)
        enqueue()
        self._ev1.record(stream)
        self._poll(self._ev1, "the timed region")
        return self.cupy.cuda.get_elapsed_time(self._ev0, self._ev1) * 1e3

    def capture(self, stream, fn: Callable[[], Any], count: int):
        """Capture ``count`` calls of ``fn`` on ``stream`` into one CUDA graph.

        Returns ``(launch, last)``: a function that launches the graph on ``stream``, and what
        the last captured call returned.
        """
        last = None
        with stream:
            stream.begin_capture()
            try:
                for _ in range(count):
                    last = fn()
            except BaseException:
                with contextlib.suppress(Exception):
                    stream.end_capture()
                raise
            graph = stream.end_capture()
        return (lambda: graph.launch(stream=stream)), last

    # ------------------------------------------------------------------ ceilings
    def pingpong(self, round_trips: int, repeats: int) -> Optional[List[Dict[str, float]]]:
        """Ranks 0 and 1 bounce a signal ``round_trips`` times per launch, ``repeats`` timed
        launches after one warm-up launch. Returns, on ranks 0 and 1, per launch the event time
        (µs) and the in-kernel %globaltimer time of the round trips after the first ``warm``."""
        cupy = self.cupy
        s = self.stream
        status = cupy.zeros(2, dtype=cupy.uint32)
        elapsed = cupy.zeros(1, dtype=cupy.uint64)
        warm = min(64, round_trips // 10)
        heap = self.sync_heap
        out = []
        for rep in range(repeats + 1):
            self.aligned(s)
            if self.rank < 2:
                peer = 1 - self.rank
                self._ev0.record(s)
                self._k_pp((1,), (32,), (
                    np.uint64(heap.local_ptr + _PP_OFF), np.uint64(heap.peer_ptrs[peer] + _PP_OFF),
                    np.int32(1 if self.rank == 0 else 0),
                    np.uint32(self._pp_base & 0xFFFFFFFF), np.int32(round_trips),
                    np.int32(warm), np.uint64(self.timeout_ns), status, elapsed), stream=s)
                self._ev1.record(s)
                self._poll(self._ev1, "the ping-pong")
                st = status.get()
                if st[0] != 0:
                    raise RuntimeError(f"ping-pong: rank {self.rank} timed out after {int(st[1])} "
                                       f"of {round_trips} round trips")
                if rep > 0:
                    out.append({"event_us": cupy.cuda.get_elapsed_time(self._ev0, self._ev1) * 1e3,
                                "globaltimer_ns": float(elapsed.get()[0]), "warm": warm})
            self._pp_base += round_trips + 1
        return out if self.rank < 2 else None

    def _pattern(self, src_rank: int, nwords: int):
        cupy = self.cupy
        x = cupy.arange(nwords, dtype=cupy.uint32) * np.uint32(2654435761)
        return x ^ np.uint32((0x9E3779B9 * (src_rank + 1)) & 0xFFFFFFFF)

    def egress_setup(self, slice_bytes: int) -> None:
        """Collective: a heap of ``world_size`` slices; this rank's source filled with a
        pattern."""
        from .symmetric import SymmetricHeap  # noqa: WPS433

        cupy = self.cupy
        heap = SymmetricHeap(self.comm, self.world * slice_bytes, multicast=False)
        # recorded at once, so that egress_release closes the heap on every rank even if a
        # later step of this setup fails here
        self._egress = {"heap": heap, "src": None, "dst": None, "slice": slice_bytes}
        self._egress["src"] = self._pattern(self.rank, slice_bytes // 4)
        self._egress["dst"] = cupy.asarray(np.array(
            [p + self.rank * slice_bytes for p in heap.peer_ptrs], dtype=np.uint64))
        cupy.cuda.runtime.deviceSynchronize()

    def _egress_launch(self, stream, nvec: int, grid: int, block: int) -> None:
        e = self._egress
        src = e["src"] if e else self._bar_peers  # any valid pointer for the empty kernel
        dst = e["dst"] if e else self._bar_peers
        self._k_egress((grid,), (block,), (src, dst, np.int32(self.rank), np.int32(self.world),
                                           np.uint64(nvec)), stream=stream)

    def egress_run(self, samples: int) -> List[float]:
        """Time ``samples`` egress launches (after two warm-up launches); µs each."""
        s = self.stream
        nvec = self._egress["slice"] // 16
        grid, block = self.sm_count * 4, 256
        for _ in range(2):
            self.aligned(s)
            self._egress_launch(s, nvec, grid, block)
        return [self.sample(s, lambda: self._egress_launch(s, nvec, grid, block))
                for _ in range(samples)]

    def egress_check(self) -> int:
        """Words of the peers' slices that differ from their pattern (needs a host barrier
        after :meth:`egress_run` on every rank: the stage boundary is one)."""
        e = self._egress
        n = e["slice"] // 4
        wrong = 0
        for s in range(self.world):
            if s == self.rank:
                continue
            got = e["heap"].view(s * e["slice"], (n,), np.uint32)
            wrong += int(self.cupy.count_nonzero(got != self._pattern(s, n)))
        return wrong

    def egress_release(self) -> None:
        """Collective: close the egress heap."""
        e, self._egress = self._egress, None
        if e is not None:
            self.quiesce()
            e["heap"].close()
        self.free_memory()

    def launch_costs(self, samples: int) -> Dict[str, float]:
        """Median cost of an empty kernel: per eager launch (200 back to back) and per kernel in
        a graph of 20 (10 replays). Local: no cross-rank work besides the barrier."""
        s = self.stream
        launch = lambda: self._egress_launch(s, 0, 1, 32)  # noqa: E731
        eager = [self.sample(s, lambda: [launch() for _ in range(200)]) / 200
                 for _ in range(samples)]
        run, _ = self.capture(s, launch, 20)
        run()
        graph = [self.sample(s, lambda: [run() for _ in range(10)]) / 200
                 for _ in range(samples)]
        return {"launch_eager_us": _stats.median(eager), "launch_graph_us": _stats.median(graph)}


# ----------------------------------------------------------------------------- ceilings
def measure_ceilings(ctx: _Ctx) -> Dict[str, Any]:
    """One-way latency, egress bandwidth and launch costs, measured now (see module doc)."""
    cfg, dev, W = ctx.cfg, ctx.dev, ctx.world
    c: Dict[str, Any] = {"errors": []}
    R = int(cfg["round_trips"])
    try:
        per = _stage(ctx, "ceilings: ping-pong",
                     lambda: dev.pingpong(R, int(cfg["pingpong_repeats"])))
        ev = _stats.max_over_ranks([[x["event_us"] for x in per[0]],
                                    [x["event_us"] for x in per[1]]])
        one_way = [t / (2.0 * R) for t in ev]
        warm = per[0][0]["warm"] if per[0] else 0
        gt = [x["globaltimer_ns"] / 1e3 / (2.0 * (R - warm)) for x in per[0]]
        c.update({"one_way_latency_us": _stats.median(one_way),
                  "one_way_latency_samples_us": one_way,
                  "one_way_latency_globaltimer_us": _stats.median(gt), "round_trips": R})
        ctx.log(f"one-way latency {c['one_way_latency_us']:.3f} us "
                f"(globaltimer {c['one_way_latency_globaltimer_us']:.3f} us)")
    except StageFailed as e:
        c["errors"].append(str(e))
    slice_bytes = int(cfg["egress_slice_bytes"])
    try:
        try:
            _stage(ctx, "ceilings: egress setup", lambda: dev.egress_setup(slice_bytes))
            per = _stage(ctx, "ceilings: egress",
                         lambda: dev.egress_run(int(cfg["egress_samples"])))
            t = _stats.max_over_ranks(per)
            gbps = [(W - 1) * slice_bytes / (x * 1e3) for x in t]
            c.update({"egress_GBps": _stats.median(gbps), "egress_samples_GBps": gbps,
                      "egress_p5_GBps": sorted(gbps)[max(0, math.ceil(0.05 * len(gbps)) - 1)],
                      "egress_slice_bytes": slice_bytes})
            per = _stage(ctx, "ceilings: egress check", dev.egress_check)
            c["egress_wrong"] = int(sum(per))
            if c["egress_wrong"]:
                c["errors"].append(f"egress: {c['egress_wrong']} words landed wrong")
            ctx.log(f"unicast egress {c['egress_GBps']:.1f} GB/s per GPU "
                    f"({_report.fmt_bytes(slice_bytes)} to each of {W - 1} peers), "
                    f"{c['egress_wrong']} wrong words")
        finally:
            _stage(ctx, "ceilings: egress release", dev.egress_release)
    except StageFailed as e:
        c["errors"].append(str(e))
    try:
        per = _stage(ctx, "ceilings: launch cost", lambda: dev.launch_costs(5 if cfg["quick"]
                                                                            else 10))
        c["launch_eager_us"] = max(p["launch_eager_us"] for p in per)
        c["launch_graph_us"] = max(p["launch_graph_us"] for p in per)
        ctx.log(f"empty kernel: {c['launch_eager_us']:.2f} us eager, "
                f"{c['launch_graph_us']:.2f} us in a graph")
    except StageFailed as e:
        c["errors"].append(str(e))
    return c


# ----------------------------------------------------------------------------- cases, inputs
def cases_for(op: str, cfg: Dict[str, Any], world_size: int) -> List[Dict[str, Any]]:
    """The cases (sizes) of ``op``: a geometry each, with its byte counts."""
    g = cfg["geometry"]
    base = {"H": g["H"], "D": g["D"], "D_v": g["D_v"], "D_kv": g["D_kv"], "itemsize": 2}
    out = []
    if op in ("q_gather", "lse_reduce"):
        Ts = cfg["tokens"]
    elif op == "decode_layer":
        Ts = [g["decode_T"]]
    else:
        Ts = None
    if Ts is not None:
        for T in Ts:
            geom = dict(base, T=int(T))
            b = _stats.geometry_bytes(op, geom, world_size)
            out.append({"op": op, "T": int(T), "nominal_bytes": b["bytes_per_rank"],
                        "geom": geom, **b})
        return out
    row_bytes = g["D_kv"] * 2
    for nominal in cfg["kv_sizes"]:
        T = max(1, int(round(nominal / row_bytes)))
        geom = dict(base, T=T)
        b = _stats.geometry_bytes(op, geom, world_size)
        out.append({"op": op, "T": T, "nominal_bytes": int(nominal), "geom": geom, **b})
    return out


def host_inputs(op: str, geom: Dict[str, Any], rank: int, world_size: int, seed: int,
                finite: bool) -> Tuple[Dict[str, np.ndarray], List[Tuple[str, np.ndarray, Any]]]:
    """This rank's inputs of one case and the references of its outputs, on the host.

    Every rank rebuilds every peer's input from ``(seed, peer)`` (:func:`make_inputs`) and keeps
    only its own share of the reference. ``finite=False`` draws lse_reduce inputs with empty and
    non-finite entries (the correctness check); ``finite=True`` draws all-finite ones (timed).
    References: ``("bits", uint view)`` for data movement, ``("close", float32, tol)`` for the
    merge.
    """
    from . import reference as ref  # noqa: WPS433

    W, T = world_size, int(geom["T"])
    dt = ref.resolve_dtype(geom.get("dtype", "bfloat16"))
    u = _uint_dtype(dt.itemsize)
    if op == "q_gather":
        qs = [ref.make_inputs(s, W, seed, op="q_gather", tokens=T, num_heads=geom["H"],
                              head_dim=geom["D"], dtype=dt)["q"] for s in range(W)]
        return {"q": qs[rank]}, [("bits", ref.q_gather_reference(qs).view(u), None)]
    if op == "kv_gather":
        D = int(geom["D_kv"])
        full = np.empty((W * T, D), dtype=dt)
        for s in range(W):
            full[s * T:(s + 1) * T] = ref.make_inputs(s, W, seed, op="kv_gather", tokens=T,
                                                      row_dim=D, dtype=dt)["kv"]
        return {"kv": full[rank * T:(rank + 1) * T].copy()}, [("bits", full.view(u), None)]
    if op == "lse_reduce":
        H, Dv = int(geom["H"]), int(geom["D_v"])
        extra = {"empty_fraction": 0.0, "nonfinite_fraction": 0.0} if finite else {}
        ins = [ref.make_inputs(s, W, seed, op="lse_reduce", tokens=T, num_heads=H, head_dim=Dv,
                               dtype=dt, lse_dtype="float32", **extra) for s in range(W)]
        out, _ = ref.lse_reduce_reference([i["out_partial"] for i in ins],
                                          [i["lse_partial"] for i in ins])
        Hr = H // W
        mine = np.ascontiguousarray(out[:, rank * Hr:(rank + 1) * Hr]).astype(np.float32)
        local = {"out_partial": ins[rank]["out_partial"], "lse_partial": ins[rank]["lse_partial"]}
        return local, [("close", mine, float(ref.lse_reduce_tolerance(dt)))]
    if op == "decode_layer":
        lq, rq = host_inputs("q_gather", geom, rank, W, seed, finite)
        ll, rl = host_inputs("lse_reduce", geom, rank, W, seed + 7919, finite)
        return {**lq, **ll}, rq + rl
    raise ValueError(f"host_inputs: unknown op {op!r}")


# ----------------------------------------------------------------------------- runners
def _construct(cls, *args, **kwargs):
    """``cls(*args, **kwargs)`` keeping only the keyword arguments ``cls`` accepts (the NCCL
    fallbacks take a subset of the direct ops' arguments)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return cls(*args, **kwargs)
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return cls(*args, **kwargs)
    return cls(*args, **{k: v for k, v in kwargs.items() if k in params})


class Runner:
    """One op on one path, for the sweep: built once per op, bound to each case's inputs.

    Interface used by the sweep: :meth:`build` (collective), :meth:`bind` (inputs of a case),
    :meth:`check_outputs` (arrays to poison and pass as ``out=``), :meth:`call`, :meth:`calls`,
    :meth:`capture`, :meth:`close` (collective); attributes ``stream`` (where the calls run and
    events are recorded) and ``launches_per_call``.
    """

    family = "base"

    def __init__(self, ctx: _Ctx, op: str, path: str, max_tokens: int):
        self.ctx, self.op, self.path, self.max_tokens = ctx, op, path, int(max_tokens)
        self.dev = ctx.dev
        self.geom = ctx.cfg["geometry"]
        self.stream = None
        self.launches_per_call: Optional[int] = None
        self.inp: Dict[str, Any] = {}
        self.case: Dict[str, Any] = {}

    # the sweep's interface
    def build(self) -> None:
        raise NotImplementedError

    def bind(self, inp: Dict[str, Any], case: Dict[str, Any], refs=None) -> None:
        self.inp, self.case = inp, case

    def out_specs(self) -> List[Tuple[Tuple[int, ...], Any]]:
        g, W, T = self.geom, self.ctx.world, self.case["T"]
        from .reference import resolve_dtype  # noqa: WPS433

        dt = resolve_dtype(g["dtype"])
        if self.op == "q_gather":
            return [((T, g["H"], g["D"]), dt)]
        if self.op == "kv_gather":
            return [((W * T, g["D_kv"]), dt)]
        if self.op == "lse_reduce":
            return [((T, g["H"] // W, g["D_v"]), dt)]
        raise ValueError(self.op)

    def check_outputs(self):
        return tuple(self.dev.empty(s, d) for s, d in self.out_specs())

    def call(self, outs=None, graph: bool = False):
        raise NotImplementedError

    def enqueue_context(self):
        return self.stream if self.stream is not None else contextlib.nullcontext()

    def calls(self, n: int, graph: bool = False):
        last = None
        with self.enqueue_context():
            for _ in range(n):
                last = self.call(graph=graph)
        return last

    def capture(self, count: int):
        return self.dev.capture(self.stream, lambda: self.call(graph=True), count)

    def close(self) -> None:
        pass


class DirectRunner(Runner):
    """dcpkit's own op (:mod:`dcpkit.ops`): ``direct`` (unicast push), ``direct-pull``
    (kv_gather pull) or ``multicast``. Eager calls use ubatch 0, captured calls ubatch 1, so the
    eager path never pays for a capture (see dcpkit/ops/_workspace.py, "Outputs")."""

    family = "direct"

    def build(self) -> None:
        from .ops import KVGather, LseReduce, QGather  # noqa: WPS433
        from .reference import resolve_dtype  # noqa: WPS433

        ctx, g = self.ctx, self.geom
        dt = resolve_dtype(g["dtype"])
        mc = None if self.path == "multicast" else False
        common = {"max_tokens": self.max_tokens, "dtype": dt, "num_ubatches": 2,
                  "timeout_ms": ctx.cfg["timeout_ms"]}
        if self.op == "q_gather":
            self.obj = QGather(ctx.comm, heads_per_rank=g["H"] // ctx.world, head_dim=g["D"],
                               multicast=mc, **common)
        elif self.op == "kv_gather":
            self.obj = KVGather(ctx.comm, row_dim=g["D_kv"], multicast=mc,
                                algorithm="pull" if self.path == "direct-pull" else "push",
                                **common)
        elif self.op == "lse_reduce":
            self.obj = LseReduce(ctx.comm, num_heads=g["H"], head_dim=g["D_v"], **common)
        else:
            raise ValueError(self.op)
        used_mc = bool(getattr(self.obj, "multicast", False))
        if used_mc != (self.path == "multicast"):
            self.obj.close()
            raise DcpkitError(f"{self.op} {self.path}: the op runs "
                              f"{'multicast' if used_mc else 'unicast'}; this path measures "
                              f"{'multicast' if self.path == 'multicast' else 'unicast'}")
        self.launches_per_call = int(getattr(self.obj, "launches_per_call", 1) or 1)
        self.stream = self.dev.new_stream()

    def call(self, outs=None, graph: bool = False):
        u = 1 if graph else 0
        o = None if outs is None else outs[0]
        if self.op == "q_gather":
            return (self.obj(self.inp["q"], ubatch=u, out=o, stream=self.stream),)
        if self.op == "kv_gather":
            return (self.obj(self.inp["kv"], ubatch=u, out=o, stream=self.stream),)
        return (self.obj(self.inp["out_partial"], self.inp["lse_partial"], ubatch=u, out=o,
                         stream=self.stream),)

    def close(self) -> None:
        obj, self.obj = getattr(self, "obj", None), None
        if obj is not None:
            obj.close()


class NcclRunner(Runner):
    """The NCCL-through-CuPy versions of the ops (:mod:`dcpkit.fallback`); outputs always go
    to buffers allocated at bind time (``out=``), so capture allocates nothing."""

    family = "nccl"

    def build(self) -> None:
        from . import fallback  # noqa: WPS433
        from .reference import resolve_dtype  # noqa: WPS433

        ctx, g = self.ctx, self.geom
        dt = resolve_dtype(g["dtype"])
        common = {"max_tokens": self.max_tokens, "dtype": dt,
                  "timeout_ms": ctx.cfg["timeout_ms"], "nccl_group": ctx.nccl_group}
        if self.op == "q_gather":
            self.obj = _construct(fallback.NcclQGather, ctx.comm,
                                  heads_per_rank=g["H"] // ctx.world, head_dim=g["D"], **common)
        elif self.op == "kv_gather":
            self.obj = _construct(fallback.NcclKVGather, ctx.comm, row_dim=g["D_kv"], **common)
        elif self.op == "lse_reduce":
            # the baseline of the issue: all_to_all + the direct op's combine
            self.obj = _construct(fallback.NcclLseReduce, ctx.comm, num_heads=g["H"],
                                  head_dim=g["D_v"], algorithm="all_to_all", **common)
        else:
            raise ValueError(self.op)
        self.launches_per_call = getattr(self.obj, "launches_per_call", None)
        self.stream = self.dev.new_stream()
        self.outs = None

    def bind(self, inp, case, refs=None) -> None:
        super().bind(inp, case, refs)
        self.outs = None
        self.outs = Runner.check_outputs(self)

    def check_outputs(self):
        return self.outs

    def call(self, outs=None, graph: bool = False):
        o = self.outs if outs is None else outs
        if self.op == "q_gather":
            r = self.obj(self.inp["q"], out=o[0], stream=self.stream)
        elif self.op == "kv_gather":
            r = self.obj(self.inp["kv"], out=o[0], stream=self.stream)
        else:
            r = self.obj(self.inp["out_partial"], self.inp["lse_partial"], out=o[0],
                         stream=self.stream)
        if isinstance(r, tuple):
            r = r[0]
        return (o[0] if r is None else r,)

    def close(self) -> None:
        obj, self.obj = getattr(self, "obj", None), None
        self.outs = None
        if obj is not None and hasattr(obj, "close"):
            obj.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class _TorchEnv:
    """torch.distributed (NCCL) over the same ranks, started by the harness if needed."""

    def __init__(self, ctx: _Ctx, port: int, addr: str):
        import torch  # noqa: WPS433
        import torch.distributed as dist  # noqa: WPS433

        self.torch, self.dist = torch, dist
        torch.cuda.set_device(ctx.dev.device)
        self.owned = False
        if not dist.is_initialized():
            kw = {"backend": "nccl", "init_method": f"tcp://{addr}:{port}",
                  "rank": ctx.rank, "world_size": ctx.world,
                  "timeout": datetime.timedelta(seconds=max(60.0, ctx.cfg["hang_s"]))}
            try:
                dist.init_process_group(device_id=torch.device("cuda", ctx.dev.device), **kw)
            except TypeError:  # torch without device_id
                dist.init_process_group(**kw)
            self.owned = True
        self.nccl_version = None
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            self.nccl_version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)

    def close(self) -> None:
        if self.owned:
            with contextlib.suppress(Exception):
                self.dist.destroy_process_group()
            self.owned = False


class TorchRunner(Runner):
    """torch.distributed NCCL: ``all_gather_into_tensor`` (+ a head-major reorder for
    q_gather), ``all_to_all_single`` of the reordered partial outputs and lse +
    :func:`~dcpkit.ops.lse_reduce.lse_combine` for lse_reduce. Tensors share memory with the
    CuPy inputs through DLPack; outputs are checked through CuPy views of the torch outputs."""

    family = "torch"

    def build(self) -> None:
        env = self.ctx.torch_env
        if env is None:
            raise DcpkitError("torch.distributed is not available in this run")
        self.torch, self.dist = env.torch, env.dist
        self.tstream = self.torch.cuda.Stream(device=self.dev.device)
        self.stream = self.dev.external_stream(self.tstream)
        self.launches_per_call = None

    def enqueue_context(self):
        return self.torch.cuda.stream(self.tstream)

    def _to_torch(self, a):
        torch = self.torch
        if a.dtype.itemsize == 2 and a.dtype != np.float16:
            return torch.from_dlpack(a.view(self.dev.xp.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)

    def _to_cupy(self, t, dtype):
        cupy = self.dev.xp
        if t.dtype == self.torch.bfloat16:
            return cupy.from_dlpack(t.view(self.torch.int16)).view(np.dtype(dtype))
        return cupy.from_dlpack(t)

    def bind(self, inp, case, refs=None) -> None:
        super().bind(inp, case, refs)
        torch = self.torch
        g, W, T = self.geom, self.ctx.world, case["T"]
        dev = torch.device("cuda", self.dev.device)
        spec = self.out_specs()[0]
        self.t = {k: self._to_torch(v) for k, v in inp.items()}
        if self.op == "q_gather":
            Hr, D = g["H"] // W, g["D"]
            self.gathered = torch.empty((W, T, Hr, D), dtype=torch.bfloat16, device=dev)
            self.o_t = torch.empty((T, W, Hr, D), dtype=torch.bfloat16, device=dev)
            self.o_cp = self._to_cupy(self.o_t, spec[1]).reshape(spec[0])
        elif self.op == "kv_gather":
            self.o_t = torch.empty(spec[0], dtype=torch.bfloat16, device=dev)
            self.o_cp = self._to_cupy(self.o_t, spec[1])
        else:
            from .ops.lse_reduce import lse_combine  # noqa: WPS433

            self.lse_combine = lse_combine
            Hr, Dv = g["H"] // W, g["D_v"]
            self.send_o = torch.empty((W, T, Hr, Dv), dtype=torch.bfloat16, device=dev)
            self.recv_o = torch.empty_like(self.send_o)
            self.send_l = torch.empty((W, T, Hr), dtype=torch.float32, device=dev)
            self.recv_l = torch.empty_like(self.send_l)
            self.recv_o_cp = self._to_cupy(self.recv_o, spec[1])
            self.recv_l_cp = self._to_cupy(self.recv_l, np.float32)
            self.o_cp = self.dev.empty(spec[0], spec[1])

    def check_outputs(self):
        return (self.o_cp,)

    def call(self, outs=None, graph: bool = False):
        dist = self.dist
        W, T, g = self.ctx.world, self.case["T"], self.geom
        if self.op == "q_gather":
            dist.all_gather_into_tensor(self.gathered, self.t["q"])
            self.o_t.copy_(self.gathered.transpose(0, 1))
        elif self.op == "kv_gather":
            dist.all_gather_into_tensor(self.o_t, self.t["kv"])
        else:
            Hr = g["H"] // W
            self.send_o.copy_(self.t["out_partial"].view(T, W, Hr, g["D_v"]).transpose(0, 1))
            self.send_l.copy_(self.t["lse_partial"].view(T, W, Hr).transpose(0, 1))
            dist.all_to_all_single(self.recv_o, self.send_o)
            dist.all_to_all_single(self.recv_l, self.send_l)
            self.lse_combine(self.recv_o_cp, self.recv_l_cp, self.o_cp, stream=self.stream)
        return (self.o_cp,)

    def capture(self, count: int):
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        last = None
        with torch.cuda.graph(g, stream=self.tstream):
            for _ in range(count):
                last = self.call(graph=True)

        def launch():
            with torch.cuda.stream(self.tstream):
                g.replay()
        return launch, last

    def close(self) -> None:
        self.t = {}
        for k in ("gathered", "o_t", "send_o", "recv_o", "send_l", "recv_l", "o_cp",
                  "recv_o_cp", "recv_l_cp"):
            setattr(self, k, None)
        with contextlib.suppress(Exception):
            self.torch.cuda.empty_cache()


class DecodeRunner(Runner):
    """The decode layer: q_gather then lse_reduce at the same T, on one stream, one path."""

    def __init__(self, ctx, op, path, max_tokens, make):
        super().__init__(ctx, op, path, max_tokens)
        self.q = make(ctx, "q_gather", path, max_tokens)
        self.l = make(ctx, "lse_reduce", path, max_tokens)
        self.family = self.q.family

    def build(self) -> None:
        self.q.build()
        try:
            self.l.build()
        except BaseException:
            self.q.close()
            raise
        # one stream for both halves
        self.l.stream = self.q.stream
        if hasattr(self.q, "tstream"):
            self.l.tstream = self.q.tstream
        self.stream = self.q.stream
        lq, ll = self.q.launches_per_call, self.l.launches_per_call
        self.launches_per_call = (lq + ll) if (lq and ll) else None

    def bind(self, inp, case, refs=None) -> None:
        super().bind(inp, case, refs)
        self.q.bind({"q": inp["q"]}, dict(case, op="q_gather"), None if refs is None else refs[:1])
        self.l.bind({"out_partial": inp["out_partial"], "lse_partial": inp["lse_partial"]},
                    dict(case, op="lse_reduce"), None if refs is None else refs[1:])

    def check_outputs(self):
        return tuple(self.q.check_outputs()) + tuple(self.l.check_outputs())

    def enqueue_context(self):
        return self.q.enqueue_context()

    def call(self, outs=None, graph: bool = False):
        a = self.q.call(None if outs is None else outs[:1], graph)
        b = self.l.call(None if outs is None else outs[1:], graph)
        return tuple(a) + tuple(b)

    def capture(self, count: int):
        if self.family == "torch":
            torch = self.q.torch
            g = torch.cuda.CUDAGraph()
            last = None
            with torch.cuda.graph(g, stream=self.q.tstream):
                for _ in range(count):
                    last = self.call(graph=True)

            def launch():
                with torch.cuda.stream(self.q.tstream):
                    g.replay()
            return launch, last
        return self.dev.capture(self.stream, lambda: self.call(graph=True), count)

    def close(self) -> None:
        try:
            self.l.close()
        finally:
            self.q.close()


_FAMILIES = {"direct": DirectRunner, "direct-pull": DirectRunner, "multicast": DirectRunner,
             "nccl": NcclRunner, "torch": TorchRunner}


def make_runner(ctx: _Ctx, op: str, path: str, max_tokens: int) -> Runner:
    """The runner of ``op`` on ``path`` (the sweep's default factory)."""
    if op == "decode_layer":
        return DecodeRunner(ctx, op, path, max_tokens, make_runner)
    return _FAMILIES[path](ctx, op, path, max_tokens)


def _multicast_allowed() -> bool:
    try:
        from .multicast import multicast_decision  # noqa: WPS433

        return bool(multicast_decision(None, os.environ, lambda: True)[0])
    except Exception:  # noqa: BLE001 - no guard module: never
        return False


def _local_paths(ctx: _Ctx) -> List[str]:
    """The paths this rank can run (agreed across ranks by the caller)."""
    import importlib.util  # noqa: WPS433

    out = []
    for p in ctx.cfg["paths"]:
        if p == "multicast" and not _multicast_allowed():
            continue
        if p == "torch" and importlib.util.find_spec("torch") is None:
            continue
        out.append(p)
    return out


def paths_for(op: str, paths: Sequence[str]) -> List[str]:
    """The paths that apply to ``op`` (pull is a kv_gather algorithm; lse_reduce has no
    multicast variant)."""
    out = []
    for p in paths:
        if p == "direct-pull" and op != "kv_gather":
            continue
        if p == "multicast" and op in ("lse_reduce", "decode_layer"):
            continue
        out.append(p)
    return out


# ----------------------------------------------------------------------------- the sweep
def _plan(est_us: float, cfg: Dict[str, Any], graph: bool) -> Dict[str, int]:
    """Calls per sample and samples for a call of about ``est_us`` µs: samples of about
    ``sample_target_us``, at most ``mode_budget_s`` per mode (at least 5 samples)."""
    est = max(float(est_us), 0.5)
    target = float(cfg["sample_target_us"])
    if graph:
        K = int(cfg["graph_calls"]) if est <= 1000.0 else max(2, int(20000.0 // est))
        R = max(1, min(10, int(round(target / (K * est)))))
        per_sample = K * R * est
        calls = {"graph_calls": K, "replays": R}
    else:
        n = max(2, min(50, int(round(target / est))))
        per_sample = n * est
        calls = {"calls": n}
    S = int(cfg["iters"])
    S = max(min(S, 5), min(S, int(cfg["mode_budget_s"] * 1e6 // max(per_sample, 1.0))))
    calls["samples"] = S
    return calls


def _check_record(stage: str, per_rank: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    errs = [p.get("max_abs_err") for p in per_rank if p.get("max_abs_err") is not None]
    rels = [p.get("rel_err") for p in per_rank if p.get("rel_err") is not None]
    return {"stage": stage, "wrong": int(sum(p["wrong"] for p in per_rank)),
            "first_bad_by_rank": [p["first_bad"] for p in per_rank],
            "max_abs_err": max(errs) if errs else None, "rel_err": max(rels) if rels else None}


def _new_row(ctx: _Ctx, case: Dict[str, Any], runner: Runner, mode: str) -> Dict[str, Any]:
    return {"op": case["op"], "path": runner.path, "mode": mode, "T": case["T"],
            "nominal_bytes": case["nominal_bytes"], "bytes_per_rank": case["bytes_per_rank"],
            "egress_bytes": case["egress_bytes"], "exchanges": case["exchanges"],
            "geometry": case["geom"], "world_size": ctx.world, "times_us": [],
            "plan": None, "wrong": 0, "checks": [], "error": None,
            "launches_per_call": runner.launches_per_call}


def run_case(ctx: _Ctx, runner: Runner, case: Dict[str, Any], data: Dict[str, Any]
             ) -> Tuple[List[Dict[str, Any]], bool]:
    """Check, then time eager and graph, one path on one case. Returns the rows and whether
    the runner must be rebuilt (a stage failed: the op may be poisoned)."""
    dev, cfg = ctx.dev, ctx.cfg
    rows = {m: _new_row(ctx, case, runner, m) for m in cfg["modes"]}
    label = f"{case['op']} T={case['T']} {runner.path}"
    A, B = data["check"], data["timed"]

    def fail(modes, e):
        for m in modes:
            rows[m]["error"] = str(e)
        return list(rows.values()), True

    # Every step that can fail on one rank only (binding, allocating, capturing) is a stage of
    # its own, before any step in which the ranks wait for each other: a peer that failed
    # there would leave the others waiting inside NCCL, which has no deadline.
    box: Dict[str, Any] = {}

    # 1. correctness on poisoned outputs, fresh inputs with edge cases
    def bind_check():
        runner.bind(A["dev"], case, A["refs"])
        box["outs"] = runner.check_outputs()
        dev.poison(box["outs"])

    def check():
        with runner.enqueue_context():
            res = runner.call(outs=box["outs"])
        dev.wait_stream(runner.stream, f"{label} check")
        return dev.compare(res, A["refs"])

    try:
        _stage(ctx, f"{label}: bind check inputs", bind_check)
        rec = _check_record("check", _stage(ctx, f"{label}: check", check))
    except StageFailed as e:
        return fail(cfg["modes"], e)
    box.clear()
    for r in rows.values():
        r["checks"].append(rec)
        r["wrong"] += rec["wrong"]

    # 2. warm-up on the timed inputs, and an estimate of the time per call (max over ranks)
    def warm():
        runner.calls(3)
        return dev.sample(runner.stream, lambda: runner.calls(5)) / 5

    try:
        _stage(ctx, f"{label}: bind timed inputs", lambda: runner.bind(B["dev"], case, B["refs"]))
        est = max(_stage(ctx, f"{label}: warm-up", warm))
    except StageFailed as e:
        return fail(cfg["modes"], e)

    # 3. eager: n back-to-back calls per sample, host launch included
    if "eager" in rows:
        plan = _plan(est, cfg, graph=False)

        def eager():
            box: List[Any] = []
            times = [dev.sample(runner.stream, lambda: box.append(runner.calls(plan["calls"])))
                     / plan["calls"] for _ in range(plan["samples"])]
            return {"times": times, "check": dev.compare(box[-1], B["refs"])}

        try:
            per = _stage(ctx, f"{label}: eager", eager)
            row = rows["eager"]
            row["times_us"] = _stats.max_over_ranks([p["times"] for p in per])
            row["plan"] = plan
            rec = _check_record("eager, after timing", [p["check"] for p in per])
            row["checks"].append(rec)
            row["wrong"] += rec["wrong"]
        except StageFailed as e:
            return fail(cfg["modes"], e)

    # 4. graph: K calls per graph, R replays per sample; output poisoned before the first replay
    if "graph" in rows:
        plan = _plan(est, cfg, graph=True)

        def capture():
            box["launch"], box["last"] = runner.capture(plan["graph_calls"])
            dev.poison(box["last"])

        def graph():
            launch, last = box["launch"], box["last"]
            launch()
            dev.wait_stream(runner.stream, f"{label} first replay")
            first = dev.compare(last, B["refs"])
            times = [dev.sample(runner.stream, lambda: [launch() for _ in range(plan["replays"])])
                     / (plan["replays"] * plan["graph_calls"]) for _ in range(plan["samples"])]
            final = dev.compare(last, B["refs"])
            return {"times": times, "first": first, "final": final}

        try:
            try:
                _stage(ctx, f"{label}: graph capture", capture)
                per = _stage(ctx, f"{label}: graph", graph)
            finally:
                box.clear()   # drops the graph
            row = rows["graph"]
            row["times_us"] = _stats.max_over_ranks([p["times"] for p in per])
            row["plan"] = plan
            for st, key in (("graph, first replay (poisoned)", "first"),
                            ("graph, after timing", "final")):
                rec = _check_record(st, [p[key] for p in per])
                row["checks"].append(rec)
                row["wrong"] += rec["wrong"]
        except StageFailed as e:
            return fail(["graph"], e)
    return list(rows.values()), False


def _prepare_data(ctx: _Ctx, op: str, case: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """Host inputs and references of both input sets, uploaded (inside a stage)."""
    dev = ctx.dev
    data = {}
    for name, s, finite in (("check", seed, False), ("timed", seed + 1, True)):
        local, refs = host_inputs(op, case["geom"], ctx.rank, ctx.world, s, finite)
        data[name] = {"dev": {k: dev.upload(v) for k, v in local.items()},
                      "refs": [(kind, dev.upload(r), tol) for kind, r, tol in refs]}
    dev.sync_null()
    return data


def _build(ctx: _Ctx, factory, op: str, path: str, max_tokens: int):
    """Build one runner (collective); None and the error when it failed on any rank."""
    runner = factory(ctx, op, path, max_tokens)
    try:
        _stage(ctx, f"{op} {path}: build", runner.build)
        return runner, None
    except StageFailed as e:
        with contextlib.suppress(StageFailed):
            _stage(ctx, f"{op} {path}: cleanup", runner.close)
        return None, str(e)


def _summary_line(rows: Sequence[Dict[str, Any]]) -> str:
    parts = []
    for r in rows:
        if r.get("error"):
            parts.append(f"{r['mode']} ERROR")
        else:
            med = _stats.median(r["times_us"])
            parts.append(f"{r['mode']} {med:.2f} us" if med is not None else f"{r['mode']} -")
    wrong = sum(r.get("wrong") or 0 for r in rows[:1])
    return ", ".join(parts) + f", wrong {wrong}"


def run_op(ctx: _Ctx, op: str, paths: Sequence[str], factory, base_seed: int) -> None:
    """Every case of ``op`` on every path: build the runners once, share each case's inputs."""
    cases = cases_for(op, ctx.cfg, ctx.world)
    if ctx.cfg["geometry"]["H"] % ctx.world and op != "kv_gather":
        ctx.errors.append(f"{op}: H = {ctx.cfg['geometry']['H']} does not divide by "
                          f"world_size {ctx.world}: skipped")
        return
    max_tokens = max(c["T"] for c in cases)
    runners: Dict[str, Optional[Runner]] = {}
    build_err: Dict[str, str] = {}
    for p in paths_for(op, paths):
        runners[p], err = _build(ctx, factory, op, p, max_tokens)
        if err:
            build_err[p] = err
            ctx.log(f"{op} {p}: build failed: {_short(err, 300)}")
    try:
        for ci, case in enumerate(cases):
            seed = base_seed + 1000 * ALL_OPS.index(op) + 2 * ci
            box: Dict[str, Any] = {}
            try:
                _stage(ctx, f"{op} T={case['T']}: inputs",
                       lambda: box.update(_prepare_data(ctx, op, case, seed)))
            except StageFailed as e:
                for p in runners:
                    for m in ctx.cfg["modes"]:
                        ctx.rows.append(dict(_new_row(ctx, case, _Stub(p), m), error=str(e)))
                continue
            for p in list(runners):
                runner = runners[p]
                if runner is None:
                    for m in ctx.cfg["modes"]:
                        ctx.rows.append(dict(_new_row(ctx, case, _Stub(p), m),
                                             error=f"build: {build_err.get(p, 'failed')}"))
                    continue
                try:
                    rows, rebuild = run_case(ctx, runner, case, box)
                except (BenchHang, KeyboardInterrupt):
                    raise
                except Exception as e:  # noqa: BLE001 - a harness bug: same on every rank
                    traceback.print_exc()
                    rows = [dict(_new_row(ctx, case, runner, m),
                                 error=f"harness error: {type(e).__name__}: {e}")
                            for m in ctx.cfg["modes"]]
                    rebuild = True
                ctx.rows.extend(rows)
                ctx.log(f"{op} {_report.fmt_bytes(case['bytes_per_rank'])}/rank T={case['T']} "
                        f"{p}: {_summary_line(rows)}")
                if rebuild:
                    with contextlib.suppress(StageFailed):
                        _stage(ctx, f"{op} {p}: close after failure", runner.close)
                    runners[p], err = _build(ctx, factory, op, p, max_tokens)
                    if err:
                        build_err[p] = err
            box.clear()
            ctx.dev.free_memory()
            ctx.save()
    finally:
        for p, runner in runners.items():
            if runner is not None:
                try:
                    _stage(ctx, f"{op} {p}: close", runner.close)
                except StageFailed as e:
                    ctx.errors.append(str(e))
        ctx.dev.free_memory()


class _Stub:
    """Stands in for a runner that could not be built (for the rows of its errors)."""

    def __init__(self, path: str):
        self.path = path
        self.launches_per_call = None


def _agree_paths(ctx: _Ctx) -> List[str]:
    per = _stage(ctx, "paths", lambda: _local_paths(ctx))
    common = [p for p in per[0] if all(p in q for q in per[1:])]
    dropped = sorted(set(ctx.cfg["paths"]) - set(common))
    if dropped:
        ctx.log(f"paths not run here: {', '.join(dropped)} (multicast only where NOTE "
                f"[dcpkit multicast guard] allows it; torch only where installed)")
    gated = [p for p in common if p in NCCL_PATHS]
    why = _nccl_unavailable(ctx) if gated else None
    if why is not None:
        note = f"n/a (NCCL unavailable: {why})"
        ctx.meta["paths_not_available"] = {p: note for p in gated}
        ctx.log(f"paths not run here: {', '.join(gated)}: {note}")
        common = [p for p in common if p not in gated]
    return common


def _nccl_unavailable(ctx: _Ctx) -> Optional[str]:
    """Collective (one stage): why NCCL cannot start in this group, or None. NCCL refuses two
    ranks of one host on one GPU (``ncclInvalidUsage`` in ``ncclCommInitRank``), a documented
    limit of NCCL: the NCCL paths are then n/a, not failures. A GPU whose bus id cannot be
    read counts as unknown (NCCL is then tried, and a failure is an error as usual)."""
    from .manager import shared_gpu_blocker  # noqa: WPS433

    def mine():
        try:
            bus = ctx.dev.pci_bus_id()
        except Exception:  # noqa: BLE001 - unknown: NCCL is tried as usual
            bus = None
        return ctx.comm.host, bus

    try:
        per = _stage(ctx, "gpus", mine)
    except StageFailed as e:
        ctx.log(f"could not compare the GPUs of the ranks ({_short(e, 200)}): NCCL is tried")
        return None
    return shared_gpu_blocker(hosts=[h for h, _ in per], bus_ids=[b for _, b in per])


def _nccl_group(ctx: _Ctx):
    from .fallback import NcclGroup  # noqa: WPS433

    return NcclGroup(ctx.comm)


def _start_torch(ctx: _Ctx) -> Optional[str]:
    """Start torch.distributed (collective) into ``ctx.torch_env``; an error message or None."""
    box: Dict[str, Any] = {}
    try:
        port = _stage(ctx, "torch: port", lambda: _free_port() if ctx.rank == 0 else None)[0]
        addr = "127.0.0.1"
        if ctx.comm.spans_hosts:
            addr = _stage(ctx, "torch: address", socket.gethostname)[0]
        _stage(ctx, "torch: init",
               lambda: box.__setitem__("env", _TorchEnv(ctx, port, addr)))
    except StageFailed as e:
        env = box.get("env")
        if env is not None:
            env.close()
        return str(e)
    ctx.torch_env = box["env"]
    ctx.meta["torch_nccl"] = ctx.torch_env.nccl_version
    return None


def run_bench(cfg: Dict[str, Any], comm, dev, argv: Sequence[str] = (),
              factory=make_runner) -> int:
    """One benchmark run on an existing group and device (see the module doc).

    Returns 0 when every measured case was correct and nothing failed, 1 otherwise (missed
    targets do not count: they are results). Rank 0 prints the tables, writes the JSON and the
    plot.
    """
    ctx = _Ctx(cfg, comm, dev, argv)
    try:
        return _run(ctx, factory)
    except BenchHang as e:
        msg = f"dcpkit bench: {e}; aborting the job"
        print(msg, file=sys.stderr, flush=True)
        ctx.errors.append(str(e))
        with contextlib.suppress(Exception):
            ctx.save()
        sys.stdout.flush()
        handle = getattr(comm, "handle", None)
        if getattr(comm, "backend", "") == "mpi" and handle is not None:
            handle.Abort(70)
        os._exit(70)


def _run(ctx: _Ctx, factory) -> int:
    cfg = ctx.cfg
    seed = cfg["seed"]
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2 ** 31))
    seed = ctx.comm.broadcast(seed, root=0)
    cfg["seed"] = seed
    ctx.meta = _collect_meta(ctx, ctx.argv)
    ctx.log(f"dcpkit bench: W={ctx.world}, {ctx.meta.get('gpu')}, commit "
            f"{str(ctx.meta.get('commit'))[:12]}, seed {seed} (replay with --seed {seed})")
    try:
        _stage(ctx, "setup", ctx.dev.setup)
    except StageFailed as e:
        ctx.errors.append(str(e))
        ctx.save()
        if ctx.rank == 0:
            print(f"dcpkit bench: setup failed, nothing measured: {e}", file=sys.stderr)
        return 1
    try:
        ctx.ceilings = measure_ceilings(ctx)
    except (BenchHang, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - a harness bug: same on every rank
        traceback.print_exc()
        ctx.ceilings = {"errors": [f"harness error: {type(e).__name__}: {e}"]}
    ctx.save()
    paths = _agree_paths(ctx)
    if "torch" in paths and factory is make_runner:
        err = _start_torch(ctx)
        if err:
            ctx.errors.append(f"torch path disabled: {err}")
            ctx.log(f"torch path disabled: {_short(err, 300)}")
            paths = [p for p in paths if p != "torch"]
    if "nccl" in paths and factory is make_runner:
        box: Dict[str, Any] = {}
        try:
            _stage(ctx, "nccl: group", lambda: box.__setitem__("group", _nccl_group(ctx)))
            ctx.nccl_group = box.get("group")
        except StageFailed as e:
            ctx.log(f"no shared NCCL group ({_short(e, 200)}): each NCCL op makes its own")
            group = box.get("group")
            if group is not None:   # made here but not everywhere: do not keep half a group
                with contextlib.suppress(Exception):
                    group.close()
    try:
        for op in cfg["ops"]:
            run_op(ctx, op, paths, factory, seed)
    finally:
        if ctx.nccl_group is not None:
            with contextlib.suppress(StageFailed):
                _stage(ctx, "nccl: close group", ctx.nccl_group.close)
        env = ctx.torch_env
        if env is not None:
            with contextlib.suppress(StageFailed):
                _stage(ctx, "torch: close", env.close)
        with contextlib.suppress(StageFailed):
            _stage(ctx, "teardown", getattr(ctx.dev, "close", lambda: None))
    res = ctx.result()
    ctx.save()
    if ctx.rank == 0:
        if cfg.get("plot"):
            why = _report.plot_results(res, cfg["plot"])
            print(f"# plot: {why}" if why else f"# plot written to {cfg['plot']}")
        print()
        print(_report.render_ceilings(ctx.ceilings))
        print(_report.render_table(res["rows"]))
        print(_report.render_targets(res["targets"], ctx.world))
        if res["errors"]:
            print("# run errors:")
            for e in res["errors"]:
                print(f"#   {_short(e, 300)}")
        for p, note in (ctx.meta.get("paths_not_available") or {}).items():
            print(f"# path {p}: {_short(note, 300)}")
        wrong = sum(r.get("wrong") or 0 for r in res["rows"])
        failed = sum(1 for r in res["rows"] if r.get("error"))
        print(f"# dcpkit bench: W={ctx.world}, {len(res['rows'])} rows, {failed} failed, "
              f"{wrong} wrong results, {res['elapsed_s']} s"
              + (f", JSON {cfg['json']}" if cfg.get("json") else ""), flush=True)
    bad = any(r.get("error") or r.get("wrong") for r in res["rows"]) or bool(res["errors"]) \
        or bool(ctx.ceilings.get("errors"))
    return 1 if bad else 0


# ----------------------------------------------------------------------------- entry points
def _oserror_text(e: BaseException) -> str:
    """``No such file or directory`` rather than ``[Errno 2] No such file or directory: 'x'``."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"


def _render_md_fail(message: str) -> int:
    print(f"dcpkit bench: --render-md: {message}", file=sys.stderr)
    return 2


def render_md_main(args: argparse.Namespace) -> int:
    """``--render-md``: BENCHMARKS.md from JSON files (no GPU, no MPI).

    Returns 0, or 2 with one line on stderr (no traceback) when an input cannot be read or is
    not a ``dcpkit bench --json`` result, or the output cannot be written.
    """
    results, plots = [], {}
    out_dir = os.path.dirname(os.path.abspath(args.md_out)) if args.md_out else os.getcwd()
    if args.md_out:
        if os.path.isdir(args.md_out):
            return _render_md_fail(f"cannot write --md-out {args.md_out}: it is a directory")
        if not os.path.isdir(out_dir):
            return _render_md_fail(f"cannot write --md-out {args.md_out}: directory {out_dir} "
                                   f"does not exist")
    for path in args.render_md:
        try:
            with open(path, encoding="utf-8") as f:
                res = json.load(f)
        except (OSError, UnicodeDecodeError) as e:
            return _render_md_fail(f"cannot read {path}: {_oserror_text(e)}")
        except ValueError as e:  # json.JSONDecodeError
            return _render_md_fail(f"{path} is not JSON ({e})")
        if not isinstance(res, dict):
            return _render_md_fail(f"{path} must hold one {SCHEMA} JSON object (got a JSON "
                                   f"{type(res).__name__})")
        if res.get("schema") != SCHEMA:
            print(f"dcpkit bench: {path} is not a {SCHEMA} JSON (schema "
                  f"{res.get('schema')!r})", file=sys.stderr)
            return 2
        results.append(res)
        png = os.path.splitext(path)[0] + ".png"
        W = (res.get("meta") or {}).get("world_size") if isinstance(res.get("meta"), dict) \
            else None
        if os.path.isfile(png) and W is not None:
            plots[W] = os.path.relpath(os.path.abspath(png), out_dir)
    notes = None
    if args.notes:
        try:
            with open(args.notes, encoding="utf-8") as f:
                notes = f.read()
        except (OSError, UnicodeDecodeError) as e:
            return _render_md_fail(f"cannot read --notes {args.notes}: {_oserror_text(e)}")
    try:
        md = _report.render_markdown(results, notes=notes, plots=plots, sources=args.render_md)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        # name the file that does not render on its own, if one does not
        bad = list(args.render_md)
        for path, res in zip(args.render_md, results):
            try:
                _report.render_markdown([res], sources=[path])
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):
                bad = [path]
                break
        return _render_md_fail(f"{' '.join(bad)} is a malformed {SCHEMA} JSON "
                               f"({type(e).__name__}: {e})")
    if args.md_out:
        try:
            with open(args.md_out, "w", encoding="utf-8") as f:
                f.write(md)
        except OSError as e:
            return _render_md_fail(f"cannot write --md-out {args.md_out}: {_oserror_text(e)}")
        print(f"dcpkit bench: wrote {args.md_out} from {len(results)} run(s)")
    else:
        sys.stdout.write(md)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``dcpkit bench`` (``python -m dcpkit bench`` / ``python -m dcpkit.bench``); returns the
    exit status: 0 all correct, 1 errors or wrong results, 2 usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.render_md:
        return render_md_main(args)
    try:
        cfg = resolve_config(args)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    from .comm import Communicator  # noqa: WPS433

    comm = Communicator.from_mpi()
    if comm.world_size < 2:
        print("dcpkit bench: needs at least 2 ranks (one per GPU): run it under "
              "mpirun -np N python -m dcpkit bench, N >= 2", file=sys.stderr)
        return 2
    try:
        dev = CupyDevice(comm, cfg)
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver, no GPU: say so, no traceback
        # Without libcuda CuPy says cudaErrorInsufficientDriver (a version mismatch): name the
        # real cause with dcpkit info's driver probe.
        from .info import no_driver_reason  # noqa: WPS433

        why = no_driver_reason() or f"{type(e).__name__}: {e}"
        print(f"dcpkit bench: rank {comm.rank}: no usable GPU ({why}); the benchmark needs one "
              f"GPU per rank", file=sys.stderr)
        return 2
    return run_bench(cfg, comm, dev, argv)


if __name__ == "__main__":
    sys.exit(main())
