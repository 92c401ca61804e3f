"""The CuPy side of the demo: arrays, the partial attention and the reference in CuPy, and
CuPy's streams, events and graphs for the timings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .exchanges import Exchanges
from .model import Model
from .numerics import attention, from_float32, is_bf16, to_float32


class CupySide:
    """The demo's arrays and math with CuPy (the default)."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cupy = cupy

    def upload(self, a: np.ndarray):
        """A host array on the current GPU (bfloat16 travels as its 16-bit words)."""
        if is_bf16(a.dtype):
            return self.cupy.asarray(a.view(np.uint16)).view(a.dtype)
        return self.cupy.asarray(a)

    def to_cupy(self, x):
        return x

    def empty(self, shape, like):
        return self.cupy.empty(shape, dtype=like.dtype)

    def wrap(self, ex: Exchanges) -> Exchanges:
        return ex

    def decode(self, ex: Exchanges, q, kv, local_lens: np.ndarray, model: Model, dtype):
        """q_gather -> partial attention of all heads over the local KV shard (fp32) ->
        lse_reduce. Returns ``(out [B, H_r, D_v], q_full [B, H, D_qk] (a copy), out_partial
        [B, H, D_v], lse_partial [B, H] float32)``."""
        cp = self.cupy
        B, H, D_v = q.shape[0], model.num_heads, model.v_dim
        q_full = ex.q_gather(q)  # a view: consumed right here, same stream
        q_f = to_float32(q_full, cp)  # [B, H, D_qk]
        q_full = q_full.copy()
        kv_f = to_float32(kv, cp)  # [B, T_local, D_qk]
        out_f = cp.empty((B, H, D_v), dtype=cp.float32)
        lse_partial = cp.empty((B, H), dtype=cp.float32)
        for b in range(B):
            out_f[b], lse_partial[b] = attention(
                q_f[b], kv_f[b, : int(local_lens[b])], model.softmax_scale, D_v, cp
            )
        out_partial = from_float32(out_f, dtype, cp)
        out = ex.lse_reduce(out_partial, lse_partial).copy()
        return out, q_full, out_partial, lse_partial

    def reference(self, q_own, full, model: Model):
        """Attention of this rank's heads ``q_own [H_r, D_qk]`` over one sequence's whole KV
        ``full [L, D_qk]``, fp32 -> ``[H_r, D_v]``."""
        return attention(
            to_float32(q_own, self.cupy),
            to_float32(full, self.cupy),
            model.softmax_scale,
            model.v_dim,
            self.cupy,
        )[0]

    def new_ref(self, shape):
        return self.cupy.empty(shape, dtype=self.cupy.float32)

    def timing(self) -> CupyTiming:
        return CupyTiming()


class CupyTiming:
    """Streams, events and graphs of CuPy."""

    def __init__(self):
        import cupy

        self.cupy = cupy

    def stream(self):
        return self.cupy.cuda.Stream(non_blocking=True)

    def on(self, stream):
        return stream  # `with stream:` makes it CuPy's current stream

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
