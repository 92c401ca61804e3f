"""The runners of the sweep: one op on one path, built once per op and bound to each case's
inputs. dcpkit's own ops (:class:`DirectRunner`), NCCL through CuPy (:class:`NcclRunner`),
torch.distributed (:class:`TorchRunner`) and the decode layer, two runners back to back
(:class:`DecodeRunner`). The floor kernel and the NVSHMEM peer live in ``floor.py`` and
``peers.py``."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import socket
from typing import Any

import numpy as np

from ..errors import DcpkitError
from .common import PULL_PATH
from .stages import Ctx

__all__ = [
    "Runner",
    "DirectRunner",
    "NcclRunner",
    "TorchEnv",
    "TorchRunner",
    "DecodeRunner",
    "construct",
    "free_port",
    "accepts_keyword",
]


def accepts_keyword(fn, name: str) -> bool:
    """True when ``fn`` (a class or a function) takes the keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


def graph_ctas(obj, T: int, *, graph_view: bool) -> int | None:
    """The grid of a captured call of dcpkit op ``obj`` at ``T`` tokens, where it differs from
    an eager call's (None: the same grid, or an op without ``ctas_for``). ``graph_view``: the
    call is captured without out= (the gathers' graph output buffers: zero copy into them, or
    copy-out); otherwise a captured call copies out. The op's rows and the floor kernel's both
    take their graph grid from here, so the floor kernel runs with the op's CTA count."""
    ctas_for = getattr(obj, "ctas_for", None)
    if not callable(ctas_for):
        return None
    if graph_view and accepts_keyword(ctas_for, "graph_view"):
        return int(ctas_for(int(T), graph_view=True))
    if accepts_keyword(ctas_for, "copy_out"):
        return int(ctas_for(int(T), copy_out=True))
    return None


class VariantUnavailable(DcpkitError):
    """The op has no keyword for the variant asked for (the row is n/a, not an error)."""


def construct(cls, *args, **kwargs):
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
    :meth:`check_outputs` (arrays to poison and pass as ``out=``), :meth:`own_refs` (references
    of a runner that checks its own pattern, else None), :meth:`call`, :meth:`calls`,
    :meth:`capture`, :meth:`close` (collective); attributes ``stream`` (where the calls run and
    events are recorded), ``launches_per_call`` and ``ctas`` (CTAs of one launch, if known).
    ``ctas_graph``, where set, is the grid of a captured call when it differs (the gathers copy
    out there). ``variant`` names a build other than the shipped one (``no_self_check``), else
    None.
    """

    family = "base"

    def __init__(self, ctx: Ctx, op: str, path: str, max_tokens: int, variant: str | None = None):
        self.ctx, self.op, self.path, self.max_tokens = ctx, op, path, int(max_tokens)
        self.variant = variant
        self.ctas: int | None = None
        self.ctas_graph: int | None = None
        self.dev = ctx.dev
        self.geom = ctx.cfg["geometry"]
        self.stream = None
        self.launches_per_call: int | None = None
        self.inp: dict[str, Any] = {}
        self.case: dict[str, Any] = {}

    # the sweep's interface
    def build(self) -> None:
        raise NotImplementedError

    def bind(self, inp: dict[str, Any], case: dict[str, Any], refs=None) -> None:
        self.inp, self.case = inp, case

    def out_specs(self) -> list[tuple[tuple[int, ...], Any]]:
        g, W, T = self.geom, self.ctx.world, self.case["T"]
        from ..reference import resolve_dtype

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

    def own_refs(self):
        """References of this runner's own inputs (the floor kernel's pattern), or None: the
        case's references apply."""
        return None

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

    def new_capture(self) -> None:
        """Called before every capture of this runner; the graph of its previous capture is
        gone by then (the sweep drops each graph before the next)."""

    def capture(self, count: int):
        self.new_capture()
        return self.dev.capture(self.stream, lambda: self.call(graph=True), count)

    def close(self) -> None:
        pass


