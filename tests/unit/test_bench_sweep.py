"""The whole sweep on a fake device with ranks as threads: stages, agreement across ranks,
error rows, wrong-result counts, the floor and peer paths, the self-check variant, the JSON.

No GPU: the fake device keeps arrays in NumPy and times with the host clock; the fake runners
return the reference (or a corrupted copy, or raise on one rank) so every branch of the harness
runs here. What only the GPU can show (kernels, events, NCCL, NVSHMEM) runs in
``scripts/gpu_suite.sh``.
"""

import json
import math
import time

import ml_dtypes
import numpy as np

from dcpkit import bench
from dcpkit.bench import report as _report
from dcpkit.bench import sweep
from dcpkit.bench.common import StageFailed
from dcpkit.bench.device import DeviceBase
from dcpkit.bench.runners import DecodeRunner, Runner, VariantUnavailable
from dcpkit.bench.stages import Ctx, stage

from _threadgroup import run_group

KiB, MiB = 1024, 1024 * 1024


class FakeDevice(DeviceBase):
    """NumPy arrays, host-clock timing, synthetic ceilings; counts its barriers."""

    xp = np

    def __init__(self, comm, delay_us=0.0):
        self.comm, self.rank, self.world = comm, comm.rank, comm.world_size
        self.device = comm.rank
        self.token = 0
        self.delay_us = delay_us
        self.egress = None

    def describe(self):
        return {
            "gpu": "Fake GPU",
            "gpu_count": self.world,
            "device": self.device,
            "cuda_runtime": "0.0",
            "driver": "fake",
            "nccl": None,
        }

    def setup(self):
        pass

    def close(self):
        pass

    def wait_stream(self, stream, what=""):
        pass

    def barrier_token(self):
        return self.token

    def barrier_resync(self, token):
        self.token = token

    def sample(self, stream, enqueue):
        self.token += 1
        t0 = time.perf_counter()
        enqueue()
        return (time.perf_counter() - t0) * 1e6 + self.delay_us

    def capture(self, stream, fn, count):
        last = fn()
        return (lambda: [fn() for _ in range(count)]), last

    def pingpong(self, round_trips, repeats):
        if self.rank >= 2:
            return None
        return [
            {
                "event_us": 2.5 * round_trips + rep,
                "globaltimer_ns": 2490.0 * (round_trips - 10),
                "warm": 10,
            }
            for rep in range(repeats)
        ]

    def egress_setup(self, slice_bytes):
        self.egress = slice_bytes

    def egress_run(self, samples):
        return [self.egress * (self.world - 1) / 345e3 * (1 + 0.01 * self.rank)] * samples

    def egress_check(self):
        return 0

    def egress_release(self):
        self.egress = None

    def launch_costs(self, samples):
        return {"launch_eager_us": 5.0, "launch_graph_us": 0.9}


class FakeRunner(Runner):
    """Returns the reference (bits, or the merge rounded to bf16); behaviours for the tests."""

    family = "fake"

    def __init__(self, ctx, op, path, max_tokens, behaviour, variant=None):
        super().__init__(ctx, op, path, max_tokens, variant)
        self.behaviour = behaviour
        self.closed = 0

    def build(self):
        b = self.behaviour.get((self.op, self.path))
        if b == "build_fail":
            raise RuntimeError("injected build failure")
        if self.variant and not self.behaviour.get("variants"):
            raise VariantUnavailable(f"{self.op}: the op has no _self_check keyword")
        self.launches_per_call = 1
        self.calls_made = 0

    def bind(self, inp, case, refs=None):
        super().bind(inp, case, refs)
        self.refs = refs
        self.graph_outs = self.check_outputs()

    def _fill(self, outs):
        for o, (kind, ref, tol) in zip(outs, self.refs):
            if kind == "bits":
                o.view(ref.dtype)[...] = ref
            else:
                o[...] = ref.astype(ml_dtypes.bfloat16)
        b = self.behaviour.get((self.op, self.path))
        if b == "wrong":
            outs[0].view(np.uint16).reshape(-1)[0] ^= 1
        if b == f"raise_rank{self.ctx.rank}_T{self.case['T']}":
            raise RuntimeError(f"injected failure on rank {self.ctx.rank}")
        return tuple(outs)

    def call(self, outs=None, graph=False):
        self.calls_made += 1
        if outs is not None:
            return self._fill(outs)
        if graph:
            return self._fill(self.graph_outs)
        return self._fill(self.check_outputs())

    def close(self):
        self.closed += 1


