"""The wheel built from this checkout carries the CUDA sources, the console script and the
extras; and the README shows the commands CI runs.

Builds with ``pip wheel --no-build-isolation --no-deps`` (no network; needs hatchling, which the
``test`` extra installs)."""

import importlib.util
import re
import subprocess
import sys
import zipfile

import pytest

from dcpkit import jit

pytestmark = pytest.mark.packaging

EXTRAS = ("cuda12", "cuda13", "mpi", "nvshmem", "nvshmem-cu13", "torch", "bench", "test")


@pytest.fixture(scope="module")
def wheel(repo_root, tmp_path_factory, skip_or_fail):
    if not (repo_root / "pyproject.toml").is_file():
        pytest.skip(f"no checkout at {repo_root} (tests run from an installed copy)")
    if importlib.util.find_spec("hatchling") is None:
        skip_or_fail("hatchling is not installed (pip install 'dcpkit[test]')")
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(repo_root), "--no-deps",
           "--no-build-isolation", "--no-index", "-w", str(out), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(out))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("dcpkit-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}, got {wheels}"
    return wheels[0]


def test_wheel_carries_every_kernel_source(wheel, repo_root):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        want = {"dcpkit_ptx.cuh"} | set(jit.VARIANTS)
        want |= {p.name for p in (repo_root / "kernels").iterdir() if p.is_file()}
        for f in sorted(want):
            assert f"dcpkit/kernels/{f}" in names, f"dcpkit/kernels/{f} missing from {wheel.name}"
            assert z.read(f"dcpkit/kernels/{f}") == (repo_root / "kernels" / f).read_bytes(), \
                f"dcpkit/kernels/{f} in the wheel differs from kernels/{f}"
    assert not any(n.startswith(("kernels/", "tests/")) for n in names), sorted(names)[:20]


def test_wheel_has_package_entry_point_and_extras(wheel, repo_root):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for mod in ("__init__.py", "__main__.py", "cli.py", "info.py", "comm.py", "jit.py",
                    "errors.py", "_cuda.py"):
            assert f"dcpkit/{mod}" in names
        ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert re.search(r"^dcpkit = dcpkit\.cli:main$", z.read(ep).decode(), re.M)
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Python: >=3.10" in meta
    provided = set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M))
    assert set(EXTRAS) <= provided, f"missing extras: {set(EXTRAS) - provided}"
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)

    def extra_reqs(extra):
        return {re.split(r"[<>=!;\[ ]", r, 1)[0].lower() for r in requires
                if f"extra == '{extra}'" in r or f'extra == "{extra}"' in r}

    assert {"cupy-cuda12x", "cuda-bindings", "nvidia-cuda-nvrtc-cu12", "nvidia-nccl-cu12",
            "nvidia-cuda-runtime-cu12"} <= extra_reqs("cuda12")
    assert {"cupy-cuda13x", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-nccl-cu13",
            "nvidia-cuda-runtime"} <= extra_reqs("cuda13")
    assert {"mpi4py", "mpich"} <= extra_reqs("mpi")
    assert {"pytest", "pytest-timeout", "hatchling"} <= extra_reqs("test")
    core = {re.split(r"[<>=!;\[ ]", r, 1)[0].lower() for r in requires if "extra ==" not in r}
    assert "numpy" in core and core & {"ml_dtypes", "ml-dtypes"}, core


def test_readme_shows_the_two_commands_ci_runs(repo_root):
    readme = (repo_root / "README.md").read_text()
    head = "\n".join(readme.splitlines()[:40])
    demo = re.findall(r"^pip install '\.\[cuda1[23],mpi\]' && mpirun .* python -m dcpkit demo$",
                      head, re.M)
    test = re.findall(r"^pip install '\.\[cuda12,mpi,test\]' && .*pytest.*$", head, re.M)
    assert len(demo) == 1 and len(test) == 1, "README must show the demo and the test command " \
                                              "near the top, once each"
    ci = (repo_root / ".ci" / "run").read_text()
    assert "README.md" in ci, ".ci/run must take its test command from README.md"
