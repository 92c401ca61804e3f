"""dcpkit.errors: every class, its attributes and message; and _cuda.check."""

import pytest

from dcpkit import errors
from dcpkit._cuda import check
from dcpkit.errors import (
    ClosedError,
    CollectiveTimeout,
    CompileError,
    ConfigMismatch,
    CudaError,
    DcpkitError,
    InvalidArgument,
    InvalidType,
    MissingDependency,
    PeerError,
)


def test_every_public_error_is_a_dcpkit_error():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, DcpkitError), name
    assert issubclass(InvalidArgument, ValueError)
    assert issubclass(InvalidType, TypeError)
    assert issubclass(MissingDependency, ImportError)
    assert issubclass(CudaError, RuntimeError)


def test_missing_dependency_names_the_extra():
    e = MissingDependency("mpi4py", "mpi", "No module named 'mpi4py'")
    assert (e.what, e.extra) == ("mpi4py", "mpi")
    assert str(e) == (
        "mpi4py is not installed: install it with `pip install 'dcpkit[mpi]'` "
        "(No module named 'mpi4py')"
    )


def test_cuda_error():
    e = CudaError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", "free memory first")
    assert (e.call, e.result) == ("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")
    assert str(e) == "cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY: free memory first"


def test_compile_error():
    e = CompileError("q_gather.cu", ["-std=c++17", "-arch=sm_90"], "q_gather.cu(3): error: x")
    assert e.kernel == "q_gather.cu" and e.options == ("-std=c++17", "-arch=sm_90")
    assert "kernels/q_gather.cu" in str(e) and "['-std=c++17', '-arch=sm_90']" in str(e)
    assert str(e).endswith("q_gather.cu(3): error: x")


def test_collective_timeout_names_rank_peer_and_epoch():
    e = CollectiveTimeout(
        "lse_reduce",
        rank=2,
        peer=3,
        expected_epoch=17,
        observed_epoch=16,
        ubatch=1,
        timeout_ms=2000.0,
    )
    assert (e.op, e.rank, e.peer, e.expected_epoch, e.observed_epoch, e.ubatch) == (
        "lse_reduce",
        2,
        3,
        17,
        16,
        1,
    )
    s = str(e)
    for part in (
        "lse_reduce: rank 2",
        "2000 ms",
        "peer 3",
        "ubatch 1",
        "expected epoch 17",
        "observed 16",
        "poisoned",
    ):
        assert part in s, (part, s)


@pytest.mark.parametrize(
    "values, ranks",
    [
        ([8, 8, 16], [2]),  # majority 8
        ([16, 8, 8, 8], [0]),  # rank 0 is the odd one
        ([8, 16], [1]),  # tie: rank 0's value is the reference
        (["a", "b", "b", "a"], [1, 2]),
    ],
)
def test_config_mismatch_names_the_differing_ranks(values, ranks):
    e = ConfigMismatch("T_max", values)
    assert e.ranks == ranks
    assert e.values == dict(enumerate(values))
    assert f"ranks {ranks} differ" in str(e) and str(e).startswith("T_max must be equal")
    for r, v in enumerate(values):
        assert f"rank {r}: {v!r}" in str(e)


@pytest.mark.parametrize("values", [[128, 129, 130], ["a", "b", "c", "d"]])
def test_config_mismatch_without_a_majority_names_every_value(values):
    e = ConfigMismatch("T_max", values)
    assert e.ranks == list(range(1, len(values)))  # rank 0's value is the reference
    detail = ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))
    assert str(e) == f"T_max must be equal on every rank; no two ranks agree: T_max={detail}"
    assert "the others" not in str(e)


def test_peer_error():
    e = PeerError("heap setup", {2: "OSError: x", 0: "ValueError: y"})
    assert e.failed == {0: "ValueError: y", 2: "OSError: x"}
    assert (
        str(e) == "heap setup failed on rank(s) [0, 2]: rank 0: ValueError: y; rank 2: OSError: x"
    )


def test_closed_error_is_runtime_error():
    assert issubclass(ClosedError, RuntimeError)


class _Res:
    """Stands in for a cuda-bindings CUresult (an int enum with .name)."""

    def __init__(self, v, name):
        self.v, self.name = v, name

    def __int__(self):
        return self.v


def test_check_returns_values_and_raises_cuda_error():
    ok = _Res(0, "CUDA_SUCCESS")
    assert check((ok,), "cuInit") is None
    assert check(ok, "cuInit") is None
    assert check((ok, 5), "cuDeviceGet") == 5
    assert check((ok, 1, 2), "cuX") == (1, 2)
    with pytest.raises(
        CudaError, match=r"^cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY: hint$"
    ) as ei:
        check((_Res(2, "CUDA_ERROR_OUT_OF_MEMORY"), None), "cuMemCreate", "hint")
    assert ei.value.result == "CUDA_ERROR_OUT_OF_MEMORY"


def test_check_with_the_real_bindings_enum():
    drv = pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(CudaError, match="cuMemMap failed with CUDA_ERROR_INVALID_VALUE"):
        check((drv.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemMap")
    assert check((drv.CUresult.CUDA_SUCCESS, 7), "cuX") == 7


# ----------------------------------------------------------------------------- dcpkit's namespace
def test_every_error_class_is_exported_from_dcpkit():
    import dcpkit

    missing = [n for n in errors.__all__ if n not in dcpkit.__all__]
    assert not missing, f"dcpkit.__all__ lacks {missing} (raised by dcpkit, listed in errors)"
    for n in errors.__all__:
        assert getattr(dcpkit, n) is getattr(errors, n), n
    from dcpkit import ClosedError as C
    from dcpkit import InvalidArgument as A
    from dcpkit import PeerError as P

    assert P is PeerError and C is ClosedError and A is InvalidArgument


def test_every_name_in_dcpkit_all_resolves():
    import dcpkit

    assert len(set(dcpkit.__all__)) == len(dcpkit.__all__)
    for n in dcpkit.__all__:
        assert getattr(dcpkit, n) is not None, n
    with pytest.raises(AttributeError, match="module 'dcpkit' has no attribute 'nope'"):
        dcpkit.nope  # noqa: B018


def test_dir_dcpkit_lists_only_public_names():
    import dcpkit

    names = dir(dcpkit)
    for leaked in ("annotations", "importlib", "_LAZY", "_ERRORS"):
        assert leaked not in names, f"dir(dcpkit) lists {leaked!r}"
    assert set(dcpkit.__all__) <= set(names)
    assert [n for n in names if n.startswith("_")] == ["__version__"], names