def _fake_run(tmp_path, W, behaviour, extra_args=(), delay_us=0.0, dev_cls=FakeDevice):
    args = [
        "--quick",
        "--max-bytes",
        "16K",
        "--tokens",
        "1,8",
        "--paths",
        "direct,nccl",
        "--json",
        str(tmp_path / "bench.json"),
        *extra_args,
    ]
    cfg = bench.resolve_config(bench.build_parser().parse_args(args))
    cfg["iters"], cfg["iters_exact"] = 3, True
    cfg["geometry"] = dict(cfg["geometry"], H=8, D=16, D_v=16, D_kv=24)

    def factory(ctx, op, path, mt, variant=None):
        mk = lambda c, o, p, m: FakeRunner(c, o, p, m, behaviour, variant)  # noqa: E731
        if op == "decode_layer":
            return DecodeRunner(ctx, op, path, mt, mk)
        return mk(ctx, op, path, mt)

    def body(comm):
        return bench.run_bench(dict(cfg), comm, dev_cls(comm, delay_us), args, factory=factory)

    out = run_group(W, body, timeout_s=60.0)
    for r, (status, val) in enumerate(out):
        assert status == "ok", f"rank {r} raised {val!r}"
    return [v for _, v in out], json.loads((tmp_path / "bench.json").read_text())


def test_fake_sweep_all_correct(tmp_path, capsys):
    rcs, res = _fake_run(tmp_path, 2, {}, delay_us=3.0)
    assert rcs == [0, 0]
    assert res["schema"] == bench.SCHEMA
    assert res["meta"]["world_size"] == 2 and res["meta"]["gpu"] == "Fake GPU"
    assert res["meta"]["commit"]
    c = res["ceilings"]
    assert math.isclose(c["one_way_latency_us"], (2.5 * 2000 + 1) / 4000)  # median repeat
    assert c["egress_GBps"] > 300 and c["egress_wrong"] == 0 and not c["errors"]
    rows = res["rows"]
    # q_gather (2 T) + lse_reduce (2 T) + decode (1) + kv (quick: x16 steps up to 16K -> 4K)
    ops = {(r["op"], r["T"], r["path"], r["mode"]) for r in rows}
    assert ("q_gather", 1, "direct", "graph") in ops and ("decode_layer", 8, "nccl", "eager") in ops
    assert ("kv_gather", round(4096 / (24 * 2)), "direct", "eager") in ops
    assert all(r["error"] is None and r["wrong"] == 0 for r in rows), [
        (r["op"], r["error"]) for r in rows if r["error"] or r["wrong"]
    ]
    for r in rows:
        assert len(r["times_us"]) == r["plan"]["samples"] and r["median_us"] > 0
        assert r["floor_us"] is not None and r["speedup_vs_nccl"] is not None
        assert r["samples"] == 3
        stages = [ch["stage"] for ch in r["checks"]]
        assert stages[0] == "check"
        assert len(stages) == (2 if r["mode"] == "eager" else 3)
    assert res["targets"] and all("met" in t for t in res["targets"])
    out = capsys.readouterr().out
    assert "# ceilings measured in this run:" in out and "median(us)" in out
    assert out.rstrip().splitlines()[-1].startswith("# dcpkit bench: W=2")


def test_fake_sweep_records_wrong_results(tmp_path):
    rcs, res = _fake_run(tmp_path, 2, {("q_gather", "direct"): "wrong"}, ["--ops", "q_gather"])
    assert rcs == [1, 1]
    bad = [r for r in res["rows"] if r["path"] == "direct"]
    assert bad and all(r["wrong"] > 0 for r in bad)
    # one element per rank per check: 2 ranks x (check + eager) and x (check + 2 graph checks)
    assert sorted({r["wrong"] for r in bad}) == [4, 6]
    first = bad[0]["checks"][0]["first_bad_by_rank"]
    assert first == [[0], [0]]
    assert all(r["wrong"] == 0 for r in res["rows"] if r["path"] == "nccl")
    items = [i for i in res["targets"] if i["path"] == "direct"]
    assert items and all(i["met"] is not True for i in items)


def test_fake_sweep_survives_a_failure_on_one_rank(tmp_path):
    # rank 1 raises inside every call of q_gather direct at T=1: rows of that case are errors
    # on every rank, the runner is rebuilt, T=8 and the other paths are measured.
    rcs, res = _fake_run(
        tmp_path, 2, {("q_gather", "direct"): "raise_rank1_T1"}, ["--ops", "q_gather,lse_reduce"]
    )
    assert rcs == [1, 1]
    rows = {(r["op"], r["T"], r["path"], r["mode"]): r for r in res["rows"]}
    for m in ("eager", "graph"):
        err = rows[("q_gather", 1, "direct", m)]["error"]
        assert err and "rank(s) [1]" in err and "injected failure on rank 1" in err
        assert rows[("q_gather", 8, "direct", m)]["error"] is None
        assert rows[("q_gather", 1, "nccl", m)]["error"] is None
    assert all(r["error"] is None for r in res["rows"] if r["op"] == "lse_reduce")


