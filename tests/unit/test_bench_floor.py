"""The floor kernel's host side on the CPU: the real FloorRunner through the real sweep, over a
fake symmetric heap and an emulation of ``floor_kernel`` (stores of every rank's pattern into
every peer's slot, the status word, a rendezvous of the ranks per call), so that the fresh
pattern, the poisoned destination, the status check and the CTA count are exercised. The kernel
itself is compile-checked in test_jit and runs in scripts/gpu_suite.sh."""

import itertools
import json
import math
import threading

import numpy as np
import pytest
from test_bench_sweep import FakeDevice

from dcpkit import bench
from dcpkit.bench import factory as factory_mod
from dcpkit.bench.floor import estimate_ctas, pattern

from _threadgroup import run_group

_REG = {}
_IDS = itertools.count(1)


class FakeHeap:
    def __init__(self, comm, nbytes, multicast=False, **kw):
        self.mem = np.zeros(int(nbytes), np.uint8)
        self.local_ptr = next(_IDS) << 32
        _REG[self.local_ptr] = self.mem
        self.peer_ptrs = comm.allgather(self.local_ptr)

    def view(self, offset, shape, dtype):
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        assert offset + n <= self.mem.size, "view out of bounds"
        return self.mem[offset : offset + n].view(dt).reshape(shape)

    def close(self):
        _REG.pop(self.local_ptr, None)


class FloorDevice(FakeDevice):
    sm_count = 8

    def new_stream(self):
        return None


def _emulated_kernel(barrier, behaviour):
    def kernel(grid, block, args, stream=None):
        src, nvec, peer_base, slot, sig_off, epochs, rank, world, timeout_ns, status = args
        rank, world, ctas = int(rank), int(world), int(grid[0])
        assert ctas <= epochs.size and block == (256,)
        data = src.view(np.uint8)[: int(nvec) * 16]
        for p in range(world):
            if p == rank or (behaviour == "drop" and p == (rank + 1) % world):
                continue
            off = rank * int(slot)
            assert off + data.size <= int(sig_off)
            _REG[int(peer_base[p])][off : off + data.size] = data
        epochs[:ctas] += 1
        status[:ctas] = 1 if behaviour == "timeout" else 0
        barrier.wait()  # the kernel returns once every peer's stores are in

    return kernel


class _Kernel:
    def __init__(self, fn):
        self.kernel = fn


def _run(tmp_path, monkeypatch, W, behaviour=None, ops="q_gather,kv_gather,decode_layer"):
    from dcpkit import jit, symmetric

    barrier = threading.Barrier(W, timeout=30)
    monkeypatch.setattr(symmetric, "SymmetricHeap", FakeHeap)
    monkeypatch.setattr(
        jit, "get_kernel", lambda f, name: _Kernel(_emulated_kernel(barrier, behaviour))
    )
    args = [
        "--quick",
        "--max-bytes",
        "64K",
        "--tokens",
        "1,8",
        "--paths",
        "floor",
        "--ops",
        ops,
        "--json",
        str(tmp_path / "bench.json"),
        "--iters",
        "3",
    ]
    cfg = bench.resolve_config(bench.build_parser().parse_args(args))
    cfg["geometry"] = dict(cfg["geometry"], H=8, D=16, D_v=16, D_kv=24)

    def body(comm):
        return bench.run_bench(
            dict(cfg), comm, FloorDevice(comm), args, factory=factory_mod.make_runner
        )

    out = run_group(W, body, timeout_s=60.0)
    for r, (status, val) in enumerate(out):
        assert status == "ok", f"rank {r} raised {val!r}"
    return [v for _, v in out], json.loads((tmp_path / "bench.json").read_text())


