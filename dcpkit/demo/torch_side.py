"""The torch side of the demo (``--torch``): torch tensors through :class:`dcpkit.torch.TorchOps`,
the partial attention in torch, the reference by ``scaled_dot_product_attention``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .._cuda import torch_extra
from .exchanges import Exchanges, OpSet
from .model import Model
from .numerics import is_bf16


class TorchSide:
    """The same with torch tensors: the ops through :class:`dcpkit.torch.TorchOps`, the
    partial attention in torch, the reference by ``scaled_dot_product_attention``."""

    name = "torch"

    def __init__(self):
        import cupy
        import torch

        from .. import torch as dcp_torch

        self.torch = torch
        self.dcp_torch = dcp_torch
        self.device = torch.device("cuda", cupy.cuda.Device().id)
        torch.cuda.set_device(self.device)

    def upload(self, a: np.ndarray):
        t = self.torch
        if is_bf16(a.dtype):
            return (
                t.from_numpy(np.ascontiguousarray(a).view(np.int16))
                .view(t.bfloat16)
                .to(self.device)
            )
        return t.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def to_cupy(self, x):
        return self.dcp_torch.to_cupy(x)

    def empty(self, shape, like):
        return self.torch.empty(shape, dtype=like.dtype, device=self.device)

    def wrap(self, ex: Exchanges) -> Exchanges:
        """``ex`` with torch tensors in and out: :class:`dcpkit.torch.TorchOps` over its
        DCPComm (or over each of its ops). ``TorchOps.close`` is local; ``ex`` stays open."""
        TorchOps = self.dcp_torch.TorchOps
        if isinstance(ex.target, OpSet):
            fronts = {k: TorchOps(v) for k, v in vars(ex.target).items()}
            target: Any = OpSet(**{k: getattr(f, k) for k, f in fronts.items()})
            owned = list(fronts.values())
        else:
            target = TorchOps(ex.target)
            owned = [target]
        return Exchanges(
            ex.label,
            target,
            ex._path_of,
            owned,
            ex.description + "\n(torch tensors through dcpkit.torch.TorchOps)",
            base=ex,
        )

    def decode(self, ex: Exchanges, q, kv, local_lens: np.ndarray, model: Model, dtype):
        """As :meth:`CupySide.decode`, in torch."""
        t = self.torch
        B, H, D_v = q.shape[0], model.num_heads, model.v_dim
        q_full = ex.q_gather(q)
        q_f = q_full.float()
        q_full = q_full.clone()
        kv_f = kv.float()
        out_f = t.empty((B, H, D_v), dtype=t.float32, device=self.device)
        lse_partial = t.empty((B, H), dtype=t.float32, device=self.device)
        for b in range(B):
            n = int(local_lens[b])
            if n == 0:  # no KV here: an output never to be read
                out_f[b] = float("nan")
                lse_partial[b] = float("-inf")
                continue
            k = kv_f[b, :n]
            s = (q_f[b] @ k.T) * model.softmax_scale
            m = s.amax(dim=1, keepdim=True)
            p = t.exp(s - m)
            denom = p.sum(dim=1)
            out_f[b] = (p @ k[:, :D_v]) / denom[:, None]
            lse_partial[b] = m[:, 0] + t.log(denom)
        out_partial = out_f.to(q.dtype)
        out = ex.lse_reduce(out_partial, lse_partial).clone()
        return out, q_full, out_partial, lse_partial

    def reference(self, q_own, full, model: Model):
        """``scaled_dot_product_attention`` (math backend, fp32) of this rank's heads over one
        sequence's whole KV -> ``[H_r, D_v]``.

        One KV head shared by every query head (MQA), one query token per head: the ``H_r``
        heads are passed as ``H_r`` query rows of a single head, which is the same attention
        and never materialises the KV once per head."""
        t = self.torch
        F = t.nn.functional
        qq = q_own.float()[None, None]  # [1, 1, H_r, D_qk]
        k = full.float()[None, None]  # [1, 1, L, D_qk]
        v = k[..., : model.v_dim]  # [1, 1, L, D_v]
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = sdpa_kernel(SDPBackend.MATH)
        except ImportError:  # older torch: its default
            ctx = contextlib.nullcontext()
        with ctx:
            o = F.scaled_dot_product_attention(qq, k, v, scale=model.softmax_scale)
        return o[0, 0]

    def new_ref(self, shape):
        return self.torch.empty(shape, dtype=self.torch.float32, device=self.device)

    def timing(self) -> TorchTiming:
        return TorchTiming(self.torch)


class TorchTiming:
    """Streams, events and graphs of torch (the ops follow torch's current stream)."""

    def __init__(self, torch):
        self.torch = torch

    def stream(self):
        return self.torch.cuda.Stream()

    def on(self, stream):
        return self.torch.cuda.stream(stream)

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def capture(self, fn: Callable[[], Any], layers: int, stream):
        graph = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.graph(graph, stream=stream):
            for _ in range(layers):
                fn()
        return graph

    def replay(self, graph, stream) -> None:
        with self.torch.cuda.stream(stream):
            graph.replay()


def torch_problem() -> str | None:
    """Why ``--torch`` cannot run here, or ``None``."""
    try:
        import torch
    except ImportError as e:
        return (
            f"--torch needs torch, which is not installed ({e}): install it with "
            f"`pip install 'dcpkit[{torch_extra()}]'`"
        )
    if not torch.cuda.is_available():
        return (
            f"--torch needs a CUDA build of torch that sees the GPUs (torch "
            f"{torch.__version__}: torch.cuda.is_available() is False)"
        )
    try:
        from .. import torch as dcp_torch
    except ImportError as e:
        return f"--torch needs dcpkit.torch, which is not available here ({e})"
    if not hasattr(dcp_torch, "TorchOps"):
        return "--torch needs dcpkit.torch.TorchOps, which this dcpkit lacks"
    return None
