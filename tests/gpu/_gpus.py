"""What the GPU tests ask of this machine before they run: the number of GPUs visible
(:data:`NUM_GPUS`) and whether ranks may share one (:data:`SHARED_GPU`)."""

from __future__ import annotations

import os


def gpu_count() -> int:
    """The number of CUDA GPUs visible here (0 without CuPy, a driver or a device)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return 0


NUM_GPUS = gpu_count()
#: DCPKIT_ALLOW_SHARED_GPU=1: several ranks of a job may share one GPU.
SHARED_GPU = os.environ.get("DCPKIT_ALLOW_SHARED_GPU", "") not in ("", "0")