def test_fake_sweep_build_failure_gives_error_rows(tmp_path):
    rcs, res = _fake_run(tmp_path, 3, {("kv_gather", "nccl"): "build_fail"}, ["--ops", "kv_gather"])
    assert rcs == [1, 1, 1]
    nccl = [r for r in res["rows"] if r["path"] == "nccl"]
    assert nccl and all("injected build failure" in r["error"] for r in nccl)
    assert all(r["error"] is None for r in res["rows"] if r["path"] == "direct")
    table = _report.render_table(res["rows"])
    assert "ERROR" in table


def test_stage_agrees_on_failure_across_ranks():
    class Dev(DeviceBase):
        def __init__(self, rank):
            self.token = 10 * rank

        def barrier_token(self):
            return self.token

        def barrier_resync(self, token):
            self.token = token

    def body(comm):
        cfg = {"verbose": False}
        ctx = Ctx(cfg, comm, Dev(comm.rank), [])
        got = stage(ctx, "ok stage", lambda: comm.rank * 2)
        try:
            stage(ctx, "bad stage", lambda: 1 / (comm.rank - 1))
        except StageFailed as e:
            return got, e.errors, ctx.dev.token
        return got, None, ctx.dev.token

    out = run_group(3, body)
    for r, (status, val) in enumerate(out):
        assert status == "ok", val
        got, errors, token = val
        assert got == [0, 2, 4]
        assert list(errors) == [1] and "ZeroDivisionError" in errors[1], f"rank {r}: {errors}"
        assert token == 20  # every rank continues from the largest barrier count


def test_fake_sweep_one_mode_one_path(tmp_path):
    rcs, res = _fake_run(
        tmp_path, 2, {}, ["--ops", "q_gather", "--modes", "graph", "--paths", "direct"]
    )
    assert rcs == [0, 0]
    assert {(r["path"], r["mode"]) for r in res["rows"]} == {("direct", "graph")}
    assert all(r["speedup_vs_nccl"] is None for r in res["rows"])
    vs = [
        i
        for i in res["targets"]
        if i["target"].startswith("nvlink.nccl_default") and i["op"] == "q_gather"
    ]
    assert vs and all(i["met"] is None for i in vs)


class SharedGpuDevice(FakeDevice):
    """Every rank on one GPU (a functional run with more ranks than GPUs)."""

    def pci_bus_id(self):
        return "0000:19:00.0"


class OwnGpuDevice(FakeDevice):
    def pci_bus_id(self):
        return f"0000:{0x19 + self.rank:02x}:00.0"


def test_fake_sweep_ranks_sharing_a_gpu_nccl_is_na_not_a_failure(tmp_path, capsys):
    """NCCL refuses two ranks on one GPU: the NCCL paths are n/a (recorded, not failed rows),
    the exit status is 0 when everything that ran is correct."""
    rcs, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather,kv_gather"], dev_cls=SharedGpuDevice)
    assert rcs == [0, 0]
    assert {r["path"] for r in res["rows"]} == {"direct"}
    assert all(r["error"] is None and r["wrong"] == 0 for r in res["rows"])
    why = "NCCL needs one GPU per rank: ranks [0, 1] share GPU 0000:19:00.0"
    assert res["meta"]["paths_not_available"] == {"nccl": f"n/a (NCCL unavailable: {why})"}
    assert not res["errors"]
    vs = [i for i in res["targets"] if i["target"].startswith("nvlink.nccl")]
    assert vs and all(i["met"] is None for i in vs)
    out = capsys.readouterr().out
    assert f"paths not run here: nccl: n/a (NCCL unavailable: {why})" in out, out
    assert f"# path nccl: n/a (NCCL unavailable: {why})" in out, out


def test_fake_sweep_one_gpu_per_rank_runs_nccl(tmp_path):
    rcs, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather"], dev_cls=OwnGpuDevice)
    assert rcs == [0, 0]
    assert {r["path"] for r in res["rows"]} == {"direct", "nccl"}
    assert "paths_not_available" not in res["meta"]


def test_fake_sweep_floor_and_peer_rows_fill_every_op_row(tmp_path):
    """Paths floor and nvshmem run beside direct; every op row carries floor_kernel_us and
    speedup_vs_peer of the same case and mode; the decode layer's floor is its two kernels."""
    rcs, res = _fake_run(
        tmp_path, 2, {}, ["--paths", "direct,floor,nvshmem", "--ops", "q_gather,decode_layer"]
    )
    assert rcs == [0, 0]
    paths = {r["path"] for r in res["rows"]}
    assert paths == {"direct", "floor", "nvshmem"}
    for r in res["rows"]:
        if r["path"] == "direct":
            assert r["floor_kernel_us"] is not None and r["speedup_vs_peer"] is not None, r
            fk = [
                x
                for x in res["rows"]
                if x["path"] == "floor"
                and x["op"] == r["op"]
                and x["T"] == r["T"]
                and x["mode"] == r["mode"]
            ]
            assert r["floor_kernel_us"] == fk[0]["median_us"]
    keys = {i["target"] for i in res["targets"] if i["met"] is not None}
    assert "small.floor_kernel" in keys and "peer.small" in keys


