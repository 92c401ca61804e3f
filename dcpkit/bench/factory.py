"""Which runner measures which path, and which paths apply to an op and this machine."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from .floor import FloorRunner
from .peers import NvshmemRunner
from .runners import DecodeRunner, DirectRunner, NcclRunner, Runner, TorchRunner
from .stages import Ctx

__all__ = ["make_runner", "local_paths", "paths_for", "FAMILIES"]

FAMILIES = {
    "direct": DirectRunner,
    "direct-pull": DirectRunner,
    "multicast": DirectRunner,
    "floor": FloorRunner,
    "nvshmem": NvshmemRunner,
    "nccl": NcclRunner,
    "torch": TorchRunner,
}


def make_runner(
    ctx: Ctx, op: str, path: str, max_tokens: int, variant: str | None = None
) -> Runner:
    """The runner of ``op`` on ``path`` (the sweep's default factory)."""
    if op == "decode_layer":
        return DecodeRunner(
            ctx, op, path, max_tokens, lambda c, o, p, m: make_runner(c, o, p, m, variant)
        )
    return FAMILIES[path](ctx, op, path, max_tokens, variant)


def multicast_allowed(env=None) -> tuple[bool, str, bool]:
    """Whether the guard lets this rank run the multicast path (the device's support is the
    ops' own check), why, and whether the why is an error: a guard variable with a malformed
    value (``InvalidArgument``) drops the path and is reported as an error, never silently."""
    from ..errors import InvalidArgument

    try:
        from ..multicast import multicast_decision
    except ImportError as e:  # no guard module: never
        return False, f"the multicast guard did not import ({e})", True
    try:
        ok, why = multicast_decision(None, os.environ if env is None else env, lambda: True)
    except InvalidArgument as e:
        return False, str(e), True
    return bool(ok), why, False


def local_paths(ctx: Ctx) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """The paths this rank can run (agreed across ranks by the caller), and for each path
    dropped here why, with whether that is an error. nvshmem stays even without nvshmem4py:
    its rows then record why (the peer must be visibly missing)."""
    out: list[str] = []
    dropped: dict[str, tuple[str, bool]] = {}
    for p in ctx.cfg["paths"]:
        if p == "multicast":
            ok, why, error = multicast_allowed()
            if not ok:
                dropped[p] = (why, error)
                continue
        if p == "torch" and importlib.util.find_spec("torch") is None:
            dropped[p] = ("torch is not installed", False)
            continue
        out.append(p)
    return out, dropped


def paths_for(op: str, paths: Sequence[str]) -> list[str]:
    """The paths that apply to ``op`` (pull is a kv_gather algorithm; lse_reduce has no
    multicast variant)."""
    out = []
    for p in paths:
        if p == "direct-pull" and op != "kv_gather":
            continue
        if p == "multicast" and op in ("lse_reduce", "decode_layer"):
            continue
        out.append(p)
    return out
