"""Helpers of tests/mpi/test_fallback.py, test_manager.py and test_torch_interop.py.

Checks return a message (or '') instead of asserting, so that every rank finishes all its
collective calls; :func:`run_all_ranks` then agrees across ranks and asserts once, naming every
failing rank with its first problems (rank, case, first mismatching index).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dcpkit.reference import (
    kv_gather_reference,
    lse_reduce_reference,
    lse_reduce_tolerance,
    make_inputs,
    merged_lse_matches,
    q_gather_reference,
    resolve_dtype,
)

MAX_REPORTED = 6


def run_all_ranks(comm, what: str, body: Callable[[list[str]], None]) -> None:
    """Run ``body(errors)`` on every rank (an exception becomes an error), then agree and
    assert. Every rank reaches the agreement even if its body raised."""
    errors: list[str] = []
    try:
        body(errors)
    except Exception as e:  # noqa: BLE001 - reported together with the other ranks below
        errors.append(f"raised {type(e).__name__}: {e}")
    errors = [e for e in errors if e]
    shown = errors[:MAX_REPORTED] + (
        [f"... {len(errors) - MAX_REPORTED} more"] if len(errors) > MAX_REPORTED else []
    )
    every = comm.allgather(shown)
    bad = {r: e for r, e in enumerate(every) if e}
    assert not bad, (
        f"{what} (world_size {comm.world_size}) failed on ranks {sorted(bad)}:\n"
        + "\n".join(f"  rank {r}: " + "\n          ".join(e) for r, e in sorted(bad.items()))
    )


def sub_seed(seed: int, *keys: int) -> int:
    return int(np.random.SeedSequence([int(seed)] + [int(k) for k in keys]).generate_state(1)[0])


def bits(x):
    """``x`` viewed as unsigned integers of its item size (bf16 / fp8 safe copies)."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def to_gpu(a: np.ndarray):
    import cupy

    a = np.ascontiguousarray(a)
    return cupy.asarray(bits(a)).view(a.dtype)


def to_host(x) -> np.ndarray:
    import cupy

    return cupy.asnumpy(bits(x)).view(x.dtype)


def poison(x) -> None:
    """All bits set: NaN in every float dtype."""
    b = bits(x)
    b.fill(np.iinfo(b.dtype).max)


def empty_poisoned(shape, dtype):
    import cupy

    dt = resolve_dtype(dtype)
    x = cupy.empty(shape, dtype=f"u{dt.itemsize}").view(dt)
    poison(x)
    return x


def poison_nccl_outputs(op) -> None:
    """Poison every workspace output buffer of an NCCL op (eager 0/1 and graph)."""
    for per_ubatch in op._outs:
        for buf in per_ubatch:
            buf.fill(0xFF)
    for per_ubatch in getattr(op, "_lse_outs", []) or []:
        for buf in per_ubatch:
            buf.fill(0xFF)


def first_diff(got: np.ndarray, want: np.ndarray) -> str:
    gb, wb = bits(np.ascontiguousarray(got)), bits(np.ascontiguousarray(want))
    if gb.shape != wb.shape:
        return f"shape {gb.shape}, expected {wb.shape}"
    bad = gb != wb
    if not bad.any():
        return ""
    i = tuple(int(v) for v in np.argwhere(bad)[0])
    return (
        f"{int(bad.sum())} of {bad.size} elements differ; first at {i}: got bits "
        f"{int(gb[i]):#x}, expected {int(wb[i]):#x}"
    )


# ----------------------------------------------------------------------------- cases
class QCase:
    def __init__(self, comm, seed, *, T, H_r, D, dtype):
        W = comm.world_size
        self.qs = [
            make_inputs(
                s, W, seed, op="q_gather", tokens=T, num_heads=H_r * W, head_dim=D, dtype=dtype
            )["q"]
            for s in range(W)
        ]
        self.q = self.qs[comm.rank]
        self.ref = q_gather_reference(self.qs)
        self.what = f"q_gather T={T} H_r={H_r} D={D} dtype={dtype}"

    def check(self, rank, res, where="") -> str:
        d = first_diff(to_host(res), self.ref)
        return f"rank {rank}, {self.what} {where}: {d}" if d else ""


class KVCase:
    def __init__(self, comm, seed, *, T, D, dtype):
        W = comm.world_size
        self.kvs = [
            make_inputs(s, W, seed, op="kv_gather", tokens=T, row_dim=D, dtype=dtype)["kv"]
            for s in range(W)
        ]
        self.kv = self.kvs[comm.rank]
        self.ref = kv_gather_reference(self.kvs)
        self.what = f"kv_gather T={T} D_kv={D} dtype={dtype}"

    def check(self, rank, res, where="") -> str:
        d = first_diff(to_host(res), self.ref)
        return f"rank {rank}, {self.what} {where}: {d}" if d else ""