@pytest.mark.parametrize("W", [2, 4])
def test_floor_rows_are_checked_and_timed_like_the_ops(tmp_path, monkeypatch, W):
    rcs, res = _run(tmp_path, monkeypatch, W)
    assert rcs == [0] * W
    rows = res["rows"]
    assert {r["path"] for r in rows} == {"floor"}
    assert {r["op"] for r in rows} == {"q_gather", "kv_gather", "decode_layer"}
    for r in rows:
        assert r["error"] is None and r["wrong"] == 0, r
        assert r["samples"] == 3 and r["median_us"] > 0
        stages = [c["stage"] for c in r["checks"]]
        assert stages[0] == "check" and len(stages) == (2 if r["mode"] == "eager" else 3)
        assert r["ctas"] and r["ctas"] <= 8
        assert r["floor_kernel_us"] is None  # a floor row is not its own floor


def test_floor_check_catches_a_lost_store_and_a_timeout(tmp_path, monkeypatch):
    rcs, res = _run(tmp_path, monkeypatch, 4, "drop", ops="q_gather")
    assert rcs == [1, 1, 1, 1]
    assert all(r["wrong"] > 0 for r in res["rows"])
    rcs, res = _run(tmp_path, monkeypatch, 2, "timeout", ops="kv_gather")
    assert rcs == [1, 1]
    # every check sees the status words the timed-out waits wrote
    for r in res["rows"]:
        assert r["wrong"] >= r["ctas"] * 2 * len(r["checks"]), r


def test_pattern_is_fresh_per_bind_and_per_rank():
    a, b, c = pattern(np, 0, 0, 64), pattern(np, 0, 1, 64), pattern(np, 1, 0, 64)
    assert not (a == b).any() and not (a == c).any()
    assert np.array_equal(a, pattern(np, 0, 0, 64))


def test_estimate_ctas_follows_the_ops_grid_rules():
    g = {"H": 128, "D": 576, "D_v": 512, "D_kv": 576, "itemsize": 2, "T": 1}
    # q_gather W=2, T=1: 64 heads * 576 * 2 B / 16 = 4608 vectors, 512 per CTA -> 9 CTAs
    assert estimate_ctas("q_gather", g, 2, 66) == 9
    assert estimate_ctas("q_gather", dict(g, T=128), 2, 66) == 66  # capped
    assert (
        estimate_ctas("kv_gather", dict(g, T=1000), 4, 33) == math.ceil(1000 * 72 / 512)
        or estimate_ctas("kv_gather", dict(g, T=1000), 4, 33) == 33
    )

    class Op:
        def ctas_for(self, T):
            return 3 * T

    assert estimate_ctas("lse_reduce", g, 4, 33, Op()) == 3
    assert estimate_ctas("lse_reduce", dict(g, T=100), 4, 33, Op()) == 33
    # an op without a copy-out grid: a graph call uses the same one
    assert estimate_ctas("lse_reduce", g, 4, 33, Op(), copy_out=True) == 3

    class Gather:  # the gathers: a graph call copies out, on its own grid
        def ctas_for(self, T, *, copy_out=False):
            return 4 * T if copy_out else T

    assert estimate_ctas("q_gather", dict(g, T=2), 2, 66, Gather()) == 2
    assert estimate_ctas("q_gather", dict(g, T=2), 2, 66, Gather(), copy_out=True) == 8
    assert estimate_ctas("q_gather", dict(g, T=30), 2, 66, Gather(), copy_out=True) == 66
    with pytest.raises(ValueError, match="op must be"):
        estimate_ctas("decode_layer", g, 2, 8)

    class ViewGather:  # a push gather: a call captured without out= has a grid of its own
        def ctas_for(self, T, *, copy_out=False, graph_view=False):
            return 5 * T if graph_view else (4 * T if copy_out else T)

    t2 = dict(g, T=2)
    assert estimate_ctas("q_gather", t2, 2, 66, ViewGather(), copy_out=True) == 8
    assert estimate_ctas("q_gather", t2, 2, 66, ViewGather(), graph_view=True) == 10
    assert estimate_ctas("q_gather", t2, 2, 66, ViewGather(), copy_out=True, graph_view=True) == 10
    # an op whose ctas_for has no graph_view keyword: a captured call copies out
    assert estimate_ctas("q_gather", t2, 2, 66, Gather(), copy_out=True, graph_view=True) == 8


