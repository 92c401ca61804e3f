"""The protocol of NOTE [dcpkit epoch signalling], checked without a GPU.

* The PTX that NVRTC emits for every kernel variant publishes in the order the PTX memory model
  needs (CTA barrier, then the acq_rel arrival, then one fence.acq_rel.sys, then the signal
  store) and waits with relaxed polling then one acquire; no fence.sc anywhere.
* The fingerprint's encoding and decoding, and its field limits.
* The Python record fields, fingerprint fields and protocol parameters match the CUDA source.
* The capture checks (constructor and first call) against a fake stream; poisoned / check()
  read the mapped record only.
"""

from __future__ import annotations

import ctypes
import functools
import re

import numpy as np
import pytest

import dcpkit
from dcpkit import _launch, jit
from dcpkit.comm import Communicator
from dcpkit.errors import CollectiveTimeout, ConfigMismatch, DcpkitError, InvalidType
from dcpkit.ops import _protocol as proto
from dcpkit.ops import _workspace
from dcpkit.ops._workspace import OP_IDS
from dcpkit.ops.kv_gather import KVGather
from dcpkit.ops.lse_reduce import LseReduce
from dcpkit.ops.q_gather import QGather

OPS_FILES = ("q_gather.cu", "kv_gather.cu", "lse_reduce.cu")
HEADER = "dcpkit_ptx.cuh"
#: The builds of lse_reduce.cu LseReduce may load: the default one and the register merge's
#: (LseReduce.REG_SOURCES, worlds up to 4).
BUILDS = ((), ("-DDCPKIT_LSE_REG_SOURCES=4",))
#: (file, extra NVRTC options) of every op kernel module: each file's default build, and
#: lse_reduce.cu in every one of BUILDS.
OPS_BUILDS = [(f, ()) for f in OPS_FILES] + [("lse_reduce.cu", b) for b in BUILDS[1:]]
OPS_BUILD_IDS = [f + "".join(o.replace("-D", "+") for o in b) for f, b in OPS_BUILDS]


def _header() -> str:
    return (jit.kernels_dir() / HEADER).read_text()


# ----------------------------------------------------------------------------- PTX order
def _nvrtc_or_skip():
    try:
        return jit._nvrtc()
    except Exception as e:  # noqa: BLE001 - no NVRTC here: say so
        pytest.skip(f"NVRTC (cuda-bindings) is not available here: {e}")


def _ptx(file: str, options=()) -> str:
    """The PTX of every variant of ``file`` (jit.VARIANTS) for compute_90 (compiled once per
    file and options in a session)."""
    _nvrtc_or_skip()
    return _ptx_of(file, tuple(options))


@functools.cache
def _ptx_of(file: str, options: tuple) -> str:
    nvrtc = jit._nvrtc()
    code = jit.source(file).encode()
    err, prog = nvrtc.nvrtcCreateProgram(code, file.encode(), 0, [], [])
    assert int(err) == 0
    try:
        for e in jit.VARIANTS[file]:
            (r,) = nvrtc.nvrtcAddNameExpression(prog, e.encode())
            assert int(r) == 0
        opts = [
            o.encode() for o in list(jit.DEFAULT_OPTIONS) + ["-arch=compute_90"] + list(options)
        ]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(res) != 0:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            log = bytearray(n)
            nvrtc.nvrtcGetProgramLog(prog, log)
            pytest.fail(f"{file}: {log.decode(errors='replace')}")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = bytearray(size)
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf.decode(errors="replace").rstrip("\x00")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _entries(ptx: str):
    """``(name, body lines)`` of every kernel entry of a PTX module."""
    out = []
    for m in re.finditer(r"\.entry\s+(\S+)\s*\(", ptx):
        start = m.end()
        nxt = ptx.find(".entry", start)
        body = ptx[start : nxt if nxt >= 0 else len(ptx)]
        out.append((m.group(1), [ln.strip() for ln in body.splitlines()]))
    return out


def _index(lines, pattern, before=None, after=-1):
    """Index of the last line matching ``pattern`` in (after, before), or None."""
    rx = re.compile(pattern)
    end = len(lines) if before is None else before
    for i in range(end - 1, after, -1):
        if rx.search(lines[i]):
            return i
    return None


SIGNAL_STORE = r"^(multimem\.st\.relaxed\.sys\.global\.u64|st\.relaxed\.sys\.global\.u64)\b"


