"""The peer measured beside dcpkit: NVSHMEM's own on-stream collectives through nvshmem4py
(path ``nvshmem``), in the same run, cases and modes as dcpkit's rows.

* q_gather: ``fcollect`` of this rank's ``[T, H_r, D]`` into ``[W, T, H_r, D]``, then the
  reorder into the op's ``[T, H, D]`` (what a caller of fcollect must add);
* kv_gather: ``fcollect`` of ``[T, D_kv]`` into ``[W*T, D_kv]`` (already the op's layout);
* lse_reduce: the head-major reorder of ``out_partial`` and ``lse_partial`` into per-destination
  blocks, two ``alltoall`` (bf16 outputs, float32 lse), then :func:`dcpkit.ops.lse_combine`.

NVSHMEM is initialised from the run's Communicator by :class:`dcpkit.SymmetricHeap` with
``backend="nvshmem"`` (dcpkit/_nvshmem.py), which also allocates the symmetric buffers the
collectives need; the inputs are copied into them at bind time (a caller would produce them
there). The collectives are called through ``nvshmem.bindings`` with explicit element counts.

Where ranks share a GPU under MPS, NVSHMEM's on-stream collectives abort the process ("not
supported with limited MPG") unless each rank's share is set: the runner refuses to start then
(an error row naming ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/W``), so the run goes on.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import DcpkitError
from .runners import Runner

__all__ = ["NvshmemRunner", "mps_share_problem", "finalize_nvshmem"]

_MPS_VARS = (
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
)


def mps_share_problem(shared_gpu, world_size: int, env=os.environ):
    """Why NVSHMEM's on-stream collectives cannot run here, or None."""
    if shared_gpu and not any(env.get(v) for v in _MPS_VARS):
        return (
            f"ranks share a GPU and neither CUDA_MPS_ACTIVE_THREAD_PERCENTAGE nor "
            f"NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set: NVSHMEM's on-stream "
            f"collectives would abort the process ('not supported with limited MPG'); set "
            f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // max(1, world_size)} for every rank"
        )
    return None


def finalize_nvshmem(comm) -> bool:
    """End NVSHMEM if this run started it (collective); False when it was not running."""
    from .. import _nvshmem

    if not all(comm.allgather(_nvshmem.is_initialized())):
        return False
    return _nvshmem.finalize(comm)


def _ptr(a) -> int:
    """The device address of a CuPy array (the host address of a NumPy one, for tests)."""
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    return int(a.data.ptr)


