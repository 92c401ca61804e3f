"""Two independent dcpkit jobs on one machine at the same time (issue 9, item 7).

Run once per GPU machine, as ONE process (not under mpirun)::

    python -m pytest tests/gpu/test_isolation.py -p no:cacheprovider

Each test starts two ``mpirun -np 2 python tests/mpi/scripts/isolation_job.py`` at once, with
this process's environment (the multicast kill switches stay set). Each job runs a few hundred
calls of every op (lse_reduce, q_gather, kv_gather push and pull), every call checked against
the reference. Both must succeed with zero wrong results, their call phases must overlap in
time, and each must have used the GPUs intended:

* ``same_gpus``: both jobs on GPUs 0 and 1 (two CUDA contexts per GPU, separate heaps, sockets
  and signals);
* ``different_gpus`` (4 GPUs or more): one job on GPUs 0-1, the other on GPUs 2-3.
"""

import json
import sys
from pathlib import Path

import pytest
from _gpus import NUM_GPUS, SHARED_GPU, mpi_launcher

SCRIPTS = Path(__file__).resolve().parents[1] / "mpi" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from reliability_cases import REPO_ROOT, Job, job_env, mpirun_command  # noqa: E402

CALLS = 300
WAIT_S = 360

# DCPKIT_ALLOW_SHARED_GPU=1: ranks may share GPUs (functional runs on machines with fewer GPUs
# than ranks, e.g. under MPS; scripts/gpu_suite.sh sets it with DCPKIT_SUITE_SHARED_GPU=1).
pytestmark = pytest.mark.skipif(
    NUM_GPUS < 2 and not (SHARED_GPU and NUM_GPUS >= 1),
    reason=f"needs 2 GPUs (have {NUM_GPUS}; DCPKIT_ALLOW_SHARED_GPU=1 lets ranks share GPUs)",
)


@pytest.fixture(scope="module")
def launcher():
    return mpi_launcher()


@pytest.mark.parametrize("layout", ["same_gpus", "different_gpus"])
def test_two_jobs_side_by_side(tmp_path, launcher, layout):
    if layout == "different_gpus" and NUM_GPUS < 4:
        pytest.skip(f"needs 4 GPUs (have {NUM_GPUS})")
    exe, flavor = launcher
    offsets = {"a": 0, "b": 0 if layout == "same_gpus" else 2}
    jobs = {}
    for name, other in (("a", "b"), ("b", "a")):
        cmd = mpirun_command(
            exe,
            flavor,
            2,
            [
                str(SCRIPTS / "isolation_job.py"),
                str(tmp_path),
                "--job",
                name,
                "--other",
                other,
                "--device-offset",
                str(offsets[name]),
                "--calls",
                str(CALLS),
            ],
        )
        jobs[name] = Job(cmd, env=job_env(), cwd=REPO_ROOT, log_prefix=tmp_path / f"job_{name}")
    for j in jobs.values():
        j.wait(WAIT_S)

    problems = []
    results = {}
    for name, j in jobs.items():
        if j.timed_out:
            problems.append(f"job {name} did not finish within {WAIT_S} s")
        elif j.returncode != 0:
            problems.append(f"job {name} returned {j.returncode}")
        for r in range(2):
            path = tmp_path / f"{name}_rank{r}.jsonl"
            if not path.exists():
                problems.append(f"job {name} rank {r} wrote no result")
                continue
            res = json.loads(path.read_text().splitlines()[-1])
            results[(name, r)] = res
            if res["errors"] or res["wrong"] or res["calls"] != 4 * CALLS:
                problems.append(
                    f"job {name} rank {r}: {res['calls']} calls, {res['wrong']} wrong, "
                    f"errors {res['errors']}, first failures {res['first_failures']}"
                )
    if len(results) == 4 and not problems:
        devs = {name: {results[(name, r)]["pci_bus_id"] for r in range(2)} for name in jobs}
        if layout == "same_gpus" and devs["a"] != devs["b"]:
            problems.append(f"the jobs did not share their GPUs: {devs}")
        if layout == "different_gpus" and devs["a"] & devs["b"]:
            problems.append(f"the jobs shared a GPU: {devs}")
        a0 = min(results[("a", r)]["t_start"] for r in range(2))
        a1 = max(results[("a", r)]["t_end"] for r in range(2))
        b0 = min(results[("b", r)]["t_start"] for r in range(2))
        b1 = max(results[("b", r)]["t_end"] for r in range(2))
        if max(a0, b0) >= min(a1, b1):
            problems.append(
                f"the call phases did not overlap: a [{a0:.2f}, {a1:.2f}], b [{b0:.2f}, {b1:.2f}]"
            )
    assert not problems, (
        "\n".join(problems) + "\n" + "\n".join(j.output(3000) for j in jobs.values())
    )
