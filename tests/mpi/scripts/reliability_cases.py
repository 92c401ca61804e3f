"""Op cases shared by the reliability tests, their subprocess scripts and ``scripts/soak.py``.

An :class:`OpCase` builds one direct op with a small test geometry, makes every rank's seeded
inputs (:func:`dcpkit.reference.make_inputs`), calls the op, and checks this rank's result
against the NumPy reference: bit for bit for the gathers, with
:func:`dcpkit.reference.lse_reduce_tolerance` for ``lse_reduce``. A failed check returns a
message naming the op, rank, T, dtype and the first mismatching index.

Also here: launching bounded MPI jobs from a test (:func:`find_mpirun`, :func:`mpirun_command`,
:func:`job_env`, :func:`run_job`), used by ``tests/gpu``.

Nothing in this module makes a collective call on its own except the op constructors and the
op calls, which every rank makes in the same order.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPTS_DIR = Path(__file__).resolve().parent

try:  # scripts started as `python tests/mpi/scripts/x.py` from a checkout without an install
    import dcpkit  # noqa: F401
except ImportError:  # pragma: no cover - depends on how the job was started
    sys.path.insert(0, str(REPO_ROOT))

from dcpkit.reference import (  # noqa: E402
    kv_gather_reference,
    lse_reduce_reference,
    lse_reduce_tolerance,
    make_inputs,
    q_gather_reference,
    resolve_dtype,
)

OPS = ("lse_reduce", "q_gather", "kv_gather")

#: Test geometry: heads per rank, head dim (q), KV row width, output head dim (lse_reduce).
H_R, HEAD_DIM, ROW_DIM, HEAD_DIM_V = 2, 64, 256, 64

#: Variables that keep multicast off on shared machines: never cleared, also not for children.
KILL_SWITCHES = (
    "NCCL_NVLS_ENABLE",
    "NVSHMEM_DISABLE_NVLS",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "DCPKIT_DISABLE_MULTICAST",
)


def bits_dtype(dt: np.dtype) -> np.dtype:
    """The unsigned integer dtype of the same size (to move and compare raw bits)."""
    return np.dtype(f"u{np.dtype(dt).itemsize}")


def to_device(h: np.ndarray, dtype=None):
    """Upload a host array; bfloat16 and other ml_dtypes travel as raw bits, then are viewed."""
    import cupy

    h = np.ascontiguousarray(h)
    dt = np.dtype(dtype) if dtype is not None else h.dtype
    if dt.kind in "biuf" and dt.type.__module__ == "numpy":
        return cupy.asarray(h)
    return cupy.asarray(h.view(bits_dtype(dt))).view(dt)


def to_host(d, dtype=None) -> np.ndarray:
    """Download a GPU array (any strides) as a NumPy array of its dtype (raw bits preserved)."""
    dt = np.dtype(dtype) if dtype is not None else np.dtype(d.dtype)
    return d.view(bits_dtype(dt)).get().view(dt)


def poison(arr, stream=None) -> None:
    """Fill a contiguous GPU array with 0xFF bytes (NaN for floats) on ``stream``."""
    if arr.size:
        arr.data.memset_async(0xFF, arr.nbytes, stream)


def first_mismatch(bad: np.ndarray) -> tuple | None:
    idx = np.argwhere(bad)
    return None if idx.size == 0 else tuple(int(i) for i in idx[0])


class OpCase:
    """One direct op with the test geometry, its inputs, reference and check.

    Parameters
    ----------
    name : {"lse_reduce", "q_gather", "kv_gather"}
    comm : dcpkit.Communicator
    max_tokens, dtype, num_ubatches, timeout_ms, heap : passed to the op constructor.
    algorithm : kv_gather algorithm ("push" or "pull").
    num_requests : S of the lse_reduce masks (0: no ``seq_lens`` / ``query_start_loc``).
    **op_kwargs : further constructor keywords (``graph_outputs``, ``waiter_ctas``, ...).

    Collective: construction and :meth:`call`.
    """

    def __init__(
        self,
        name: str,
        comm,
        *,
        max_tokens: int = 16,
        dtype="bfloat16",
        num_ubatches: int = 1,
        timeout_ms: float | None = None,
        heap=None,
        algorithm: str = "push",
        num_requests: int = 0,
        **op_kwargs,
    ):
        from dcpkit.ops import KVGather, LseReduce, QGather

        if name not in OPS:
            raise ValueError(f"OpCase: name must be one of {OPS} (got {name!r})")
        self.name = name
        self.comm = comm
        self.W = comm.world_size
        self.rank = comm.rank
        self.max_tokens = max_tokens
        self.dtype = resolve_dtype(dtype)
        self.num_requests = num_requests if name == "lse_reduce" else 0
        self.label = name if name != "kv_gather" else f"kv_gather[{algorithm}]"
        if name == "lse_reduce":
            self.op = LseReduce(
                comm,
                max_tokens=max_tokens,
                num_heads=H_R * self.W,
                head_dim=HEAD_DIM_V,
                dtype=self.dtype,
                num_ubatches=num_ubatches,
                timeout_ms=timeout_ms,
                heap=heap,
                **op_kwargs,
            )
        elif name == "q_gather":
            self.op = QGather(
                comm,
                max_tokens=max_tokens,
                heads_per_rank=H_R,
                head_dim=HEAD_DIM,
                dtype=self.dtype,
                num_ubatches=num_ubatches,
                timeout_ms=timeout_ms,
                heap=heap,
                **op_kwargs,
            )
        else:
            self.op = KVGather(
                comm,
                max_tokens=max_tokens,
                row_dim=ROW_DIM,
                dtype=self.dtype,
                num_ubatches=num_ubatches,
                algorithm=algorithm,
                timeout_ms=timeout_ms,
                heap=heap,
                **op_kwargs,
            )

    # ------------------------------------------------------------------ inputs
    def host_inputs(self, seed: int, T: int, rank: int | None = None) -> dict:
        """Rank ``rank``'s (default: this rank's) host inputs for ``T`` tokens."""
        r = self.rank if rank is None else rank
        if self.name == "lse_reduce":
            return make_inputs(
                r,
                self.W,
                seed,
                op="lse_reduce",
                tokens=T,
                num_heads=H_R * self.W,
                head_dim=HEAD_DIM_V,
                dtype=self.dtype,
                num_requests=self.num_requests,
            )
        if self.name == "q_gather":
            return make_inputs(
                r,
                self.W,
                seed,
                op="q_gather",
                tokens=T,
                num_heads=H_R * self.W,
                head_dim=HEAD_DIM,
                dtype=self.dtype,
            )
        return make_inputs(
            r, self.W, seed, op="kv_gather", tokens=T, row_dim=ROW_DIM, dtype=self.dtype
        )

    def all_host_inputs(self, seed: int, T: int) -> list[dict]:
        return [self.host_inputs(seed, T, r) for r in range(self.W)]

    def upload(self, host: dict) -> dict:
        """Device copies of one rank's inputs (``None`` stays ``None``)."""
        return {k: (None if v is None else to_device(v)) for k, v in host.items()}

    def expected(self, all_host: Sequence[dict]) -> np.ndarray:
        """This rank's reference result (host array; float64 for lse_reduce)."""
        if self.name == "q_gather":
            return q_gather_reference([h["q"] for h in all_host])
        if self.name == "kv_gather":
            return kv_gather_reference([h["kv"] for h in all_host])
        qsl = all_host[0]["query_start_loc"]
        seq = None if qsl is None else [h["seq_lens"] for h in all_host]
        out, _ = lse_reduce_reference(
            [h["out_partial"] for h in all_host],
            [h["lse_partial"] for h in all_host],
            seq_lens=seq,
            query_start_loc=qsl,
        )
        return out[:, self.rank * H_R : (self.rank + 1) * H_R]

    def prepare(self, seed: int, T: int):
        """``(device inputs of this rank, expected result)`` for a fresh seeded input."""
        all_host = self.all_host_inputs(seed, T)
        return self.upload(all_host[self.rank]), self.expected(all_host)

    # ------------------------------------------------------------------ calls
    def out_shape(self, T: int) -> tuple:
        if self.name == "q_gather":
            return (T, H_R * self.W, HEAD_DIM)
        if self.name == "kv_gather":
            return (self.W * T, ROW_DIM)
        return (T, H_R, HEAD_DIM_V)

    def poisoned_out(self, T: int, stream=None):
        """A fresh output array for ``T`` tokens, filled with 0xFF bytes."""
        import cupy

        with cupy.cuda.Device(self.op.device):
            out = cupy.empty(self.out_shape(T), dtype=self.dtype)
        poison(out, stream)
        return out

    def call(self, dev: dict, *, ubatch: int = 0, out=None, stream=None):
        """One collective call of the op on ``dev`` (from :meth:`upload`)."""
        if self.name == "lse_reduce":
            return self.op(
                dev["out_partial"],
                dev["lse_partial"],
                seq_lens=dev.get("seq_lens"),
                query_start_loc=dev.get("query_start_loc"),
                ubatch=ubatch,
                out=out,
                stream=stream,
            )
        if self.name == "q_gather":
            return self.op(dev["q"], ubatch=ubatch, out=out, stream=stream)
        return self.op(dev["kv"], ubatch=ubatch, out=out, stream=stream)

    # ------------------------------------------------------------------ checks
    def check(self, got, expected: np.ndarray, what: str = "", *, xor: int = 0) -> str | None:
        """``None`` when ``got`` (GPU or host array) matches ``expected``, else a message.

        ``xor``: the gathers' inputs were XOR-ed with this value (raw bits); so is the result.
        """
        host = got if isinstance(got, np.ndarray) else to_host(got, self.dtype)
        T = expected.shape[0] // self.W if self.name == "kv_gather" else expected.shape[0]
        where = f"{self.label} rank {self.rank}/{self.W} T={T} dtype={self.dtype} {what}"
        if host.shape != expected.shape:
            return f"{where}: result shape {host.shape} != expected {expected.shape}"
        if self.name != "lse_reduce":
            bt = bits_dtype(self.dtype)
            g = host.view(bt)
            e = np.ascontiguousarray(expected).view(bt) ^ bt.type(xor)
            bad = g != e
            idx = first_mismatch(bad)
            if idx is None:
                return None
            return (
                f"{where}: {int(bad.sum())} of {bad.size} elements differ (bit-exact check); "
                f"first at index {idx}: got bits {int(g[idx]):#x}, expected {int(e[idx]):#x}"
            )
        g = host.astype(np.float64)
        tol = lse_reduce_tolerance(self.dtype)
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(g) & (np.abs(g - expected) <= tol * (1.0 + np.abs(expected))))
        idx = first_mismatch(bad)
        if idx is None:
            return None
        return (
            f"{where}: {int(bad.sum())} of {bad.size} elements off by more than "
            f"{tol:g}*(1+|ref|); first at index {idx}: got {g[idx]!r}, "
            f"expected {expected[idx]!r}"
        )