class NvshmemRunner(Runner):
    """One op on NVSHMEM's collectives (see the module doc). One symmetric heap per case size,
    allocated at bind time (NVSHMEM's symmetric heap, ``NVSHMEM_SYMMETRIC_SIZE``, bounds it: a
    case that does not fit is an error row, the smaller ones still run)."""

    family = "nvshmem"

    def build(self) -> None:
        from .. import _nvshmem

        why = mps_share_problem(getattr(self.ctx, "shared_gpu", None), self.ctx.world)
        if why:
            raise DcpkitError(f"nvshmem: {why}")
        self.nv = _nvshmem.load()
        import nvshmem.bindings as bindings

        self.bindings = bindings
        self.team = self.nv.Teams.TEAM_WORLD
        self.stream = self.dev.new_stream()
        self.heap = None
        self.heap_T = None
        self.launches_per_call = None

    def _coll(self, name: str, dtype: str, dst, src, nelems: int) -> None:
        fn = getattr(self.bindings, f"{dtype}_{name}_on_stream")
        rc = fn(
            self.team, _ptr(dst), _ptr(src), int(nelems), int(getattr(self.stream, "ptr", 0) or 0)
        )
        if rc:
            raise DcpkitError(f"nvshmem: {dtype}_{name}_on_stream returned {rc}")

    def _heap(self, nbytes: int):
        from ..symmetric import SymmetricHeap

        T = self.case["T"]
        if self.heap is not None and self.heap_T == T:
            return self.heap
        if self.heap is not None:
            self.dev.quiesce()
            self.heap.close()
            self.heap = None
        self.heap = SymmetricHeap(
            self.ctx.comm, -(-nbytes // 4096) * 4096, backend="nvshmem", multicast=False
        )
        self.heap_T = T
        return self.heap

    def bind(self, inp, case, refs=None) -> None:
        super().bind(inp, case, refs)
        from ..reference import resolve_dtype

        g, W, T = self.geom, self.ctx.world, int(case["T"])
        dt = resolve_dtype(g["dtype"])
        isz = dt.itemsize
        self.v: dict[str, Any] = {}
        if self.op in ("q_gather", "kv_gather"):
            row = (g["H"] // W) * g["D"] if self.op == "q_gather" else g["D_kv"]
            n = T * row
            heap = self._heap((W + 1) * n * isz)
            self.v["src"] = heap.view(0, (n,), np.uint16)
            self.v["dst"] = heap.view(n * isz, (W * n,), np.uint16)
            key = "q" if self.op == "q_gather" else "kv"
            self.v["src"][...] = inp[key].view(np.uint16).reshape(-1)
            self.n = n
            if self.op == "q_gather":
                self.out = self.dev.empty((T, g["H"], g["D"]), dt)
                # reorders move 16-bit words: no reliance on bfloat16 kernels of the array library
                self.out_u = self.out.view(np.uint16).reshape(T, W, g["H"] // W, g["D"])
                self.gathered = self.v["dst"].reshape(W, T, g["H"] // W, g["D"])
            else:
                self.out = self.v["dst"].view(dt).reshape(W * T, g["D_kv"])
        else:
            Hr, Dv = g["H"] // W, g["D_v"]
            no, nl = W * T * Hr * Dv, W * T * Hr
            off_ro = no * isz
            off_sl = 2 * no * isz
            off_rl = off_sl + nl * 4
            heap = self._heap(off_rl + nl * 4)
            self.v["send_o"] = heap.view(0, (W, T, Hr, Dv), np.uint16)
            self.v["recv_o"] = heap.view(off_ro, (W, T, Hr, Dv), dt)
            self.v["send_l"] = heap.view(off_sl, (W, T, Hr), np.float32)
            self.v["recv_l"] = heap.view(off_rl, (W, T, Hr), np.float32)
            self.o_in = inp["out_partial"].view(np.uint16).reshape(T, W, Hr, Dv)
            self.l_in = inp["lse_partial"].reshape(T, W, Hr)
            self.out = self.dev.empty((T, Hr, Dv), dt)
            from ..ops.lse_reduce import lse_combine

            self.lse_combine = lse_combine
            self.no, self.nl = T * Hr * Dv, T * Hr
        self.dev.sync_null()

    def check_outputs(self):
        return (self.out,)

    def call(self, outs=None, graph: bool = False):
        v = self.v
        with self.enqueue_context():
            if self.op in ("q_gather", "kv_gather"):
                self._coll("fcollect", "bfloat16", v["dst"], v["src"], self.n)
                if self.op == "q_gather":
                    self.out_u[...] = self.gathered.transpose(1, 0, 2, 3)
            else:
                v["send_o"][...] = self.o_in.transpose(1, 0, 2, 3)
                v["send_l"][...] = self.l_in.transpose(1, 0, 2)
                self._coll("alltoall", "bfloat16", v["recv_o"], v["send_o"], self.no)
                self._coll("alltoall", "float", v["recv_l"], v["send_l"], self.nl)
                self.lse_combine(v["recv_o"], v["recv_l"], self.out, stream=self.stream)
        return (self.out,)

    def close(self) -> None:
        heap, self.heap = getattr(self, "heap", None), None
        self.v = {}
        if heap is not None:
            self.dev.quiesce()
            heap.close()
