"""What a new user sees on a machine without GPU or without the CUDA extra: errors that say
what is missing, never a misleading one, and tools that end with one line and a non-zero exit
instead of a traceback."""

from __future__ import annotations

import types

import pytest

import dcpkit
import dcpkit._cuda
from dcpkit import info
from dcpkit.errors import DcpkitError

INSUFFICIENT = (
    "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
)


class _Runtime:
    """cupy.cuda.runtime of a machine whose getDeviceCount fails with ``error``."""

    def __init__(self, error):
        self.error = error

    def getDeviceCount(self):
        raise RuntimeError(self.error)


def _fake_cupy(monkeypatch, error):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_Runtime(error)))
    monkeypatch.setattr(dcpkit._cuda, "require_cupy", lambda: fake)


def test_no_driver_library_is_called_no_driver(monkeypatch):
    """Without libcuda the CUDA runtime says the driver is "insufficient": the error must say
    there is no driver instead."""
    _fake_cupy(monkeypatch, INSUFFICIENT)
    monkeypatch.setattr(dcpkit._cuda, "driver_library_loads", lambda: False)
    with pytest.raises(DcpkitError) as ei:
        dcpkit._cuda.require_device("lse_reduce")
    msg = str(ei.value)
    assert msg.startswith(
        "lse_reduce: no CUDA GPU is visible (no CUDA driver on this machine: "
        "the NVIDIA driver library libcuda.so.1 cannot be loaded)"
    ), msg
    assert "insufficient" not in msg.lower(), msg


def test_a_driver_older_than_the_runtime_keeps_the_runtime_error(monkeypatch):
    _fake_cupy(monkeypatch, INSUFFICIENT)
    monkeypatch.setattr(dcpkit._cuda, "driver_library_loads", lambda: True)
    with pytest.raises(DcpkitError) as ei:
        dcpkit._cuda.require_device("lse_reduce")
    assert "cudaErrorInsufficientDriver" in str(ei.value), str(ei.value)
    assert "no CUDA driver on this machine" not in str(ei.value)


def _constructors():
    comm = dcpkit.Communicator.single()
    return {
        "LseReduce": lambda: dcpkit.LseReduce(
            comm, max_tokens=8, num_heads=2, head_dim=64, dtype="bfloat16"
        ),
        "QGather": lambda: dcpkit.QGather(
            comm, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="bfloat16"
        ),
        "KVGather": lambda: dcpkit.KVGather(comm, max_tokens=8, row_dim=64, dtype="bfloat16"),
        "SymmetricHeap": lambda: dcpkit.SymmetricHeap(comm, 4096),
        "DCPComm": lambda: dcpkit.DCPComm(
            comm, max_tokens=8, num_heads=2, q_head_dim=64, v_head_dim=64, dtype="bfloat16"
        ),
    }


@pytest.mark.parametrize("name", ["LseReduce", "QGather", "KVGather", "SymmetricHeap", "DCPComm"])
def test_constructors_on_a_machine_without_driver_say_so(name):
    if dcpkit._cuda.driver_library_loads():
        pytest.skip("this machine has a CUDA driver library (the case is faked above)")
    try:
        dcpkit._cuda.require_cupy()
    except DcpkitError as e:
        pytest.skip(f"CuPy is not installed here: {e}")
    with pytest.raises(DcpkitError) as ei:
        _constructors()[name]()
    msg = str(ei.value)
    assert "no CUDA driver on this machine" in msg, msg
    assert "insufficient" not in msg.lower(), msg


