"""An MPI library that cannot start under the launcher is refused before ``MPI_Init``.

MPICH's ``MPI_Init`` aborts the process with a multi-line error stack under a PMIx launcher
(Open MPI's ``mpirun``); every entry point must instead print one line and exit 2. The
launcher is faked through its environment variables, so no second MPI is needed.
"""

from __future__ import annotations

import sys

import pytest

from dcpkit.comm import launcher_library_mismatch

MPICH = (
    "MPICH Version:      5.0.2\nMPICH ABI:          18:2:6\n"
    "MPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra:gforker\n"
)
MPICH_PMIX = "MPICH Version:      4.2.0\nMPICH configure:    --with-pmix=/usr\n"
OPEN_MPI = "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6\n"
INTEL = "Intel(R) MPI Library 2021.13 for Linux* OS\n"


@pytest.mark.parametrize(
    "library, env, says",
    [
        (MPICH, {"PMIX_RANK": "0"}, "(PMIX_RANK=0) but mpi4py loaded MPICH Version: 5.0.2"),
        (MPICH, {"PMIX_NAMESPACE": "job1", "OMPI_COMM_WORLD_SIZE": "2"}, "PMIX_NAMESPACE=job1"),
        (OPEN_MPI, {"HYDI_CONTROL_FD": "7", "PMI_RANK": "0"}, "hydra launcher"),
    ],
)
def test_mismatch_is_named(library, env, says):
    why = launcher_library_mismatch(env, library)
    assert why is not None and says in why, why
    assert "\n" not in why


@pytest.mark.parametrize(
    "library, env",
    [
        (MPICH, {}),  # no launcher: a singleton
        (MPICH, {"PMI_RANK": "0", "PMI_FD": "9", "HYDI_CONTROL_FD": "7"}),  # its own hydra
        (MPICH, {"PMIX_RANK": "0", "PMI_FD": "9"}),  # PMI-2 offered beside PMIx
        (MPICH, {"OMPI_COMM_WORLD_SIZE": "2"}),  # no PMIx: left to the one-rank check
        (MPICH_PMIX, {"PMIX_RANK": "0"}),  # MPICH built with PMIx
        (OPEN_MPI, {"PMIX_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}),  # its own mpirun
        (OPEN_MPI, {"PMI_RANK": "0", "PMI_FD": "9"}),  # Slurm PMI-2: Open MPI may speak it
        (INTEL, {"PMIX_RANK": "0"}),  # not judged
        ("", {"PMIX_RANK": "0"}),
    ],
)
def test_no_mismatch(library, env):
    assert launcher_library_mismatch(env, library) is None


@pytest.fixture(scope="module")
def foreign_env():
    """Variables of a launcher that the MPI library mpi4py loads here cannot start under."""
    import subprocess

    from conftest import subprocess_env

    try:
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import mpi4py; mpi4py.rc.initialize = False\n"
                "from mpi4py import MPI; print(MPI.Get_library_version())",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=subprocess_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot ask mpi4py for its MPI library: {e}")
    if probe.returncode != 0:
        pytest.skip(f"mpi4py or an MPI library is not installed: {probe.stderr.strip()[-200:]}")
    text = probe.stdout
    for env in ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "fake"}, {"HYDI_CONTROL_FD": "7"}):
        if launcher_library_mismatch(env, text) is not None:
            return env
    pytest.skip(f"no foreign launcher to fake for this MPI library: {text.splitlines()[:1]}")


FROM_MPI = "from dcpkit.comm import Communicator\nCommunicator.from_mpi()\nprint('NO ERROR')\n"
FROM_MPI_CAUGHT = (
    "from dcpkit.comm import Communicator\nfrom dcpkit.errors import DcpkitError\n"
    "try:\n    Communicator.from_mpi()\n    print('NO ERROR')\n"
    "except DcpkitError as e:\n    print('ERROR', e)\n"
)


@pytest.mark.parametrize(
    "args, prefix",
    [
        (["-m", "dcpkit", "demo"], "dcpkit demo: "),
        (["-m", "dcpkit", "bench", "--quick"], "dcpkit bench: "),
        (["examples/dcpcomm_step.py"], "dcpcomm_step: "),
        (["examples/cupy_decode_step.py"], "cupy_decode_step: "),
    ],
)
def test_entry_points_say_one_line_and_exit_2(run_python, foreign_env, args, prefix):
    from conftest import REPO_ROOT

    args = [str(REPO_ROOT / a) if a.endswith(".py") else a for a in args]
    r = run_python(args, timeout=120, env=foreign_env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), r.stdout + r.stderr
    assert "Communicator.from_mpi: " in lines[0], lines[0]
    assert any(f"{k}={v}" in lines[0] for k, v in foreign_env.items()), lines[0]


