"""The host side of the self-checking signals and of the failure record.

See NOTE [dcpkit epoch signalling] in ``kernels/dcpkit_ptx.cuh``. A signal is one 64-bit word,
``(fingerprint << 32) | (epoch & 0xFFFFFFFF)``, written with one store after the elected CTA's
``fence.acq_rel.sys`` (the pull kv_gather), or by CTA 0 before its fence beside the share
counters (the push gathers and lse_reduce: NOTE [dcpkit share counters]). The fingerprint
packs what every rank's call must agree on:

=========  =====  ==========================================================================
field      bits   value
=========  =====  ==========================================================================
op         0-2    op id (``OP_IDS``: 1 lse_reduce, 2 q_gather, 3 kv_gather)
ubatch     3-6    ubatch mod 16
dtype      7-10   :data:`DTYPE_CODES` of the data dtype (15: any other dtype)
lse        11-12  :data:`LSE_CODES` of ``lse_partial`` (lse_reduce; 0 for the gathers)
qsl        13     ``query_start_loc`` given (lse_reduce)
seq        14     ``seq_lens`` given (lse_reduce)
T          15-30  ``T mod 2**16``
zc         31     the push gathers: the result goes straight into a graph output buffer (a call
                  captured without ``out=``; NOTE [dcpkit zero-copy graph outputs])
=========  =====  ==========================================================================

Decoding is exact for every field within these limits: ubatches beyond 16 and ``T`` beyond
``2**16 - 1`` are compared modulo ``2**4`` and ``2**16`` (calls whose values differ by a multiple
of that are not told apart by the signal; ``DCPKIT_DEBUG=1`` compares the exact values on the
host). The kernel builds the ``T``, lse and mask fields itself; the host passes the rest as
``fp_base`` (:func:`fingerprint_base`).

The record (mapped pinned memory, one per workspace) is :data:`RECORD_FIELDS` followed by
``seen_fp [RECORD_SOURCES]``: for a mismatch, the fingerprint the recording waiter saw from every
source of that epoch (0: not arrived yet). Every rank records what it saw; each raises
:class:`~dcpkit.errors.ConfigMismatch` at its next call, ``synchronize()`` or ``check()``,
naming the ranks and values it saw (``T=2 on rank 0, T=6 on ranks 1-3``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import CollectiveTimeout, ConfigMismatch

__all__ = [
    "failure_error",
    "FP_FIELDS",
    "DTYPE_CODES",
    "LSE_CODES",
    "REC_TIMEOUT",
    "REC_MISMATCH",
    "RECORD_FIELDS",
    "RECORD_SOURCES",
    "RECORD_WORDS",
    "RECORD_BYTES",
    "dtype_code",
    "fingerprint_base",
    "fingerprint",
    "decode_fingerprint",
    "signal_word",
    "describe_mismatch",
    "rank_ranges",
]

#: field -> (shift, bits), mirroring the DCPKIT_FP_* macros of kernels/dcpkit_ptx.cuh.
FP_FIELDS: dict[str, tuple] = {
    "op": (0, 3),
    "ubatch": (3, 4),
    "dtype": (7, 4),
    "lse": (11, 2),
    "qsl": (13, 1),
    "seq": (14, 1),
    "T": (15, 16),
    "zc": (31, 1),
}
#: Fingerprint codes of the data dtypes (names as ``str(numpy dtype)``); 15 = any other.
DTYPE_CODES: dict[str, int] = {
    "bfloat16": 1,
    "float16": 2,
    "float32": 3,
    "float64": 4,
    "int8": 5,
    "uint8": 6,
    "int16": 7,
    "uint16": 8,
    "int32": 9,
    "uint32": 10,
    "int64": 11,
    "uint64": 12,
    "float8_e4m3fn": 13,
    "float8_e5m2": 14,
}
OTHER_DTYPE = 15
#: Fingerprint codes of the lse_partial dtypes (kernels/lse_reduce.cu lse_code).
LSE_CODES: dict[str, int] = {"bfloat16": 1, "float16": 2, "float32": 3}

#: The share counters of the push gathers and lse_reduce (NOTE [dcpkit share counters] in
#: kernels/dcpkit_ptx.cuh): a call adds 2**SHARE_SHIFT shares to every destination's counter of
#: its source (kShareShift), above the counter's SKIP_BITS low bits (kSkipBits).
SHARE_SHIFT = 20
SKIP_BITS = 12


def share_counter_word(world_size: int, src: int) -> int:
    """Offset in u64 words, from a ubatch's signals[0][0], of source ``src``'s share counter
    (``src == world_size``: the end of the last one): right after the signals [2][W] and the
    credits [W] (share_counter_off in kernels/dcpkit_ptx.cuh)."""
    return 3 * world_size + src


REC_TIMEOUT = 0
REC_MISMATCH = 1
#: u32 fields of kernels/dcpkit_ptx.cuh ProtoRecord before ``seen_fp``.
RECORD_FIELDS = (
    "state",
    "op",
    "rank",
    "peer",
    "expected",
    "observed",
    "ubatch",
    "kind",
    "own_fp",
    "peer_fp",
    "world",
    "reserved0",
    "reserved1",
    "reserved2",
    "reserved3",
    "reserved4",
)
#: Sources whose fingerprint a mismatch record keeps (DCPKIT_REC_SOURCES).
RECORD_SOURCES = 64
RECORD_WORDS = len(RECORD_FIELDS) + RECORD_SOURCES
RECORD_BYTES = 4 * RECORD_WORDS

_OP_NAMES = {1: "lse_reduce", 2: "q_gather", 3: "kv_gather", 4: "ceilings"}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_CODE_LSE = {v: k for k, v in LSE_CODES.items()}


def _mask(field: str) -> int:
    return (1 << FP_FIELDS[field][1]) - 1


def _put(field: str, value: int) -> int:
    shift, _ = FP_FIELDS[field]
    return (int(value) & _mask(field)) << shift


def dtype_code(dtype) -> int:
    """The fingerprint code of a data dtype (15 for one without a code of its own)."""
    return DTYPE_CODES.get(
        str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype, OTHER_DTYPE
    )


def fingerprint_base(op_id: int, ubatch: int, dtype) -> int:
    """The workspace-constant fields (op, ubatch, dtype): the kernel's ``proto_fp_base``."""
    return _put("op", op_id) | _put("ubatch", ubatch) | _put("dtype", dtype_code(dtype))


