"""Facts recorded with every run: commit, driver, library versions, GPUs, the command line."""

from __future__ import annotations

import datetime
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "git_commit",
    "driver_version",
    "pkg_version",
    "first_version",
    "command_line",
    "collect_meta",
]


def git_commit() -> tuple[str, bool | None]:
    """``(commit, dirty)``: ``DCPKIT_COMMIT`` when set (scripts/gpu_suite.sh sets it: a copy of
    the checkout on another machine may carry a stale git state), else ``git rev-parse``."""
    if os.environ.get("DCPKIT_COMMIT"):
        return os.environ["DCPKIT_COMMIT"], None
    root = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if r.returncode == 0 and r.stdout.strip():
            d = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            )
            return r.stdout.strip(), (bool(d.stdout.strip()) if d.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("DCPKIT_COMMIT", "unknown"), None


def driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9.]+)", f.read(), re.ASCII)
            if m:
                return m.group(1)
    except OSError:
        pass
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def pkg_version(name: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def first_version(*names: str) -> str | None:
    for n in names:
        v = pkg_version(n)
        if v:
            return f"{n} {v}"
    return None


def command_line(world_size: int, argv: Sequence[str]) -> str:
    """The command line of the run, output paths shortened to their file names (the folders
    are those of a machine that is gone)."""
    out, short = [], False
    for a in argv:
        if short:
            a = os.path.basename(a)
        short = a in ("--json", "--plot")
        if a.startswith(("--json=", "--plot=")):
            k, v = a.split("=", 1)
            a = f"{k}={os.path.basename(v)}"
        out.append(shlex.quote(a))
    return f"mpirun -np {world_size} python -m dcpkit bench " + " ".join(out)


def collect_meta(ctx, argv: Sequence[str]) -> dict[str, Any]:
    from .. import __version__

    commit, dirty = git_commit()
    try:
        dev = ctx.dev.describe()
    except Exception as e:  # noqa: BLE001 - facts are best effort; the allgather below is not
        dev = {"describe_error": f"{type(e).__name__}: {e}"}
    hosts = ctx.comm.allgather((socket.gethostname(), dev.get("gpu"), dev.get("device")))
    meta = {
        "world_size": ctx.comm.world_size,
        "hostname": socket.gethostname(),
        "hosts": sorted({h[0] for h in hosts}),
        "gpus_by_rank": [f"{h[0]}:{h[2]} {h[1]}" for h in hosts],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "commit_dirty": dirty,
        "command": command_line(ctx.comm.world_size, argv),
        "dcpkit": __version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "cupy": first_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "cuda_bindings": pkg_version("cuda-bindings") or pkg_version("cuda-python"),
        "mpi4py": pkg_version("mpi4py"),
        "torch": pkg_version("torch"),
        "nvshmem4py": first_version("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"),
        "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "multicast_env": {
            k: os.environ.get(k)
            for k in (
                "NCCL_NVLS_ENABLE",
                "NVSHMEM_DISABLE_NVLS",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                "DCPKIT_DISABLE_MULTICAST",
                "DCPKIT_MULTICAST",
            )
        },
    }
    meta.update(dev)
    meta["driver"] = meta.get("driver") or driver_version()
    meta["machine"] = (
        os.environ.get("DCPKIT_MACHINE_KIND")
        or f"{dev.get('gpu_count', '?')}x {dev.get('gpu', '?')}"
    )
    return meta
