"""Communicator across real processes: ``mpiexec -n 2`` and ``-n 3`` on the CPU.

Each test launches tests/unit/mpi_scripts/comm_worker.py with one scenario; every rank writes
what it saw to ``rank<r>.json`` and the test checks every rank's file. A hang is a failure
(the launch is bounded and killed), never a stuck CI.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dcpkit.comm import Communicator, launcher_world_size
from dcpkit.errors import ClosedError, DcpkitError, InvalidArgument, InvalidType, PeerError

from _threadgroup import run_group

WORKER = Path(__file__).resolve().parent / "mpi_scripts" / "comm_worker.py"
LAUNCH_TIMEOUT_S = 60


def _results(outdir: Path, n: int, proc) -> list:
    setup_errors = sorted(outdir.glob("setup-error-*.json"))
    detail = (
        f"\n--- exit status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    assert not setup_errors, (
        "Communicator.from_mpi failed: " + "; ".join(p.read_text() for p in setup_errors) + detail
    )
    missing = [r for r in range(n) if not (outdir / f"rank{r}.json").is_file()]
    assert not missing, f"ranks {missing} wrote no result" + detail
    res = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(n)]
    for r, x in enumerate(res):
        assert "unexpected" not in x, f"rank {r}: {x['unexpected']}" + detail
        assert x["rank"] == r and x["world_size"] == n, f"rank {r}: {x}"
    assert proc.returncode == 0, f"mpiexec exited with {proc.returncode}" + detail
    return res


@pytest.fixture
def run_scenario(mpi_launcher, run_cmd, tmp_path):
    def run(scenario: str, n: int):
        outdir = tmp_path / f"{scenario}-{n}"
        outdir.mkdir()
        cmd = mpi_launcher.command(n, sys.executable, str(WORKER), scenario, str(outdir))
        proc = run_cmd(cmd, timeout=LAUNCH_TIMEOUT_S)
        return _results(outdir, n, proc)

    return run


@pytest.mark.parametrize("n", [2, 3])
def test_allgather_broadcast_barrier(run_scenario, n):
    res = run_scenario("basic", n)
    expected_gather = [{"rank": r, "payload": [r] * (r + 1)} for r in range(n)]
    root = n - 1
    for r, x in enumerate(res):
        assert x["backend"] == "mpi"
        assert x["allgather"] == expected_gather, f"rank {r}: allgather gave {x['allgather']}"
        assert x["allgather_big"] == [[1 << 20, s % 256, s % 256] for s in range(n)], (
            f"rank {r}: 1 MiB allgather gave {x['allgather_big']}"
        )
        assert x["broadcast_root"] == root
        assert x["broadcast"] == {"from": root, "data": list(range(root, root + 4))}, (
            f"rank {r}: broadcast from root {root} gave {x['broadcast']}"
        )
        assert x["marker_seen_after_barrier"], (
            f"rank {r} passed the barrier before rank 0 reached it"
        )
        # all ranks run on this host: local ranks are the ranks
        assert x["hosts"] == [x["host"]] * n
        assert (x["local_rank"], x["local_world_size"]) == (r, n)
    tokens = {x["job_token"] for x in res}
    assert len(tokens) == 1 and len(tokens.pop()) == 16, f"job tokens differ: {res}"


@pytest.mark.parametrize("n", [2, 3])
def test_agree_raises_config_mismatch_on_every_rank(run_scenario, n):
    res = run_scenario("agree", n)
    for r, x in enumerate(res):
        assert x["equal"] == ["bfloat16"] * n
        m = x["mismatch"]
        assert m is not None, f"rank {r}: agree() accepted differing values"
        assert m["type"] == "ConfigMismatch", f"rank {r}: {m}"
        assert m["what"] == "T_max"
        assert m["ranks"] == [n - 1], f"rank {r}: named ranks {m['ranks']}, expected [{n - 1}]"
        assert f"ranks [{n - 1}] differ" in m["message"] and "T_max" in m["message"], m["message"]
        assert f"rank {n - 1}: 16" in m["message"], m["message"]
        assert x["after"] is True


@pytest.mark.parametrize("n", [2, 3])
def test_failing_rank_in_setup_fails_every_rank(run_scenario, n):
    res = run_scenario("all_ok", n)
    for r, x in enumerate(res):
        e = x["error"]
        assert e is not None, f"rank {r}: setup succeeded although rank 1 failed"
        assert e["type"] == "PeerError", f"rank {r}: {e}"
        assert e["failed"] == {"1": "RuntimeError: simulated map failure on rank 1"}, e
        assert "failed on rank(s) [1]" in e["message"] and "'map'" in e["message"], e["message"]
        # the failing rank chains its own exception; the others have none to chain
        assert e["cause"] == ("RuntimeError" if r == 1 else None), f"rank {r}: {e}"
        # every rank unwound what it had done, in reverse
        assert x["undo"] == (["reserve"] if r == 1 else ["map", "reserve"]), f"rank {r}: {x}"
        em = x["error_many"]
        assert em is not None and em["type"] == "PeerError"
        assert em["failed"] == list(range(1, n)), f"rank {r}: {em}"
        assert x["clean"] == ["reserve", "map", "publish"]
        assert x["after"] is True


def test_from_mpi_outside_mpirun_is_one_rank(mpi_launcher, run_cmd, tmp_path):
    proc = run_cmd([sys.executable, WORKER, "single", tmp_path], timeout=LAUNCH_TIMEOUT_S)
    (x,) = _results(tmp_path, 1, proc)
    assert (x["rank"], x["world_size"], x["backend"]) == (0, 1, "mpi")
    assert (x["local_rank"], x["local_world_size"]) == (0, 1)
    assert x["allgather"] == [{"x": 1}] and x["broadcast"] == "b" and x["agree"] == [3]
    assert x["all_ok_error"]["type"] == "PeerError" and x["all_ok_error"]["cause"] == "ValueError"
    assert x["single"] == {
        "rank": 0,
        "world_size": 1,
        "backend": "single",
        "allgather": [5],
        "broadcast": 6,
    }


def test_from_mpi_detects_a_foreign_launcher(mpi_launcher, run_python):
    """Launched by one MPI's mpirun, mpi4py loading another MPI sees one rank: say so."""
    probe = run_python(
        "import mpi4py; mpi4py.rc.initialize = False\n"
        "from mpi4py import MPI; print(MPI.Get_library_version())"
    )
    assert probe.returncode == 0, probe.stderr
    lib = probe.stdout.lower()
    if "mpich" in lib:
        var = "OMPI_COMM_WORLD_SIZE"  # what Open MPI's mpirun would set; MPICH ignores it
    elif "open mpi" in lib:
        var = "PMI_SIZE"  # what MPICH's hydra would set; Open MPI ignores it
    else:
        pytest.skip(f"unknown MPI library, cannot fake a foreign launcher: {probe.stdout!r}")
    code = (
        "from dcpkit.comm import Communicator\n"
        "from dcpkit.errors import DcpkitError\n"
        "try:\n    Communicator.from_mpi()\n    print('NO ERROR')\n"
        "except DcpkitError as e:\n    print('ERROR', e)\n"
    )
    proc = run_python(code, env={var: "4"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ERROR"), proc.stdout + proc.stderr
    assert f"started 4 processes ({var}=4)" in proc.stdout, proc.stdout
    assert "MPI.COMM_WORLD has 1 rank" in proc.stdout, proc.stdout


def test_launcher_world_size():
    assert launcher_world_size({}) is None
    assert launcher_world_size({"PMI_SIZE": "1"}) is None
    assert launcher_world_size({"PMI_SIZE": "1" * 5000}) is None  # beyond int()'s 4300 digits
    assert launcher_world_size({"PMI_SIZE": "3"}) == ("PMI_SIZE", 3)
    assert launcher_world_size({"OMPI_COMM_WORLD_SIZE": "2"}) == ("OMPI_COMM_WORLD_SIZE", 2)
    assert launcher_world_size({"PMI_SIZE": "x"}) is None


def test_single_group():
    with Communicator.single() as c:
        assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (0, 1, 0, 1)
        assert c.backend == "single" and not c.spans_hosts
        assert c.allgather("a") == ["a"]
        assert c.broadcast({"k": 1}) == {"k": 1}
        c.barrier()
        assert c.agree("x", 1) == [1]
        c.all_ok("noop", None)
        with pytest.raises(PeerError, match=r"step failed on rank\(s\) \[0\]") as ei:
            c.all_ok("step", KeyError("k"))
        assert isinstance(ei.value.__cause__, KeyError)
        assert len(c.job_token()) == 16
        assert "world_size=1" in repr(c)
    # closed by the context manager; close() is idempotent
    c.close()
    with pytest.raises(ClosedError, match="Communicator.allgather: the communicator is closed"):
        c.allgather(1)
    with pytest.raises(ClosedError):
        c.barrier()


def test_broadcast_root_out_of_range():
    c = Communicator.single()
    with pytest.raises(DcpkitError, match=r"root must lie in \[0, 1\) \(got 1\)"):
        c.broadcast(0, root=1)


def _fake(rank, world_size):
    return Communicator(
        rank,
        world_size,
        allgather=lambda o: [o] * 2,
        broadcast=lambda o, r: o,
        barrier=lambda: None,
        backend="test",
    )


def test_rank_out_of_range():
    with pytest.raises(
        InvalidArgument,
        match=r"^Communicator: rank must lie in \[0, 2\) "
        r"\(got 2\)",
    ):
        _fake(2, 2)
    with pytest.raises(
        InvalidArgument,
        match=r"^Communicator: world_size must be >= 1 "
        r"\(got 0\)",
    ):
        _fake(0, 0)


@pytest.mark.parametrize(
    "rank,world_size,bad",
    [
        (0.5, 2, "rank"),
        ("0", 2, "rank"),
        (True, 2, "rank"),
        (None, 2, "rank"),
        (0, 2.0, "world_size"),
        (0, "2", "world_size"),
    ],
)
def test_rank_and_world_size_types(rank, world_size, bad):
    with pytest.raises(InvalidType, match=rf"^Communicator: {bad} must be an int \(got "):
        _fake(rank, world_size)


def test_numpy_int_rank_is_accepted():
    np = pytest.importorskip("numpy")
    assert _fake(np.int64(1), np.int32(2)).rank == 1


@pytest.mark.parametrize("root", ["0", None, True, 0.0, [0]])
def test_broadcast_root_type(root):
    c = Communicator.single()
    with pytest.raises(
        InvalidType,
        match=r"^Communicator.broadcast: root must be an int "
        r"\(got ",
    ):
        c.broadcast("x", root=root)


def test_from_mpi_refuses_a_non_communicator():
    pytest.importorskip("mpi4py")
    with pytest.raises(
        InvalidType,
        match=r"^Communicator.from_mpi: comm must be None or an "
        r"mpi4py.MPI.Comm \(got str 'x'\)",
    ):
        Communicator.from_mpi("x")


def test_unpicklable_objects_single_rank():
    c = Communicator.single()
    unpicklable = lambda: None  # noqa: E731 - a lambda does not pickle
    for method, call in (
        ("allgather", lambda: c.allgather(unpicklable)),
        ("agree", lambda: c.agree("thing", unpicklable)),
        ("broadcast", lambda: c.broadcast(unpicklable)),
        ("agree_setup", lambda: c.agree_setup("op", lambda: unpicklable)),
    ):
        with pytest.raises(
            InvalidType,
            match=rf"^Communicator.{method}: the object must be "
            rf"picklable \(got function: ",
        ):
            call()
    c.barrier()  # still usable
    assert c.allgather(1) == [1]


def test_unpicklable_object_on_one_rank_fails_every_rank():
    """No rank is left waiting: the rank with the bad object raises InvalidType, the others
    PeerError naming it."""
    bad = lambda: None  # noqa: E731

    def body(comm):
        res = {}
        for method in ("allgather", "agree", "broadcast"):
            obj = bad if comm.rank == 1 else comm.rank
            try:
                if method == "allgather":
                    comm.allgather(obj)
                elif method == "agree":
                    comm.agree("x", obj)
                else:
                    comm.broadcast(obj if comm.rank == 1 else None, root=1)
                res[method] = None
            except DcpkitError as e:
                res[method] = (type(e).__name__, str(e), getattr(e, "failed", None))
        res["after"] = comm.allgather(comm.rank)
        return res

    out = run_group(3, body)
    for r, (status, res) in enumerate(out):
        assert status == "ok", f"rank {r}: {res!r}"
        for method in ("allgather", "agree", "broadcast"):
            got = res[method]
            assert got is not None, f"rank {r}: {method} accepted an unpicklable object"
            if r == 1:
                assert (
                    got[0] == "InvalidType"
                    and f"Communicator.{method}: the object must be picklable" in got[1]
                ), f"rank {r}: {got}"
            else:
                assert got[0] == "PeerError", f"rank {r}: {got}"
                assert (
                    f"Communicator.{method}: pickling the object failed on rank(s) [1]" in got[1]
                ), got[1]
                assert list(got[2]) == [1]
        assert res["after"] == [0, 1, 2]


def test_all_ok_refuses_a_non_exception():
    c = Communicator.single()
    with pytest.raises(
        InvalidType,
        match=r"^Communicator.all_ok: error must be an exception or "
        r"None \(got str 'string'\)",
    ):
        c.all_ok("step", "string")

    def body(comm):
        try:
            comm.all_ok("step", "oops" if comm.rank == 0 else None)
        except DcpkitError as e:
            return type(e).__name__, str(e)
        return None

    out = run_group(2, body)
    assert out[0][1][0] == "InvalidType", out
    assert out[1][1][0] == "PeerError" and "step failed on rank(s) [0]" in out[1][1][1], out


def test_all_ok_failing_rank_raises_peer_error_chained_to_its_own():
    """What the docstring says: PeerError on every rank; on the failing rank its __cause__ is
    the rank's own exception."""

    def body(comm):
        own = ValueError("bad value") if comm.rank == 1 else None
        try:
            comm.all_ok("step", own)
        except PeerError as e:
            return type(e.__cause__).__name__ if e.__cause__ is not None else None, e.failed
        return "no error"

    out = run_group(2, body)
    assert out[1] == ("ok", ("ValueError", {1: "ValueError: bad value"})), out
    assert out[0] == ("ok", (None, {1: "ValueError: bad value"})), out
    doc = Communicator.all_ok.__doc__
    assert "PeerError" in doc and "from error" in doc


def test_closed_communicator_names_the_method():
    c = Communicator.single()
    c.close()
    for method, call in (
        ("allgather", lambda: c.allgather(1)),
        ("agree", lambda: c.agree("x", 1)),
        ("agree_setup", lambda: c.agree_setup("op", lambda: 1)),
        ("all_ok", lambda: c.all_ok("x", None)),
        ("broadcast", lambda: c.broadcast(1)),
        ("barrier", lambda: c.barrier()),
        ("job_token", lambda: c.job_token()),
    ):
        with pytest.raises(
            ClosedError,
            match=rf"^Communicator.{method}: the communicator is "
            rf"closed$",
        ):
            call()


# ----------------------------------------------------------------------------- agree: by value
def _agree_across(values):
    """Rank r calls agree("x", values[r]); per rank, None or the error's type name."""

    def body(comm):
        try:
            comm.agree("x", values[comm.rank])
        except DcpkitError as e:
            return type(e).__name__
        return None

    out = run_group(len(values), body)
    assert all(status == "ok" for status, _ in out), out
    return [res for _, res in out]


EQUAL_ACROSS_RANKS = [
    pytest.param([{"a": 1, "b": 2}, {"b": 2, "a": 1}], id="dict key order"),
    pytest.param([np.int64(3), 3, np.int32(3)], id="numpy and python ints"),
    pytest.param([3, 3.0, np.float32(3.0)], id="integral float"),
    pytest.param([0.5, np.float32(0.5), np.float16(0.5)], id="numpy floats"),
    pytest.param([float("nan"), np.float32("nan"), float("nan")], id="nan"),
    pytest.param([0.0, -0.0], id="signed zero"),
    pytest.param([(1, "a", [2.0]), [1, "a", (2,)]], id="list vs tuple elementwise"),
    pytest.param(
        [
            {"t": (np.int64(8), float("nan")), "d": {"x": None}},
            {"d": {"x": None}, "t": [8, float("nan")]},
        ],
        id="nested",
    ),
    pytest.param([True, np.bool_(True)], id="numpy bool"),
    pytest.param([np.dtype("float16"), np.dtype("<f2")], id="dtype"),
    pytest.param([{1, 2, 3}, frozenset({3, 2, 1})], id="sets"),
    pytest.param([np.arange(4), np.arange(4)], id="arrays"),
    pytest.param([np.str_("bf16"), "bf16"], id="numpy str"),
]


@pytest.mark.parametrize("values", EQUAL_ACROSS_RANKS)
def test_agree_compares_values_not_pickled_bytes(values):
    assert _agree_across(values) == [None] * len(values)


DIFFERENT_ACROSS_RANKS = [
    pytest.param([3, "3"], id="int vs str"),
    pytest.param([1, True], id="int vs bool"),
    pytest.param([0, False], id="zero vs False"),
    pytest.param(["3", b"3"], id="str vs bytes"),
    pytest.param([0.1, np.float32(0.1)], id="float32 rounding"),
    pytest.param([float("nan"), 0.0], id="nan vs number"),
    pytest.param([float("inf"), float("-inf")], id="infinities"),
    pytest.param([{"a": 1}, {"a": 1, "b": 2}], id="extra key"),
    pytest.param([{"a": 1}, {"A": 1}], id="other key"),
    pytest.param([(1, 2), (2, 1)], id="order of a sequence"),
    pytest.param([None, 0], id="None vs 0"),
    pytest.param([np.dtype("float16"), np.dtype("float32")], id="dtypes"),
    pytest.param([np.arange(4), np.arange(4).astype(np.int32)], id="array dtypes"),
    pytest.param([2**60 + 1, float(2**60)], id="large int vs nearest float"),
]


@pytest.mark.parametrize("values", DIFFERENT_ACROSS_RANKS)
def test_agree_keeps_types_that_really_differ_apart(values):
    assert _agree_across(values) == ["ConfigMismatch"] * len(values)


def test_canonical_form_is_deterministic_and_hashable():
    from dcpkit.comm import canonical

    a = {"z": [1, 2.5, {"k": np.int16(7)}], "a": (None, "s", b"b", float("nan"))}
    b = {"a": [None, "s", b"b", np.float64("nan")], "z": ((1, np.float32(2.5), {"k": 7}))}
    assert canonical(a) == canonical(b)
    assert hash(canonical(a)) == hash(canonical(b))
    # repeated calls, and a value rebuilt through pickle (what another rank sends), agree
    import pickle

    assert canonical(pickle.loads(pickle.dumps(a))) == canonical(a)


def test_agree_setup_compares_the_settings_by_name():
    """A setting read from one rank's environment (DCPKIT_DEBUG) that differs raises
    ConfigMismatch on every rank, naming the setting and the odd rank; equal settings pass and
    the geometry comes back."""

    def body(comm):
        on = comm.rank == 2
        try:
            return comm.agree_setup("Op", lambda: (8, "bf16"), "geometry", {"DCPKIT_DEBUG": on})
        except DcpkitError as e:
            return type(e).__name__, str(e), getattr(e, "ranks", None)

    for r, (status, res) in enumerate(run_group(3, body)):
        assert status == "ok", f"rank {r}: {res!r}"
        assert res[0] == "ConfigMismatch", f"rank {r}: {res}"
        assert res[1].startswith("Op: DCPKIT_DEBUG must be equal on every rank"), res[1]
        assert "rank 2: True" in res[1] and res[2] == [2], res

    def same(comm):
        return comm.agree_setup("Op", lambda: (8, "bf16"), "geometry", {"DCPKIT_DEBUG": True})

    assert run_group(2, same) == [("ok", (8, "bf16"))] * 2


def test_agree_setup_checks_the_geometry_before_the_settings():
    def body(comm):
        try:
            comm.agree_setup("Op", lambda: comm.rank, "geometry", {"DCPKIT_DEBUG": comm.rank > 0})
        except DcpkitError as e:
            return str(e)
        return None

    for status, res in run_group(2, body):
        assert status == "ok" and res.startswith("Op: geometry must be equal"), res


def test_broadcast_with_different_roots_fails_every_rank():
    """Ranks that name different roots get ConfigMismatch naming them, never another rank's
    object (rank 2 asked for its own value and would have got rank 0's)."""

    def body(comm):
        root = 2 if comm.rank == 2 else 0
        try:
            got = comm.broadcast(f"value of rank {comm.rank}", root=root)
            res = ("ok", got)
        except DcpkitError as e:
            res = (type(e).__name__, str(e), getattr(e, "ranks", None))
        return res, comm.allgather(comm.rank)

    out = run_group(3, body)
    for r, (status, (res, after)) in enumerate(out):
        assert status == "ok", f"rank {r}: {res!r}"
        assert res[0] == "ConfigMismatch", f"rank {r}: {res}"
        assert "Communicator.broadcast: root" in res[1] and "rank 2: 2" in res[1], res[1]
        assert list(res[2]) == [2], res
        assert after == [0, 1, 2]


@pytest.mark.parametrize("bad", [2, -1, "0", False])
def test_broadcast_with_a_bad_root_on_one_rank_fails_every_rank(bad):
    """A root that is bad on one rank only: that rank raises its own error, the others
    ConfigMismatch, and nobody waits in a broadcast the bad rank never enters."""

    def body(comm):
        try:
            comm.broadcast("x", root=bad if comm.rank == 1 else 0)
            res = ("ok",)
        except DcpkitError as e:
            res = (type(e).__name__, str(e))
        return res, comm.allgather(comm.rank)

    out = run_group(2, body)
    for r, (status, (res, after)) in enumerate(out):
        assert status == "ok", f"rank {r}: {res!r}"
        want = (
            ("InvalidType" if isinstance(bad, (str, bool)) else "InvalidArgument")
            if r == 1
            else ("ConfigMismatch")
        )
        assert res[0] == want, f"rank {r}: {res}"
        assert after == [0, 1]
