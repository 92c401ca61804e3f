"""The custom ops of :mod:`dcpkit.torch` and their process-wide state (torch imported only by
:func:`register_custom_ops`).

The ``dcpkit::*`` operators are registered with torch once per process, and torch keeps their
kernels for the life of the process; the registry of live :class:`~dcpkit.torch.TorchOps`
handles that those kernels look up must be just as process-wide. It lives here rather than in
``dcpkit.torch`` so that a second import of that module (a reload, a test that imports it
afresh) shares it instead of registering the operators again.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from .errors import ClosedError, DcpkitError, InvalidArgument, MissingDependency

#: handle -> weak reference to a live TorchOps (each adds itself and removes itself at close).
REGISTRY: dict[int, Any] = {}
NEXT_HANDLE = itertools.count(1)
LOCK = threading.Lock()
#: op name -> torch.ops.dcpkit.<name>, once registered; and the torch.library.Library that
#: holds the definitions (kept alive for the life of the process).
state: dict[str, Any | None] = {
    "custom_ops": None,
    "library": None,
    "increment_version": None,
    "probe": None,
    "probe_library": None,
}


def torch_module():
    """The torch module, or MissingDependency naming the torch extra of this CUDA stack."""
    try:
        import torch
    except ImportError as e:
        from ._cuda import torch_extra

        raise MissingDependency("torch", torch_extra(), str(e)) from None
    return torch


def require_torch_cuda(torch, what: str) -> None:
    """Raise :class:`DcpkitError` when torch cannot reach a CUDA GPU (a CPU build of torch, no
    driver, no device), before any torch CUDA call fails with its own error."""
    if torch.version.cuda is None:
        raise DcpkitError(
            f"{what}: torch {torch.__version__} is a CPU build (no CUDA): install a "
            f"CUDA build of torch matching the cuda12 / cuda13 extra"
        )
    if not torch.cuda.is_available():
        raise DcpkitError(
            f"{what}: torch sees no CUDA GPU (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}): dcpkit needs an NVIDIA GPU and its driver"
        )


def cuda_device(torch, device, what: str) -> int | None:
    """``device`` (None: torch's current device) checked as the ordinal of a GPU torch sees,
    after :func:`require_torch_cuda`."""
    from ._checks import check_int

    if device is not None:
        device = check_int(device, what, "device")
    require_torch_cuda(torch, what)
    if device is not None and device >= torch.cuda.device_count():
        raise InvalidArgument(
            f"{what}: device must be one of the {torch.cuda.device_count()} GPUs torch sees "
            f"(got {device})"
        )
    return device


def _lookup(handle: int, op: str) -> Any:
    """The live TorchOps of ``handle``; ClosedError for a closed or unknown one."""
    ref = REGISTRY.get(int(handle))
    obj = ref() if ref is not None else None
    if obj is None or obj.closed:
        raise ClosedError(
            f"dcpkit::{op}: handle {handle} must name a live dcpkit.torch.TorchOps "
            f"(got a closed or unknown handle)"
        )
    return obj


# ----------------------------------------------------------------------------- custom ops
# The kernels are registered for every backend (CompositeExplicitAutograd) with
# torch.library.Library, not torch.library.custom_op, whose Python autograd and
# ADInplaceOrView layers cost tens of microseconds per call. What the ADInplaceOrView layer did
# for a mutating op, bumping the version counter of every mutated tensor (so that autograd
# notices a saved tensor that changed), the impls do themselves.
def _version_bump(torch):
    """``bump(tensors)``: the version counters of a tuple of tensors bumped in one call,
    through ``torch._C._increment_version`` where it takes a sequence (what
    ``torch.autograd.graph.increment_version`` calls, without its Python layer)."""
    inc = getattr(torch._C, "_increment_version", None)
    if inc is not None:
        try:
            inc(())
            return inc
        except TypeError:  # a torch whose C function takes one tensor
            pass
    one = torch.autograd.graph.increment_version

    def each(tensors) -> None:
        for t in tensors:
            one(t)

    return each


# The kernels: the live TorchOps of the handle (the registry read inline: :func:`_lookup`, which
# raises, only for a closed or unknown handle), its work, then the version bump of what the op
# wrote.
def _q_gather_impl(handle: int, q, out, ubatch: int) -> None:
    ref = REGISTRY.get(handle)
    obj = ref() if ref is not None else None
    if obj is None or obj._closed:
        obj = _lookup(handle, "q_gather")  # raises
    obj._gather_work("q_gather", "q", q, ubatch, out)
    state["increment_version"]((out,))


def _kv_gather_impl(handle: int, kv, out, ubatch: int) -> None:
    ref = REGISTRY.get(handle)
    obj = ref() if ref is not None else None
    if obj is None or obj._closed:
        obj = _lookup(handle, "kv_gather")  # raises
    obj._gather_work("kv_gather", "kv", kv, ubatch, out)
    state["increment_version"]((out,))


def _lse_reduce_impl(
    handle: int, out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse, ubatch: int
) -> None:
    ref = REGISTRY.get(handle)
    obj = ref() if ref is not None else None
    if obj is None or obj._closed:
        obj = _lookup(handle, "lse_reduce")  # raises
    tensors = (out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse)
    obj._lse_work(tensors, ubatch, False)
    state["increment_version"]((out,) if out_lse is None else (out, out_lse))


def _gather_fake(handle, x, out, ubatch) -> None:
    return None


def _lse_reduce_fake(
    handle, out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse, ubatch
) -> None:
    return None


_SCHEMAS = {
    "q_gather": (
        "(int handle, Tensor q, Tensor(a!) out, int ubatch) -> ()",
        ("out",),
        _q_gather_impl,
        _gather_fake,
    ),
    "kv_gather": (
        "(int handle, Tensor kv, Tensor(a!) out, int ubatch) -> ()",
        ("out",),
        _kv_gather_impl,
        _gather_fake,
    ),
    "lse_reduce": (
        "(int handle, Tensor out_partial, Tensor lse_partial, Tensor? seq_lens, "
        "Tensor? query_start_loc, Tensor(a!) out, Tensor(b!)? out_lse, int ubatch) "
        "-> ()",
        ("out", "out_lse"),
        _lse_reduce_impl,
        _lse_reduce_fake,
    ),
}


def register_custom_ops() -> dict[str, Any]:
    """Register ``dcpkit::q_gather``, ``dcpkit::kv_gather`` and ``dcpkit::lse_reduce`` with
    ``torch.library.Library`` (once per process; :class:`~dcpkit.torch.TorchOps` calls it).

    Schemas (all return nothing and write into caller-provided tensors)::

        dcpkit::q_gather(int handle, Tensor q, Tensor(a!) out, int ubatch)
        dcpkit::kv_gather(int handle, Tensor kv, Tensor(a!) out, int ubatch)
        dcpkit::lse_reduce(int handle, Tensor out_partial, Tensor lse_partial,
                           Tensor? seq_lens, Tensor? query_start_loc, Tensor(a!) out,
                           Tensor(b!)? out_lse, int ubatch)

    ``handle`` is :attr:`TorchOps.handle`. The kernels are registered for every backend
    (``CompositeExplicitAutograd``) plus a fake (meta) kernel for tracing; each bumps the
    version counter of the tensors it writes. Returns op name -> ``torch.ops.dcpkit.<name>``.
    """
    torch = torch_module()  # MissingDependency without torch, registered or not
    with LOCK:
        if state["custom_ops"] is None:
            # torch._C._increment_version takes a sequence of tensors: what
            # torch.autograd.graph.increment_version calls, without its Python layer
            state["increment_version"] = _version_bump(torch)
            lib = torch.library.Library("dcpkit", "DEF")
            for name, (schema, _mutates, impl, fake) in _SCHEMAS.items():
                lib.define(f"{name}{schema}")
                lib.impl(name, impl, "CompositeExplicitAutograd")
                torch.library.register_fake(f"dcpkit::{name}", fake, lib=lib)
            state["library"] = lib
            state["custom_ops"] = {name: getattr(torch.ops.dcpkit, name) for name in _SCHEMAS}
    return state["custom_ops"]


def dispatcher_probe() -> Any:
    """``torch.ops.dcpkit_probe.q_gather``: ``dcpkit::q_gather``'s schema registered the same way
    (``torch.library.Library``, CompositeExplicitAutograd) with a body that does nothing, so a
    call of it costs what torch's dispatcher alone costs (the host-time scripts time it beside
    the custom ops). Registered once per process."""
    torch = torch_module()
    with LOCK:
        if state["probe"] is None:
            lib = torch.library.Library("dcpkit_probe", "DEF")
            lib.define("q_gather" + _SCHEMAS["q_gather"][0])
            lib.impl("q_gather", lambda handle, q, out, ubatch: None, "CompositeExplicitAutograd")
            state["probe_library"] = lib  # kept alive with the process
            state["probe"] = torch.ops.dcpkit_probe.q_gather
    return state["probe"]
