"""What the demo needs of the machine: the optional packages, a GPU per rank, a world size
that divides the heads."""

from __future__ import annotations

from .. import _cuda
from ..errors import MissingDependency
from .model import Model
from .steps import short_error
from .torch_side import torch_problem


def missing_extra() -> str | None:
    """The optional package the demo needs and lacks (CuPy, cuda-bindings), named with the extra
    that brings it; None when both are there."""
    try:
        _cuda.require_cupy()
        _cuda.driver()
    except MissingDependency as e:
        return str(e)
    return None


def gpu_count() -> tuple[int, str]:
    """(GPUs visible to this process, why none when 0)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()), ""
    except ImportError as e:
        return 0, f"CuPy is not installed ({e})"
    except Exception as e:  # noqa: BLE001 - no driver, no device: both mean "no GPU"
        # Without libcuda CuPy says cudaErrorInsufficientDriver (a version mismatch): name the
        # real cause with dcpkit info's driver probe.
        from ..info import no_driver_reason

        why = no_driver_reason()
        if why:
            return 0, why
        return 0, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def pci_bus_id(device: int) -> str:
    import cupy

    return str(cupy.cuda.runtime.deviceGetPCIBusId(device))


def distinct_gpus(comm) -> int:
    """How many GPUs the ranks use (collective); world_size when a GPU cannot be identified."""
    try:
        import cupy

        bus = pci_bus_id(cupy.cuda.runtime.getDevice())
    except Exception:  # noqa: BLE001 - only used for the report
        bus = None
    every = comm.allgather((comm.host, bus))
    if any(b is None for _, b in every):
        return comm.world_size
    return len(set(every))


def environment_error(
    *, num_gpus: int, gpu_error: str, world_size: int, local_world_size: int, num_heads: int
) -> str | None:
    """Why the demo cannot run on this rank, or ``None``. Pure function of its arguments."""
    if num_gpus == 0:
        why = f": {gpu_error}" if gpu_error else ""
        return (
            f"no CUDA GPU is visible on this host{why}. The demo needs one GPU per rank: "
            "run it on a machine with NVIDIA GPUs as 'mpirun -np N python -m dcpkit demo'"
        )
    if world_size < 2:
        return (
            f"the demo needs at least 2 ranks (got {world_size}): run it as "
            f"'mpirun -np N python -m dcpkit demo' with N = 2, 4 or 8 "
            f"(this host has {num_gpus} GPU{'s' if num_gpus != 1 else ''})"
        )
    if local_world_size > num_gpus:
        return (
            f"asked for {local_world_size} ranks on this host but it has {num_gpus} "
            f"GPU{'s' if num_gpus != 1 else ''}: start at most {num_gpus} ranks per host "
            f"(one per GPU)"
        )
    if num_heads % world_size:
        return (
            f"num_heads {num_heads} must be divisible by world_size {world_size}: use a "
            f"world size that divides {num_heads}"
        )
    return None


def environment_problem(comm, args, model: Model) -> str | None:
    """Why the demo cannot run on this rank, or ``None``: a missing package first (named with
    its extra, never reported as "no GPU"), then the GPUs. Collective (one allgather), so
    that every rank counts the GPUs its host's ranks would use: rank ``r`` takes visible GPU
    ``local_rank % visible``; ranks of one host that land on the same GPU (by PCI bus id) mean
    more ranks than GPUs, also when each rank sees a different subset of the GPUs."""
    missing = missing_extra()
    num_gpus, gpu_error = (0, "") if missing else gpu_count()
    bus = None
    if num_gpus:
        try:
            bus = pci_bus_id(comm.local_rank % num_gpus)
        except Exception as e:  # noqa: BLE001 - reported as "no usable GPU"
            num_gpus, gpu_error = 0, short_error(e)
    seen = comm.allgather((comm.host, bus))  # every rank, also one that misses a package
    if missing is not None:
        return missing
    host_gpus = len({b for h, b in seen if h == comm.host and b is not None})
    if getattr(args, "allow_shared_gpu", False) and host_gpus:
        host_gpus = max(host_gpus, comm.local_world_size)
    problem = environment_error(
        num_gpus=host_gpus if num_gpus else 0,
        gpu_error=gpu_error,
        world_size=comm.world_size,
        local_world_size=comm.local_world_size,
        num_heads=model.num_heads,
    )
    if problem is None and args.torch:
        problem = torch_problem()
    return problem