@pytest.mark.parametrize("self_check", [True, False], ids=["self-check", "epoch-only"])
@pytest.mark.parametrize("file,build", OPS_BUILDS, ids=OPS_BUILD_IDS)
def test_publish_order_in_every_variant(file, build, self_check):
    """No fence.sc in any kernel. In every kernel that elects (the pull kv_gather): bar.sync,
    then atom.acq_rel.gpu (the arrival), then fence.acq_rel.sys, then the signal stores;
    relaxed polls of the signal, then ld.acquire.sys. Before the arrival, the unicast push
    kernels store one relaxed word (the credit, NOTE [dcpkit zero-copy graph outputs]) and the
    others none. The push gathers and lse_reduce publish by shares
    (test_publishing_by_shares). lse_reduce.cu in every build."""
    ptx = _ptx(file, build + (() if self_check else ("-DDCPKIT_SELF_CHECK=0",)))
    entries = [(n, b) for n, b in _entries(ptx) if "combine" not in n]
    assert len(entries) == len(jit.VARIANTS[file]) - (3 if file == "lse_reduce.cu" else 0)
    for name, lines in entries:
        assert not any("fence.sc" in ln for ln in lines), f"{name}: fence.sc emitted"
        if _publishes_by_shares(name):
            continue
        arrival = next(
            (i for i, ln in enumerate(lines) if ln.startswith("atom.acq_rel.gpu.global.add.u32")),
            len(lines),
        )
        sig = [i for i, ln in enumerate(lines) if re.search(SIGNAL_STORE, ln) and i > arrival]
        assert sig, f"{name}: no 64-bit relaxed signal store after the arrival"
        first = sig[0]
        early = [i for i, ln in enumerate(lines[:arrival]) if re.search(SIGNAL_STORE, ln)]
        credit = "push_kernel" in name or "q_gather_kernel" in name
        unicast = "TransportE0" in name
        assert len(early) == (1 if credit and unicast else 0), (name, early)
        fence = _index(lines, r"^fence\.acq_rel\.sys;", before=first)
        assert fence is not None, f"{name}: no fence.acq_rel.sys before the signal store"
        atom = _index(lines, r"^atom\.acq_rel\.gpu\.global\.add\.u32", before=fence)
        assert atom is not None, f"{name}: no acq_rel arrival before the fence"
        bar = _index(lines, r"^(bar\.sync|barrier\.sync)\b", before=atom)
        assert bar is not None, f"{name}: no CTA barrier before the arrival"
        # the payload loop (16-byte stores) comes before the barrier
        assert any(re.match(r"^st\.global\.v4", ln) for ln in lines[:bar]), (
            f"{name}: no payload store before the barrier"
        )
        # exactly one fence in the publish step: the one before the first signal store
        assert sum(1 for ln in lines[atom:first] if ln.startswith("fence.")) == 1, name
        # the wait: relaxed polling, then one acquire of the same word
        poll = _index(lines, r"^ld\.relaxed\.sys\.global\.u64")
        acq = _index(lines, r"^ld\.acquire\.sys\.global\.u64")
        assert poll is not None and acq is not None, f"{name}: relaxed poll / acquire missing"
        first_acq = next(
            i for i, ln in enumerate(lines) if ln.startswith("ld.acquire.sys.global.u64")
        )
        first_poll = next(
            i for i, ln in enumerate(lines) if ln.startswith("ld.relaxed.sys.global.u64")
        )
        assert first_poll < first_acq, f"{name}: the acquire comes before the relaxed poll"
        assert not any(ln.startswith("ld.acquire.sys.global.u32") for ln in lines), (
            f"{name}: 32-bit acquire polls of the old protocol"
        )


def _publishes_by_shares(name: str) -> bool:
    """The kernels of NOTE [dcpkit share counters]: the push gathers and lse_reduce."""
    return any(k in name for k in ("q_gather_kernel", "kv_gather_push_kernel", "lse_reduce_kernel"))


#: (file, options, entries) of every module with kernels that publish by shares: the push
#: gathers' (two entries each) and every build of lse_reduce.cu (the kernel of each output and
#: lse dtype, small and large instance).
SHARE_BUILDS = [("q_gather.cu", (), 2), ("kv_gather.cu", (), 2)] + [
    ("lse_reduce.cu", b, len(jit.VARIANTS["lse_reduce.cu"]) - 3) for b in BUILDS
]


RED_SHARE = (
    r"^(multimem\.red\.relaxed\.sys\.global\.add\.u64|red\.relaxed\.sys\.global\.add\.u64)\b"
)


