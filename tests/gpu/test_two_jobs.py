"""Two jobs started at once on one machine each get correct symmetric heaps (issue 3).

Run as ONE process (not under mpirun)::

    python -m pytest tests/gpu/test_two_jobs.py -p no:cacheprovider

Starts two ``mpirun -np 2 python scripts/two_jobs_check.py`` at the same time, both on GPUs 0
and 1, with this process's environment: the multicast-disabling variables stay exactly as they
are (the jobs report what they saw, and the test compares). Only variables of an enclosing MPI
launcher are dropped, so that the children start clean jobs, and the checkout is put on
PYTHONPATH. Both jobs must succeed, their heap rounds must overlap in time, and every rank must
have seen correct heaps in every round (each job waits until the other is set up before its
heap rounds, so they run at the same time).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _gpus import NUM_GPUS

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "two_jobs_check.py"
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_")
# Settings of the MPI installation (e.g. OMPI_MCA_plm_rsh_agent on machines without ssh) are
# not state of an enclosing job: they are kept.
KEEP_PREFIXES = ("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")
WAIT_S = 400


pytestmark = pytest.mark.skipif(NUM_GPUS < 1, reason="no CUDA GPU visible here")


def _mpirun():
    exe = os.environ.get("DCPKIT_MPIRUN") or shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpirun / mpiexec found (set DCPKIT_MPIRUN)")
    if any(k.startswith(("OMPI_COMM_WORLD", "PMI_RANK", "PMIX_RANK")) for k in os.environ):
        pytest.skip(
            "this test launches its own MPI jobs: run pytest as one process, not under mpirun"
        )
    text = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.lower()
    flags = []
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        flags = ["--oversubscribe", "-x", "PYTHONPATH"]
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return exe, flags


def _env():
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCHER_PREFIXES) or k.startswith(KEEP_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


@pytest.mark.timeout(WAIT_S + 60)
def test_two_jobs_at_once_each_get_correct_heaps(tmp_path):
    exe, flags = _mpirun()
    env = _env()
    procs = {}
    for name, other in (("a", "b"), ("b", "a")):
        # Each job waits for the other to be set up before its heap rounds: they overlap.
        cmd = [
            exe,
            *flags,
            "-np",
            "2",
            sys.executable,
            str(SCRIPT),
            "--job",
            name,
            "--rounds",
            "30",
            "--ready-file",
            str(tmp_path / f"ready_{name}"),
            "--wait-file",
            str(tmp_path / f"ready_{other}"),
        ]
        procs[name] = subprocess.Popen(
            cmd,
            cwd=str(REPO_ROOT),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    outs = {}
    for name, p in procs.items():
        try:
            outs[name] = p.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = p.communicate()
            pytest.fail(f"job {name} did not finish within {WAIT_S} s (hang)\n{out}\n{err}")

    expected_switches = {
        n: os.environ.get(n)
        for n in (
            "NCCL_NVLS_ENABLE",
            "NVSHMEM_DISABLE_NVLS",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST",
            "DCPKIT_DISABLE_MULTICAST",
        )
    }
    problems, spans = [], {}
    for name, (out, err) in outs.items():
        detail = f"job {name}: exit {procs[name].returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
        lines = [
            json.loads(line.split(" ", 1)[1])
            for line in out.splitlines()
            if line.startswith("DCPKIT_TWO_JOBS ")
        ]
        if procs[name].returncode != 0 or len(lines) != 2:
            problems.append(detail)
            continue
        for x in lines:
            if not x["ok"]:
                problems.append(f"job {name} rank {x['rank']}: {x['errors']} / {x['job_errors']}")
            if x["kill_switches"] != expected_switches:
                problems.append(
                    f"job {name} rank {x['rank']} saw multicast-disabling variables "
                    f"{x['kill_switches']}, the launcher has {expected_switches}"
                )
            if x["handle_types"] != ["posix_fd"]:
                problems.append(f"job {name} rank {x['rank']}: handle types {x['handle_types']}")
        spans[name] = (min(x["start"] for x in lines), max(x["end"] for x in lines))
    assert not problems, "\n".join(problems)
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    assert a0 < b1 and b0 < a1, (
        f"the two jobs did not run at the same time: a {spans['a']}, b {spans['b']}"
    )
