"""Shared fixtures of the CPU tests (``tests/unit``).

Which dcpkit is tested: the one this pytest process imports. In CI (``.ci/run``) that is the
installed wheel, because pytest runs from ``tests/`` where the checkout's ``dcpkit/`` is not on
``sys.path``; ``DCPKIT_CI=1`` makes the session fail if the checkout's copy was imported instead.
In a development checkout without an install, ``python -m pytest tests/unit`` from the root
tests the source. Subprocesses started by the tests import the same copy (:func:`subprocess_env`).

``DCPKIT_CI=1`` also turns every "skip: tool not installed" (MPI launcher, mpi4py, hatchling,
the ``dcpkit`` console script) into a failure: CI installs all of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import dcpkit

REPO_ROOT = Path(__file__).resolve().parents[2]
PKG_DIR = Path(dcpkit.__file__).resolve().parent
IN_CI = os.environ.get("DCPKIT_CI") == "1"

#: Variables of an enclosing MPI launcher; removed from subprocess environments so that a
#: test started under mpirun still launches clean jobs.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_")


def _from_checkout() -> bool:
    return PKG_DIR.parent == REPO_ROOT


def pytest_report_header(config):
    where = "source checkout" if _from_checkout() else "installed package"
    return f"dcpkit {dcpkit.__version__} from {PKG_DIR} ({where}); DCPKIT_CI={int(IN_CI)}"


def pytest_sessionstart(session):
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None and session.config.option.verbose < 0:  # -q hides the report header
        tr.write_line(pytest_report_header(session.config))
    if IN_CI and _from_checkout():
        raise pytest.UsageError(
            f"DCPKIT_CI=1 but dcpkit was imported from the checkout ({PKG_DIR}), not from the "
            "installed wheel: run pytest from tests/ (see README), not from the repository root"
        )


def skip_or_fail(reason: str):
    """Skip with ``reason``; in CI (``DCPKIT_CI=1``) fail instead, since CI installs everything."""
    if IN_CI:
        pytest.fail(f"{reason} (DCPKIT_CI=1: CI installs it, so this is a failure)")
    pytest.skip(reason)


def subprocess_env(extra=None) -> dict:
    """An environment in which a child Python imports the same dcpkit as this process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    parts = [str(PKG_DIR.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    if extra:
        env.update(extra)
    return env


def _descendants(pid: int) -> list:
    """Every live descendant of ``pid`` (from /proc; empty where /proc is missing)."""
    children = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(p: subprocess.Popen) -> None:
    """Kill ``p`` and everything it started. MPI launchers put each rank in its own session,
    so killing the launcher's process group alone would leave the ranks running."""
    for pid in [p.pid] + _descendants(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_bounded(cmd, *, timeout: float, cwd, env) -> subprocess.CompletedProcess:
    """Run ``cmd``; on timeout kill it and all its descendants and fail the test (a hang is a
    failure, never a stuck CI). Also cleans up when the test is interrupted."""
    p = subprocess.Popen(
        cmd,
        cwd=str(cwd),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(p)
        out, err = p.communicate()
        pytest.fail(
            f"{' '.join(map(str, cmd))} did not finish within {timeout} s (hang)\n"
            f"--- stdout\n{out}\n--- stderr\n{err}"
        )
    finally:
        if p.poll() is None:  # interrupted (pytest-timeout, Ctrl-C): leave nothing behind
            _kill_tree(p)
            p.wait()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.fixture
def run_python(tmp_path):
    """Run ``python -c CODE`` (or a script path) in ``tmp_path`` with this dcpkit importable."""

    def run(code_or_args, *, timeout: float = 120, env=None):
        args = ["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args)
        return run_bounded(
            [sys.executable, *args], timeout=timeout, cwd=tmp_path, env=subprocess_env(env)
        )

    return run


class MpiLauncher:
    """The ``mpiexec`` that goes with this Python's mpi4py, and how to call it."""

    def __init__(self, exe: str, flavor: str, version_text: str):
        self.exe = exe
        self.flavor = flavor  # "mpich", "openmpi" or "other"
        self.version_text = version_text

    def command(self, n: int, *args: str):
        cmd = [self.exe]
        if self.flavor == "openmpi":
            cmd += ["--oversubscribe", "-x", "PYTHONPATH"]
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                cmd.append("--allow-run-as-root")
        return cmd + ["-n", str(n), *args]


def _find_mpiexec():
    bindir = Path(sys.executable).parent  # the venv's bin/ (not resolved: a venv links python)
    for name in ("mpiexec", "mpirun"):
        cand = bindir / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def mpi_launcher() -> MpiLauncher:
    exe = _find_mpiexec()
    if exe is None:
        skip_or_fail("no MPI launcher (mpiexec / mpirun) installed: pip install 'dcpkit[mpi]'")
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        skip_or_fail("mpi4py is not installed: pip install 'dcpkit[mpi]'")
    try:
        v = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
        text = v.stdout + v.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"{exe} --version failed: {e}")
    low = text.lower()
    if "open mpi" in low or "openrte" in low or "open rte" in low:
        flavor = "openmpi"
    elif "hydra" in low or "mpich" in low:
        flavor = "mpich"
    else:
        flavor = "other"
    return MpiLauncher(exe, flavor, text)


# Fixtures that hand the helpers above to test modules (test modules never import conftest).
@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout the tests belong to (holds pyproject.toml, kernels/, README.md)."""
    return REPO_ROOT


@pytest.fixture(scope="session", name="skip_or_fail")
def _skip_or_fail_fixture():
    return skip_or_fail


@pytest.fixture
def run_cmd(tmp_path):
    """Run any command in ``tmp_path`` with this dcpkit importable, bounded by ``timeout``."""

    def run(cmd, *, timeout: float = 120, env=None):
        return run_bounded(
            list(map(str, cmd)), timeout=timeout, cwd=tmp_path, env=subprocess_env(env)
        )

    return run


@pytest.fixture(scope="session", autouse=True)
def kernel_compile_memo():
    """NVRTC compiles each (kernel source, variants, options) once per session.

    Several test files compile the same kernel file for the same target (``test_jit.py``
    compiles every file; the op tests compile their own). The memo wraps
    ``dcpkit.jit._compile_one``, the step that runs NVRTC on one file, keyed on the file's whole
    spliced source, its name expressions and the options: a compile that would see other code
    (an edited or substituted kernels folder, other variants, another ``-arch``) is a new key
    and runs NVRTC. Only successful results are kept; a failing compile raises every time.
    Yields the memo (key -> result) so that a test can check it.
    """
    from dcpkit import jit

    real = jit._compile_one
    memo: dict = {}

    def compile_one(nvrtc, file, exprs, opts):
        exprs, opts = tuple(exprs), tuple(opts)
        key = (file, jit.source(file), exprs, opts)
        if key not in memo:
            memo[key] = real(nvrtc, file, exprs, list(opts))
        return dict(memo[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jit, "_compile_one", compile_one)
        yield memo
