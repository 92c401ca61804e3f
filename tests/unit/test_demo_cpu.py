"""CPU tests of ``python -m dcpkit demo`` (dcpkit/demo/): arguments and presets, the data
layout (interleaved KV shards, de-interleaving the kv_gather result), the attention and rounding
helpers on tiny NumPy inputs, the whole DCP decomposition simulated on the CPU, the verdict and
the report, and the error paths on a machine without GPUs (in-process and under ``mpiexec``).

The GPU run of the demo is tests/mpi/test_demo.py.
"""

import argparse
import json
import math
import sys

import numpy as np
import pytest

from dcpkit import demo
from dcpkit.comm import Communicator
from dcpkit.demo import environment, model, numerics, report, steps, torch_side
from dcpkit.errors import InvalidArgument
from dcpkit.reference import kv_gather_reference, lse_reduce_reference, resolve_dtype


# ----------------------------------------------------------------------------- arguments
def test_defaults_are_the_deepseek_v3_geometry():
    a = demo.parse_args([])
    assert (a.model, a.batch, a.context, a.dtype, a.seed, a.iters, a.json, a.torch) == (
        "deepseek-v3",
        8,
        16384,
        "bfloat16",
        0,
        200,
        None,
        False,
    )
    m = demo.PRESETS[a.model]
    assert (m.num_heads, m.qk_dim, m.v_dim, m.kv_lora_rank, m.rope_dim) == (128, 576, 512, 512, 64)
    assert m.softmax_scale == pytest.approx(1 / 24)


def test_kimi_k2_preset():
    a = demo.parse_args(
        [
            "--model",
            "kimi-k2",
            "--batch",
            "3",
            "--context",
            "100",
            "--dtype",
            "float16",
            "--seed",
            "7",
            "--iters",
            "0",
            "--json",
            "x.json",
            "--torch",
        ]
    )
    assert (a.model, a.batch, a.context, a.dtype, a.seed, a.iters, a.json, a.torch) == (
        "kimi-k2",
        3,
        100,
        "float16",
        7,
        0,
        "x.json",
        True,
    )
    m = demo.PRESETS["kimi-k2"]
    assert (m.num_heads, m.qk_dim, m.v_dim) == (64, 576, 512)