def test_the_op_rows_and_the_floor_kernel_take_one_graph_grid():
    """graph_ctas is the one rule both the op's graph row and the floor kernel's follow."""
    from dcpkit.bench.runners import graph_ctas

    class ViewGather:
        def ctas_for(self, T, *, copy_out=False, graph_view=False):
            return 5 * T if graph_view else (4 * T if copy_out else T)

    class Plain:
        def ctas_for(self, T):
            return 7

    assert graph_ctas(ViewGather(), 3, graph_view=True) == 15
    assert graph_ctas(ViewGather(), 3, graph_view=False) == 12
    assert graph_ctas(Plain(), 3, graph_view=True) is None  # the eager grid
    assert graph_ctas(object(), 3, graph_view=True) is None


@pytest.mark.parametrize(
    "graph_forms, graph_grid",
    [
        ({}, 12),  # the op's graph row copies out: the copy-out grid
        ({"q_gather": False}, 12),
        ({"q_gather": True}, 6),  # captured without out= (graph output buffers): that grid
    ],
)
def test_a_graph_call_of_the_floor_kernel_takes_the_ops_graph_grid(
    monkeypatch, graph_forms, graph_grid
):
    """With the op built (its grids known), the floor kernel's eager calls take the op's eager
    grid and its graph calls the grid of the op's own graph row, and each row reports its own."""
    import types

    from dcpkit import jit, symmetric
    from dcpkit.bench.floor import FloorRunner
    from dcpkit.bench.sweep import _ctas
    from dcpkit.comm import Communicator

    grids = []

    class Kernel:
        def __call__(self, grid, block, args, stream=None):
            grids.append(int(grid[0]))

    monkeypatch.setattr(symmetric, "SymmetricHeap", FakeHeap)
    monkeypatch.setattr(jit, "get_kernel", lambda f, name: types.SimpleNamespace(kernel=Kernel()))

    class Gather:
        max_ctas = 64

        def ctas_for(self, T, *, copy_out=False, graph_view=False):
            return 2 * T if graph_view else (4 * T if copy_out else T)

    comm = Communicator.single()
    geom = {"H": 8, "D": 16, "D_v": 16, "D_kv": 24, "dtype": "bfloat16"}
    ctx = types.SimpleNamespace(
        comm=comm, world=1, rank=0, cfg={"geometry": geom, "timeout_ms": 1000.0},
        dev=FloorDevice(comm), op_objects={"q_gather": Gather()}, ranks_on_gpu=1,
        op_graph_view=graph_forms,
    )  # fmt: skip
    r = FloorRunner(ctx, "q_gather", "floor", 8)
    r.build()
    r.bind({}, {"T": 3, "geom": dict(geom, T=3)})
    r.call()
    r.call(graph=True)
    assert grids == [3, graph_grid]
    assert (r.ctas, r.ctas_graph) == (3, graph_grid)
    assert _ctas(r, "eager") == 3 and _ctas(r, "graph") == graph_grid
    r.close()


# ----------------------------------------------------------------------------- the pull grid
#: The push kv_gather's grids of the fake op below: eager (zero copy), captured without out=
#: (the direct path's graph row), copy-out.
_PUSH = {"eager": 2, "graph_view": 4, "copy_out": 5}


class _FakeKV:
    """What the sweep reads of a KVGather: its grids (per algorithm), its cap, no kernel."""

    multicast = False
    launches_per_call = 1
    max_ctas = 8
    pull_grids = {"eager": 2, "copy_out": 4}  # set per test

    def __init__(self, comm, *, algorithm, **kw):
        self.algorithm = algorithm
        self.grids = dict(self.pull_grids) if algorithm == "pull" else dict(_PUSH)

    def ctas_for(self, T, *, copy_out=False, graph_view=False):
        if graph_view and "graph_view" in self.grids:
            return self.grids["graph_view"]
        return self.grids["copy_out" if (copy_out or graph_view) else "eager"]

    def release_graph_outputs(self):
        pass

    def close(self):
        pass