@pytest.mark.parametrize("self_check", [True, False], ids=["self-check", "epoch-only"])
@pytest.mark.parametrize(
    "file,build,count",
    SHARE_BUILDS,
    ids=[f + "".join(o.replace("-D", "+") for o in b) for f, b, _ in SHARE_BUILDS],
)
def test_publishing_by_shares(file, build, count, self_check):
    """NOTE [dcpkit share counters]: in the push gathers and lse_reduce no arrival atomic;
    after the payload stores a CTA barrier, then one fence.acq_rel.sys, then the share adds
    (red, no returned value), with the signal-word stores before that fence; the waits poll
    with relaxed loads and take one acquire, and the fingerprint's signal word is read after
    it."""
    ptx = _ptx(file, build + (() if self_check else ("-DDCPKIT_SELF_CHECK=0",)))
    entries = [(n, b) for n, b in _entries(ptx) if _publishes_by_shares(n)]
    assert len(entries) == count, [n for n, _ in _entries(ptx)]
    for name, lines in entries:
        assert not any(ln.startswith("atom.acq_rel.gpu") for ln in lines), name
        reds = [i for i, ln in enumerate(lines) if re.search(RED_SHARE, ln)]
        assert reds, f"{name}: no share add"
        bar = _index(lines, r"^(bar\.sync|barrier\.sync)\b", before=reds[0])
        assert bar is not None, f"{name}: no CTA barrier before the share adds"
        assert any(re.match(r"^st\.global\.v4", ln) for ln in lines[:bar]), name
        # every share add follows a fence.acq_rel.sys issued after the barrier
        for r in reds:
            assert _index(lines, r"^fence\.acq_rel\.sys;", before=r, after=bar) is not None, (
                f"{name}: a share add without a fence before it: {lines[r]}"
            )
        # the normal path: the signal words, then its one fence, then the adds
        last = _index(lines, r"^fence\.acq_rel\.sys;", before=reds[-1], after=bar)
        assert any(re.search(SIGNAL_STORE, ln) for ln in lines[bar:last]), (
            f"{name}: no signal-word store before the fence"
        )
        assert not any(ln.startswith("fence.") for ln in lines[last + 1 : reds[-1]]), name
        first_poll = next(
            i for i, ln in enumerate(lines) if ln.startswith("ld.relaxed.sys.global.u64")
        )
        first_acq = next(
            i for i, ln in enumerate(lines) if ln.startswith("ld.acquire.sys.global.u64")
        )
        assert first_poll < first_acq, f"{name}: the acquire comes before the relaxed poll"
        if self_check:  # the signal word is read after an acquire
            assert any(
                ln.startswith("ld.relaxed.sys.global.u64") for ln in lines[first_acq + 1 :]
            ), name


@pytest.mark.parametrize("file", ["gather.cuh", "lse_reduce.cu"])
def test_a_failed_wait_settles_the_own_counter_before_the_epoch_and_the_poison(file):
    """NOTE [dcpkit share counters]: a wait may fail early while CTAs of the same kernel still
    send (an in-place lse_reduce reads the input that the poison overwrites) or have not read the
    epoch; so after a failed wait the waiter waits for this rank's own counter
    (settle_own_shares) before the epoch store and before any poison: one step of the header
    (waiter_shares) that both kernels' waiters go through."""
    src = (jit.kernels_dir() / file).read_text()
    # the kernel's waiters go through waiter_shares, which also stores the epoch
    wait = src.index("if (!waiter_shares(P, ")
    poison = src.index("poison_result(" if file == "lse_reduce.cu" else "gather_failed(", wait)
    assert wait < poison and "wait_all_shares(" not in src and "P.epoch) = e" not in src
    header = _header()
    step = header[header.index("bool waiter_shares(") :]
    step = step[: step.index("\n}\n")]
    order = [step.index(s) for s in ("wait_all_shares(", "settle_own_shares(", "p.epoch) = e")]
    assert order == sorted(order), step
    assert "if (!ok) settle_own_shares(p, e);" in step and "&& !dead" in step, step
    body = header[header.index("void settle_own_shares(") :]
    body = body[: body.index("\n}\n")]
    assert "shares_reached(" in body and "acquire_polled(cnt)" in body
    assert "__syncthreads();" in body and "aborted(" not in body  # a poisoned workspace waits too


def test_only_share_kernels_skip_a_ubatch_they_have_published():
    """At the deadline a ubatch mismatch is reported from another ubatch's signal only where
    this rank has not published that call itself: under share counters the epoch is stored
    after the waits, so a call still waiting there is not a mismatch. The election's waits do
    not look at the counters (its kernels leave them alone)."""
    header = _header()
    sig = header[header.index("bool wait_signal(") :]
    sig = sig[: sig.index("\n}\n")]
    shares = header[header.index("bool wait_shares(") :]
    shares = shares[: shares.index("\n}\n")]
    assert "other_ubatch_signal(p, src, false)" in sig
    assert "other_ubatch_signal(p, src, true)" in shares
    body = header[header.index("u64 other_ubatch_signal(") :]
    body = body[: body.index("\n}\n")]
    assert re.search(r"if \(shares && shares_reached\(", body), body


