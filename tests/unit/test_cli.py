"""The ``dcpkit`` command: ``info`` on this (GPU-less) machine, its JSON, the GPU report on
faked devices, and subcommand dispatch."""

import json
import sys
import types
from pathlib import Path

import pytest

import dcpkit
from dcpkit import cli, info
from dcpkit.errors import MissingDependency


def _has_gpu() -> bool:
    return info.collect()["gpu_count"] > 0


def test_info_runs_and_says_no_gpu(run_python):
    proc = run_python(["-m", "dcpkit", "info"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"dcpkit {dcpkit.__version__}" in out
    for name in ("CuPy", "cuda-bindings", "NVRTC", "NCCL", "NVSHMEM", "mpi4py", "MPI library"):
        assert f"  {name}" in out, f"no {name} line in:\n{out}"
    assert "multicast" in out and "P2P access" in out
    if not _has_gpu():
        assert "GPUs             none: no GPU here" in out, out
        assert "P2P access       n/a (no GPU)" in out
    assert "Traceback" not in proc.stderr


def test_info_json_parses(run_python):
    proc = run_python(["-m", "dcpkit", "info", "--json"])
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["versions"]["dcpkit"] == dcpkit.__version__
    assert set(d) >= {"versions", "driver", "gpu_count", "gpus", "p2p", "multicast", "env"}
    assert d["gpu_count"] == len(d["gpus"]) == len(d["p2p"])
    if d["gpu_count"] == 0:
        assert d["no_gpu_reason"]
        assert d["multicast"]["device_supported"] is None


def test_info_never_creates_multicast_and_asks_the_guard(monkeypatch):
    """info asks dcpkit.multicast.multicast_decision, as configured and as if opted in."""
    calls = []

    def fake_decision(opt_in, env, device_supported):
        calls.append((opt_in, dict(env), device_supported))
        return (False, f"fake reason for opt_in={opt_in!r}")

    fake = types.ModuleType("dcpkit.multicast")
    fake.multicast_decision = fake_decision
    monkeypatch.setitem(sys.modules, "dcpkit.multicast", fake)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    d = info.collect()
    assert [c[0] for c in calls] == [None, True]
    assert all(c[1].get("NCCL_NVLS_ENABLE") == "0" for c in calls)
    assert d["multicast"]["reason"] == "fake reason for opt_in=None"
    assert d["multicast"]["reason_if_opted_in"] == "fake reason for opt_in=True"
    text = info.format_text(d)
    assert "dcpkit would use it: no (fake reason for opt_in=None)" in text
    assert "NCCL_NVLS_ENABLE=0" in text


def test_info_without_multicast_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "dcpkit.multicast", None)  # import fails
    text = info.format_text(info.collect())
    assert "multicast: unknown (dcpkit.multicast not available)" in text


class _FakeRuntime:
    """Four H200-like devices with full P2P (what MEASURED.md reports)."""

    def getDeviceCount(self):
        return 4

    def getDeviceProperties(self, d):
        return {
            "name": b"NVIDIA H200",
            "major": 9,
            "minor": 0,
            "multiProcessorCount": 132,
            "totalGlobalMem": 150_000_000_000,
        }

    def deviceCanAccessPeer(self, i, j):
        return 1


class _FakeDriver:
    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = "mc"
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = "vmm"
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = "fd"
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = "fabric"

    def cuInit(self, flags):
        return (0,)

    def cuDriverGetVersion(self):
        return (0, 13000)

    def cuDeviceGet(self, d):
        return (0, d)

    def cuDeviceGetAttribute(self, attr, dev):
        return (0, 1)


def test_info_reports_gpus_p2p_and_multicast(monkeypatch):
    """The GPU part of the report, on faked devices (CuPy runtime and driver replaced)."""
    cupy = pytest.importorskip("cupy")
    from dcpkit import _cuda

    monkeypatch.setattr(cupy.cuda, "runtime", _FakeRuntime())
    monkeypatch.setattr(_cuda, "driver", lambda: _FakeDriver())
    for k in ("DCPKIT_MULTICAST", "DCPKIT_DISABLE_MULTICAST"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    d = info.collect()
    assert d["driver"] == {"ok": True, "version": "13.0", "error": None}
    assert d["gpu_count"] == 4
    assert d["gpus"][3] == {
        "index": 3,
        "name": "NVIDIA H200",
        "compute_capability": "9.0",
        "sm_count": 132,
        "memory_bytes": 150_000_000_000,
        "multicast_supported": 1,
        "vmm_supported": 1,
        "posix_fd_handles": 1,
        "fabric_handles": 1,
    }
    assert d["p2p"][0] == [None, True, True, True]
    assert d["multicast"]["device_supported"] is True
    text = info.format_text(d)
    assert "GPUs             4" in text
    assert "  2  NVIDIA H200  sm_90  132 SMs  139.7 GiB  multicast yes" in text, text
    assert "full P2P: yes" in text
    assert "supported by every GPU: yes" in text
    if d["multicast"].get("used") is not None:  # the real guard answered
        assert d["multicast"]["used"] is False
        assert d["multicast"]["used_if_opted_in"] is False
        assert "NCCL_NVLS_ENABLE" in d["multicast"]["reason_if_opted_in"]


def test_console_script(run_cmd, skip_or_fail):
    exe = Path(sys.executable).parent / "dcpkit"
    if not exe.is_file():
        skip_or_fail(f"no console script at {exe} (dcpkit is not installed in this environment)")
    proc = run_cmd([exe, "info", "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["versions"]["dcpkit"] == dcpkit.__version__


def test_usage_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert "usage: dcpkit {info,demo,bench}" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "usage: dcpkit" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    # one line, as every other usage error of the command: no usage block
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert "unknown command 'frobnicate'" in err and "info, demo, bench" in err, err


def test_missing_subcommand_module(monkeypatch, capsys):
    monkeypatch.setitem(cli._COMMANDS, "ghost", ("dcpkit._no_such_module", "a missing one"))
    assert cli.main(["ghost"]) == 2
    assert "dcpkit._no_such_module is not available in this installation" in capsys.readouterr().err


def test_subcommand_gets_its_arguments_and_missing_dependency_is_named(monkeypatch, capsys):
    seen = []
    mod = types.ModuleType("dcpkit._fake_cmd")

    def main(argv):
        seen.append(argv)
        if "--need-mpi" in argv:
            raise MissingDependency("mpi4py", "mpi")
        return 3

    mod.main = main
    monkeypatch.setitem(sys.modules, "dcpkit._fake_cmd", mod)
    monkeypatch.setitem(cli._COMMANDS, "fake", ("dcpkit._fake_cmd", "test"))
    assert cli.main(["fake", "--x", "1"]) == 3
    assert seen == [["--x", "1"]]
    assert cli.main(["fake", "--need-mpi"]) == 2
    assert "pip install 'dcpkit[mpi]'" in capsys.readouterr().err


def test_python_dash_m_dcpkit_without_arguments(run_python):
    proc = run_python(["-m", "dcpkit"])
    assert proc.returncode == 2
    assert "usage: dcpkit" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- unknown multicast
def test_info_without_gpu_says_unknown_not_reports_0(monkeypatch):
    """No GPU: nothing was queried, so the report must not claim the device said 0."""
    monkeypatch.setattr(
        info, "_gpus", lambda driver_ok: {"count": 0, "gpus": [], "p2p": [], "error": "no driver"}
    )
    monkeypatch.setenv("DCPKIT_MULTICAST", "1")
    for k in (
        "DCPKIT_DISABLE_MULTICAST",
        "NCCL_NVLS_ENABLE",
        "NVSHMEM_DISABLE_NVLS",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    ):
        monkeypatch.delenv(k, raising=False)
    d = info.collect()
    mc = d["multicast"]
    assert mc["device_supported"] is None
    assert mc["reason"].startswith("unknown (no GPU/driver"), mc
    assert mc["used_if_opted_in"] is None and mc["reason_if_opted_in"].startswith(
        "unknown (no GPU/driver"
    ), mc
    text = info.format_text(d)
    assert "MULTICAST_SUPPORTED = 0" not in text, text
    assert "if opted in (multicast=True or DCPKIT_MULTICAST=1): unknown (no GPU/driver" in text
    # not opted in: the guard never gets to the device, the reason stays "not opted in"
    monkeypatch.delenv("DCPKIT_MULTICAST")
    mc = info.collect()["multicast"]
    assert mc["used"] is False and mc["reason"].startswith("not opted in"), mc


def _one_gpu(multicast_supported):
    """What info._gpus reports for one made-up GPU whose multicast attribute reads as given."""
    gpu = {
        "index": 0,
        "name": "X",
        "compute_capability": "9.0",
        "sm_count": 1,
        "memory_bytes": 1,
        "multicast_supported": multicast_supported,
    }
    return {"count": 1, "gpus": [gpu], "p2p": [[None]], "error": None}


def test_info_gpu_with_unreadable_attribute_is_unknown(monkeypatch):
    gpus = _one_gpu(multicast_supported=None)
    monkeypatch.setattr(info, "_gpus", lambda driver_ok: gpus)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.delenv("DCPKIT_DISABLE_MULTICAST", raising=False)
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    mc = info.collect()["multicast"]
    assert mc["used_if_opted_in"] is None
    assert mc["reason_if_opted_in"] == (
        "unknown (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED could not be read)"
    )


# ----------------------------------------------------------------------------- no driver probe
def test_no_driver_reason(monkeypatch):
    lib_missing = {
        "ok": False,
        "version": None,
        "error": 'DynamicLibNotFoundError: "cuda" is an NVIDIA driver library',
    }
    assert info.no_driver_reason(lib_missing).startswith("no CUDA driver found")
    assert info.no_driver_reason({"ok": True, "version": "13.0", "error": None}) is None
    # the driver is there but does not initialise: not "no driver"
    assert (
        info.no_driver_reason(
            {"ok": False, "version": None, "error": "cuInit failed with CUDA_ERROR_NO_DEVICE"}
        )
        is None
    )
    # cuda-bindings missing: ask the loader directly
    no_bindings = {"ok": False, "version": None, "error": "MissingDependency: cuda-bindings"}
    monkeypatch.setattr(info, "_libcuda_loads", lambda: False)
    assert info.no_driver_reason(no_bindings).startswith("no CUDA driver found")
    monkeypatch.setattr(info, "_libcuda_loads", lambda: True)
    assert info.no_driver_reason(no_bindings) is None


def test_no_driver_reason_on_this_machine():
    probe = info._driver_probe()
    reason = info.no_driver_reason()
    if probe["ok"]:
        assert reason is None
    elif "DynamicLibNotFoundError" in str(probe["error"]):
        assert reason == (
            "no CUDA driver found (the NVIDIA driver library libcuda.so.1 cannot be "
            "loaded on this machine)"
        )


# ----------------------------------------------------------------------------- one report per job
def test_launcher_rank():
    assert info.launcher_rank({}) is None
    assert info.launcher_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert info.launcher_rank({"PMIX_RANK": "1"}) == 1
    assert info.launcher_rank({"PMI_RANK": "0"}) == 0
    assert info.launcher_rank({"PMI_RANK": "x"}) is None
    assert info.launcher_rank({"PMI_RANK": "\u0661"}) is None  # an Arabic-Indic 1: no rank
    assert info.launcher_rank({"PMI_RANK": " 3 "}) == 3
    assert info.launcher_rank({"PMI_RANK": "1" * 5000}) is None
    assert info.launcher_rank({"OMPI_COMM_WORLD_RANK": "x", "PMI_RANK": "1"}) == 1


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"])
def test_info_prints_only_on_launcher_rank_0(run_python, var):
    quiet = run_python(["-m", "dcpkit", "info", "--json"], env={var: "2"})
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout + quiet.stderr
    loud = run_python(["-m", "dcpkit", "info", "--json", "--all-ranks"], env={var: "2"})
    assert loud.returncode == 0, loud.stderr
    assert json.loads(loud.stdout)["launcher_rank"] == 2
    first = run_python(["-m", "dcpkit", "info"], env={var: "0"})
    assert first.returncode == 0 and "[launcher rank 0]" in first.stdout


def test_info_under_mpiexec_prints_one_document(mpi_launcher, run_cmd):
    proc = run_cmd(
        mpi_launcher.command(3, sys.executable, "-m", "dcpkit", "info", "--json"), timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)  # exactly one JSON document
    assert d["launcher_rank"] == 0


def test_info_json_on_all_ranks_is_one_line_per_rank(mpi_launcher, run_cmd):
    """--json --all-ranks under a launcher: every rank's report is one JSON line, so the
    reports of the ranks, sharing one stdout, can be read back (JSON Lines)."""
    cmd = mpi_launcher.command(3, sys.executable, "-m", "dcpkit", "info", "--json", "--all-ranks")
    proc = run_cmd(cmd, timeout=180)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 3, proc.stdout
    assert sorted(json.loads(ln)["launcher_rank"] for ln in lines) == [0, 1, 2]


@pytest.mark.parametrize(
    "env, line, warns",
    [
        ({}, "settings         wait deadline 5000 ms (default), DCPKIT_DEBUG off", False),
        (
            {"DCPKIT_TIMEOUT_MS": "250", "DCPKIT_DEBUG": "1"},
            "wait deadline 250 ms (DCPKIT_TIMEOUT_MS)",
            False,
        ),
        ({"DCPKIT_TIMEOUT_MS": "abc"}, "wait deadline invalid DCPKIT_TIMEOUT_MS", True),
        ({"DCPKIT_TIMEOUT_MS": "0"}, "wait deadline invalid DCPKIT_TIMEOUT_MS", True),
    ],
)
def test_info_shows_the_settings_and_refuses_a_bad_deadline(monkeypatch, env, line, warns):
    for k in ("DCPKIT_TIMEOUT_MS", "DCPKIT_DEBUG"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    d = info.collect()
    text = info.format_text(d)
    assert line in text
    assert d["settings"]["debug"] == ("DCPKIT_DEBUG" in env)
    bad = [w for w in d["warnings"] if "DCPKIT_TIMEOUT_MS must be" in w]
    assert bool(bad) == warns
    if warns:
        assert d["settings"]["timeout_ms"] is None
        assert f"(got {env['DCPKIT_TIMEOUT_MS']!r})" in bad[0]
        assert "ops built without timeout_ms refuse to build" in bad[0], bad[0]
        assert f"warning: {bad[0]}" in text


def test_info_lists_the_mps_share(monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in info.format_text(info.collect())


@pytest.mark.parametrize(
    "value, on",
    [
        ("1", True),
        ("yes", True),
        ("2", True),
        ("anything", True),
        ("", False),
        ("0", False),
        ("00", False),
        ("false", False),
        ("OFF", False),
        (" no ", False),
        (" ", False),
        ("\t0\n", False),
        ("0" * 5000, False),  # beyond int()'s 4300 digits: read without it, never raising
        ("0" * 4999 + "1", True),
        ("-" + "0" * 5000, False),
    ],
)
def test_dcpkit_debug_reads_false_words_as_off(monkeypatch, value, on):
    """DCPKIT_DEBUG=false (or off, no) leaves the per-call check off, as DCPKIT_MULTICAST
    reads the same words; info shows what the ops will do."""
    from dcpkit._setup import debug_enabled

    monkeypatch.setenv("DCPKIT_DEBUG", value)
    assert debug_enabled() is on
    d = info.collect()
    assert d["settings"]["debug"] is on
    assert f"DCPKIT_DEBUG {'on' if on else 'off'}" in info.format_text(d)


def test_readme_says_what_dcpkit_debug_reads_as_off(repo_root, monkeypatch):
    """Every value the README lists as off is off, and the README names the values beyond its
    word list that are off too (blank, spaces around a word, other spellings of 0)."""
    from dcpkit._setup import debug_enabled

    text = " ".join((repo_root / "README.md").read_text().split())
    said = text.split("`DCPKIT_DEBUG=1` (read when the op is built; ", 1)[1].split(")", 1)[0]
    assert "a blank value" in said and "spaces around them" in said and "`00`" in said, said
    for value in ("", "0", "false", "no", "off", "n", "f", "FALSE", " ", " off ", "00"):
        monkeypatch.setenv("DCPKIT_DEBUG", value)
        assert debug_enabled() is False, value
    for value in ("1", "on", "x", "-", "0_0", "1_0", "\u0660"):
        monkeypatch.setenv("DCPKIT_DEBUG", value)
        assert debug_enabled() is True, value


# ----------------------------------------------------------------------------- malformed guard
def test_info_asks_each_multicast_question_on_its_own(monkeypatch):
    """A malformed variable spoils only the answer that reads it: DCPKIT_MULTICAST is read
    without opt-in, the disabling variables once opted in."""
    gpus = _one_gpu(multicast_supported=1)
    monkeypatch.setattr(info, "_gpus", lambda driver_ok: gpus)
    for k in (
        "DCPKIT_DISABLE_MULTICAST",
        "NVSHMEM_DISABLE_NVLS",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("DCPKIT_MULTICAST", "maybe")
    mc = info.collect()["multicast"]
    assert mc["used"] is None and mc["reason"].startswith("refused: "), mc
    assert "'maybe'" in mc["reason"]
    # the opted-in question does not read DCPKIT_MULTICAST: NCCL_NVLS_ENABLE=0 refuses
    assert mc["used_if_opted_in"] is False and "NCCL_NVLS_ENABLE" in mc["reason_if_opted_in"]
    text = info.format_text(info.collect())
    assert "dcpkit would use it: refused: " in text, text
    # the other way round: a word in NCCL_NVLS_ENABLE spoils only the opted-in answer
    monkeypatch.delenv("DCPKIT_MULTICAST")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "true")
    mc = info.collect()["multicast"]
    assert mc["used"] is False and mc["reason"].startswith("not opted in"), mc
    assert mc["used_if_opted_in"] is None
    assert mc["reason_if_opted_in"].startswith("refused: ") and "'true'" in mc["reason_if_opted_in"]


def test_info_drops_the_nul_byte_of_open_mpis_library_version(monkeypatch):
    """Open MPI's MPI_Get_library_version string ends in a NUL byte; printed as it is, the
    report (and a log holding it) reads as binary to grep."""
    pytest.importorskip("mpi4py")
    import types

    fake = types.SimpleNamespace(
        Get_library_version=lambda: "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6\x00",
        COMM_WORLD=types.SimpleNamespace(Get_size=lambda: 1),
    )
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    import mpi4py

    monkeypatch.setattr(mpi4py, "MPI", fake, raising=False)
    v = info._versions()
    assert v["mpi_library"] == "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6"
    assert "\x00" not in info.format_text(info.collect())