class DirectRunner(Runner):
    """dcpkit's own op (:mod:`dcpkit.ops`): ``direct`` (unicast push), ``direct-pull``
    (kv_gather pull) or ``multicast``. Eager calls use ubatch 0, captured calls ubatch 1, so the
    eager path never pays for a capture (see dcpkit/ops/_workspace.py, "Outputs").

    Captured calls of the unicast push gathers (``direct``) take the view form, whose result is
    the call's own graph output buffer, stored into by every rank (zero copy); the op is built
    with ``graph_calls`` of them, given back before each capture. Every other captured call
    writes caller storage (``out=``).

    Variant ``no_self_check``: the op built (or called) with its private ``_self_check=False``
    keyword; :class:`VariantUnavailable` when the op has no such keyword.
    """

    family = "direct"
    call_kw: dict[str, Any] = {}
    graph_view = False  # set by build

    def build(self) -> None:
        from ..ops import KVGather, LseReduce, QGather
        from ..reference import resolve_dtype

        ctx, g = self.ctx, self.geom
        dt = resolve_dtype(g["dtype"])
        mc = None if self.path == "multicast" else False
        common = {
            "max_tokens": self.max_tokens,
            "dtype": dt,
            "num_ubatches": 2,
            "timeout_ms": ctx.cfg["timeout_ms"],
        }
        self.graph_view = self.path == "direct" and self.op in ("q_gather", "kv_gather")
        if self.graph_view:
            common["graph_outputs"] = int(ctx.cfg["graph_calls"])
        cls = {"q_gather": QGather, "kv_gather": KVGather, "lse_reduce": LseReduce}.get(self.op)
        self.call_kw = {}
        if self.variant == "no_self_check":
            if accepts_keyword(cls, "_self_check"):
                common["_self_check"] = False
            elif accepts_keyword(getattr(cls, "__call__", None), "_self_check"):  # noqa: B004
                self.call_kw = {"_self_check": False}
            else:
                raise VariantUnavailable(f"{self.op}: the op has no _self_check keyword")
        elif self.variant is not None:
            raise ValueError(f"DirectRunner: unknown variant {self.variant!r}")
        if self.op == "q_gather":
            self.obj = QGather(
                ctx.comm,
                heads_per_rank=g["H"] // ctx.world,
                head_dim=g["D"],
                multicast=mc,
                **common,
            )
        elif self.op == "kv_gather":
            self.obj = KVGather(
                ctx.comm,
                row_dim=g["D_kv"],
                multicast=mc,
                algorithm="pull" if self.path == "direct-pull" else "push",
                **common,
            )
        elif self.op == "lse_reduce":
            self.obj = LseReduce(ctx.comm, num_heads=g["H"], head_dim=g["D_v"], **common)
        else:
            raise ValueError(self.op)
        used_mc = bool(getattr(self.obj, "multicast", False))
        if used_mc != (self.path == "multicast"):
            self.obj.close()
            raise DcpkitError(
                f"{self.op} {self.path}: the op runs "
                f"{'multicast' if used_mc else 'unicast'}; this path measures "
                f"{'multicast' if self.path == 'multicast' else 'unicast'}"
            )
        self.launches_per_call = int(getattr(self.obj, "launches_per_call", 1) or 1)
        self.stream = self.dev.new_stream()
        if self.variant is None and self.path == "direct":
            ctx.op_objects[self.op] = self.obj  # the floor kernel takes its CTA count
            graph_forms = getattr(ctx, "op_graph_view", None)
            if graph_forms is not None:
                graph_forms[self.op] = self.graph_view  # and its captured call's grid
        elif self.variant is None and self.path == PULL_PATH:
            pulls = getattr(ctx, "pull_objects", None)
            if pulls is not None:  # the floor row on the pull kernel's grid takes it from here
                pulls[self.op] = (self.obj, self.graph_view)

    def bind(self, inp, case, refs=None) -> None:
        super().bind(inp, case, refs)
        ctas_for = getattr(self.obj, "ctas_for", None)
        T = int(case["T"])
        self.ctas = int(ctas_for(T)) if callable(ctas_for) else None
        self.ctas_graph = graph_ctas(self.obj, T, graph_view=self.graph_view)
        # The other captured calls write caller storage (out=), so capture allocates nothing.
        self.graph_outs = None if self.graph_view else self.check_outputs()

    def new_capture(self) -> None:
        if self.graph_view:
            self.obj.release_graph_outputs()  # the previous capture's graph is gone

    def call(self, outs=None, graph: bool = False):
        u = 1 if graph else 0
        if outs is None and graph:
            outs = self.graph_outs
        o = None if outs is None else outs[0]
        kw = self.call_kw
        if self.op == "q_gather":
            return (self.obj(self.inp["q"], ubatch=u, out=o, stream=self.stream, **kw),)
        if self.op == "kv_gather":
            return (self.obj(self.inp["kv"], ubatch=u, out=o, stream=self.stream, **kw),)
        return (
            self.obj(
                self.inp["out_partial"],
                self.inp["lse_partial"],
                ubatch=u,
                out=o,
                stream=self.stream,
                **kw,
            ),
        )

    def close(self) -> None:
        obj, self.obj = getattr(self, "obj", None), None
        if self.ctx.op_objects.get(self.op) is obj:
            self.ctx.op_objects.pop(self.op, None)
            getattr(self.ctx, "op_graph_view", {}).pop(self.op, None)
        pulls = getattr(self.ctx, "pull_objects", {})
        if obj is not None and pulls.get(self.op, (None,))[0] is obj:
            pulls.pop(self.op, None)
        if obj is not None:
            obj.close()


