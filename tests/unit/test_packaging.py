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
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(repo_root),
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        str(out),
        "-q",
    ]
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
            assert z.read(f"dcpkit/kernels/{f}") == (repo_root / "kernels" / f).read_bytes(), (
                f"dcpkit/kernels/{f} in the wheel differs from kernels/{f}"
            )
    assert not any(n.startswith(("kernels/", "tests/")) for n in names), sorted(names)[:20]


def test_wheel_has_package_entry_point_and_extras(wheel, repo_root):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for mod in (
            "__init__.py",
            "__main__.py",
            "cli.py",
            "info.py",
            "comm.py",
            "jit.py",
            "errors.py",
            "_cuda.py",
        ):
            assert f"dcpkit/{mod}" in names
        ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert re.search(r"^dcpkit = dcpkit\.cli:main$", z.read(ep).decode(), re.M)
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Python: >=3.10" in meta
    provided = set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M))
    assert set(EXTRAS) <= provided, f"missing extras: {set(EXTRAS) - provided}"
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)

    def extra_reqs(extra):
        return {
            re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].lower()
            for r in requires
            if f"extra == '{extra}'" in r or f'extra == "{extra}"' in r
        }

    assert {
        "cupy-cuda12x",
        "cuda-bindings",
        "nvidia-cuda-nvrtc-cu12",
        "nvidia-nccl-cu12",
        "nvidia-cuda-runtime-cu12",
    } <= extra_reqs("cuda12")
    assert {
        "cupy-cuda13x",
        "cuda-bindings",
        "nvidia-cuda-nvrtc",
        "nvidia-nccl-cu13",
        "nvidia-cuda-runtime",
    } <= extra_reqs("cuda13")
    assert {"mpi4py", "mpich"} <= extra_reqs("mpi")
    assert {"pytest", "pytest-timeout", "hatchling"} <= extra_reqs("test")
    core = {
        re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r
    }
    assert "numpy" in core and core & {"ml_dtypes", "ml-dtypes"}, core


def test_readme_shows_the_two_commands_ci_runs(repo_root):
    readme = (repo_root / "README.md").read_text()
    head = "\n".join(readme.splitlines()[:40])
    demo = re.findall(
        r"^pip install '\.\[cuda1[23],mpi\]' && mpirun .* python -m dcpkit demo$", head, re.M
    )
    test = re.findall(r"^pip install '\.\[cuda12,mpi,test\]' && .*pytest.*$", head, re.M)
    assert len(demo) == 1 and len(test) == 1, (
        "README must show the demo and the test command near the top, once each"
    )
    ci = (repo_root / ".ci" / "run").read_text()
    assert "README.md" in ci, ".ci/run must take its test command from README.md"


def test_wheel_is_typed_and_licensed(wheel, repo_root):
    """PEP 561: the wheel carries dcpkit/py.typed; the licence file ships with it."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "dcpkit/py.typed" in names, sorted(names)[:40]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)[-10:]
    assert re.search(r"^License-Expression: Apache-2\.0$", meta, re.M), meta[:800]
    assert "Apache License" in (repo_root / "LICENSE").read_text()[:200]


def _code_blocks(text):
    return re.findall(r"^```(?:bash|sh)?\n(.*?)^```", text, re.M | re.S)


def test_readme_quick_start_installs_each_cuda_stack_in_its_own_environment(repo_root):
    """Followed literally, the two Quick start commands must not install the CUDA 12 and the
    CUDA 13 stack into one environment: each block makes and enters its own venv first."""
    readme = (repo_root / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    envs = {}
    for block in _code_blocks(quick):
        if "pip install '.[" not in block:
            continue
        lines = [line for line in block.splitlines() if line.strip()]
        m = re.match(r"^python3 -m venv (\S+) && \. (\S+)/bin/activate$", lines[0])
        assert m and m.group(1) == m.group(2), (
            f"a Quick start block must start by making and activating a venv of its own:\n{block}"
        )
        extras = re.search(r"pip install '\.\[([^\]]+)\]'", block).group(1).split(",")
        stack = [e for e in extras if e in ("cuda12", "cuda13")]
        assert len(stack) == 1, block
        envs.setdefault(m.group(1), set()).add(stack[0])
    assert len(envs) == 2, f"two Quick start commands in two environments expected: {envs}"
    assert all(len(s) == 1 for s in envs.values()), envs


def test_readme_counts_the_bad_input_table(repo_root):
    import test_bad_input_table as table

    n = len(table.ROWS) + len(table.HEAP_ROWS) + len(table.CTOR_ROWS)
    readme = (repo_root / "README.md").read_text()
    said = [int(x) for x in re.findall(r"a table of (\d+) bad calls", readme)]
    assert said == [n], f"README says {said} bad calls, tests/unit/test_bad_input_table.py has {n}"


#: Words about how the project was made rather than what it does.
DEVELOPMENT_WORDS = re.compile(
    r"\blent\b|\bsession\b(?! *-scoped)|nvidia-h200(-x\d)?|\bissues? \d+|\bwork[- ]log\b|"
    r"while this was written|\.whl/",
    re.I,
)


def test_readme_speaks_of_the_project_only(repo_root):
    found = [
        f"README.md:{i}: {line.strip()}"
        for i, line in enumerate((repo_root / "README.md").read_text().splitlines(), 1)
        if DEVELOPMENT_WORDS.search(line)
    ]
    assert not found, "\n".join(found)