def test_from_mpi_raises_before_mpi_init(run_python, foreign_env):
    r = run_python(FROM_MPI_CAUGHT, timeout=60, env=foreign_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ERROR Communicator.from_mpi: "), r.stdout + r.stderr
    assert "Launch with the mpirun of that library" in r.stdout, r.stdout


def test_info_warns_and_still_reports(run_python, foreign_env):
    r = run_python(["-m", "dcpkit", "info", "--all-ranks"], timeout=120, env=foreign_env)
    assert r.returncode == 0, r.stdout + r.stderr
    warn = [ln for ln in r.stdout.splitlines() if ln.startswith("warning: ")]
    assert any("Communicator.from_mpi" in ln and "refuses to start" in ln for ln in warn), warn
    assert "MPI library" in r.stdout


@pytest.mark.parametrize("level", ["funneled", "single"])
def test_from_mpi_initialises_as_mpi4py_would(run_python, level):
    """MPI initialised by from_mpi honours mpi4py.rc, and is finalised at exit."""
    code = (
        "import mpi4py\n"
        f"mpi4py.rc.thread_level = {level!r}\n"
        "import atexit, sys\n"
        "def probe():  # registered first, so it runs after from_mpi's own exit handler\n"
        "    print('finalized', sys.modules['mpi4py.MPI'].Is_finalized(), flush=True)\n"
        "atexit.register(probe)\n"
        "from dcpkit.comm import Communicator\n"
        "c = Communicator.from_mpi()\n"
        "from mpi4py import MPI\n"
        "names = {MPI.THREAD_SINGLE: 'single', MPI.THREAD_FUNNELED: 'funneled',\n"
        "         MPI.THREAD_SERIALIZED: 'serialized', MPI.THREAD_MULTIPLE: 'multiple'}\n"
        "print(c.world_size, names[MPI.Query_thread()], mpi4py.rc.initialize)\n"
    )
    r = run_python(code, timeout=60)
    if r.returncode != 0 and "mpi4py" in r.stderr and "No module" in r.stderr:
        pytest.skip("mpi4py is not installed")
    assert r.returncode == 0, r.stdout + r.stderr
    first, last = r.stdout.splitlines()[0], r.stdout.splitlines()[-1]
    assert first == f"1 {level} True", r.stdout
    assert last == "finalized True", r.stdout


class _OneRankMPI:
    """An initialised MPI whose COMM_WORLD has ``size`` ranks."""

    def __init__(self, size: int):
        self.COMM_WORLD = type("World", (), {"Get_size": lambda _self: size})()

    def Get_library_version(self):
        return MPICH


@pytest.mark.parametrize(
    "env, size, says",
    [
        ({"OMPI_COMM_WORLD_SIZE": "2"}, 1, "the launcher started 2 processes "),
        ({"PMI_SIZE": "4"}, 1, "(PMI_SIZE=4) but MPI.COMM_WORLD has 1 rank"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, 2, None),  # the launcher's own job
        ({"OMPI_COMM_WORLD_SIZE": "1"}, 1, None),
        ({}, 1, None),  # a singleton
    ],
)
def test_world_size_mismatch_is_named(env, size, says):
    from dcpkit.comm import launcher_world_size_mismatch

    why = launcher_world_size_mismatch(env, _OneRankMPI(size))
    if says is None:
        assert why is None, why
    else:
        assert why is not None and says in why and "MPICH Version: 5.0.2" in why, why


def test_info_warns_of_a_one_rank_world_under_a_launcher_of_several(run_python):
    """The mismatch from_mpi refuses (the launcher started 2 processes, MPI.COMM_WORLD has 1
    rank) is the one info warns of, from the same check."""
    import json

    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    probe = run_python("import mpi4py", timeout=60)
    if probe.returncode != 0:
        pytest.skip("mpi4py is not installed")
    r = run_python(FROM_MPI_CAUGHT, timeout=60, env=env)
    if "ERROR" not in r.stdout:
        pytest.skip(f"MPI here starts the job of these variables: {r.stdout + r.stderr}")
    refused = r.stdout.split("Communicator.from_mpi: ", 1)[1].split(". Launch with")[0]
    r = run_python(["-m", "dcpkit", "info", "--json"], timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["versions"]["mpi_launcher_mismatch"] == refused
    assert any(w.startswith(refused) and "refuses to start" in w for w in d["warnings"])


@pytest.mark.parametrize(
    "env, joins",
    [
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, False),
        ({}, False),
        ({"PMI_FD": "7", "PMI_RANK": "0", "PMI_SIZE": "2"}, True),  # hydra
        ({"OMPI_COMM_WORLD_SIZE": "2", "PMIX_NAMESPACE": "job"}, True),  # Open MPI's mpirun
        ({"SLURM_PROCID": "0"}, True),
    ],
)
def test_info_initialises_mpi_only_where_it_cannot_wait_for_peers(env, joins):
    from dcpkit.comm import mpi_init_may_join_a_job

    assert mpi_init_may_join_a_job(env) is joins
