"""dcpkit.vllm on the CPU: importing it needs no torch; the ubatch context; every vLLM
``ValueError`` condition of the four classes gives the same kind of error (a ``ValueError``
that is also a dcpkit error) on every rank, before anything is allocated; ranks that disagree
never hang; call-time checks name the argument and launch nothing; MLADCPManager's collective
paths (all-to-all, all-gather + reduce-scatter, all-gather + all-reduce, query all-gather, KV
all-gather) against the float64 reference, over a group of threads.

No GPU: constructors fail (agreed on every rank) only after the checks; call checks run on
workspaces built with ``__new__``; the collective paths run on CPU tensors through a
Communicator of threads (the code of the GPU runs, with the GPU device swapped for the CPU).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from _scripts import load_file

from dcpkit.errors import (
    ClosedError,
    ConfigMismatch,
    DcpkitError,
    InvalidArgument,
    InvalidType,
    PeerError,
)
from dcpkit.reference import (
    kv_gather_reference,
    lse_reduce_reference,
    lse_reduce_tolerance,
    make_inputs,
    q_gather_reference,
)

from _threadgroup import run_group

torch = pytest.importorskip(
    "torch", reason="torch is not installed here (pip install 'dcpkit[torch-cu12]', or torch-cu13)"
)

import dcpkit.vllm as dv  # noqa: E402
from dcpkit.comm import Communicator  # noqa: E402

CUDA0 = torch.device("cuda", 0)
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _torch_cuda_not_required(monkeypatch):
    """These tests run the argument checks and the collective paths over CPU tensors, with
    whatever torch build is installed: the check that torch reaches a CUDA GPU (which comes
    after every argument check) is tested on its own in test_vllm_cpu_torch.py."""
    import dcpkit.vllm._common as common

    monkeypatch.setattr(common, "require_torch_cuda", lambda torch, what: None)


def _have_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


def on_ranks(fn, world_size=2):
    """``fn(comm, rank)`` on a group of threads; per rank ``("ok", value)`` or ``("err", e)``."""
    return run_group(world_size, lambda c: fn(c, c.rank))


def t_from_np(a: np.ndarray):
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# ----------------------------------------------------------------------------- constructors
A2A = dv.DirectDCPA2AWorkspace
QG = dv.DirectDCPQGatherWorkspace
KV = dv.DirectDCPKVGatherWorkspace
MGR = dv.MLADCPManager


def mgr(c, **kw):
    args = dict(
        num_heads=4,
        query_head_dim=576,
        output_head_dim=512,
        query_dtype=BF16,
        output_dtype=BF16,
        padded_num_heads=None,
        is_lse_base_on_e=True,
        use_pcp=False,
    )
    args.update(kw)
    mk = {k: args.pop(k) for k in ("max_num_tokens", "num_ubatches", "comm_backend") if k in args}
    mk.setdefault("max_num_tokens", 8)
    return MGR(c, CUDA0, **args, **mk)


# (name, world_size, build(comm), error class, text in the message). Every one is a vLLM
# ValueError condition (or a type error of the same argument).
CTOR_CASES = [
    (
        "a2a float32",
        2,
        lambda c: A2A(c, CUDA0, 8, 4, 512, torch.float32),
        dv.UnsupportedDtype,
        "dtype must be one of [torch.float16, torch.bfloat16] (got torch.float32)",
    ),
    (
        "a2a no ubatch",
        2,
        lambda c: A2A(c, CUDA0, 8, 4, 512, BF16, 0),
        dv.InvalidGeometry,
        "at least one ubatch slot (got 0)",
    ),
    (
        "a2a T=0",
        2,
        lambda c: A2A(c, CUDA0, 0, 4, 512),
        dv.InvalidGeometry,
        "dimensions must be positive (got T=0, H=4, D=512)",
    ),
    ("a2a H=0", 2, lambda c: A2A(c, CUDA0, 8, 0, 512), dv.InvalidGeometry, "H=0"),
    ("a2a D=0", 2, lambda c: A2A(c, CUDA0, 8, 4, 0), dv.InvalidGeometry, "D=0"),
    (
        "a2a row bytes",
        2,
        lambda c: A2A(c, CUDA0, 8, 4, 4),
        dv.InvalidGeometry,
        "head_dim * itemsize must be a multiple of 16 bytes (got 4 * 2 = 8)",
    ),
    (
        "q no ubatch",
        2,
        lambda c: QG(c, CUDA0, 8, 4, 576, BF16, 0),
        dv.InvalidGeometry,
        "at least one ubatch slot",
    ),
    ("q T=0", 2, lambda c: QG(c, CUDA0, 0, 4, 576), dv.InvalidGeometry, "T=0"),
    ("q H=0", 2, lambda c: QG(c, CUDA0, 8, 0, 576), dv.InvalidGeometry, "H=0"),
    ("q D=0", 2, lambda c: QG(c, CUDA0, 8, 4, 0), dv.InvalidGeometry, "D=0"),
    (
        "q rows",
        2,
        lambda c: QG(c, CUDA0, 8, 1, 4),
        dv.InvalidGeometry,
        "query rows must be 16-byte aligned",
    ),
    (
        "q padded rows",
        2,
        lambda c: QG(c, CUDA0, 8, 2, 4, padded_num_heads=5),
        dv.InvalidGeometry,
        "5*4*2 = 40",
    ),
    (
        "q one rank",
        1,
        lambda c: QG(c, CUDA0, 8, 4, 576),
        dv.InvalidGeometry,
        "requires at least two ranks (got 1)",
    ),
    (
        "q padded < gathered",
        2,
        lambda c: QG(c, CUDA0, 8, 4, 576, padded_num_heads=6),
        dv.InvalidGeometry,
        "must cover the gathered heads world_size*heads_per_rank = 8 (got 6)",
    ),
    (
        "q complex",
        2,
        lambda c: QG(c, CUDA0, 8, 4, 576, torch.complex64),
        dv.UnsupportedDtype,
        "torch.complex64",
    ),
    (
        "kv float32",
        2,
        lambda c: KV(c, CUDA0, 8, 576, torch.float32),
        dv.UnsupportedDtype,
        "[torch.float16, torch.bfloat16, torch.float8_e4m3fn] (got torch.float32)",
    ),
    (
        "kv no ubatch",
        2,
        lambda c: KV(c, CUDA0, 8, 576, BF16, 0),
        dv.InvalidGeometry,
        "at least one ubatch slot",
    ),
    ("kv T=0", 2, lambda c: KV(c, CUDA0, 0, 576), dv.InvalidGeometry, "(got T=0, D=576)"),
    ("kv D=0", 2, lambda c: KV(c, CUDA0, 8, 0), dv.InvalidGeometry, "D=0"),
    (
        "kv rows",
        2,
        lambda c: KV(c, CUDA0, 8, 12),
        dv.InvalidGeometry,
        "KV rows must be 16-byte aligned",
    ),
    (
        "kv fp8 rows",
        2,
        lambda c: KV(c, CUDA0, 8, 24, torch.float8_e4m3fn),
        dv.InvalidGeometry,
        "(got 24 * 1 = 24)",
    ),
    (
        "kv one rank",
        1,
        lambda c: KV(c, CUDA0, 8, 576),
        dv.InvalidGeometry,
        "at least two ranks (got 1)",
    ),
    (
        "kv capacity",
        2,
        lambda c: KV(c, CUDA0, 7, 576),
        dv.InvalidGeometry,
        "must divide evenly across ranks: a multiple of world_size 2 (got 7; 7 % 2 = 1)",
    ),
    ("kv capacity W=3", 3, lambda c: KV(c, CUDA0, 8, 576), dv.InvalidGeometry, "8 % 3 = 2"),
    (
        "manager backend",
        2,
        lambda c: mgr(c, comm_backend="nccl"),
        InvalidArgument,
        "comm_backend must be one of ['a2a', 'ag_rs'] (got 'nccl')",
    ),
    (
        "manager heads",
        2,
        lambda c: mgr(c, num_heads=0),
        InvalidArgument,
        "num_heads must be >= 1 (got 0)",
    ),
    (
        "manager output dtype",
        2,
        lambda c: mgr(c, output_dtype=torch.int32),
        dv.UnsupportedDtype,
        "output_dtype must be one of",
    ),
    (
        "manager padded",
        2,
        lambda c: mgr(c, padded_num_heads=6),
        InvalidArgument,
        "padded_num_heads must be >= world_size * num_heads = 8 (got 6)",
    ),
    (
        "manager T",
        2,
        lambda c: mgr(c, max_num_tokens=0),
        InvalidArgument,
        "max_num_tokens must be >= 1",
    ),
    # wrong types: TypeError-kind dcpkit errors, also before anything is allocated
    (
        "int as str",
        2,
        lambda c: A2A(c, CUDA0, "8", 4, 512),
        InvalidType,
        "max_num_tokens must be an int (got str '8')",
    ),
    (
        "dtype as str",
        2,
        lambda c: KV(c, CUDA0, 8, 576, "bfloat16"),
        InvalidType,
        "dtype must be a torch.dtype",
    ),
    (
        "bool flag",
        2,
        lambda c: mgr(c, is_lse_base_on_e=1),
        InvalidType,
        "is_lse_base_on_e must be a bool",
    ),
    (
        "cpu device",
        2,
        lambda c: A2A(c, "cpu", 8, 4, 512),
        InvalidArgument,
        "device must be a CUDA device (got cpu)",
    ),
    (
        "bad group",
        1,
        lambda c: A2A(object(), CUDA0, 8, 4, 512),
        InvalidType,
        "group must be a torch.distributed.ProcessGroup or a dcpkit.Communicator (got object)",
    ),
]


@pytest.mark.parametrize("case", CTOR_CASES, ids=[c[0] for c in CTOR_CASES])
def test_constructor_rejects_on_every_rank_before_allocating(case, monkeypatch):
    _, W, build, exc, text = case
    # Anything allocated would go through torch or a dcpkit op: make both fail loudly.
    monkeypatch.setattr(torch, "zeros", _no_alloc)
    monkeypatch.setattr(torch, "empty", _no_alloc)
    import dcpkit.ops as ops

    for name in ("LseReduce", "QGather", "KVGather"):
        monkeypatch.setattr(ops, name, _no_alloc)
    res = on_ranks(lambda c, r: build(c), W)
    for r, (kind, e) in enumerate(res):
        assert kind == "err", f"rank {r} built it"
        assert type(e) is exc, f"rank {r}: {type(e).__name__}: {e}"
        assert text in str(e), f"rank {r}: {e}"
        if exc is not InvalidType:
            assert isinstance(e, ValueError)


def _no_alloc(*a, **k):
    raise AssertionError("allocated before the checks")


# (world_size, build(comm), the whole message): the geometry checks the three workspaces share.
CTOR_MESSAGES = [
    (
        2,
        lambda c: A2A(c, CUDA0, 8, 4, 512, torch.float32),
        "DirectDCPA2AWorkspace: dtype must be one of [torch.float16, torch.bfloat16] "
        "(got torch.float32)",
    ),
    (
        2,
        lambda c: A2A(c, CUDA0, 8, 4.0, 512),
        "DirectDCPA2AWorkspace: heads_per_rank must be an int (got float 4.0)",
    ),
    (
        2,
        lambda c: A2A(c, CUDA0, 8, 4, 4),
        "DirectDCPA2AWorkspace: head_dim * itemsize must be a multiple of 16 bytes (got 4 * 2 = 8)",
    ),
    (
        2,
        lambda c: QG(c, CUDA0, 8, 4, 576, BF16, 0),
        "DirectDCPQGatherWorkspace: num_ubatches must be >= 1: at least one ubatch slot (got 0)",
    ),
    (
        2,
        lambda c: QG(c, CUDA0, 8, 0, 576),
        "DirectDCPQGatherWorkspace: dimensions must be positive (got T=8, H=0, D=576)",
    ),
    (
        1,
        lambda c: QG(c, CUDA0, 8, 4, 576),
        "DirectDCPQGatherWorkspace: world_size must be >= 2: the q-gather requires at least "
        "two ranks (got 1)",
    ),
    (
        2,
        lambda c: KV(c, CUDA0, 8, 576, torch.float32),
        "DirectDCPKVGatherWorkspace: dtype must be one of [torch.float16, torch.bfloat16, "
        "torch.float8_e4m3fn] (got torch.float32)",
    ),
    (
        2,
        lambda c: KV(c, CUDA0, 0, 576),
        "DirectDCPKVGatherWorkspace: dimensions must be positive (got T=0, D=576)",
    ),
    (
        2,
        lambda c: KV(c, CUDA0, 8, "576"),
        "DirectDCPKVGatherWorkspace: token_dim must be an int (got str '576')",
    ),
    (
        2,
        lambda c: KV(c, CUDA0, 8, 12),
        "DirectDCPKVGatherWorkspace: KV rows must be 16-byte aligned: token_dim * itemsize "
        "must be a multiple of 16 bytes (got 12 * 2 = 24)",
    ),
    (
        1,
        lambda c: KV(c, CUDA0, 8, 576),
        "DirectDCPKVGatherWorkspace: world_size must be >= 2: the kv-gather requires at least "
        "two ranks (got 1)",
    ),
]


@pytest.mark.parametrize("W,build,message", CTOR_MESSAGES)
def test_the_shared_geometry_checks_give_each_workspace_its_whole_message(W, build, message):
    for r, (kind, e) in enumerate(on_ranks(lambda c, r: build(c), W)):
        assert kind == "err", f"rank {r} built it"
        assert str(e) == message, f"rank {r}"


def test_valid_arguments_without_a_gpu_raise_a_clear_error_on_every_rank():
    if _have_gpu():
        pytest.skip("a GPU is visible here: construction would succeed")
    for build in (
        lambda c: A2A(c, CUDA0, 8, 4, 512),
        lambda c: QG(c, CUDA0, 8, 4, 576),
        lambda c: KV(c, CUDA0, 8, 576),
        lambda c: mgr(c),
    ):
        res = on_ranks(lambda c, r, build=build: build(c))
        for r, (kind, e) in enumerate(res):
            assert kind == "err"
            assert isinstance(e, (DcpkitError, PeerError)), f"rank {r}: {type(e)}: {e}"
            assert "no CUDA GPU is visible" in str(e), str(e)


def test_ranks_that_disagree_never_hang():
    # rank 1 rejects its argument: it raises its own error, rank 0 a PeerError naming it
    res = on_ranks(lambda c, r: KV(c, CUDA0, 8, 576 if r == 0 else 12))
    assert res[1][0] == "err" and isinstance(res[1][1], dv.InvalidGeometry)
    assert res[0][0] == "err" and isinstance(res[0][1], PeerError)
    assert sorted(res[0][1].failed) == [1]
    # different valid geometries: ConfigMismatch on both
    res = on_ranks(lambda c, r: A2A(c, CUDA0, 8 + r, 4, 512))
    for kind, e in res:
        assert kind == "err" and isinstance(e, ConfigMismatch), e


# ----------------------------------------------------------------------------- call checks
class _NoLaunch:
    def __getattr__(self, name):
        raise AssertionError(f"a rejected call reached the op ({name})")


def fake(cls, device="cpu", **attrs):
    """A workspace as far as its calls can tell (no GPU, no op: a launch fails the test)."""
    ws = object.__new__(cls)
    ws._torch, ws._closed, ws._ops, ws._op = torch, False, _NoLaunch(), None
    ws.device = torch.device(device)
    ws.world_size, ws.rank, ws.num_ubatches = 2, 0, 1
    for k, v in attrs.items():
        setattr(ws, k, v)
    return ws


def a2a_ws(device="cpu"):
    return fake(A2A, device, max_num_tokens=8, heads_per_rank=2, head_dim=16, dtype=BF16)


def lse_args(T=3, H=4, D=16, dtype=BF16):
    return torch.zeros(T, H, D, dtype=dtype), torch.zeros(T, H)


LSE_CALL_CASES = [
    (
        "ubatch",
        lambda ws, o, l: _in_ubatch(1, ws.lse_reduce, o, l, True),
        dv.UbatchOutOfRange,
        "ubatch 1 exceeds 1 slots",
    ),
    (
        "base not bool",
        lambda ws, o, l: ws.lse_reduce(o, l, 1),
        InvalidType,
        "is_lse_base_on_e must be a bool",
    ),
    (
        "not a tensor",
        lambda ws, o, l: ws.lse_reduce(o.float().numpy(), l, True),
        InvalidType,
        "partial_output must be a torch.Tensor",
    ),
    (
        "dtype",
        lambda ws, o, l: ws.lse_reduce(o.float(), l, True),
        InvalidType,
        "partial_output dtype must be torch.bfloat16 (got torch.float32)",
    ),
    (
        "heads",
        lambda ws, o, l: ws.lse_reduce(o[:, :3], l, True),
        InvalidArgument,
        "partial_output shape must be [T, 4, 16]",
    ),
    (
        "T > max",
        lambda ws, o, l: ws.lse_reduce(*lse_args(T=9), True),
        InvalidArgument,
        "partial_output tokens must be <= max_num_tokens 8 (got 9)",
    ),
    (
        "strided heads",
        lambda ws, o, l: ws.lse_reduce(torch.zeros(3, 4, 32, dtype=BF16)[:, :, :16], l, True),
        InvalidArgument,
        "partial_output must have contiguous heads",
    ),
    (
        "lse shape",
        lambda ws, o, l: ws.lse_reduce(o, l[:2], True),
        InvalidArgument,
        "partial_lse shape must be [3, 4]",
    ),
    (
        "lse dtype",
        lambda ws, o, l: ws.lse_reduce(o, l.double(), True),
        InvalidType,
        "partial_lse dtype must be",
    ),
    (
        "seq_lens alone",
        lambda ws, o, l: ws.lse_reduce(o, l, True, torch.ones(1, dtype=torch.int32)),
        InvalidArgument,
        "seq_lens and query_start_loc must be provided together",
    ),
    (
        "qsl alone",
        lambda ws, o, l: ws.lse_reduce(o, l, True, None, torch.zeros(2, dtype=torch.int32)),
        InvalidArgument,
        "must be provided together",
    ),
    (
        "qsl length",
        lambda ws, o, l: ws.lse_reduce(
            o, l, True, torch.ones(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        ),
        InvalidArgument,
        "one boundary per sequence: its length must be len(seq_lens) + 1 = 3",
    ),
    (
        "seq_lens int64",
        lambda ws, o, l: ws.lse_reduce(
            o, l, True, torch.ones(1, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)
        ),
        InvalidType,
        "seq_lens dtype must be torch.int32 (got torch.int64)",
    ),
    (
        "out shape",
        lambda ws, o, l: ws.lse_reduce(o, l, True, out=torch.zeros(3, 4, 16, dtype=BF16)),
        InvalidArgument,
        "out shape must be [3, 2, 16]",
    ),
    (
        "out strided",
        lambda ws, o, l: ws.lse_reduce(o, l, True, out=torch.zeros(3, 2, 32, dtype=BF16)[..., :16]),
        InvalidArgument,
        "out must be contiguous",
    ),
    (
        "out_lse dtype",
        lambda ws, o, l: ws.lse_reduce(o, l, True, out_lse=torch.zeros(3, 2).double()),
        InvalidType,
        "out_lse dtype must be torch.float32",
    ),
]


def _in_ubatch(u, fn, *args):
    with dv.ubatch(u):
        return fn(*args)


@pytest.mark.parametrize("case", LSE_CALL_CASES, ids=[c[0] for c in LSE_CALL_CASES])
def test_lse_reduce_call_checks(case):
    _, call, exc, text = case
    o, l = lse_args()
    with pytest.raises(exc) as ei:
        call(a2a_ws(), o, l)
    assert text in str(ei.value)
    assert str(ei.value).startswith("DirectDCPA2AWorkspace.lse_reduce: ")


def test_calls_check_device_and_closed():
    o, l = lse_args()
    with pytest.raises(
        InvalidArgument,
        match=r"partial_output device must be the workspace's "
        r"cuda:0 \(got cpu\)",
    ):
        a2a_ws("cuda:0").lse_reduce(o, l, True)
    ws = a2a_ws()
    ws._closed = True
    with pytest.raises(ClosedError, match="the workspace is closed"):
        ws.lse_reduce(o, l, True)


def q_ws(**kw):
    a = dict(
        max_num_tokens=8,
        heads_per_rank=2,
        head_dim=8,
        dtype=BF16,
        gathered_num_heads=4,
        padded_num_heads=4,
        _view_dtype=None,
    )
    a.update(kw)
    return fake(QG, **a)


Q_CALL_CASES = [
    (
        "vLLM heads check",
        lambda ws: ws.gather(torch.zeros(2, 3, 8, dtype=BF16)),
        dv.InvalidGeometry,
        "local_query must have heads_per_rank = 2 local query heads (got 3)",
    ),
    (
        "dtype",
        lambda ws: ws.gather(torch.zeros(2, 2, 8)),
        InvalidType,
        "local_query dtype must be torch.bfloat16",
    ),
    (
        "ndim",
        lambda ws: ws.gather(torch.zeros(2, 16, dtype=BF16)),
        InvalidArgument,
        "local_query must have 3 dimensions",
    ),
    (
        "head_dim",
        lambda ws: ws.gather(torch.zeros(2, 2, 16, dtype=BF16)),
        InvalidArgument,
        "local_query head_dim must be 8 (got 16)",
    ),
    (
        "T > max",
        lambda ws: ws.gather(torch.zeros(9, 2, 8, dtype=BF16)),
        InvalidArgument,
        "local_query tokens must be <= max_num_tokens 8 (got 9)",
    ),
    (
        "strided",
        lambda ws: ws.gather(torch.zeros(2, 2, 16, dtype=BF16)[:, :, ::2]),
        InvalidArgument,
        "local_query must have contiguous heads",
    ),
    (
        "ubatch",
        lambda ws: _in_ubatch(2, ws.gather, torch.zeros(2, 2, 8, dtype=BF16)),
        dv.UbatchOutOfRange,
        "ubatch 2 exceeds 1 slots",
    ),
]


@pytest.mark.parametrize("case", Q_CALL_CASES, ids=[c[0] for c in Q_CALL_CASES])
def test_q_gather_call_checks(case):
    _, call, exc, text = case
    with pytest.raises(exc) as ei:
        call(q_ws())
    assert text in str(ei.value)


def kv_ws(**kw):
    a = dict(max_gathered_tokens=8, token_dim=16, dtype=BF16, _view_dtype=None)
    a.update(kw)
    return fake(KV, **a)


KV_CALL_CASES = [
    (
        "local strided",
        lambda ws: ws.gather(
            torch.zeros(4, 16, dtype=BF16), torch.zeros(2, 32, dtype=BF16)[:, :16]
        ),
        InvalidArgument,
        "local_kv must be contiguous",
    ),
    (
        "local T=0",
        lambda ws: ws.gather(torch.zeros(0, 16, dtype=BF16), torch.zeros(0, 16, dtype=BF16)),
        InvalidArgument,
        "local_kv shape must be [T, 16] with T >= 1",
    ),
    (
        "capacity",
        lambda ws: ws.gather(torch.zeros(10, 16, dtype=BF16), torch.zeros(5, 16, dtype=BF16)),
        InvalidArgument,
        "world_size * local_kv tokens must be <= max_gathered_tokens 8 (got 2 * 5",
    ),
    (
        "gathered shape",
        lambda ws: ws.gather(torch.zeros(3, 16, dtype=BF16), torch.zeros(2, 16, dtype=BF16)),
        InvalidArgument,
        "gathered_kv shape must be [world_size*T, D] = [4, 16]",
    ),
    (
        "gathered strided",
        lambda ws: ws.gather(
            torch.zeros(4, 32, dtype=BF16)[:, :16], torch.zeros(2, 16, dtype=BF16)
        ),
        InvalidArgument,
        "gathered_kv must be contiguous",
    ),
    (
        "dtype",
        lambda ws: ws.gather(torch.zeros(4, 16, dtype=BF16), torch.zeros(2, 16)),
        InvalidType,
        "local_kv dtype must be torch.bfloat16",
    ),
    (
        "ubatch",
        lambda ws: _in_ubatch(
            1, ws.gather, torch.zeros(4, 16, dtype=BF16), torch.zeros(2, 16, dtype=BF16)
        ),
        dv.UbatchOutOfRange,
        "exceeds 1 slots",
    ),
]


@pytest.mark.parametrize("case", KV_CALL_CASES, ids=[c[0] for c in KV_CALL_CASES])
def test_kv_gather_call_checks(case):
    _, call, exc, text = case
    with pytest.raises(exc) as ei:
        call(kv_ws())
    assert text in str(ei.value)


# ----------------------------------------------------------------------------- manager, CPU
def cpu_manager(c, **kw):
    """A manager whose direct paths cannot serve (so it builds without a GPU), its device then
    swapped for the CPU so that its collective paths run on CPU tensors over the threads."""
    m = mgr(c, **kw)
    m.device = torch.device("cpu")
    m._coll.device = m.device
    return m


def test_manager_paths_and_one_log(caplog):
    caplog.set_level(logging.INFO, logger="dcpkit.vllm")
    for _ in range(2):  # a second manager of the same choice logs nothing new
        res = on_ranks(
            lambda c, r: cpu_manager(c, comm_backend="ag_rs", use_pcp=True, max_num_tokens=13).paths
        )
        assert [k for k, _ in res] == ["ok", "ok"], res
    assert res[0][1] == {"combine": "ag-ar", "query_gather": None, "kv_gather": None}
    msgs = [r.getMessage() for r in caplog.records if r.name == "dcpkit.vllm"]
    assert len(msgs) == 1, msgs
    assert "combine: ag-ar (comm_backend='ag_rs' with use_pcp=True" in msgs[0]
    assert "query_gather: None (use_pcp=True)" in msgs[0]


@pytest.mark.parametrize("path", ["ag-rs", "ag-ar", "a2a"])
@pytest.mark.parametrize("dtype, base", [("float32", math.e), ("bfloat16", 2.0)])
def test_manager_combine_paths_match_the_reference(path, dtype, base):
    W, H_r, D, T, S, seed = 2, 3, 16, 7, 3, 1234
    H = W * H_r
    ins = [
        make_inputs(
            s,
            W,
            seed,
            op="lse_reduce",
            tokens=T,
            num_heads=H,
            head_dim=D,
            dtype=dtype,
            lse_base=base,
            num_requests=S,
        )
        for s in range(W)
    ]
    tdt = getattr(torch, dtype)

    def run(c, r):
        # a non-movable query dtype keeps the query gather off the direct path (no GPU here)
        m = cpu_manager(
            c,
            num_heads=H_r,
            output_head_dim=D,
            output_dtype=tdt,
            query_dtype=torch.complex64,
            is_lse_base_on_e=(base == math.e),
            comm_backend="ag_rs",
            use_pcp=(path == "ag-ar"),
        )
        if path == "a2a":
            m.combine = m._combine_a2a
        i = ins[r]
        return m.combine(
            t_from_np(i["out_partial"]),
            t_from_np(i["lse_partial"]),
            seq_lens=t_from_np(i["seq_lens"]),
            query_start_loc=t_from_np(i["query_start_loc"]),
            return_lse=True,
        )

    res = on_ranks(run, W)
    for r, (kind, val) in enumerate(res):
        assert kind == "ok", val
        out, lse = val
        heads = slice(None) if path == "ag-ar" else slice(r * H_r, (r + 1) * H_r)
        ref_out, ref_lse = lse_reduce_reference(
            [i["out_partial"][:, heads] for i in ins],
            [i["lse_partial"][:, heads] for i in ins],
            lse_base=base,
            seq_lens=[i["seq_lens"] for i in ins],
            query_start_loc=ins[0]["query_start_loc"],
        )
        assert out.dtype == tdt and tuple(out.shape) == ref_out.shape
        got = out.float().numpy()
        assert np.isfinite(got).all(), "a NaN of an empty shard leaked"
        tol = lse_reduce_tolerance(dtype)
        assert np.abs(got - ref_out).max() <= tol
        want_lse = ref_lse if base == math.e else ref_lse / math.log(2.0)
        fin = np.isfinite(want_lse)
        assert (np.isneginf(lse.numpy()) == ~fin).all()
        assert np.abs(lse.numpy()[fin] - want_lse[fin]).max() <= 1e-4 * max(
            1.0, np.abs(want_lse[fin]).max()
        )
        pad = int(ins[0]["query_start_loc"][-1])
        assert (got[pad:] == 0).all(), "padding rows must be exactly 0"


def test_manager_query_gather_fallback_pads_storage_and_is_bit_exact():
    W, H_r, D, T, pad = 2, 2, 8, 3, 6
    qs = [
        make_inputs(
            s, W, 7, op="q_gather", tokens=T, num_heads=W * H_r, head_dim=D, dtype="float32"
        )["q"]
        for s in range(W)
    ]

    def run(c, r):
        # world_size 2, float32 queries: the direct q-gather would serve; force the collective
        m = cpu_manager(
            c,
            num_heads=H_r,
            query_head_dim=D,
            query_dtype=torch.float32,
            padded_num_heads=pad,
            comm_backend="ag_rs",
            use_pcp=True,
        )
        m.query_gather = m._gather_query
        return m.query_gather(torch.from_numpy(qs[r]))

    res = on_ranks(run, W)
    ref = q_gather_reference(qs)
    for kind, out in res:
        assert kind == "ok", out
        assert tuple(out.shape) == (T, W * H_r, D) and out.stride() == (W * H_r * D, D, 1)
        assert out.untyped_storage().nbytes() >= T * pad * D * 4
        assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))


def test_manager_kv_gather_fallback_and_init_checks():
    W, D, M = 2, 16, 8

    def run(c, r):
        m = cpu_manager(c, comm_backend="ag_rs", use_pcp=True)
        errors = []
        good = torch.zeros(M + M // W, D)  # float32: the direct KV gather cannot serve
        for bad, text in (
            (lambda: m.kv_gather(good[:4], good[:2]), "init_kv_gather must be called first"),
            (lambda: m.init_kv_gather(good, 0), "max_gathered_tokens must be > 0"),
            (lambda: m.init_kv_gather(good, 7), "a multiple of world_size 2"),
            (lambda: m.init_kv_gather(good.view(-1), M), "must be 2-D"),
            (lambda: m.init_kv_gather(good.t(), M), "must be contiguous"),
            (
                lambda: m.init_kv_gather(good[:-1], M),
                (
                    "workspace rows must be "
                    "max_gathered_tokens + max_gathered_tokens // world_size = 12 (got 11)"
                ),
            ),
            (lambda: m.init_kv_gather(torch.zeros(12, 0), M), "width must be > 0"),
            (lambda: m.init_kv_gather(good.numpy(), M), "must be a torch.Tensor"),
        ):
            try:
                bad()
                errors.append(f"no error for {text}")
            except (InvalidArgument, InvalidType) as e:
                if text not in str(e):
                    errors.append(str(e))
        m.init_kv_gather(good, M)
        kv = torch.from_numpy(
            make_inputs(r, W, 3, op="kv_gather", tokens=3, row_dim=D, dtype="float32")["kv"]
        )
        out = torch.full((W * 3, D), float("nan"))
        assert m.kv_gather(out, kv) is None
        return errors, m.paths["kv_gather"], m.counters, out

    res = on_ranks(run, W)
    ref = kv_gather_reference(
        [
            make_inputs(s, W, 3, op="kv_gather", tokens=3, row_dim=D, dtype="float32")["kv"]
            for s in range(W)
        ]
    )
    for kind, val in res:
        assert kind == "ok", val
        errors, path, counters, out = val
        assert errors == []
        assert path == "all-gather" and counters == {"kv_gather:all-gather": 1}
        assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))


def test_manager_combine_checks_name_the_argument():
    def run(c, r):
        m = cpu_manager(
            c,
            comm_backend="ag_rs",
            use_pcp=False,
            query_dtype=torch.complex64,
            output_dtype=torch.float32,
        )
        o, l = torch.zeros(2, 8, 512), torch.zeros(2, 8)
        msgs = []
        for call in (
            lambda: m.combine(o[:, :7], l[:, :7]),
            lambda: m.combine(o, l, seq_lens=torch.zeros(1, dtype=torch.int32)),
            lambda: m.combine(o.bfloat16(), l),
            lambda: m.combine(o, l, out=torch.zeros(2, 8, 512)),
        ):
            try:
                call()
                msgs.append("no error")
            except (InvalidArgument, InvalidType) as e:
                msgs.append(str(e))
        return msgs

    res = on_ranks(run)
    msgs = res[0][1]
    assert "partial_output heads must be a multiple of world_size 2 (got 7)" in msgs[0]
    assert "seq_lens and query_start_loc must be provided together" in msgs[1]
    assert "partial_output dtype must be torch.float32 (got torch.bfloat16)" in msgs[2]
    assert "out shape must be [2, 4, 512]" in msgs[3]
    assert res[1][1] == msgs


def test_one_rank_group_takes_the_collective_paths():
    """A group of one rank: no direct path (it needs two ranks); the combine is the merge of one
    source: the partial output where its lse is finite, 0 where it is empty."""
    c = Communicator.single()
    m = cpu_manager(
        c,
        num_heads=2,
        output_head_dim=16,
        output_dtype=torch.float32,
        comm_backend="ag_rs",
        use_pcp=False,
    )
    assert m.paths == {"combine": "ag-rs", "query_gather": "all-gather", "kv_gather": None}
    assert "world_size 1 < 2" in m.reasons["query_gather"]
    o = torch.randn(3, 2, 16)
    lse = torch.tensor([[0.5, float("-inf")], [float("nan"), 2.0], [1.0, float("inf")]])
    o[0, 1] = float("nan")
    out, merged = m.combine(o, lse, return_lse=True)
    ok = torch.isfinite(lse) & (lse > float("-inf"))
    assert torch.equal(out[ok], o[ok]) and (out[~ok] == 0).all()
    assert torch.equal(merged[ok], lse[ok]) and torch.isneginf(merged[~ok]).all()


@pytest.mark.parametrize("combine", ["_combine_a2a", "_combine_ag_rs"])
def test_example_decode_step_on_cpu_collective_paths(combine, monkeypatch):
    """examples/vllm_api.py's decode step, call for call, on the collective paths over a thread
    group (CPU tensors): its attention, masks and reference agree with dcpkit's merge."""
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))  # the examples share examples/_support.py
    ex = load_file(examples / "vllm_api.py", "vllm_api_example")
    cpu = torch.device("cpu")

    def run(c, r):
        m = cpu_manager(
            c,
            num_heads=2,
            query_head_dim=ex.D_Q,
            output_head_dim=ex.D_LATENT,
            comm_backend="ag_rs",
            use_pcp=True,
        )
        m.query_gather, m.combine = m._gather_query, getattr(m, combine)
        step = ex.make_step(5, c.world_size, r, 2, cpu)
        return ex.check_step(ex.decode_step(m, step), step)

    for kind, val in on_ranks(run, 2):
        assert kind == "ok", val
        ok, _, _, msg = val
        assert ok, msg