@pytest.mark.parametrize("self_check", [True, False], ids=["self-check", "epoch-only"])
@pytest.mark.parametrize("file,build", OPS_BUILDS, ids=OPS_BUILD_IDS)
def test_no_value_of_an_acquire_is_used(file, build, self_check):
    """Every ld.acquire of a signal or credit word follows a relaxed poll that already read the
    awaited value, and the word does not change again in the call: the waits read the polled
    word (fingerprint, credit offset). A use of the acquire's own value makes the wait a second
    dependent round trip to the word (measured 0.2-0.4 us per call at T <= 8); without a use,
    ptxas keeps only the acquire's ordering. lse_reduce.cu in every build."""
    ptx = _ptx(file, build + (() if self_check else ("-DDCPKIT_SELF_CHECK=0",)))
    for name, lines in _entries(ptx):
        if "combine" in name:  # lse_combine_kernel: the NCCL fallback's merge, no protocol
            continue
        for i, ln in enumerate(lines):
            m = re.match(r"^ld\.acquire\.sys\.global\.u64\s+(%rd\d+),", ln)
            if not m:
                continue
            reg = re.compile(re.escape(m.group(1)) + r"(?!\d)")
            uses = [later for later in lines[i + 1 :] if reg.search(later)]
            assert not uses, f"{name}: the value of {ln!r} is used: {uses[:3]}"
        assert any(ln.startswith("ld.acquire.sys.global.u64") for ln in lines), name


def test_register_merge_only_in_the_small_instance():
    """The register build of lse_reduce.cu (LseReduce.REG_SOURCES) changes the small instance
    and the local merge, and leaves the large instance's PTX as the default build's: it keeps
    the warp merge (the register merge made ptxas spill there)."""
    # Names of the file's internal globals carry a hash that differs between builds.
    internal = re.compile(r"\d+_INTERNAL_\w+?_lse_reduce_cu_[0-9a-f]+_\d+")
    default, reg = (
        {n: "\n".join(b) for n, b in _entries(internal.sub("I", _ptx("lse_reduce.cu", build)))}
        for build in BUILDS
    )
    assert default.keys() == reg.keys() and len(default) == len(jit.VARIANTS["lse_reduce.cu"])
    for name in default:
        large = "Lb1E" in name  # lse_reduce_kernel<OUT_T, LSE_T, true>
        assert (default[name] == reg[name]) == large, (name, "same" if large else "differs")


# ----------------------------------------------------------------------------- fingerprint
def test_fingerprint_fields_match_the_kernel_macros():
    text = _header()
    macros = dict(re.findall(r"#define DCPKIT_FP_(\w+) (\d+)", text))
    for field, (shift, bits) in proto.FP_FIELDS.items():
        key = {
            "op": "OP",
            "ubatch": "UBATCH",
            "dtype": "DTYPE",
            "lse": "LSE",
            "qsl": "QSL",
            "seq": "SEQ",
            "T": "T",
            "zc": "ZC",
        }[field]
        assert int(macros[f"{key}_SHIFT"]) == shift, field
        if f"{key}_BITS" in macros:
            assert int(macros[f"{key}_BITS"]) == bits, field
    # the fields tile the 32 bits exactly, without overlap
    used = 0
    for shift, bits in proto.FP_FIELDS.values():
        m = ((1 << bits) - 1) << shift
        assert used & m == 0
        used |= m
    assert used == 0xFFFFFFFF


def test_share_shift_matches_the_kernel():
    text = _header()
    assert int(re.search(r"constexpr int kShareShift = (\d+);", text).group(1)) == (
        proto.SHARE_SHIFT
    )
    assert int(re.search(r"constexpr int kSkipBits = (\d+);", text).group(1)) == proto.SKIP_BITS
    # a call's shares (2**SHARE_SHIFT) above the skip count fill exactly the upper 32 bits'
    # step, so that the observed epoch of a timeout is the counter's upper half
    assert proto.SHARE_SHIFT + proto.SKIP_BITS == 32


def test_share_counters_follow_the_credits():
    """The share counters' offsets agree between the kernel (share_counter_off) and the
    workspace (share_counter_word): right after the signals [2][W] and the credits [W], one u64
    per source, inside the ubatch's signal block."""
    body = re.search(
        r"u64 share_counter_off\(const Proto& p, int src\) \{\s*return ([^;]+);", _header()
    )
    assert body is not None
    assert re.sub(r"\s+", " ", body.group(1)) == (
        "3ull * static_cast<u64>(p.world) + static_cast<u64>(src)"
    )
    for W in range(1, 9):
        assert [proto.share_counter_word(W, s) for s in range(W + 1)] == list(
            range(3 * W, 4 * W + 1)
        )


def test_lse_codes_match_the_kernel():
    src = (jit.kernels_dir() / "lse_reduce.cu").read_text()
    found = dict(re.findall(r"struct lse_code<(\w+)> \{ static constexpr u32 value = (\d+);", src))
    names = {"bf16_t": "bfloat16", "fp16_t": "float16", "float": "float32"}
    assert {names[k]: int(v) for k, v in found.items()} == proto.LSE_CODES