def _grid_direct():
    from dcpkit.bench.runners import DirectRunner

    class GridDirect(DirectRunner):
        """The real DirectRunner (its build registers the op's grids for the floor kernel) over
        the fake op; its calls store the reference."""

        def bind(self, inp, case, refs=None):
            super().bind(inp, case, refs)
            self.refs, self.mine = refs, self.check_outputs()

        def call(self, outs=None, graph=False):
            outs = self.mine if outs is None else outs
            for o, (kind, ref, tol) in zip(outs, self.refs):
                o.view(ref.dtype)[...] = ref
            return tuple(outs)

    return GridDirect


#: Time the emulated floor kernel takes per CTA of its grid, on a virtual clock the device adds
#: to its samples: a floor row's median then tells which grid it ran on.
_US_PER_CTA = 1000.0
_VCLOCK: dict[int, float] = {}


class _ClockDevice(FloorDevice):
    """Samples in virtual time only (what the launches charged), never the real time they took:
    on a loaded machine that adds milliseconds of scheduling."""

    def sample(self, stream, enqueue):
        v0 = _VCLOCK.get(self.rank, 0.0)
        super().sample(stream, enqueue)
        return _VCLOCK.get(self.rank, 0.0) - v0


def _run_pull(tmp_path, monkeypatch, pull_grids, W=2):
    """The sweep of kv_gather on direct, direct-pull and floor: the real FloorRunner (emulated
    kernel, fake heap) beside the real DirectRunner over :class:`_FakeKV`."""
    from dcpkit import jit, ops, symmetric

    barrier = threading.Barrier(W, timeout=30)
    emulated = _emulated_kernel(barrier, None)

    def kernel(grid, block, args, stream=None):
        rank = int(args[6])
        _VCLOCK[rank] = _VCLOCK.get(rank, 0.0) + _US_PER_CTA * int(grid[0])
        return emulated(grid, block, args, stream)

    monkeypatch.setattr(symmetric, "SymmetricHeap", FakeHeap)
    monkeypatch.setattr(jit, "get_kernel", lambda f, name: _Kernel(kernel))
    monkeypatch.setattr(_FakeKV, "pull_grids", dict(pull_grids))
    monkeypatch.setattr(ops, "KVGather", _FakeKV)
    args = ["--quick", "--max-bytes", "64K", "--paths", "direct,direct-pull,floor"]
    args += ["--ops", "kv_gather", "--json", str(tmp_path / "bench.json"), "--iters", "3"]
    cfg = bench.resolve_config(bench.build_parser().parse_args(args))
    cfg["geometry"] = dict(cfg["geometry"], H=8, D=16, D_v=16, D_kv=24)
    direct = _grid_direct()

    def factory(ctx, op, path, mt, variant=None):
        if path == "floor":
            return factory_mod.make_runner(ctx, op, path, mt, variant)
        return direct(ctx, op, path, mt, variant)

    def body(comm):
        return bench.run_bench(dict(cfg), comm, _ClockDevice(comm), args, factory=factory)

    out = run_group(W, body, timeout_s=60.0)
    for r, (status, val) in enumerate(out):
        assert status == "ok", f"rank {r} raised {val!r}"
    return [v for _, v in out], json.loads((tmp_path / "bench.json").read_text())