@pytest.mark.parametrize(
    "argv",
    [
        ["--batch", "0"],
        ["--context", "-3"],
        # values no run can honour: refused when parsed, not at the allocation
        ["--batch", "65537"],
        ["--context", "16777217"],
        ["--batch", "4096", "--context", "1000000"],  # 2**32 KV rows gathered onto every rank
        ["--iters", "-1"],
        ["--model", "llama"],
        ["--dtype", "float32"],
        ["--bogus"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    """As ``dcpkit bench``: one line naming the argument and pointing at --help, no usage
    block."""
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith("dcpkit demo: ") and err.rstrip().endswith("--help)"), err
    assert argv[0] in err, err
    assert demo.main(argv, comm=Communicator.single()) == 2


def test_help_exits_0(capsys):
    assert demo.main(["--help"], comm=Communicator.single()) == 0
    out = capsys.readouterr().out
    assert "mpirun -np N python -m dcpkit demo" in out
    for opt in (
        "--model",
        "--batch",
        "--context",
        "--dtype",
        "--seed",
        "--json",
        "--torch",
        "--iters",
    ):
        assert opt in out


def test_ranks_other_than_0_print_no_usage(monkeypatch, capsys):
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--batch", "0"])
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == ""


# ----------------------------------------------------------------------------- environment
def test_environment_errors():
    ok = dict(num_gpus=4, gpu_error="", world_size=4, local_world_size=4, num_heads=128)
    assert demo.environment_error(**ok) is None
    msg = demo.environment_error(**{**ok, "num_gpus": 0, "gpu_error": "no driver"})
    assert "no CUDA GPU" in msg and "no driver" in msg and "mpirun -np N" in msg
    msg = demo.environment_error(**{**ok, "world_size": 1, "local_world_size": 1})
    assert "at least 2 ranks" in msg and "(got 1)" in msg
    msg = demo.environment_error(**{**ok, "num_gpus": 2})
    assert "asked for 4 ranks on this host but it has 2 GPUs" in msg
    msg = demo.environment_error(**{**ok, "world_size": 3, "local_world_size": 3})
    assert "num_heads 128 must be divisible by world_size 3" in msg
    # several hosts: only the ranks per host count against the host's GPUs
    assert demo.environment_error(**{**ok, "world_size": 8, "local_world_size": 4}) is None


def test_no_gpu_in_process(capsys, monkeypatch):
    """On a machine without GPUs the demo says so and exits 2 (this CPU machine has none)."""
    monkeypatch.setattr(environment, "gpu_count", lambda: (0, "CUDARuntimeError: no CUDA driver"))
    rc = demo.main(["--batch", "2", "--context", "64"], comm=Communicator.single())
    assert rc == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is visible on this host" in err and "no CUDA driver" in err


def test_no_driver_is_named_not_a_version_mismatch(monkeypatch, capsys):
    """Without libcuda CuPy reports cudaErrorInsufficientDriver; the demo says there is no
    driver (dcpkit info's probe)."""
    cupy = pytest.importorskip("cupy")
    from dcpkit import info

    class Runtime:
        def getDeviceCount(self):
            raise RuntimeError(
                "cudaErrorInsufficientDriver: CUDA driver version is "
                "insufficient for CUDA runtime version"
            )

    monkeypatch.setattr(cupy.cuda, "runtime", Runtime())
    monkeypatch.setattr(info, "no_driver_reason", lambda probe=None: "no CUDA driver found (x)")
    assert environment.gpu_count() == (0, "no CUDA driver found (x)")
    rc = demo.main(["--batch", "2", "--context", "64"], comm=Communicator.single())
    err = capsys.readouterr().err
    assert rc == 2 and "no CUDA GPU is visible on this host: no CUDA driver found" in err, err
    assert "InsufficientDriver" not in err
    # a driver that is there: CuPy's own message stays
    monkeypatch.setattr(info, "no_driver_reason", lambda probe=None: None)
    n, why = environment.gpu_count()
    assert n == 0 and why.startswith("RuntimeError: cudaErrorInsufficientDriver"), why


class FakeComm:
    """Rank 0 of ``world_size`` ranks on one host whose ranks see ``gpus`` GPUs; rank ``r``
    lands on the GPU with PCI bus id ``bus{r % gpus}``."""

    def __init__(self, world_size, gpus):
        self.rank, self.local_rank, self.host = 0, 0, "host-a"
        self.world_size = self.local_world_size = world_size
        self.gpus = gpus

    def allgather(self, obj):
        if isinstance(obj, tuple) and obj[:1] == (self.host,):  # (host, bus id)
            return [(self.host, f"bus{r % self.gpus}") for r in range(self.world_size)]
        return [obj] * self.world_size

    def broadcast(self, obj, root=0):
        return obj


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(environment, "gpu_count", lambda: (2, ""))
    monkeypatch.setattr(environment, "pci_bus_id", lambda device: f"bus{device}")


def test_too_many_ranks_for_the_gpus(capsys, two_gpus):
    assert demo.main([], comm=FakeComm(4, 2)) == 2
    assert "asked for 4 ranks on this host but it has 2 GPUs" in capsys.readouterr().err


def test_ranks_sharing_one_gpu_are_refused(capsys, two_gpus):
    """Each rank sees two GPUs, but the host's 3 ranks land on one (CUDA_VISIBLE_DEVICES set
    per rank to the same GPU looks like this)."""
    assert demo.main([], comm=FakeComm(3, 1)) == 2
    assert "asked for 3 ranks on this host but it has 1 GPU:" in capsys.readouterr().err


def test_heads_must_divide_by_world_size(capsys, monkeypatch):
    monkeypatch.setattr(environment, "gpu_count", lambda: (8, ""))
    monkeypatch.setattr(environment, "pci_bus_id", lambda device: f"bus{device}")
    assert demo.main(["--model", "kimi-k2"], comm=FakeComm(6, 8)) == 2
    assert "num_heads 64 must be divisible by world_size 6" in capsys.readouterr().err


def test_torch_missing_is_a_clear_error(capsys, monkeypatch, two_gpus):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert demo.main(["--torch"], comm=FakeComm(2, 2)) == 2
    assert "--torch needs torch" in capsys.readouterr().err


def test_no_gpu_under_mpiexec_exits_2_on_every_rank(mpi_launcher, run_cmd):
    """Two ranks, no GPU: one message, exit status 2, no hang."""
    cmd = mpi_launcher.command(
        2, sys.executable, "-m", "dcpkit.demo", "--batch", "2", "--context", "64"
    )
    proc = run_cmd(cmd, timeout=180)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stderr.count("no CUDA GPU is visible on this host") == 1, proc.stderr


# ----------------------------------------------------------------------------- layout
def test_context_lengths():
    for W in (2, 4, 8):
        L = demo.context_lengths(8, 16384, W, seed=3)
        assert L[0] == 16384 and L[-1] == W - 1
        assert ((L >= 1) & (L <= 16384)).all()
        assert len(set(L.tolist())) > 2, "lengths must differ"
        np.testing.assert_array_equal(L, demo.context_lengths(8, 16384, W, seed=3))
        # the short sequence leaves some ranks without KV
        assert any(demo.local_lengths(L, W, r)[-1] == 0 for r in range(W))
    assert demo.context_lengths(1, 5, 4, 0).tolist() == [5]
    assert demo.context_lengths(2, 1, 4, 0).tolist() == [1, 1]


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_local_lengths_partition_every_sequence(W):
    L = np.array([0, 1, 2, 3, 7, 8, 9, 100, 16384])
    per_rank = np.stack([demo.local_lengths(L, W, r) for r in range(W)])
    np.testing.assert_array_equal(per_rank.sum(axis=0), L)
    for i, n in enumerate(L):
        for r in range(W):
            assert per_rank[r, i] == len(range(r, int(n), W))


@pytest.mark.parametrize("W,L", [(2, 7), (4, 3), (4, 16), (8, 1), (3, 11)])
def test_deinterleave_inverts_interleave_and_gather(W, L):
    rng = np.random.default_rng(0)
    full = rng.standard_normal((L, 5)).astype(np.float32)
    cap = -(-L // W)
    shards = [demo.interleave(full, W, r, cap) for r in range(W)]
    for r, s in enumerate(shards):
        n = demo.local_lengths([L], W, r)[0]
        np.testing.assert_array_equal(s[:n], full[r::W])
        assert np.isnan(s[n:]).all()
    gathered = kv_gather_reference(shards)  # rank-major, as kv_gather gives
    np.testing.assert_array_equal(demo.deinterleave(gathered, W, L), full)


# ----------------------------------------------------------------------------- math helpers
def _naive_attention(q, kv, scale, v_dim):
    q, kv = q.astype(np.float64), kv.astype(np.float64)
    s = q @ kv.T * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p @ kv[:, :v_dim]) / p.sum(axis=1, keepdims=True), np.log(np.exp(s).sum(axis=1))


def test_attention_matches_naive():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((6, 12)).astype(np.float32)
    kv = rng.standard_normal((9, 12)).astype(np.float32)
    out, lse = demo.attention(q, kv, 0.3, 8)
    ref, ref_lse = _naive_attention(q, kv, 0.3, 8)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == (6, 8) and lse.shape == (6,)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


def test_attention_of_an_empty_shard_is_nan_with_lse_minus_inf():
    out, lse = demo.attention(np.ones((3, 4), np.float32), np.zeros((0, 4), np.float32), 1.0, 2)
    assert out.shape == (3, 2) and np.isnan(out).all()
    assert np.isneginf(lse).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rounding_helpers_match_ml_dtypes(dtype):
    dt = resolve_dtype(dtype)
    rng = np.random.default_rng(2)
    x = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * 100,
            np.array(
                [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3.0e38, -3.3e38, 65504.0, 1e5],
                np.float32,
            ),
            # exact ties of bf16 (round half to even both ways)
            (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
        ]
    )
    got = demo.from_float32(x, dtype)
    want = x.astype(dt)
    assert got.dtype == dt
    nan = np.isnan(x)
    assert np.isnan(got.astype(np.float32)[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
    back = demo.to_float32(want)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back[~nan], want[~nan].astype(np.float32))


def test_unit_roundoff_and_tolerance():
    assert demo.unit_roundoff("bfloat16") == 2.0**-8
    assert demo.unit_roundoff("float16") == 2.0**-11
    assert demo.unit_roundoff("float32") == 2.0**-24
    assert demo.tolerance("bfloat16", 4.0) == pytest.approx(2 * 4.0 / 256 + 1e-3)


def test_checksums_see_every_bit():
    rng = np.random.default_rng(3)
    a = demo.from_float32(rng.standard_normal((16, 8)).astype(np.float32), "bfloat16")
    b = a.copy()
    assert model.checksums(np, [a]) == model.checksums(np, [b])
    b.view(np.uint16)[3, 5] ^= 1
    assert model.checksums(np, [a]) != model.checksums(np, [b])
    c = a.copy()
    c.view(np.uint16)[[0, 1], 0] = a.view(np.uint16)[[1, 0], 0]  # two words swapped
    if a.view(np.uint16)[0, 0] != a.view(np.uint16)[1, 0]:
        assert model.checksums(np, [a]) != model.checksums(np, [c])


# ----------------------------------------------------------------------------- the whole step
def _args(**kw):
    base = dict(
        model="kimi-k2",
        batch=3,
        context=37,
        dtype="bfloat16",
        seed=5,
        iters=0,
        json=None,
        torch=False,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_host_inputs_are_per_rank_and_reproducible():
    args, m, W = _args(), demo.PRESETS["kimi-k2"], 4
    x0, x0b, x1 = (model.make_host_inputs(args, m, r, W) for r in (0, 0, 1))
    assert x0["q"].shape == (3, 16, 576) and x0["q"].dtype == resolve_dtype("bfloat16")
    assert x0["kv"].shape == (3, x0["T_local"], 576) and x0["T_local"] == 10
    np.testing.assert_array_equal(x0["q"].view(np.uint16), x0b["q"].view(np.uint16))
    assert not np.array_equal(x0["q"].view(np.uint16), x1["q"].view(np.uint16))
    np.testing.assert_array_equal(x0["q_all"][:, 16:32].view(np.uint16), x1["q"].view(np.uint16))
    # queries are scaled by Q_STD (a power of two: exact)
    assert 3.0 < float(np.std(x0["q"].astype(np.float32))) < 5.0
    for x in (x0, x1):
        for b, n in enumerate(x["local_lengths"]):
            kvf = x["kv"][b].astype(np.float32)
            assert np.isfinite(kvf[:n]).all() and np.isnan(kvf[n:]).all()
    assert x0["lengths"].tolist()[-1] == 3 and x1["local_lengths"][-1] == 1


@pytest.mark.parametrize("W,dtype", [(2, "bfloat16"), (4, "bfloat16"), (4, "float16")])
def test_dcp_decomposition_on_the_cpu(W, dtype):
    """The demo's steps with the references standing in for the collectives: partial attention
    of every rank over its interleaved shard, rounded to the dtype, merged by the lse_reduce
    reference, equals attention over the whole KV within the demo's tolerance; the empty
    shards' NaN outputs are never read."""
    args, m = _args(dtype=dtype), demo.PRESETS["kimi-k2"]
    xs = [model.make_host_inputs(args, m, r, W) for r in range(W)]
    dt = resolve_dtype(dtype)
    B, H, H_r = args.batch, m.num_heads, m.num_heads // W
    q_full = demo.to_float32(xs[0]["q_all"])  # [B, H, D]
    outs, lses = [], []
    for r, x in enumerate(xs):
        kvf = demo.to_float32(x["kv"])
        o = np.empty((B, H, m.v_dim), np.float32)
        lse = np.empty((B, H), np.float32)
        for b in range(B):
            o[b], lse[b] = demo.attention(
                q_full[b], kvf[b, : x["local_lengths"][b]], m.softmax_scale, m.v_dim
            )
        outs.append(demo.from_float32(o, dt))
        lses.append(lse)
    assert any(np.isneginf(lse[-1]).all() for lse in lses), "some rank must hold no KV"
    merged, _ = lse_reduce_reference(outs, lses)
    got = demo.from_float32(merged.astype(np.float32), dt)
    v_max, stats = 0.0, []
    for r, x in enumerate(xs):
        ref = np.empty((B, H_r, m.v_dim), np.float32)
        for b in range(B):
            gathered = kv_gather_reference([xx["kv"][b] for xx in xs])
            full = demo.to_float32(demo.deinterleave(gathered, W, int(x["lengths"][b])))
            ref[b] = demo.attention(demo.to_float32(x["q"][b]), full, m.softmax_scale, m.v_dim)[0]
            v_max = max(v_max, float(np.abs(full[:, : m.v_dim]).max()))
        s = numerics.local_stats(got[:, r * H_r : (r + 1) * H_r], ref, r, H_r)
        s.update(q_gather_exact=True, kv_gather_exact=True, v_max=v_max)
        stats.append(s)
    v = demo.verdict(stats, dt)
    assert v["nonfinite_outputs"] == 0
    assert v["verdict"] == "PASS", v
    assert v["max_abs_error"] < v["tolerance_abs"] / 2
    assert 0.1 < max(s["ref_max"] for s in stats) < 10


# ----------------------------------------------------------------------------- verdict, report
def _stats(**kw):
    s = {
        "max_abs": 1e-3,
        "ref_max": 2.0,
        "nonfinite": 0,
        "worst": [0, 1, 2],
        "q_gather_exact": True,
        "kv_gather_exact": True,
        "v_max": 4.0,
    }
    s.update(kw)
    return s


def test_verdict():
    v = demo.verdict([_stats(), _stats(max_abs=2e-3)], "bfloat16")
    assert v["verdict"] == "PASS" and v["max_abs_error"] == 2e-3
    assert v["max_rel_error"] == pytest.approx(1e-3)
    assert v["worst"]["rank"] == 1
    assert v["tolerance_abs"] == pytest.approx(demo.tolerance("bfloat16", 4.0))
    for bad in (
        dict(max_abs=1.0),
        dict(nonfinite=3),
        dict(q_gather_exact=False),
        dict(kv_gather_exact=False),
    ):
        assert demo.verdict([_stats(), _stats(**bad)], "bfloat16")["verdict"] == "FAIL", bad


def test_summarize_times_is_median_of_max_over_ranks():
    s = demo.summarize_times([[1, 10, 3, 4], [2, 1, 5, 4]])
    assert s["median_us"] == pytest.approx(np.median([2, 10, 5, 4]))
    assert s["repeats"] == 4


def _report(verdict="PASS", timing=True):
    t = {"median_us": 10.0, "p10_us": 9.0, "p90_us": 11.0, "repeats": 5}
    slow = dict(t, median_us=40.0)

    def path(x):
        return {
            "eager": {"q_gather": x, "lse_reduce": x, "layer": x},
            "graph": {"q_gather": x, "lse_reduce": {"error": "rank 1: boom"}, "layer": x},
        }

    return {
        "model": "deepseek-v3",
        "num_heads": 128,
        "heads_per_rank": 64,
        "qk_dim": 576,
        "kv_lora_rank": 512,
        "rope_dim": 64,
        "v_dim": 512,
        "softmax_scale": 1 / 24,
        "dtype": "bfloat16",
        "batch": 2,
        "context": 256,
        "context_lengths": [256, 1],
        "kv_rows_per_rank": 128,
        "world_size": 2,
        "gpus": ["NVIDIA H200"] * 2,
        "paths": {"q_gather": "direct", "lse_reduce": "direct", "kv_gather": "nccl"},
        "paths_agree": True,
        "check": demo.verdict(
            [_stats(), _stats(max_abs=1.0 if verdict == "FAIL" else 1e-3)], "bfloat16"
        ),
        "timing": {"direct": path(t), "nccl": path(slow)} if timing else {},
    }


def test_format_report():
    text = demo.format_report(_report())
    for s in (
        "deepseek-v3: 128 query heads",
        "1/sqrt(576)",
        "2 ranks on 2 x NVIDIA H200",
        "q_gather: direct",
        "kv_gather: nccl",
        "verdict    PASS",
        "max abs error",
        "tolerance",
        "4.0x",
        "communication only",
        "graph of lse_reduce failed",
    ):
        assert s in text, f"{s!r} not in\n{text}"
    fail = demo.format_report(_report("FAIL", timing=False))
    assert "verdict    FAIL" in fail and "worst: rank 1" in fail
    json.dumps(_report())  # the report is JSON-serialisable


def test_speedup_text():
    assert report._speedup({"median_us": 5.0}, {"median_us": 20.0}) == "4.0x"
    assert report._speedup(None, {"median_us": 20.0}) == "n/a"
    assert report._speedup({"error": "x"}, {"median_us": 1.0}) == "n/a"
    assert math.isclose(demo.PRESETS["deepseek-v3"].softmax_scale, 576**-0.5)


# ----------------------------------------------------------------------------- simulated run
# The whole demo (run(): inputs, exchanges, decode step, reference, check, timings, report) on
# the CPU: W threads play the ranks, a thread-group Communicator connects them, NumPy stands in
# for CuPy, and a NumPy DCPComm built on the references stands in for the GPU ops. This checks
# the demo's orchestration and bookkeeping; the GPU run (tests/mpi/test_demo.py) checks the ops.
import threading  # noqa: E402
import types  # noqa: E402


class _ThreadGroup:
    def __init__(self, n):
        self.n = n
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def communicator(self, rank):
        def allgather(obj):
            self.barrier.wait()
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return Communicator(
            rank,
            self.n,
            allgather=allgather,
            broadcast=lambda obj, root: allgather(obj)[root],
            barrier=lambda: allgather(None),
            backend="threads",
        )


def _fake_cupy():
    """NumPy dressed as the part of CuPy the demo uses (device = a thread-local number)."""
    local = threading.local()
    cp = types.ModuleType("cupy")
    for name in (
        "asarray",
        "empty",
        "full",
        "float32",
        "uint16",
        "uint32",
        "uint64",
        "arange",
        "abs",
        "isfinite",
        "isnan",
        "where",
        "exp",
        "log",
        "array_equal",
        "ascontiguousarray",
    ):
        setattr(cp, name, getattr(np, name))
    cp.get_array_module = lambda *a: np

    class Device:
        def __init__(self, i=None):
            self.id = getattr(local, "device", 0) if i is None else i

        def use(self):
            local.device = self.id

    class Stream:
        def __init__(self, non_blocking=False):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

        def begin_capture(self):
            pass

        def end_capture(self):
            return types.SimpleNamespace(launch=lambda stream=None: None)

    class Event:
        def record(self, stream=None):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 8,
        deviceGetPCIBusId=lambda d: f"bus{d}",
        getDeviceProperties=lambda d: {"name": b"Fake GPU"},
    )
    cp.cuda = types.SimpleNamespace(
        Device=Device,
        Stream=Stream,
        Event=Event,
        runtime=runtime,
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    )
    return cp


def _fake_manager(bug=None, nccl_reason=None):
    """A NumPy DCPComm on the references; ``bug`` breaks one op on purpose; ``nccl_reason``:
    NCCL is unavailable (policy 'auto' is direct-only and says why, 'nccl' raises)."""
    mod = types.ModuleType("dcpkit.manager")

    class DCPComm:
        def __init__(
            self,
            comm,
            *,
            max_tokens,
            num_heads,
            q_head_dim,
            v_head_dim,
            kv_row_dim=None,
            dtype,
            policy="auto",
            timeout_ms=None,
        ):
            self.timeout_ms = timeout_ms  # the demo passes its resolved deadline
            self.nccl_reason = nccl_reason
            if nccl_reason is not None:
                comm.barrier()  # the agreement a real DCPComm makes
                if policy == "nccl":
                    raise InvalidArgument(
                        f"DCPComm: policy 'nccl' cannot be served: NCCL is "
                        f"unavailable ({nccl_reason})"
                    )
            self.comm, self.max_tokens, self.dtype = comm, max_tokens, resolve_dtype(dtype)
            self.H_r = num_heads // comm.world_size
            self.path = "nccl" if policy == "nccl" else "direct-unicast"
            self.last_path = None
            self.direct_reason = {"kv_gather": None}
            self.ops = ("q_gather", "lse_reduce") + (("kv_gather",) if kv_row_dim else ())

        def _done(self, res, out=None, tokens=1):
            self.last_path = self.path if tokens <= self.max_tokens else "nccl"
            if out is None:
                return res
            out[...] = res
            return out

        def q_gather(self, q, out=None, **kw):
            qs = self.comm.allgather(np.array(q))
            if bug == "q_gather" and self.comm.rank == 0:
                qs = qs[::-1]
            return self._done(np.concatenate(qs, axis=1), out, q.shape[0])

        def lse_reduce(self, out_partial, lse_partial, out=None, **kw):
            outs = self.comm.allgather(np.array(out_partial))
            lses = self.comm.allgather(np.array(lse_partial))
            if bug == "lse_reduce":
                lses = [np.where(np.isneginf(x), x, 0.0) for x in lses]  # equal weights
            merged, _ = lse_reduce_reference(outs, lses)
            r = self.comm.rank
            own = demo.from_float32(
                merged[:, r * self.H_r : (r + 1) * self.H_r].astype(np.float32), self.dtype
            )
            return self._done(own, out, out_partial.shape[0])

        def kv_gather(self, kv, out=None, **kw):
            parts = self.comm.allgather(np.array(kv))
            if bug == "kv_gather" and self.comm.rank == 1:
                parts[0] = parts[0].copy()
                parts[0].view(np.uint16)[0, 0] ^= 1
            return self._done(np.concatenate(parts), out, kv.shape[0])

        def describe(self):
            return f"fake DCPComm ({self.path})\nsecond line"

        def synchronize(self):
            pass

        def close(self):
            self.comm.barrier()

    mod.DCPComm = DCPComm
    ops = types.ModuleType("dcpkit.ops")

    class KVGather:
        transport = "unicast"

        def __init__(self, comm, *, max_tokens, row_dim, dtype, timeout_ms=None):
            self.dcp = DCPComm(
                comm,
                max_tokens=max_tokens,
                num_heads=comm.world_size,
                q_head_dim=row_dim,
                v_head_dim=row_dim,
                dtype=dtype,
                timeout_ms=timeout_ms,
            )

        def __call__(self, kv, **kw):
            return self.dcp.kv_gather(kv, **kw)

        def close(self):
            self.dcp.close()

    ops.KVGather = KVGather
    return mod, ops


import time  # noqa: E402


def _simulate(monkeypatch, W, argv, bug=None, nccl_reason=None):
    cp = _fake_cupy()
    manager, ops = _fake_manager(bug, nccl_reason)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "dcpkit.manager", manager)
    monkeypatch.setitem(sys.modules, "dcpkit.ops", ops)
    group = _ThreadGroup(W)
    results, errors = [None] * W, []

    def rank_main(r):
        try:
            cp.cuda.Device(r).use()
            comm = group.communicator(r)
            args = demo.parse_args(argv)
            results[r] = demo.run(args, comm, steps.Say(r))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append((r, e))
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize(
    "W,argv",
    [
        (2, ["--batch", "3", "--context", "40", "--iters", "2"]),
        (
            4,
            [
                "--model",
                "kimi-k2",
                "--dtype",
                "float16",
                "--batch",
                "2",
                "--context",
                "9",
                "--iters",
                "0",
            ],
        ),
    ],
)
def test_simulated_run_passes(monkeypatch, capsys, W, argv):
    reports = _simulate(monkeypatch, W, argv)
    assert all(r == reports[0] for r in reports), "the report must be equal on every rank"
    rep = reports[0]
    c = rep["check"]
    assert c["verdict"] == "PASS", c
    assert c["q_gather_bit_exact"] and c["kv_gather_bit_exact"] and c["nonfinite_outputs"] == 0
    assert rep["paths"] == {
        "q_gather": "direct-unicast",
        "lse_reduce": "direct-unicast",
        "kv_gather": "direct-unicast",
    }
    assert rep["context_lengths"][-1] == W - 1
    if "--iters" in argv and argv[argv.index("--iters") + 1] != "0":
        t = rep["timing"]
        assert t["direct"]["paths"] == {
            "q_gather": "direct-unicast",
            "lse_reduce": "direct-unicast",
        }
        assert t["nccl"]["paths"] == {"q_gather": "nccl", "lse_reduce": "nccl"}
        for path in ("direct", "nccl"):
            for mode in ("eager", "graph"):
                assert set(t[path][mode]) == {"q_gather", "lse_reduce", "layer"}
                assert all(e["repeats"] == 2 for e in t[path][mode].values())
    text = demo.format_report(rep)
    assert "verdict    PASS" in text
    out = capsys.readouterr().out
    for progress in (
        "building inputs",
        "building the ops",
        "decode step",
        "reference:",
        "check: max abs error",
    ):
        assert progress in out, out


def test_simulated_run_without_nccl_checks_and_times_the_direct_path(monkeypatch, capsys):
    """NCCL unavailable (ranks sharing a GPU): the check runs on the direct path, the report
    says why NCCL is unavailable, the NCCL timings are skipped (never built), PASS."""
    why = "NCCL needs one GPU per rank: ranks [0, 1] share GPU 0000:19:00.0"
    rep = _simulate(
        monkeypatch, 2, ["--batch", "2", "--context", "30", "--iters", "2"], nccl_reason=why
    )[0]
    assert rep["check"]["verdict"] == "PASS", rep["check"]
    assert rep["paths"] == {
        "q_gather": "direct-unicast",
        "lse_reduce": "direct-unicast",
        "kv_gather": "direct-unicast",
    }
    assert rep["nccl_path"] == f"unavailable ({why})"
    assert rep["nccl_unavailable_reason"] == why
    assert rep["timing"]["nccl"] == {"skipped": f"NCCL unavailable: {why}"}
    assert rep["timing"]["direct"]["paths"] == {
        "q_gather": "direct-unicast",
        "lse_reduce": "direct-unicast",
    }
    text = demo.format_report(rep)
    assert f"NCCL path: unavailable ({why})" in text, text
    assert f"nccl path not timed: NCCL unavailable: {why}" in text, text
    assert "verdict    PASS" in text
    out = capsys.readouterr().out
    assert f"NCCL timings skipped: NCCL unavailable ({why})" in out, out
    assert "timing the nccl path" not in out, out
    json.dumps(rep)
    # with NCCL available the report says so
    rep = _simulate(monkeypatch, 2, ["--batch", "2", "--context", "30", "--iters", "0"])[0]
    assert rep["nccl_path"] == "available" and rep["nccl_unavailable_reason"] is None
    assert "NCCL path: available" in demo.format_report(rep)


@pytest.mark.parametrize(
    "bug,what",
    [
        ("lse_reduce", "max_abs_error"),
        ("q_gather", "q_gather_bit_exact"),
        ("kv_gather", "kv_gather_bit_exact"),
    ],
)
def test_simulated_run_catches_a_wrong_op(monkeypatch, bug, what):
    rep = _simulate(monkeypatch, 2, ["--batch", "2", "--context", "30", "--iters", "0"], bug=bug)[0]
    c = rep["check"]
    assert c["verdict"] == "FAIL", c
    if what == "max_abs_error":
        assert c["max_abs_error"] > c["tolerance_abs"]
    else:
        assert c[what] is False


# ----------------------------------------------------------------------------- --torch math
def test_torch_side_math_on_cpu():
    """The --torch side's upload, partial attention (with an identity exchange: one rank) and
    SDPA reference agree with the NumPy helpers (torch on the CPU: no GPU needed)."""
    torch = pytest.importorskip("torch")
    side = object.__new__(torch_side.TorchSide)
    side.torch, side.device, side.dcp_torch = torch, torch.device("cpu"), None
    m = demo.PRESETS["kimi-k2"]
    x = model.make_host_inputs(_args(batch=3, context=11), m, 0, 1)
    dt = x["dtype"]
    q, kv = side.upload(x["q"]), side.upload(x["kv"])
    assert q.dtype == torch.bfloat16 and q.shape == (3, 64, 576)
    np.testing.assert_array_equal(q.float().numpy(), x["q"].astype(np.float32))

    class Identity:  # one rank: q_gather and lse_reduce are identities
        def q_gather(self, q):
            return q

        def lse_reduce(self, out_partial, lse_partial):
            return out_partial

    lens = np.array([11, 4, 0])  # the last sequence has no KV here
    out, q_full, out_partial, lse = side.decode(Identity(), q, kv, lens, m, dt)
    assert torch.isnan(out_partial[2].float()).all() and torch.isneginf(lse[2]).all()
    qf, kvf = demo.to_float32(x["q"]), demo.to_float32(x["kv"])
    for b in range(2):
        o_np, l_np = demo.attention(qf[b], kvf[b, : lens[b]], m.softmax_scale, m.v_dim)
        np.testing.assert_allclose(
            out_partial[b].float().numpy(),
            o_np,
            atol=2**-7 * np.abs(o_np).max(),
            err_msg=f"sequence {b}",
        )
        np.testing.assert_allclose(lse[b].numpy(), l_np, rtol=1e-5)
        ref = side.reference(q[b], kv[b, : lens[b]], m)
        assert ref.shape == (64, 512) and ref.dtype == torch.float32
        np.testing.assert_allclose(ref.numpy(), o_np, rtol=1e-4, atol=1e-5)
    full = torch.arange(24.0).reshape(6, 4)
    gathered = torch.cat([full[0::2], full[1::2]])  # 2 ranks, rank-major
    assert torch.equal(demo.deinterleave(gathered, 2, 6), full)


# ----------------------------------------------------------------------------- first-hour checks
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seed", "-1"], "argument --seed: must be an integer in [0, 2147483647] (got '-1')"),
        (
            ["--seed", "2147483648"],
            "argument --seed: must be an integer in [0, 2147483647] (got '2147483648')",
        ),
        (
            ["--iters", "1000000000000"],
            "argument --iters: must be an integer in [0, 10000] (got '1000000000000')",
        ),
        (["--json", ""], "argument --json: must name a file (got '')"),
        (
            ["--context", "1e20"],
            "argument --context: must be an integer in [1, 16777216] (got '1e20')",
        ),
        (
            ["--context", "2147483648"],
            "argument --context: must be an integer in [1, 16777216] (got '2147483648')",
        ),
        (["--batch", "x"], "argument --batch: must be an integer in [1, 65536] (got 'x')"),
        (
            ["--batch", "4096", "--context", "1000000"],
            "argument --context: --batch x --context must be at most 134217728 KV rows (the check "
            "gathers the whole KV cache onto every rank) (got 4096 x 1000000)",
        ),
        (["--iters", "2.5"], "argument --iters: must be an integer in [0, 10000] (got '2.5')"),
        (
            ["--timeout-ms", "-1"],
            "argument --timeout-ms: must be a number of milliseconds in [0.001, 3600000] (got '-1')",
        ),
        (
            ["--timeout-ms", "1e-300"],
            "argument --timeout-ms: must be a number of milliseconds in [0.001, 3600000] "
            "(got '1e-300')",
        ),
        (
            ["--timeout-ms", "nan"],
            "argument --timeout-ms: must be a number of milliseconds in [0.001, 3600000] (got 'nan')",
        ),
        (
            ["--timeout-ms", "inf"],
            "argument --timeout-ms: must be a number of milliseconds in [0.001, 3600000] (got 'inf')",
        ),
    ],
)
def test_numeric_arguments_are_validated_when_parsed_with_a_readable_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "invalid" not in err, err
    assert demo.main(argv, comm=Communicator.single()) == 2


