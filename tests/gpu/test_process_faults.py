"""Process-level faults of the direct ops (issue 9, items 2 and 6), each in its own MPI job.

Run once per GPU machine, as ONE process (not under mpirun)::

    python -m pytest tests/gpu/test_process_faults.py -p no:cacheprovider

Each test launches ``mpirun -np N python tests/mpi/scripts/<script>.py`` (N = 2, and 4 where
there are 4 GPUs) with this process's environment (the multicast kill switches stay set), waits
for it with a hard timeout (the whole process group is killed past it: a hang fails the test
instead of stalling the suite), and checks what every rank wrote to its file.

* ``test_rank_dies``: the last rank ``os._exit(3)``s right before a call; every survivor raises
  CollectiveTimeout for every op within the timeout, naming the dead rank; the next call raises
  too; the CUDA context stays usable; mpirun returns.
* ``test_exit_without_close``: a job that exits with open workspaces, one of them dropped
  (``del`` + ``gc.collect()``) on one rank only, exits with status 0 and nothing crashes; the
  finaliser warns and makes no collective call.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from _gpus import NUM_GPUS, SHARED_GPU, mpi_launcher

SCRIPTS = Path(__file__).resolve().parents[1] / "mpi" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from reliability_cases import REPO_ROOT, Job, job_env, mpirun_command  # noqa: E402

# DCPKIT_ALLOW_SHARED_GPU=1: ranks may share GPUs (functional runs on machines with fewer GPUs
# than ranks, e.g. under MPS; scripts/gpu_suite.sh sets it with DCPKIT_SUITE_SHARED_GPU=1).
TIMEOUT_MS = 300.0
HANG_MARGIN_S = 5.0

pytestmark = pytest.mark.skipif(
    NUM_GPUS == 0, reason="no CUDA GPU visible here (these tests launch multi-GPU jobs)"
)


@pytest.fixture(scope="module")
def launcher():
    return mpi_launcher()


def _read(path: Path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("n", [2, 4])
def test_rank_dies(tmp_path, launcher, n):
    if n > NUM_GPUS and not SHARED_GPU:
        pytest.skip(
            f"needs {n} GPUs (have {NUM_GPUS}; DCPKIT_ALLOW_SHARED_GPU=1 lets ranks share GPUs)"
        )
    exe, flavor = launcher
    cmd = mpirun_command(
        exe,
        flavor,
        n,
        [str(SCRIPTS / "die.py"), str(tmp_path), "--timeout-ms", str(TIMEOUT_MS)],
        tolerate_death=True,
    )
    job = Job(cmd, env=job_env(), cwd=REPO_ROOT, log_prefix=tmp_path / "mpirun").wait(240)
    dead = n - 1
    problems = []
    if job.timed_out:
        problems.append("mpirun did not return within 240 s: something hung")
    ops = None
    for r in range(n):
        lines = _read(tmp_path / f"rank{r}.jsonl")
        setup = [x for x in lines if x.get("phase") == "setup"]
        bad_setup = [x for x in setup if x.get("good_call")]
        if not setup or bad_setup:
            problems.append(f"rank {r}: setup lines {setup}")
        ops = ops or [x["op"] for x in setup]
        if r == dead:
            if any(x.get("phase") != "setup" for x in lines):
                problems.append(f"rank {r} (the dead rank) wrote past its death: {lines}")
            continue
        faults = {x["op"]: x for x in lines if x.get("phase") == "fault"}
        if set(faults) != set(ops or ()):
            problems.append(
                f"rank {r}: reports for {sorted(faults)}, expected {ops} "
                f"(killed before reporting?) lines: {lines}"
            )
        for op, x in faults.items():
            if x.get("raised") != "CollectiveTimeout" or x.get("peer") != dead:
                problems.append(
                    f"rank {r} {op}: expected CollectiveTimeout naming rank {dead}, got {x}"
                )
            if x.get("elapsed_s", 1e9) > TIMEOUT_MS / 1e3 + HANG_MARGIN_S:
                problems.append(
                    f"rank {r} {op}: took {x.get('elapsed_s')} s (> timeout + "
                    f"{HANG_MARGIN_S} s margin)"
                )
            if x.get("next_call") != "CollectiveTimeout":
                problems.append(f"rank {r} {op}: the next call: {x.get('next_call')}")
        ctx = [x for x in lines if x.get("phase") == "context"]
        if not ctx or ctx[0].get("context") != "ok":
            problems.append(f"rank {r}: CUDA context after the faults: {ctx}")
    report = os.environ.get("DCPKIT_RELIABILITY_REPORT")
    if report:
        times = [
            x.get("elapsed_s")
            for r in range(n)
            if r != dead
            for x in _read(tmp_path / f"rank{r}.jsonl")
            if x.get("phase") == "fault"
        ]
        with open(report, "a") as f:
            f.write(
                json.dumps(
                    {
                        "test": "rank_dies",
                        "world_size": n,
                        "timeout_ms": TIMEOUT_MS,
                        "detect_s": times,
                        "mpirun_s": round(job.wall_s, 1),
                        "mpirun_rc": job.returncode,
                    }
                )
                + "\n"
            )
    assert not problems, "\n".join(problems) + "\n" + job.output()


@pytest.mark.parametrize("n", [2, 4])
def test_exit_without_close(tmp_path, launcher, n):
    if n > NUM_GPUS and not SHARED_GPU:
        pytest.skip(
            f"needs {n} GPUs (have {NUM_GPUS}; DCPKIT_ALLOW_SHARED_GPU=1 lets ranks share GPUs)"
        )
    exe, flavor = launcher
    cmd = mpirun_command(exe, flavor, n, [str(SCRIPTS / "noclose.py"), str(tmp_path)])
    job = Job(cmd, env=job_env(), cwd=REPO_ROOT, log_prefix=tmp_path / "mpirun").wait(300)
    problems = []
    if job.timed_out:
        problems.append("mpirun did not return within 300 s: the exit without close hung")
    elif job.returncode != 0:
        problems.append(f"mpirun returned {job.returncode} (expected 0)")
    for r in range(n):
        lines = _read(tmp_path / f"rank{r}.jsonl")
        if not lines or not lines[-1].get("reached_exit"):
            problems.append(f"rank {r} did not reach its exit: {lines}")
            continue
        if lines[-1]["problems"]:
            problems.append(f"rank {r}: {lines[-1]['problems']}")
        if r == 0 and not lines[-1].get("warned"):
            problems.append("rank 0: dropping an open workspace gave no ResourceWarning")
    err = job.err_path.read_text(errors="replace")
    for bad in ("Traceback", "Segmentation fault", "core dumped", "Aborted", "CUDA_ERROR"):
        if bad in err:
            problems.append(f"stderr contains {bad!r}")
    assert not problems, "\n".join(problems) + "\n" + job.output()