@pytest.mark.parametrize(
    "pull_grids, differ",
    [
        ({"eager": 6, "copy_out": 7}, ("eager", "graph")),  # pull: the whole share, copy-out
        ({"eager": 6, "copy_out": 4}, ("eager",)),
        ({"eager": 2, "copy_out": 7}, ("graph",)),
        ({"eager": 2, "copy_out": 4}, ()),  # the push grids: one floor row serves both
    ],
)
def test_the_floor_kernel_runs_again_on_the_pull_grid_where_it_differs(
    tmp_path, monkeypatch, pull_grids, differ
):
    """The floor row runs on the push kv_gather's grids; where the pull build's grid differs in
    a mode, a second floor row (variant pull_grid) runs on it in that mode only, says its grid
    in ctas, and the pull rows take their floor kernel from it; the push rows never do."""
    rcs, res = _run_pull(tmp_path, monkeypatch, pull_grids)
    assert rcs == [0, 0]
    rows = res["rows"]
    assert all(r["error"] is None and r["wrong"] == 0 for r in rows), rows
    push = {"eager": _PUSH["eager"], "graph": _PUSH["graph_view"]}
    pull = {"eager": pull_grids["eager"], "graph": pull_grids["copy_out"]}
    cases = sorted({r["nominal_bytes"] for r in rows})
    assert len(cases) == 2
    for nominal in cases:
        for mode in ("eager", "graph"):
            at = {
                (r["path"], r["variant"]): r
                for r in rows
                if r["nominal_bytes"] == nominal and r["mode"] == mode
            }
            want = {("direct", None), ("direct-pull", None), ("floor", None)}
            if mode in differ:
                want.add(("floor", "pull_grid"))
            assert set(at) == want, (nominal, mode)
            floor, direct, pulled = at["floor", None], at["direct", None], at["direct-pull", None]
            # every row says the grid it ran with; the floor rows ran on it (their medians)
            assert floor["ctas"] == direct["ctas"] == push[mode]
            assert pulled["ctas"] == pull[mode]
            assert round(floor["median_us"] / _US_PER_CTA) == push[mode]
            own = at.get(("floor", "pull_grid"), floor)
            assert own["ctas"] == pull[mode] and round(own["median_us"] / _US_PER_CTA) == pull[mode]
            assert direct["floor_kernel_us"] == floor["median_us"]
            assert pulled["floor_kernel_us"] == own["median_us"]


def test_no_pull_grid_floor_is_planned_where_the_grids_are_equal():
    """pull_grid_modes: the modes whose pull grid differs from the push grid; none where they
    are equal, and none where the pull path was not built."""
    import types

    from dcpkit.bench.floor import floor_grids, pull_grid_modes

    def ctx(pull):
        objs = {} if pull is None else {"kv_gather": (pull, False)}
        return types.SimpleNamespace(
            world=2, op_objects={"kv_gather": push}, op_graph_view={"kv_gather": True},
            pull_objects=objs,
        )  # fmt: skip

    push = _FakeKV(None, algorithm="push")
    case = {"T": 4, "geom": {"H": 8, "D": 16, "D_v": 16, "D_kv": 24, "T": 4}}
    modes = ("eager", "graph")
    for grids, want in (
        ({"eager": 2, "copy_out": 4}, []),
        ({"eager": 3, "copy_out": 4}, ["eager"]),
        ({"eager": 2, "copy_out": 5}, ["graph"]),  # the push copy-out grid, not its graph row's
        ({"eager": 3, "copy_out": 5}, ["eager", "graph"]),
    ):
        pull = _FakeKV(None, algorithm="pull")
        pull.grids = grids
        assert floor_grids(ctx(pull), "kv_gather", case["geom"], "pull_grid") == (
            grids["eager"],
            grids["copy_out"],
        )
        assert pull_grid_modes(ctx(pull), "kv_gather", case, modes) == want
        assert pull_grid_modes(ctx(pull), "kv_gather", case, ("graph",)) == [
            m for m in want if m == "graph"
        ]
    assert floor_grids(ctx(None), "kv_gather", case["geom"]) == (2, 4)
    assert floor_grids(ctx(None), "kv_gather", case["geom"], "pull_grid") is None
    assert pull_grid_modes(ctx(None), "kv_gather", case, modes) == []