class LseCase:
    """One lse_reduce call's inputs on every rank and this rank's expected output (own heads,
    or all heads with ``all_heads=True``). With ``num_requests`` > 0 the call gets
    ``query_start_loc`` and every rank's ``seq_lens`` (some 0: empty requests), or
    ``query_start_loc`` alone with ``qsl_only=True`` (padding rows only)."""

    def __init__(
        self,
        comm,
        seed,
        *,
        T,
        H,
        D,
        dtype,
        lse_dtype="float32",
        lse_base=math.e,
        num_requests=0,
        all_heads=False,
        qsl_only=False,
    ):
        W, r = comm.world_size, comm.rank
        H_r = H // W
        ins = [
            make_inputs(
                s,
                W,
                seed,
                op="lse_reduce",
                tokens=T,
                num_heads=H,
                head_dim=D,
                dtype=dtype,
                lse_dtype=lse_dtype,
                lse_base=lse_base,
                num_requests=num_requests,
            )
            for s in range(W)
        ]
        self.qsl = ins[0]["query_start_loc"]
        seq = None if (num_requests == 0 or qsl_only) else [i["seq_lens"] for i in ins]
        # masks are per row: the heads compared suffice for the reference
        heads = slice(0, H) if all_heads else slice(r * H_r, (r + 1) * H_r)
        self.ref_out, self.ref_lse = lse_reduce_reference(
            [i["out_partial"][:, heads] for i in ins],
            [i["lse_partial"][:, heads] for i in ins],
            lse_base=lse_base,
            seq_lens=seq,
            query_start_loc=self.qsl,
        )
        self.out_partial = ins[r]["out_partial"]
        self.lse_partial = ins[r]["lse_partial"]
        self.seq_lens = None if seq is None else seq[r]
        self.dtype = resolve_dtype(dtype)
        self.what = (
            f"lse_reduce T={T} H={H} D_v={D} dtype={dtype} lse_dtype={lse_dtype} "
            f"lse_base={'e' if lse_base == math.e else lse_base} S={num_requests}"
            f"{' (query_start_loc only)' if qsl_only else ''}"
        )

    def gpu_args(self):
        kw = {}
        if self.qsl is not None:
            kw["query_start_loc"] = to_gpu(self.qsl)
            if self.seq_lens is not None:
                kw["seq_lens"] = to_gpu(self.seq_lens)
        return to_gpu(self.out_partial), to_gpu(self.lse_partial), kw

    def check_host(self, rank, got, got_lse: np.ndarray | None = None, where="") -> str:
        """'' when ``got`` (and ``got_lse``) match the reference, else what differs: out within
        the dtype's tolerance (NaN, the poison, counts as a difference), every row whose sources
        are all empty exactly 0, the merged lse by :func:`merged_lse_matches`."""
        what = f"rank {rank}, {self.what}{', ' + where if where else ''}"
        got = np.asarray(got).astype(np.float64)
        if got.shape != self.ref_out.shape:
            return f"{what}: out shape {got.shape}, expected {self.ref_out.shape}"
        msgs = []
        tol = lse_reduce_tolerance(self.dtype)
        bad = ~(np.abs(got - self.ref_out) <= tol)  # NaN (poison) counts as bad
        if bad.any():
            i = tuple(int(v) for v in np.argwhere(bad)[0])
            msgs.append(
                f"{what}: out differs at {int(bad.sum())} of {bad.size}; first "
                f"[t, h, d] = {i}: got {got[i]!r}, expected {self.ref_out[i]!r} "
                f"(tolerance {tol})"
            )
        empty = np.isneginf(self.ref_lse)
        if empty.any() and (got[empty] != 0).any():
            i = tuple(int(v) for v in np.argwhere(empty & (got != 0).any(-1))[0])
            msgs.append(f"{what}: row [t, h] = {i} has every source empty but is not exactly 0")
        if got_lse is not None:
            gl = np.asarray(got_lse).astype(np.float64)
            rl = self.ref_lse
            ok = merged_lse_matches(gl, rl)
            if not ok.all():
                i = tuple(int(v) for v in np.argwhere(~ok)[0])
                msgs.append(
                    f"{what}: merged lse differs at {int((~ok).sum())} of {ok.size}; "
                    f"first [t, h] = {i}: got {gl[i]!r}, expected {rl[i]!r}"
                )
        return "; ".join(msgs)

    def check(self, rank, out, out_lse=None, where="") -> str:
        return self.check_host(
            rank, to_host(out), None if out_lse is None else to_host(out_lse), where
        )


def close_enough(a: np.ndarray, b: np.ndarray, dtype) -> str:
    """'' when two lse_reduce outputs agree within twice the reference tolerance."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    tol = 2 * lse_reduce_tolerance(dtype)
    bad = ~(np.abs(a64 - b64) <= tol)
    if not bad.any():
        return ""
    i = tuple(int(v) for v in np.argwhere(bad)[0])
    return (
        f"{int(bad.sum())} of {bad.size} differ by more than {tol}; first at {i}: "
        f"{a64[i]!r} vs {b64[i]!r}"
    )