class NcclRunner(Runner):
    """The NCCL-through-CuPy versions of the ops (:mod:`dcpkit.fallback`); outputs always go
    to buffers allocated at bind time (``out=``), so capture allocates nothing."""

    family = "nccl"

    def build(self) -> None:
        from .. import fallback
        from ..reference import resolve_dtype

        ctx, g = self.ctx, self.geom
        dt = resolve_dtype(g["dtype"])
        common = {
            "max_tokens": self.max_tokens,
            "dtype": dt,
            "timeout_ms": ctx.cfg["timeout_ms"],
            "nccl_group": ctx.nccl_group,
        }
        if self.op == "q_gather":
            self.obj = construct(
                fallback.NcclQGather,
                ctx.comm,
                heads_per_rank=g["H"] // ctx.world,
                head_dim=g["D"],
                **common,
            )
        elif self.op == "kv_gather":
            self.obj = construct(fallback.NcclKVGather, ctx.comm, row_dim=g["D_kv"], **common)
        elif self.op == "lse_reduce":
            # the NCCL baseline of lse_reduce: all_to_all + the direct op's combine
            self.obj = construct(
                fallback.NcclLseReduce,
                ctx.comm,
                num_heads=g["H"],
                head_dim=g["D_v"],
                algorithm="all_to_all",
                **common,
            )
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
            r = self.obj(
                self.inp["out_partial"], self.inp["lse_partial"], out=o[0], stream=self.stream
            )
        if isinstance(r, tuple):
            r = r[0]
        return (o[0] if r is None else r,)

    def close(self) -> None:
        obj, self.obj = getattr(self, "obj", None), None
        self.outs = None
        if obj is not None and hasattr(obj, "close"):
            obj.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class TorchEnv:
    """torch.distributed (NCCL) over the same ranks, started by the harness if needed."""

    def __init__(self, ctx: Ctx, port: int, addr: str):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        torch.cuda.set_device(ctx.dev.device)
        self.owned = False
        if not dist.is_initialized():
            kw = {
                "backend": "nccl",
                "init_method": f"tcp://{addr}:{port}",
                "rank": ctx.rank,
                "world_size": ctx.world,
                "timeout": datetime.timedelta(seconds=max(60.0, ctx.cfg["hang_s"])),
            }
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
            from ..ops.lse_reduce import lse_combine

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
        for k in (
            "gathered",
            "o_t",
            "send_o",
            "recv_o",
            "send_l",
            "recv_l",
            "o_cp",
            "recv_o_cp",
            "recv_l_cp",
        ):
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
        self.l.bind(
            {"out_partial": inp["out_partial"], "lse_partial": inp["lse_partial"]},
            dict(case, op="lse_reduce"),
            None if refs is None else refs[1:],
        )
        self.n_q = len(tuple(self.q.check_outputs()))  # outputs of the first half
        cq, cl = self.q.ctas, self.l.ctas
        self.ctas = max(cq, cl) if (cq and cl) else None
        gq, gl = self.q.ctas_graph or cq, self.l.ctas_graph or cl
        self.ctas_graph = max(gq, gl) if (gq and gl) else None

    def check_outputs(self):
        return tuple(self.q.check_outputs()) + tuple(self.l.check_outputs())

    def own_refs(self):
        a, b = self.q.own_refs(), self.l.own_refs()
        return None if a is None or b is None else list(a) + list(b)

    def enqueue_context(self):
        return self.q.enqueue_context()

    def call(self, outs=None, graph: bool = False):
        n = getattr(self, "n_q", 1)
        a = self.q.call(None if outs is None else outs[:n], graph)
        b = self.l.call(None if outs is None else outs[n:], graph)
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
        self.q.new_capture()
        self.l.new_capture()
        return self.dev.capture(self.stream, lambda: self.call(graph=True), count)

    def close(self) -> None:
        try:
            self.l.close()
        finally:
            self.q.close()
