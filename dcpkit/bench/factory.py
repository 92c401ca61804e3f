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


def _multicast_allowed() -> bool:
    try:
        from ..multicast import multicast_decision

        return bool(multicast_decision(None, os.environ, lambda: True)[0])
    except Exception:  # noqa: BLE001 - no guard module: never
        return False


def local_paths(ctx: Ctx) -> list[str]:
    """The paths this rank can run (agreed across ranks by the caller). nvshmem stays even
    without nvshmem4py: its rows then record why (the peer must be visibly missing)."""
    out = []
    for p in ctx.cfg["paths"]:
        if p == "multicast" and not _multicast_allowed():
            continue
        if p == "torch" and importlib.util.find_spec("torch") is None:
            continue
        out.append(p)
    return out


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
