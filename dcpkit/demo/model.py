"""The model of the demo: MLA geometry presets, the context lengths and their interleaved
layout over the ranks, and the per-rank seeded inputs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Scale of the queries: q ~ N(0, Q_STD^2), so the scores q.K^T/sqrt(576) have a standard
#: deviation of Q_STD. A power of two keeps the scaled queries exact in bf16/fp16. With 4 the
#: softmax is peaked (each head attends to a handful of tokens, like a trained model), outputs
#: have magnitudes 0.3 to 1 and an error in the LSE weights shows up at once.
Q_STD = 4.0


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
PRESETS: dict[str, Model] = {
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
    grid = gathered.reshape(world_size, T_local, D).swapaxes(0, 1)  # [T_local, N, D]
    return grid.reshape(NT, D)[:length]


def make_host_inputs(args, model: Model, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's queries ``q [B, H_r, D_qk]`` and KV shard ``kv [B, T_local, D_qk]`` (host
    arrays, from ``--seed`` and the rank), and every rank's queries ``q_all [B, H, D_qk]``
    (for the bit-exact q_gather check)."""
    from .._checks import resolve_dtype
    from ..reference import make_inputs

    dt = resolve_dtype(args.dtype)
    B, H, D = args.batch, model.num_heads, model.qk_dim

    def queries(r: int) -> np.ndarray:
        q = make_inputs(
            r, world_size, args.seed, op="q_gather", tokens=B, num_heads=H, head_dim=D, dtype=dt
        )["q"]
        return (q.astype(np.float32) * np.float32(Q_STD)).astype(dt)  # exact: power of two

    lengths = context_lengths(B, args.context, world_size, args.seed)
    T_local = max(1, int(local_lengths([lengths.max()], world_size, 0)[0]))  # ceil(max L / N)
    mine = local_lengths(lengths, world_size, rank)
    kv = make_inputs(
        rank, world_size, args.seed, op="kv_gather", tokens=B * T_local, row_dim=D, dtype=dt
    )["kv"].reshape(B, T_local, D)
    for b in range(B):
        kv[b, int(mine[b]) :] = np.nan  # rows that must never be read
    return {
        "q": queries(rank),
        "q_all": np.concatenate([queries(r) for r in range(world_size)], axis=1),
        "kv": kv,
        "lengths": lengths,
        "local_lengths": mine,
        "T_local": T_local,
        "dtype": dt,
    }


def checksums(xp, blocks) -> list[int]:
    """Order-independent 64-bit checksum of each block's bytes (position-weighted sum of the
    16-bit words, wrapping modulo 2^64): equal iff the bits are equal, with overwhelming
    probability."""
    out = []
    for blk in blocks:
        w = blk.reshape(-1).view(xp.uint16).astype(xp.uint64)
        pos = xp.arange(1, w.size + 1, dtype=xp.uint64) * xp.uint64(0x9E3779B97F4A7C15)
        out.append(int((w * pos + (w << xp.uint64(17))).sum()))
    return out