def test_timeout_ms_is_parsed_as_milliseconds(monkeypatch):
    monkeypatch.delenv("DCPKIT_TIMEOUT_MS", raising=False)
    assert demo.parse_args(["--timeout-ms", "250"]).timeout_ms == 250.0
    assert demo.parse_args([]).timeout_ms == 5000.0  # the ops' own default


def test_json_into_a_missing_folder_is_refused_before_the_run(tmp_path, capsys):
    path = tmp_path / "missing" / "report.json"
    assert demo.main(["--json", str(path)], comm=Communicator.single()) == 2
    err = capsys.readouterr().err
    assert f"--json {path} is in a folder that does not exist ({path.parent})" in err, err
    assert "no CUDA GPU" not in err  # refused before the environment checks
    assert demo.main(["--json", str(tmp_path)], comm=Communicator.single()) == 2
    assert f"--json {tmp_path} is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_launcher_mismatch_is_one_line_and_exit_2(var, run_python):
    pytest.importorskip("mpi4py")
    res = run_python(["-m", "dcpkit", "demo", "--iters", "0"], env={var: "2"})
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(
        f"dcpkit demo: Communicator.from_mpi: the launcher started 2 processes ({var}=2)"
    ), lines[0]


def test_missing_cupy_is_reported_as_the_missing_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert demo.main(["--iters", "0"], comm=Communicator.single()) == 2
    err = capsys.readouterr().err
    assert (
        "dcpkit demo: cupy is not installed: install it with `pip install 'dcpkit[cuda1" in err
    ), err
    assert "no CUDA GPU" not in err


def test_missing_cuda_bindings_is_reported_as_the_missing_extra(monkeypatch, capsys):
    import dcpkit._cuda
    from dcpkit.errors import MissingDependency

    def no_bindings():
        raise MissingDependency("cuda-bindings (cuda-python)", "cuda12", "No module named 'cuda'")

    monkeypatch.setattr(dcpkit._cuda, "driver", no_bindings)
    assert demo.main(["--iters", "0"], comm=Communicator.single()) == 2
    err = capsys.readouterr().err
    assert (
        "cuda-bindings (cuda-python) is not installed: install it with `pip install "
        "'dcpkit[cuda12]'`" in err
    ), err
    assert "no CUDA GPU" not in err