def test_fingerprint_round_trip_and_limits():
    for op in ("lse_reduce", "q_gather", "kv_gather"):
        for T in (1, 2, 6, 128, 2**16 - 1):
            for lse in (None, "bfloat16", "float16", "float32"):
                for qsl, seq in ((False, False), (True, False), (True, True)):
                    for u, zc in ((0, False), (1, True), (15, False), (15, True)):
                        fp = proto.fingerprint(OP_IDS[op], u, "bfloat16", T, lse, qsl, seq, zc)
                        d = proto.decode_fingerprint(fp)
                        assert d == {
                            "op": op,
                            "ubatch": u,
                            "dtype": "bfloat16",
                            "lse": lse or "none",
                            "qsl": qsl,
                            "seq": seq,
                            "T": T,
                            "zc": zc,
                        }
                        assert fp != 0  # a signal is never the zero word
    # beyond the field widths: compared modulo 2**16 (T) and 2**4 (ubatch), documented; T never
    # spills into the zero-copy bit
    d = proto.decode_fingerprint(proto.fingerprint(2, 0, "float16", 2**16 + 5))
    assert d["T"] == 5 and d["zc"] is False
    assert proto.fingerprint(3, 0, "bfloat16", 2**16 - 1, zc=True) >> 31 == 1
    # a mode mismatch is named as such
    summary, per_rank = proto.describe_mismatch(
        [proto.fingerprint(2, 0, "bfloat16", 8, zc=True), proto.fingerprint(2, 0, "bfloat16", 8)]
    )
    assert summary == ("zero-copy graph output=yes on rank 0, zero-copy graph output=no on rank 1")
    assert per_rank == ["zero-copy graph output=yes", "zero-copy graph output=no"]
    assert proto.decode_fingerprint(proto.fingerprint(2, 17, "float16", 1))["ubatch"] == 1
    # the dtype codes are distinct and fit their field
    codes = list(proto.DTYPE_CODES.values()) + [proto.OTHER_DTYPE]
    assert len(set(codes)) == len(codes) and max(codes) < 2 ** proto.FP_FIELDS["dtype"][1]
    assert proto.dtype_code(np.dtype("complex64")) == proto.OTHER_DTYPE
    w = proto.signal_word(2**32 + 7, 0xABCDEF01)
    assert w == (0xABCDEF01 << 32) | 7


def test_mismatch_summary_names_ranks_and_values():
    t2 = proto.fingerprint(1, 0, "bfloat16", 2, "float32")
    t6 = proto.fingerprint(1, 0, "bfloat16", 6, "float32")
    summary, per_rank = proto.describe_mismatch([t2, t6, t6, t6])
    assert summary == "T=2 on rank 0, T=6 on ranks 1-3"
    assert per_rank == ["T=2", "T=6", "T=6", "T=6"]
    s16 = proto.fingerprint(1, 0, "bfloat16", 2, "float16", True, True)
    summary, _ = proto.describe_mismatch([t2, s16, None])
    assert "lse_partial dtype=float32 on rank 0, lse_partial dtype=float16 on rank 1" in summary
    assert "query_start_loc given=no on rank 0, query_start_loc given=yes on rank 1" in summary
    assert summary.endswith("(rank 2 not seen)")
    assert proto.rank_ranges([5, 1, 2, 3]) == "ranks 1-3, 5"


# ----------------------------------------------------------------------------- layouts
def _struct_fields(text: str, name: str):
    body = re.search(r"struct %s \{(.*?)\n\};" % name, text, re.S).group(1)
    fields = []
    for m in re.finditer(r"^\s*(u32|u64|int|[\w:]+\*?)\s+(\w+)(\[(\w+)\])?;", body, re.M):
        fields.append((m.group(1), m.group(2), m.group(4)))
    return fields


def test_record_layout_matches_the_cuda_struct():
    text = _header()
    fields = _struct_fields(text, "ProtoRecord")
    names, offsets, off = [], {}, 0
    for typ, name, count in fields:
        assert typ == "u32", (typ, name)
        n = 1
        if count is not None:
            n = (
                int(re.search(r"#define %s (\d+)" % count, text).group(1))
                if not count.isdigit()
                else int(count)
            )
        offsets[name] = off
        off += 4 * n
        names += [name] if n == 1 or name == "seen_fp" else [f"{name}{i}" for i in range(n)]
    assert off == proto.RECORD_BYTES
    assert tuple(n for n in names if n != "seen_fp") == proto.RECORD_FIELDS
    assert offsets["seen_fp"] == 4 * len(proto.RECORD_FIELDS)
    assert (
        int(re.search(r"#define DCPKIT_REC_SOURCES (\d+)", text).group(1)) == proto.RECORD_SOURCES
    )
    assert int(re.search(r"#define DCPKIT_REC_MISMATCH (\d+)", text).group(1)) == proto.REC_MISMATCH
    assert _workspace.TIMEOUT_RECORD_FIELDS == proto.RECORD_FIELDS[:8]