def fingerprint(
    op_id: int,
    ubatch: int,
    dtype,
    T: int,
    lse_dtype=None,
    qsl: bool = False,
    seq: bool = False,
    zc: bool = False,
) -> int:
    """The whole fingerprint of a call, as the kernel computes it (for tests and messages)."""
    lse = (
        0
        if lse_dtype is None
        else LSE_CODES[str(np.dtype(lse_dtype)) if not isinstance(lse_dtype, str) else lse_dtype]
    )
    return (
        fingerprint_base(op_id, ubatch, dtype)
        | _put("lse", lse)
        | _put("qsl", qsl)
        | _put("seq", seq)
        | _put("T", T)
        | _put("zc", zc)
    )


def signal_word(epoch: int, fp: int) -> int:
    """The 64-bit signal word of a call at ``epoch`` with fingerprint ``fp``."""
    return ((int(fp) & 0xFFFFFFFF) << 32) | (int(epoch) & 0xFFFFFFFF)


def decode_fingerprint(fp: int) -> dict[str, object]:
    """Fingerprint -> ``{"op", "ubatch", "dtype", "lse", "qsl", "seq", "T", "zc"}`` with names for
    the codes (``T`` and ``ubatch`` are the values modulo their field width)."""
    raw = {f: (int(fp) >> s) & ((1 << b) - 1) for f, (s, b) in FP_FIELDS.items()}
    return {
        "op": _OP_NAMES.get(raw["op"], f"op{raw['op']}"),
        "ubatch": raw["ubatch"],
        "dtype": _CODE_DTYPES.get(
            raw["dtype"], "other" if raw["dtype"] == OTHER_DTYPE else f"dtype{raw['dtype']}"
        ),
        "lse": _CODE_LSE.get(raw["lse"], "none"),
        "qsl": bool(raw["qsl"]),
        "seq": bool(raw["seq"]),
        "T": raw["T"],
        "zc": bool(raw["zc"]),
    }