def test_fake_sweep_a_failing_peer_is_an_error_row_and_the_run_passes(tmp_path):
    rcs, res = _fake_run(
        tmp_path,
        2,
        {("q_gather", "nvshmem"): "build_fail"},
        ["--paths", "direct,nvshmem", "--ops", "q_gather"],
    )
    assert rcs == [0, 0]  # the peer's failure is a result, not a failed run
    peer = [r for r in res["rows"] if r["path"] == "nvshmem"]
    assert peer and all("injected build failure" in r["error"] for r in peer)
    items = [i for i in res["targets"] if i["target"] == "peer.small"]
    assert items and all(i["met"] is None for i in items)


def test_fake_sweep_self_check_variant(tmp_path, capsys):
    """q_gather and lse_reduce T=1 also run in a graph without self-checking signals where the
    op has the keyword, and the target compares the two; otherwise n/a, recorded."""
    rcs, res = _fake_run(
        tmp_path, 2, {"variants": True}, ["--ops", "q_gather,lse_reduce", "--paths", "direct"]
    )
    assert rcs == [0, 0]
    var = [r for r in res["rows"] if r["variant"] == "no_self_check"]
    assert {(r["op"], r["T"], r["mode"]) for r in var} == {
        ("q_gather", 1, "graph"),
        ("lse_reduce", 1, "graph"),
    }
    sc = [i for i in res["targets"] if i["target"] == "self_check.cost"]
    assert len(sc) == 2 and all(i["met"] is not None for i in sc)
    # both builds again, timed in alternating samples of one stage, checked like every row
    pair = [r for r in res["rows"] if r["variant"] in ("paired", "paired_no_self_check")]
    assert sorted((r["op"], r["variant"]) for r in pair) == [
        ("lse_reduce", "paired"),
        ("lse_reduce", "paired_no_self_check"),
        ("q_gather", "paired"),
        ("q_gather", "paired_no_self_check"),
    ]
    for r in pair:
        assert r["mode"] == "graph" and r["T"] == 1 and not r["error"] and r["wrong"] == 0
        assert r["times_us"] and len(r["checks"]) == 2
        assert r["plan"]["samples"] == len(r["times_us"])
    for i in sc:  # judged on the paired rows
        p = next(r for r in pair if r["op"] == i["op"] and r["variant"] == "paired")
        assert math.isclose(i["value"], p["median_us"])
    rcs, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather", "--paths", "direct"])
    assert rcs == [0, 0]
    assert not [r for r in res["rows"] if r["variant"]]
    assert "no _self_check keyword" in res["meta"]["variants_not_available"]["q_gather"]
    assert "no _self_check keyword" in capsys.readouterr().out


def test_fake_sweep_records_whether_ranks_share_a_gpu(tmp_path):
    _, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather"], dev_cls=SharedGpuDevice)
    assert res["meta"]["ranks_share_gpu"] is True
    nv = [i for i in res["targets"] if i["target"] == "nvlink.q_gather_t1"]
    assert nv and all(i["note"] == "ranks share a GPU" for i in nv)
    _, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather"], dev_cls=OwnGpuDevice)
    assert res["meta"]["ranks_share_gpu"] is False
    _, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather"])
    assert res["meta"]["ranks_share_gpu"] is None  # bus ids unknown


def test_exact_iters_are_honoured(tmp_path):
    cfg = bench.resolve_config(bench.build_parser().parse_args(["--iters", "7"]))
    assert cfg["iters_exact"]
    assert sweep.plan(50000.0, cfg, graph=False)["samples"] == 7
    assert sweep.plan(5000.0, cfg, graph=True)["samples"] == 7
    default = bench.resolve_config(bench.build_parser().parse_args([]))
    assert sweep.plan(50000.0, default, graph=False)["samples"] < default["iters"]


def test_fake_sweep_heads_that_do_not_divide_are_not_a_failure(tmp_path, capsys):
    """W = 3 with H = 8: q_gather cannot split its heads; recorded as not run, exit 0."""
    rcs, res = _fake_run(tmp_path, 3, {}, ["--ops", "q_gather,kv_gather", "--paths", "direct"])
    assert rcs == [0, 0, 0]
    assert not res["errors"]
    assert {r["op"] for r in res["rows"]} == {"kv_gather"}
    assert "do not divide by world_size 3" in res["meta"]["ops_not_run"]["q_gather"]
    assert "# q_gather: not run: H = 8 heads do not divide" in capsys.readouterr().out