def _proto_param_sizes():
    text = _header()
    body = re.search(r"#define DCPKIT_PROTO_PARAMS(.*?)\n#define", text, re.S).group(1)
    body = body.replace("\\", " ")
    sizes = []
    for decl in body.split(","):
        decl = decl.strip()
        if "*" in decl or "u64" in decl:
            sizes.append(8)
        elif re.match(r"^(int|dcpkit::u32)\b", decl):
            sizes.append(4)
        else:
            raise AssertionError(f"unknown parameter {decl!r}")
    return sizes


class _Arr:
    def __init__(self, ptr):
        self.data = type("D", (), {"ptr": ptr})()


class _Heap:
    local_ptr = 1 << 40
    mc_ptr = 0


def test_protocol_tuple_matches_the_kernel_parameters():
    ws = QGather.__new__(QGather)
    ws._check_arguments(
        4, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="bfloat16", num_ubatches=2
    )
    ws.rank, ws.world_size, ws.multicast, ws.heap, ws._base = 1, 4, False, _Heap(), 0
    ws._epoch, ws._ctl, ws._peer_sig = _Arr(1 << 30), _Arr(2 << 30), _Arr(3 << 30)
    ws._rec_ptr = 4 << 30
    ws._timeout_ns = np.uint64(10**9)
    ws.waiter_ctas = 3
    t = ws._make_proto(1)
    sizes = _proto_param_sizes()
    assert len(t) == len(sizes)
    for v, size in zip(t, sizes):
        assert isinstance(v, np.generic) and v.dtype.itemsize == size, (v, size)
    # fp_base, waiters, num_ubatches, sig_ustride (the last four parameters)
    assert int(t[12]) == proto.fingerprint_base(OP_IDS["q_gather"], 1, "bfloat16")
    assert (int(t[13]), int(t[14])) == (3, 2)
    assert int(t[15]) * 8 == ws._ubatch_stride
    # the signal block holds the signals [2][W], the credits [W] and the share counters [W]
    assert ws._sig_bytes >= proto.share_counter_word(4, 4) * 8 == 4 * 4 * 8


# ----------------------------------------------------------------------------- host behaviour
class FakeStream:
    def __init__(self, capturing=False):
        self.capturing = capturing

    def is_capturing(self):
        return self.capturing


@pytest.mark.parametrize(
    "cls,kw",
    [
        (QGather, dict(max_tokens=4, heads_per_rank=4, head_dim=64, dtype="float16")),
        (KVGather, dict(max_tokens=4, row_dim=64, dtype="float16")),
        (LseReduce, dict(max_tokens=4, num_heads=4, head_dim=64, dtype="float16")),
    ],
)
def test_constructor_refuses_a_capturing_stream(monkeypatch, cls, kw):
    """Checked inside the agreed setup exchange (so every rank raises), before any GPU work."""
    monkeypatch.setattr(dcpkit._cuda, "require_device", lambda what, device=None: 0)
    monkeypatch.setattr(_workspace, "_current_stream", lambda cupy, device: FakeStream(True))
    called = []
    monkeypatch.setattr(cls, "_init_region", lambda self, *a: called.append(1))
    with pytest.raises(DcpkitError) as info:
        cls(Communicator.single(), **kw)
    assert "construction must not happen while a CUDA graph is being captured" in str(info.value)
    assert not called


def _fake(ws, W=2, U=2):
    ws.rank, ws.world_size, ws.device, ws.num_ubatches = 0, W, 0, U
    ws.timeout_ms = 100.0
    ws._closed, ws._debug = False, False
    ws._rec = np.zeros(proto.RECORD_WORDS, dtype=np.uint32)
    ws._calls, ws._captured = [0] * U, [False] * U
    ws.graph_outputs, ws._graph_next = 2, 0
    return ws


def test_first_call_while_capturing_is_refused_before_counting():
    ws = _fake(QGather.__new__(QGather))
    with pytest.raises(DcpkitError) as info:
        ws.begin_call(0, FakeStream(True), ())
    assert "the first call must not happen while a CUDA graph is being captured" in str(info.value)
    assert ws._calls == [0, 0] and ws._captured == [False, False]
    assert ws.begin_call(0, FakeStream(False), ()) == (1, False, True)  # eager first call
    assert ws.begin_call(1, FakeStream(True), ())[1] is True  # then capture is fine


def test_return_padded_must_be_a_bool():
    ws = _fake(QGather.__new__(QGather))
    ws._init_geometry(2, 8, 4, 64, "float16", None)
    with pytest.raises(InvalidType) as info:
        ws._validate(None, 0, None, "no")
    assert "q_gather: return_padded must be a bool (got 'no')" in str(info.value)


