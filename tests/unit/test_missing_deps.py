"""A missing optional dependency gives MissingDependency naming the pip extra to install, not an
ImportError from deep inside. Each case runs in a fresh interpreter in which the dependency's
top-level package is blocked (``sys.modules[name] = None`` makes every import of it fail)."""

import json
import re

import pytest

_PROBE = """
import json, sys
for name in {blocked!r}:
    sys.modules[name] = None
from dcpkit.errors import MissingDependency
try:
{call}
    print(json.dumps({{"raised": None}}))
except MissingDependency as e:
    print(json.dumps({{"raised": "MissingDependency", "message": str(e), "extra": e.extra,
                      "what": e.what, "chained": e.__cause__ is not None,
                      "context_shown": not e.__suppress_context__}}))
except BaseException as e:
    print(json.dumps({{"raised": type(e).__name__, "message": str(e)}}))
"""


def _probe(run_python, blocked, call):
    body = "\n".join("    " + line for line in call.strip().splitlines())
    proc = run_python(_PROBE.format(blocked=list(blocked), call=body))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cuda_extra(run_python):
    proc = run_python("from dcpkit._cuda import cuda_extra; print(cuda_extra())")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


CASES = {
    "mpi4py": (["mpi4py"], "from dcpkit.comm import Communicator\nCommunicator.from_mpi()", "mpi"),
    "torch": (
        ["torch"],
        "from dcpkit.comm import Communicator\nCommunicator.from_torch()",
        "TORCH",
    ),
    "nvshmem4py": (["nvshmem"], "from dcpkit import _nvshmem\n_nvshmem.load()", "nvshmem"),
    "cupy": (
        ["cupy"],
        (
            "from dcpkit import jit\nf = next(iter(jit.VARIANTS))\n"
            "jit.get_kernel(f, jit.VARIANTS[f][0])"
        ),
        "CUDA",
    ),
    "cuda-bindings (driver)": (["cuda"], "from dcpkit import _cuda\n_cuda.driver()", "CUDA"),
    "cuda-bindings (NVRTC)": (["cuda"], "from dcpkit import jit\njit.compile_only()", "CUDA"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_missing_dependency_names_the_extra(run_python, case):
    blocked, call, extra = CASES[case]
    if extra in ("CUDA", "TORCH"):  # the extra of this environment's CUDA stack
        cuda = _cuda_extra(run_python)
        assert cuda in ("cuda12", "cuda13")
        extra = cuda if extra == "CUDA" else "torch-cu" + cuda[len("cuda") :]
    got = _probe(run_python, blocked, call)
    assert got["raised"] == "MissingDependency", f"{case}: got {got}"
    assert got["extra"] == extra
    assert f"pip install 'dcpkit[{extra}]'" in got["message"], got["message"]
    # raised "from None": the user sees one clear error, not the ImportError chain under it
    assert not got["chained"] and not got["context_shown"], got


def test_a_broken_cupy_gives_the_kernel_loader_the_same_clear_error(run_python):
    """A CuPy that is installed but fails to import (CUDA libraries of another major version)
    is reported as MissingDependency by the kernel loader too, as by every other entry point."""
    code = """
import importlib.abc, json, sys

class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cupy":
            raise OSError("libcudart.so.12: cannot open shared object file")

sys.meta_path.insert(0, Broken())
from dcpkit import jit
from dcpkit.errors import MissingDependency
f = next(iter(jit.VARIANTS))
try:
    jit.get_kernel(f, jit.VARIANTS[f][0])
    print(json.dumps({"raised": None}))
except MissingDependency as e:
    print(json.dumps({"raised": "MissingDependency", "message": str(e)}))
except BaseException as e:
    print(json.dumps({"raised": type(e).__name__, "message": str(e)}))
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["raised"] == "MissingDependency", got
    assert "importing it failed: OSError: libcudart.so.12" in got["message"], got


def test_cuda_extra_follows_the_installed_wheels(monkeypatch):
    from importlib import metadata

    from dcpkit import _cuda

    def fake_versions(installed):
        def version(name):
            if name in installed:
                return installed[name]
            raise metadata.PackageNotFoundError(name)

        return version

    for installed, want in [
        ({"cupy-cuda13x": "14.2.0"}, "cuda13"),
        ({"cupy-cuda12x": "14.2.0", "cuda-bindings": "13.3.1"}, "cuda12"),
        ({"cuda-bindings": "13.3.1"}, "cuda13"),
        ({"cuda-python": "12.6.0"}, "cuda12"),
        ({}, "cuda12"),
    ]:
        monkeypatch.setattr(metadata, "version", fake_versions(installed))
        assert _cuda.cuda_extra() == want, installed


def test_core_imports_and_info_work_without_any_optional_dependency(run_python):
    code = """
import sys
for name in ("cupy", "cupy_backends", "cuda", "mpi4py", "torch", "nvshmem"):
    sys.modules[name] = None
import dcpkit, dcpkit.comm, dcpkit.jit, dcpkit.errors, dcpkit.cli, dcpkit.info, dcpkit.reference
from dcpkit.comm import Communicator
c = Communicator.single()
assert c.allgather(1) == [1]
sys.exit(dcpkit.cli.main(["info"]))
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "CuPy           not installed" in out or "CuPy           not available" in out, out
    assert "mpi4py" in out, out
    # a missing extra is named as such, never reported as "no GPU"
    assert "no GPU here" not in out, out
    assert re.search(
        r"^GPUs +not checked \(missing or not importable: CuPy, cuda-bindings; "
        r"pip install 'dcpkit\[cuda1[23]\]'\)$",
        out,
        re.M,
    ), out
    assert re.search(r"^CUDA driver +version not read \(missing or not importable: ", out, re.M), (
        out
    )
    assert "Traceback" not in proc.stderr