def test_collective_paths_over_a_real_gloo_group(tmp_path, world_size=3):
    """The host-staged gloo path that ranks sharing a GPU use: the three combines, the query
    all-gather and the KV all-gather over a gloo group of three real processes (CPU tensors;
    the thread-group tests above cover two ranks)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import subprocess_env

    worker = Path(__file__).resolve().parent / "mpi_scripts" / "vllm_gloo_worker.py"
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                str(r),
                str(world_size),
                str(store),
                str(tmp_path / f"rank{r}.json"),
            ],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world_size)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{out}\n{err}"
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["errors"] == [], f"rank {r}: " + "\n".join(res["errors"])
        assert set(res["modes"]) == {"host"}, res["modes"]


class _Recorder:
    """Stands in for dcpkit.torch.TorchOps: records what a workspace passes to the op."""

    def __init__(self):
        self.calls = []

    def lse_reduce(self, x, lse, *, seq_lens, query_start_loc, ubatch, out, out_lse):
        self.calls.append(
            dict(
                x=x,
                lse=lse.clone(),
                ubatch=ubatch,
                out=out,
                out_lse=out_lse,
                masks=(seq_lens, query_start_loc),
            )
        )
        out.fill_(1.5)
        if out_lse is not None:
            out_lse.fill_(2.0)  # a natural-log merged lse

    def q_gather(self, q, *, ubatch, out):
        self.calls.append(dict(q=q, ubatch=ubatch, out=out))
        out.copy_(q.repeat(1, out.shape[1] // q.shape[1], 1))

    def kv_gather(self, kv, *, ubatch, out):
        self.calls.append(dict(kv=kv, ubatch=ubatch, out=out))


def test_lse_reduce_passes_out_ubatch_and_converts_base_2():
    ws = a2a_ws()
    ws.num_ubatches = 2
    ws._ops = rec = _Recorder()
    o, l = lse_args()
    l.uniform_(-3, 3)
    sl, qsl = torch.ones(2, dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    with dv.ubatch(1):
        out, lse = ws.lse_reduce(o, l, False, sl, qsl, return_lse=True)
    c = rec.calls[-1]
    assert c["ubatch"] == 1 and c["out"] is out and c["out_lse"] is lse
    assert c["masks"][0] is sl and c["masks"][1] is qsl
    assert torch.allclose(c["lse"], l * math.log(2.0)), "base-2 lse must reach dcpkit as ln"
    assert torch.allclose(lse, torch.full((3, 2), 2.0 / math.log(2.0))), "merged lse in base 2"
    assert out.dtype == BF16 and tuple(out.shape) == (3, 2, 16) and (out == 1.5).all()
    mine = torch.empty(3, 2, 16, dtype=BF16)
    assert ws.lse_reduce(o, l, True, out=mine) is mine
    assert rec.calls[-1]["lse"] is not None and torch.equal(rec.calls[-1]["lse"], l)
    assert rec.calls[-1]["out_lse"] is None


@pytest.mark.parametrize("dtype", [BF16, torch.float8_e4m3fn])
def test_q_gather_returns_a_view_of_padded_storage_with_vllm_stride(dtype):
    W, H_r, D, T_max, pad = 2, 2, 16, 4, 6
    view = None if dtype == BF16 else torch.uint8
    ws = q_ws(
        max_num_tokens=T_max,
        heads_per_rank=H_r,
        head_dim=D,
        dtype=dtype,
        gathered_num_heads=W * H_r,
        padded_num_heads=pad,
        _view_dtype=view,
        num_ubatches=2,
    )
    ws.final_query = torch.zeros(2, T_max, pad, D * dtype.itemsize, dtype=torch.uint8).view(dtype)
    ws._ops = rec = _Recorder()
    q = torch.randn(3, H_r, D).to(dtype)
    with dv.ubatch(1):
        out = ws.gather(q)
    c = rec.calls[-1]
    assert c["ubatch"] == 1
    assert c["q"].dtype == (view or dtype) and c["out"].dtype == (view or dtype)
    assert out.dtype == dtype and tuple(out.shape) == (3, W * H_r, D)
    assert out.stride() == (W * H_r * D, D, 1), "vLLM's row stride"
    assert out.data_ptr() == ws.final_query[1].data_ptr(), "a view of the ubatch's storage"
    assert out.untyped_storage().data_ptr() == ws.final_query.untyped_storage().data_ptr()
    b = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t.view(torch.int16))
    assert torch.equal(b(out[:, :H_r]), b(q)), "the op wrote through the returned view"


def test_kv_gather_passes_the_callers_tensor():
    ws = kv_ws(dtype=torch.float8_e4m3fn, _view_dtype=torch.uint8)
    ws._ops = rec = _Recorder()
    dst = torch.zeros(4, 16).to(torch.float8_e4m3fn)
    src = torch.zeros(2, 16).to(torch.float8_e4m3fn)
    assert ws.gather(dst, src) is None
    c = rec.calls[-1]
    assert c["out"].data_ptr() == dst.data_ptr() and c["out"].dtype == torch.uint8
    assert c["kv"].data_ptr() == src.data_ptr() and c["ubatch"] == 0