def test_the_hot_path_reads_a_record_over_ctypes_memory():
    """The mapped record is a NumPy view of ctypes memory (format '<I'), as on the GPU: the
    hot path's memoryview of it must index (a plain memoryview of it raises
    NotImplementedError, which failed every call on the GPU)."""
    ws = _fake(QGather.__new__(QGather))
    buf = (ctypes.c_uint32 * proto.RECORD_WORDS)()
    ws._rec = np.ctypeslib.as_array(
        (ctypes.c_uint32 * proto.RECORD_WORDS).from_address(ctypes.addressof(buf))
    )
    ws._launch_failed = None
    assert not ws.poisoned
    ws.check_open()  # clean: nothing raised
    ws._rec[:8] = [2, OP_IDS["q_gather"], 0, 1, 7, 5, 0, proto.REC_TIMEOUT]
    assert ws.poisoned
    with pytest.raises(CollectiveTimeout):
        ws.check_open()


def test_poisoned_and_check_read_the_record_without_a_device():
    ws = _fake(LseReduce.__new__(LseReduce), W=4)
    assert not ws.poisoned
    ws.check()  # clean: nothing raised
    # a timeout record
    ws._rec[:8] = [2, OP_IDS["lse_reduce"], 0, 3, 7, 5, 1, proto.REC_TIMEOUT]
    assert ws.poisoned
    with pytest.raises(CollectiveTimeout) as info:
        ws.check()
    assert info.value.peer == 3 and info.value.ubatch == 1
    # a mismatch record, as rank 1 (T=6) saw it: rank 0 at T=2, ranks 2 and 3 at T=6
    t2 = proto.fingerprint(1, 0, "bfloat16", 2, "float32")
    t6 = proto.fingerprint(1, 0, "bfloat16", 6, "float32")
    n = len(proto.RECORD_FIELDS)
    ws._rec[:] = 0
    ws._rec[:n] = [2, 1, 1, 0, 9, 9, 0, proto.REC_MISMATCH, t6, t2, 4, 0, 0, 0, 0, 0]
    ws._rec[n : n + 4] = [t2, t6, t6, t6]
    with pytest.raises(ConfigMismatch) as info:
        ws.check()
    msg = str(info.value)
    assert "T=2 on rank 0, T=6 on ranks 1-3" in msg and "seen by rank 1" in msg
    assert info.value.ranks == [0]
    # rank 0's own view, where ranks 2 and 3 had not arrived yet
    ws._rec[:n] = [2, 1, 0, 1, 9, 9, 0, proto.REC_MISMATCH, t2, t6, 4, 0, 0, 0, 0, 0]
    ws._rec[n : n + 4] = [t2, t6, 0, 0]
    with pytest.raises(ConfigMismatch) as info:
        ws.check()
    assert "T=2 on rank 0, T=6 on rank 1 (ranks 2-3 not seen)" in str(info.value)


def test_self_check_knob_selects_the_epoch_only_variant():
    ws = QGather.__new__(QGather)
    ws._check_protocol_options(graph_outputs=None, waiter_ctas=None, self_check=True)
    assert ws._kernel_options() == ()
    assert ws.graph_outputs == _workspace.DEFAULT_GRAPH_OUTPUTS
    ws._check_protocol_options(graph_outputs=0, waiter_ctas=2, self_check=False)
    assert ws._kernel_options() == ("-DDCPKIT_SELF_CHECK=0",)
    with pytest.raises(InvalidType):
        ws._check_protocol_options(graph_outputs=1, waiter_ctas=None, self_check="yes")
    with pytest.raises(dcpkit.InvalidArgument):
        ws._check_protocol_options(graph_outputs=-1, waiter_ctas=None, self_check=True)