_LABELS = {
    "op": "op",
    "ubatch": "ubatch",
    "dtype": "dtype",
    "lse": "lse_partial dtype",
    "qsl": "query_start_loc given",
    "seq": "seq_lens given",
    "T": "T",
    "zc": "zero-copy graph output",
}
_ORDER = ("T", "lse", "qsl", "seq", "zc", "ubatch", "dtype", "op")


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0]`` -> ``"rank 0"``, ``[1, 2, 3, 5]`` -> ``"ranks 1-3, 5"``."""
    rs = sorted(set(int(r) for r in ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def _value(field: str, v) -> str:
    if field in ("qsl", "seq", "zc"):
        return "yes" if v else "no"
    return str(v)


def describe_mismatch(fps: Sequence[int | None]):
    """From the fingerprint seen for each rank (None: not seen), the summary of the fields that
    differ (``"T=2 on rank 0, T=6 on ranks 1-3"``) and one description per rank.

    Returns ``(summary, per_rank)``."""
    dec = {r: decode_fingerprint(fp) for r, fp in enumerate(fps) if fp is not None}
    fields = [f for f in _ORDER if len({str(d[f]) for d in dec.values()}) > 1]
    groups = []
    for f in fields:
        by_value: dict[str, list[int]] = {}
        for r, d in dec.items():
            by_value.setdefault(_value(f, d[f]), []).append(r)
        groups.append(
            ", ".join(
                f"{_LABELS[f]}={v} on {rank_ranges(rs)}"
                for v, rs in sorted(by_value.items(), key=lambda kv: kv[1][0])
            )
        )
    unseen = [r for r, fp in enumerate(fps) if fp is None]
    summary = "; ".join(groups) if groups else "fingerprints differ"
    if unseen:
        summary += f" ({rank_ranges(unseen)} not seen)"
    per_rank = []
    for r, fp in enumerate(fps):
        if fp is None:
            per_rank.append("not seen")
        else:
            d = dec[r]
            per_rank.append(
                ", ".join(f"{_LABELS[f]}={_value(f, d[f])}" for f in _ORDER if f in fields)
                or f"fingerprint 0x{fp:08x}"
            )
    return summary, per_rank


def failure_error(rec, op_names: dict, op_name: str, world_size: int, timeout_ms: float):
    """The error a failure record holds (``rec``: its ``uint32`` words): a
    :class:`CollectiveTimeout`, or a :class:`ConfigMismatch` with the values this rank saw.
    ``op_names`` maps the record's op id to a name (default ``op_name``)."""
    n = len(RECORD_FIELDS)
    f = dict(zip(RECORD_FIELDS[:8], (int(v) for v in rec[:8])))
    op = op_names.get(f["op"], op_name)
    if f["kind"] != REC_MISMATCH or len(rec) < RECORD_WORDS:
        return CollectiveTimeout(
            op,
            f["rank"],
            f["peer"],
            f["expected"],
            f["observed"],
            ubatch=f["ubatch"],
            timeout_ms=timeout_ms,
        )
    f = dict(zip(RECORD_FIELDS, (int(v) for v in rec[:n])))
    W = min(int(f["world"]) or world_size, RECORD_SOURCES)
    seen = [int(v) or None for v in rec[n : n + W]]
    for r, fp in ((f["rank"], f["own_fp"]), (f["peer"], f["peer_fp"])):
        if r < W:
            seen[r] = fp
    summary, per_rank = describe_mismatch(seen)
    return ConfigMismatch(
        f"{op}: call arguments ({summary}; seen by rank {f['rank']} in ubatch "
        f"{f['ubatch']}, epoch {f['expected']}; the workspace is poisoned: close it and "
        f"build a new one)",
        per_rank,
    )