def gather_failures(comm, msg: str | None) -> list[str]:
    """Collective: every rank's failure message (``None`` = ok), as ``"rank r: msg"`` lines."""
    msgs = comm.allgather(msg)
    return [f"rank {r}: {m}" for r, m in enumerate(msgs) if m]


def set_device(comm, offset: int = 0) -> int:
    """Select this rank's GPU: ``(offset + local_rank) % device_count``; returns it."""
    import cupy

    dev = (offset + comm.local_rank) % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    return dev


def context_usable() -> str | None:
    """Allocate and run unrelated kernels on the current GPU; ``None`` when they work."""
    import cupy

    try:
        s = int(cupy.arange(10).sum())
        x = cupy.ones((1 << 20,), dtype=cupy.float32)
        t = float((x * 2).sum())
        cupy.cuda.get_current_stream().synchronize()
    except Exception as e:  # noqa: BLE001 - reported as the failure
        return f"CUDA context not usable: {type(e).__name__}: {e}"
    if s != 45 or t != 2.0 * (1 << 20):
        return f"CUDA context gave wrong results: arange(10).sum()={s}, sum(2*ones)={t}"
    return None


def write_line(path, text: str) -> None:
    """Append one line to ``path`` and force it to disk (survives an os._exit right after)."""
    with open(path, "a") as f:
        f.write(text.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------- launching jobs
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_", "MPI_LOCAL")
# Settings of the MPI installation (e.g. OMPI_MCA_plm_rsh_agent on machines without ssh) are
# not state of an enclosing job: they are kept.
_KEEP_PREFIXES = ("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")


def find_mpirun() -> str | None:
    """The MPI launcher for this Python's mpi4py: ``DCPKIT_MPIRUN``, else ``mpirun`` /
    ``mpiexec`` next to the interpreter, else on ``PATH``."""
    env = os.environ.get("DCPKIT_MPIRUN")
    if env:
        return env
    bindir = Path(sys.executable).parent
    for name in ("mpirun", "mpiexec"):
        cand = bindir / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            return found
    return None


def mpi_flavor(exe: str) -> str:
    try:
        v = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "other"
    low = (v.stdout + v.stderr).lower()
    if "open mpi" in low or "openrte" in low or "open rte" in low:
        return "openmpi"
    if "hydra" in low or "mpich" in low:
        return "mpich"
    return "other"


def mpirun_command(
    exe: str, flavor: str, n: int, args: Sequence[str], *, tolerate_death: bool = False
) -> list[str]:
    """``mpirun -np n python args...``. ``tolerate_death``: a rank that exits early does not
    get its peers killed at once (Open MPI: 5 s before SIGTERM, 10 s before SIGKILL; MPICH:
    no automatic cleanup), so survivors can report."""
    cmd = [exe]
    if flavor == "openmpi":
        cmd += ["--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if tolerate_death:
            cmd += ["--mca", "odls_base_sigkill_timeout", "4"]
    elif flavor == "mpich" and tolerate_death:
        cmd.append("-disable-auto-cleanup")
    return cmd + ["-np", str(n), sys.executable, *args]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child job: unchanged, except that the variables of an
    enclosing MPI launcher are dropped (so the child mpirun starts a fresh job) and the dcpkit
    this process imports is put first on PYTHONPATH. The multicast kill switches stay set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) or k.startswith(_KEEP_PREFIXES)
    }
    import dcpkit as _d

    root = str(Path(_d.__file__).resolve().parent.parent)
    parts = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    if extra:
        env.update(extra)
    for k in KILL_SWITCHES:
        assert env.get(k) == os.environ.get(k), f"job_env must keep {k} as it is"
    return env