def test_ctas_for_matches_the_launch_rule():
    q = _fake(QGather.__new__(QGather), W=4)
    q._init_geometry(4, 128, 32, 576, "bfloat16", None)
    q.max_ctas = 33
    vec = 32 * 576 * 2 // 16
    assert q.ctas_for(1) == min(33, -(-vec // q.vectors_per_cta))
    assert q.ctas_for(128, copy_out=True) == 33
    assert q.THREADS == 512
    r = _fake(LseReduce.__new__(LseReduce), W=4)
    r._init_geometry(
        4, max_tokens=8, num_heads=8, head_dim=64, dtype="float16", lse_base=np.e, return_lse=False
    )
    r.max_ctas = 10
    assert r.ctas_for(1) == 1 and r.ctas_for(8) == min(10, 4 * 8 * 2 // 8)
    assert r.THREADS == 256


# ----------------------------------------------------------------------------- programmatic launch
_MEMORY_OP = re.compile(
    r"^(ld\.(?!param)|ldu\.|st\.|atom\.|red\.|fence\.|membar\.|multimem\.|cp\.async|"
    r"prefetch|call)"
)


@pytest.mark.parametrize("file,build", OPS_BUILDS, ids=OPS_BUILD_IDS)
def test_programmatic_variant_waits_before_any_memory_access(file, build):
    """NOTE [dcpkit programmatic launch]: built with DCPKIT_PDL=1, every op kernel's first
    memory instruction comes after griddepcontrol.wait; the shipped build has no such wait.
    lse_reduce.cu in every build."""
    assert "griddepcontrol" not in _ptx(file, build)
    entries = _entries(_ptx(file, build + ("-DDCPKIT_PDL=1",)))
    assert entries
    for name, lines in entries:
        if "lse_combine" in name:  # the NCCL path's local combine: not an op kernel
            continue
        wait = next((i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")), None)
        assert wait is not None, f"{file}: {name} has no griddepcontrol.wait"
        first = next((i for i, ln in enumerate(lines) if _MEMORY_OP.match(ln)), None)
        assert first is not None and first > wait, (
            f"{file}: {name}: {lines[first]!r} (line {first}) before the wait (line {wait})"
        )


def test_programmatic_variant_refuses_to_build_below_sm_90():
    """Below sm_90 there is no griddepcontrol: a DCPKIT_PDL build there fails (the wait must
    never compile away under a programmatic launch; the host refuses the option as well)."""
    _nvrtc_or_skip()
    archs = jit.nvrtc_archs()
    if archs is not None and 80 not in archs:
        pytest.skip("this NVRTC cannot target sm_80")
    for f in OPS_FILES:
        with pytest.raises(dcpkit.CompileError, match="needs sm_90 or newer"):
            jit.compile_only(f, arch="sm_80", options="-DDCPKIT_PDL=1")
    assert jit.compile_only(list(OPS_FILES), arch="sm_80")  # the shipped build is fine there


@pytest.mark.parametrize("cls", [QGather, KVGather, LseReduce])
def test_programmatic_launch_option_selects_the_variant_and_the_launcher(cls):
    ws = cls.__new__(cls)
    ws._check_protocol_options(graph_outputs=None, waiter_ctas=None, self_check=True)
    assert ws.programmatic_launch is False and ws._kernel_options() == ()
    ws._check_protocol_options(
        graph_outputs=None, waiter_ctas=None, programmatic_launch=True, self_check=False
    )
    assert ws._kernel_options() == ("-DDCPKIT_SELF_CHECK=0", "-DDCPKIT_PDL=1")
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidType, match="programmatic_launch must be a bool"):
            ws._check_protocol_options(
                graph_outputs=None, waiter_ctas=None, programmatic_launch=bad, self_check=True
            )


class _Props:
    def __init__(self, major, minor):
        self.props = {"major": major, "minor": minor}

    def getDeviceProperties(self, device):
        return self.props


class _FakeCupy:
    def __init__(self, major, minor):
        self.cuda = type("cuda", (), {"runtime": _Props(major, minor)})()


def test_programmatic_launch_needs_sm_90_and_cuda_bindings(monkeypatch):
    with pytest.raises(dcpkit.InvalidArgument, match="compute capability 9.0 or newer.*8.0"):
        _launch.check_programmatic_launch(_FakeCupy(8, 0), 0, "q_gather")
    # Whatever the default backend (CuPy's binding has no cuLaunchKernelEx), cuda.bindings
    # decides.
    monkeypatch.setattr(_launch, "default_backend", lambda: "cupy")
    monkeypatch.setattr(_launch, "bindings_available", lambda: False)
    with pytest.raises(dcpkit.InvalidArgument, match="cuLaunchKernelEx.*install cuda-bindings"):
        _launch.check_programmatic_launch(_FakeCupy(9, 0), 0, "q_gather")
    monkeypatch.setattr(_launch, "bindings_available", lambda: True)
    _launch.check_programmatic_launch(_FakeCupy(10, 0), 0, "q_gather")  # no error


def test_protocol_probe_flags_travel_in_64_bit_words():
    """The probe's flags-inside-the-data variant relies on each 64-bit word (32 bits of data, 32
    of epoch) being one single-copy-atomic access: its stores and polls must be vector accesses
    of u64 elements at system scope, never of u32 elements (whose data and flag could land
    apart)."""
    ptx = _ptx("protocol_probe.cu")
    ((name, lines),) = _entries(ptx)
    assert "protocol_probe_kernel" in name, name
    stores = [ln for ln in lines if ln.startswith("st.relaxed.sys.global.v2")]
    loads = [ln for ln in lines if ln.startswith("ld.relaxed.sys.global.v2")]
    assert stores and loads, "no flag-carrying vector accesses in the probe"
    assert all(ln.startswith("st.relaxed.sys.global.v2.u64") for ln in stores), stores
    assert all(ln.startswith("ld.relaxed.sys.global.v2.u64") for ln in loads), loads