# ----------------------------------------------------------------------------- dcpkit info
def test_python_dash_m_dcpkit_info_prints_the_report(run_python):
    proc = run_python(["-m", "dcpkit.info"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"dcpkit {dcpkit.__version__}"), proc.stdout
    assert "CUDA driver" in proc.stdout and "multicast" in proc.stdout, proc.stdout
    proc = run_python(["-m", "dcpkit.info", "--json"])
    assert proc.returncode == 0 and proc.stdout.lstrip().startswith("{"), proc.stdout


def test_info_without_a_driver_says_no_driver(monkeypatch):
    monkeypatch.setattr(
        info,
        "_driver_probe",
        lambda: {
            "ok": False,
            "version": None,
            "error": 'DynamicLibNotFoundError: "cuda" is an NVIDIA driver library',
        },
    )
    monkeypatch.setattr(info, "_libcuda_loads", lambda: False)
    monkeypatch.setattr(
        info,
        "_gpus",
        lambda driver_ok: {
            "count": 0,
            "gpus": [],
            "p2p": [],
            "error": f"CUDARuntimeError: {INSUFFICIENT}",
        },
    )
    text = info.format_text(info.collect())
    assert "no CUDA driver on this machine" in text, text
    assert "insufficient" not in text.lower(), text


# ----------------------------------------------------------------------------- mixed CUDA stacks
def _versions(**kw):
    v = {
        "cupy": "14.2.0",
        "cuda_runtime": "12.9",
        "cuda_bindings": "12.9.10",
        "nvrtc": "12.9",
        "cuda_packages": {
            "cupy-cuda12x": "14.2.0",
            "nvidia-cuda-nvrtc-cu12": "12.9.86",
            "nvidia-cuda-runtime-cu12": "12.9.79",
        },
    }
    v.update(kw)
    return v


def test_a_consistent_stack_gives_no_warning():
    assert info.stack_warnings(_versions()) == []
    assert info.stack_warnings(_versions(), {"ok": True, "version": "13.0"}) == []
    v13 = _versions(
        cuda_runtime="13.0",
        cuda_bindings="13.3.1",
        nvrtc="13.0",
        cuda_packages={"cupy-cuda13x": "14.2.0", "nvidia-cuda-nvrtc": "13.0.88"},
    )
    assert info.stack_warnings(v13, {"ok": True, "version": "13.0"}) == []


@pytest.mark.parametrize(
    "change, fragment",
    [
        (
            {"nvrtc": "13.5"},
            "mixed CUDA majors: cuda-bindings 12.9.10, CUDA runtime 12.9, NVRTC 13.5",
        ),
        ({"cuda_bindings": "13.3.1"}, "mixed CUDA majors: cuda-bindings 13.3.1"),
        (
            {"cuda_packages": {"cupy-cuda12x": "14.2.0", "cupy-cuda13x": "14.2.0"}},
            "both cupy-cuda12x 14.2.0 and cupy-cuda13x 14.2.0 are installed",
        ),
        (
            {"cuda_packages": {"cupy-cuda12x": "14.2.0", "nvidia-cuda-nvrtc": "13.0.88"}},
            (
                "wheels of two CUDA majors are installed (CUDA 12: cupy-cuda12x 14.2.0; CUDA 13: "
                "nvidia-cuda-nvrtc 13.0.88)"
            ),
        ),
    ],
)
def test_a_mixed_stack_is_flagged(change, fragment):
    warnings = info.stack_warnings(_versions(**change))
    assert any(fragment in w for w in warnings), warnings


def test_unsuffixed_cuda_wheels_count_by_their_own_major():
    v = _versions(cuda_packages={"cupy-cuda12x": "14.2.0", "nvidia-cuda-nvrtc": "12.9.86"})
    assert info.stack_warnings(v) == []
    v = _versions(cuda_packages={"cupy-cuda12x": "14.2.0", "nvidia-cuda-runtime": "13.0.96"})
    assert any("CUDA 13: nvidia-cuda-runtime 13.0.96" in w for w in info.stack_warnings(v))


def test_a_driver_older_than_the_runtime_is_flagged():
    v = _versions(
        cuda_runtime="13.0",
        cuda_bindings="13.3.1",
        nvrtc="13.0",
        cuda_packages={"cupy-cuda13x": "14.2.0"},
    )
    warnings = info.stack_warnings(v, {"ok": True, "version": "12.8"})
    assert warnings == [
        (
            "the CUDA driver (12.8) is older than the CUDA runtime CuPy loads "
            "(13.0): install the cuda12 extra instead"
        )
    ], warnings


def test_info_prints_a_warning_line_for_a_mixed_stack(monkeypatch):
    real = info._dist_version
    fake = {"cupy-cuda13x": "14.2.0", "nvidia-cuda-nvrtc": "13.0.88"}
    monkeypatch.setattr(info, "_dist_version", lambda name: fake.get(name) or real(name))
    d = info.collect()
    text = info.format_text(d)
    if real("cupy-cuda12x") is None:
        pytest.skip("this environment has no cupy-cuda12x to mix with")
    assert "warning: both cupy-cuda12x" in text, text
    assert "warning: wheels of two CUDA majors are installed" in text, text
    assert d["warnings"], d


# ----------------------------------------------------------------------------- scripts/
@pytest.mark.parametrize(
    "script, args",
    [
        ("soak.py", ["--calls", "10"]),
        ("two_jobs_check.py", ["--job", "a"]),
        ("kernel_timeline.py", ["--tokens", "1"]),
        ("programmatic_launch.py", ["--replays", "4"]),
        ("protocol_probe.py", ["--replays", "4"]),
    ],
)
def test_scripts_without_a_gpu_end_with_one_line(repo_root, run_python, script, args):
    path = repo_root / "scripts" / script
    if not path.is_file():
        pytest.skip(f"no {path} (tests run from an installed copy without the checkout)")
    if info.collect()["gpu_count"] > 0:
        pytest.skip("this machine has a GPU")
    proc = run_python([str(path), *args], timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA GPU is visible" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