class Job:
    """A started MPI job (its own session, so a hang can be killed as a group)."""

    def __init__(self, cmd: list[str], *, env: dict[str, str], cwd, log_prefix: Path):
        self.cmd = cmd
        self.t0 = time.monotonic()
        self.out_path = Path(str(log_prefix) + ".stdout")
        self.err_path = Path(str(log_prefix) + ".stderr")
        self._out = open(self.out_path, "w")
        self._err = open(self.err_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=str(cwd),
            env=env,
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.returncode: int | None = None
        self.timed_out = False
        self.wall_s = 0.0

    def wait(self, timeout_s: float) -> Job:
        """Wait up to ``timeout_s`` seconds from the start; kill the whole group past it."""
        left = max(0.0, timeout_s - (time.monotonic() - self.t0))
        try:
            self.returncode = self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.returncode = self.proc.wait()
        self.wall_s = time.monotonic() - self.t0
        self._out.close()
        self._err.close()
        return self

    def output(self, limit: int = 6000) -> str:
        out = self.out_path.read_text(errors="replace")
        err = self.err_path.read_text(errors="replace")
        return (
            f"$ {' '.join(self.cmd)}\nreturn code {self.returncode}, "
            f"{self.wall_s:.1f} s{' (KILLED: timed out)' if self.timed_out else ''}\n"
            f"--- stdout (last {limit} chars)\n{out[-limit:]}\n"
            f"--- stderr (last {limit} chars)\n{err[-limit:]}"
        )
