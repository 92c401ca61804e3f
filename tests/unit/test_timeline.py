"""The kernel timeline (diagnostics build): the marks compile in only with -DDCPKIT_TIMELINE=1,
the host mirrors the buffer layout, and the analysis splits calls into the right steps."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dcpkit import jit
from dcpkit.bench import timeline as tl
from dcpkit.errors import InvalidArgument, InvalidType

TIMELINE = ["-DDCPKIT_TIMELINE=1"]


def _ptx(file: str, options=()) -> str:
    """PTX of every variant of ``file`` (NVRTC, no GPU)."""
    nvrtc = jit._nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(jit.source(file).encode(), file.encode(), 0, [], [])
    assert int(err) == 0
    for e in jit.VARIANTS[file]:
        nvrtc.nvrtcAddNameExpression(prog, e.encode())
    opts = [o.encode() for o in list(jit.DEFAULT_OPTIONS) + ["-arch=compute_90", *options]]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert int(res) == 0
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    buf = bytearray(n)
    nvrtc.nvrtcGetPTX(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    return buf.decode(errors="replace")


@pytest.mark.parametrize("file", ["q_gather.cu", "kv_gather.cu", "lse_reduce.cu", "ceilings.cu"])
def test_timeline_build_compiles(file):
    res = jit.compile_only([file], options=TIMELINE)
    assert res[file]["variants"] == len(jit.VARIANTS[file])
    assert res[file]["cubin_bytes"] > 0


@pytest.mark.parametrize("file", ["q_gather.cu", "ceilings.cu"])
def test_marks_exist_only_in_the_timeline_build(file):
    shipped, diag = _ptx(file), _ptx(file, TIMELINE)
    assert "dcpkit_timeline" not in shipped
    assert "globaltimer" in diag and re.search(r"\.global \.align 8 \.u64 dcpkit_timeline;", diag)
    # every kernel of the file reads the buffer address in the diagnostics build
    assert diag.count("dcpkit_timeline") > len(jit.VARIANTS[file])


def test_layout_mirrors_the_header():
    text = (jit.kernels_dir() / "dcpkit_ptx.cuh").read_text()
    got = {
        name: int(v) for name, v in re.findall(r"constexpr unsigned kTimeline(\w+) = (\d+);", text)
    }
    assert got == {
        "Calls": tl.CALLS,
        "Ctas": tl.CTAS,
        "Marks": tl.MARKS,
        "Role": tl.ROLE,
        "Sm": tl.SM,
    }
    assert tl.buffer_words() == tl.CALLS * tl.CTAS * 2 * tl.MARKS


def test_module_global_checks_its_arguments_first():
    with pytest.raises(InvalidType, match="name must be a str"):
        jit.module_global("q_gather.cu", 3, TIMELINE)
    with pytest.raises(InvalidArgument, match="file must be"):
        jit.module_global("nope.cu", "dcpkit_timeline")


# ------------------------------------------------------------------ analysis, synthetic marks
RANKS, NCALLS, NCTA = 2, 5, 3
SKEW, PERIOD = 500, 10_000


def _synthetic(first_epoch: int) -> list[np.ndarray]:
    """Every rank's buffer for calls first_epoch .. first_epoch + NCALLS - 1: rank r starts
    SKEW ns after rank r - 1; CTA g enters 100 g ns after the first; stores done at +1000 + 10 g;
    the elected CTA (g = 2, role 3) publishes at +1500; every signal seen 700 ns after the last
    rank published (CTA g 10 g later); exit 2000 ns after that (+ g)."""
    bufs = []
    for r in range(RANKS):
        b = np.zeros((tl.CALLS, tl.CTAS, 2 * tl.MARKS), dtype=np.uint64)
        for c in range(NCALLS):
            e = first_epoch + c
            base = 1_000_000 + c * PERIOD + r * SKEW
            last_pub = 1_000_000 + c * PERIOD + (RANKS - 1) * SKEW + 1500
            for g in range(NCTA):
                row = b[e % tl.CALLS, g]
                row[tl.ENTRY] = base + 100 * g
                row[tl.CHECKED] = base + 100 * g + 50
                row[tl.STORED] = base + 1000 + 10 * g
                row[tl.PUBLISHED] = base + (1500 if g == 2 else 1100)
                row[tl.SEEN] = last_pub + 700 + 10 * g
                row[tl.EXIT] = last_pub + 700 + 2000 + g
                row[tl.ROLE] = g + 1
                row[tl.SM] = g
        bufs.append(b)
    return bufs


@pytest.mark.parametrize("first_epoch", [1, 62])  # 62: the calls wrap around the ring
def test_phases_of_synthetic_calls(first_epoch):
    calls = [tl.ordered_calls(b) for b in _synthetic(first_epoch)]
    assert [len(c) for c in calls] == [NCALLS] * RANKS
    entries = calls[0][:, 0, tl.ENTRY]
    assert list(np.diff(entries.astype(np.int64))) == [PERIOD] * (NCALLS - 1)  # in call order
    p = tl.phases(calls)
    us = {k: p[k]["median_us"] for k in p if isinstance(p[k], dict)}
    mean = {k: p[k]["mean_us"] for k in p if isinstance(p[k], dict)}
    assert mean["slowest_rank"] == pytest.approx(SKEW / 2e3)  # half the samples 500, half 0
    assert mean["stores"] == pytest.approx(us["stores"])
    assert p["calls"] == NCALLS and p["ranks"] == RANKS
    assert us["stores"] == pytest.approx(1.020)
    assert us["publish"] == pytest.approx(0.480)
    assert us["slowest_rank"] == pytest.approx(SKEW / 2e3)  # rank 0 waits 500 ns, rank 1 none
    assert us["signal"] == pytest.approx(0.700)
    assert us["finish"] == pytest.approx(2.002)
    assert us["skew"] == pytest.approx(SKEW / 1e3)
    assert us["period"] == pytest.approx(PERIOD / 1e3)
    assert us["cta_spread"] == pytest.approx(0.200)
    assert us["check"] == pytest.approx(0.050)
    # rank 0: 1020 + 480 + 500 + 700 + 2002; rank 1: the same without the 500
    assert us["total"] == pytest.approx((4702 + 4202) / 2e3)
    assert p["timer_step_ns"] == 50  # entry -> poison check, the closest marks of a CTA
    table = tl.format_table([{"label": "op", "phases": p}])
    assert "| entry -> last CTA's payload stores issued | 1.02 (1.02) |" in table


def test_phases_refuses_ranks_with_other_call_counts():
    a, b = (tl.ordered_calls(x) for x in _synthetic(1))
    with pytest.raises(ValueError, match="same number of calls"):
        tl.phases([a, b[:-1]])
    with pytest.raises(ValueError, match="at least one rank"):
        tl.phases([])


def test_a_cta_that_never_saw_the_signals_is_left_out_of_signal():
    bufs = _synthetic(1)
    for b in bufs:
        b[:, 0, tl.SEEN] = 0  # CTA 0 did not wait (or gave up helping)
    p = tl.phases([tl.ordered_calls(b) for b in bufs])
    assert p["signal"]["median_us"] == pytest.approx(0.710)  # CTA 1 is now the first


def test_publish_is_the_last_ctas_under_share_counters():
    """Under share counters every CTA publishes its own part and the waiters are fixed by index:
    the rank has published when its last CTA has, whichever its role (here CTA 0, which does
    not wait, publishes 100 ns after the top waiter)."""
    bufs = _synthetic(1)
    for b in bufs:
        b[:, 0, tl.PUBLISHED] = b[:, 2, tl.PUBLISHED] + 100
    p = tl.phases([tl.ordered_calls(b) for b in bufs])
    assert p["publish"]["median_us"] == pytest.approx(0.580)
    assert p["signal"]["median_us"] == pytest.approx(0.600)  # seen 700 ns after the old last
