"""Argument checks of LseReduce and lse_combine, on a CPU machine (no GPU, no driver).

The workspace is built without its collective setup (``LseReduce.__new__`` plus the attributes
``_setup`` would set), so every check of a call runs exactly as on a GPU. Arrays are fakes that
describe device memory without owning any: a tiny ``__cuda_array_interface__`` class, and CuPy
arrays over unowned fake pointers (for bfloat16, which the interface cannot express). Nothing is
ever dereferenced: every call here is rejected, or only validated, before a launch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dcpkit import jit
from dcpkit.comm import Communicator
from dcpkit.errors import ClosedError, CollectiveTimeout, InvalidArgument, InvalidType
from dcpkit.ops._lse_checks import combine_variant as _combine_variant
from dcpkit.ops._lse_checks import reduce_variant as _reduce_variant
from dcpkit.ops._lse_checks import validate_combine as _validate_combine
from dcpkit.ops.lse_reduce import MAX_WORLD_SIZE, LseReduce
from dcpkit.reference import resolve_dtype

BF16 = resolve_dtype("bfloat16")
W, RANK, DEV = 4, 1, 0
H, D, T_MAX = 16, 64, 32
H_R = H // W
BASE = 0x7F00_0000_0000  # a fake, 256-byte aligned device address


class FakeDev:
    """Describes a device array through ``__cuda_array_interface__``; owns no memory."""

    _next = BASE

    def __init__(self, shape, dtype, strides=None, *, offset=0, device=DEV):
        dt = np.dtype(dtype)
        self.shape = tuple(shape)
        self.dtype = dt
        FakeDev._next += 1 << 24
        self._ptr = FakeDev._next + offset
        self.__cuda_array_interface__ = {
            "shape": self.shape,
            "typestr": dt.str,
            "data": (self._ptr, False),
            "strides": None if strides is None else tuple(strides),
            "version": 3,
        }
        self._dcpkit_device = device


def strided(shape, dtype, strides_el, **kw):
    """A FakeDev with strides given in elements."""
    isz = np.dtype(dtype).itemsize
    return FakeDev(shape, dtype, tuple(s * isz for s in strides_el), **kw)


def cupy_fake(shape, dtype, strides=None, *, offset=0, device=DEV):
    """A CuPy array over fake unowned memory (never dereferenced)."""
    cupy = pytest.importorskip("cupy")
    FakeDev._next += 1 << 24
    mem = cupy.cuda.UnownedMemory(FakeDev._next + offset, 1 << 24, None, device_id=device)
    return cupy.ndarray(tuple(shape), dtype, cupy.cuda.MemoryPointer(mem, 0), strides=strides)


def make_ws(
    *, world_size=W, rank=RANK, dtype=np.float16, num_ubatches=2, cls=LseReduce, **geometry
):
    """An LseReduce (or subclass ``cls``) with the state _setup would give it, minus the GPU."""
    ws = cls.__new__(cls)
    g = dict(
        max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype, lse_base=math.e, return_lse=False
    )
    g.update(geometry)
    ws._init_geometry(world_size, **g)
    ws.rank, ws.world_size, ws.device = rank, world_size, DEV
    ws.num_ubatches = num_ubatches
    ws.timeout_ms = 5000.0
    ws._debug = False
    ws._rec = np.zeros(8, dtype=np.uint32)
    ws._calls = [0] * num_ubatches
    ws._captured = [False] * num_ubatches
    ws._closed = False
    return ws


@pytest.fixture
def ws():
    w = make_ws()
    yield w
    w._closed = True  # nothing to release: keeps __del__ quiet


def good(T=5, dtype=np.float16, lse_dtype=np.float32):
    return dict(out_partial=FakeDev((T, H, D), dtype), lse_partial=FakeDev((T, H), lse_dtype))


def call(ws, *, out_partial, lse_partial, ubatch=0, **kw):
    return ws._validate(
        out_partial,
        lse_partial,
        kw.get("seq_lens"),
        kw.get("query_start_loc"),
        ubatch,
        kw.get("out"),
        kw.get("out_lse"),
    )


# ----------------------------------------------------------------------------- accepted calls
def test_contiguous_call_plan(ws):
    p = call(ws, **good(T=5))
    assert (p.T, p.ubatch, p.copy_input) == (5, 0, False)
    assert (p.in_tok, p.in_head) == (H * D, D)
    assert (p.lse_tok, p.lse_head) == (H, 1)
    assert (p.seq_ptr, p.qsl_ptr, p.num_requests) == (0, 0, 0)
    assert p.out is None and p.out_lse is None and p.want_lse is False


def test_padded_head_and_token_storage_is_accepted_without_copy(ws):
    # [T, H, D] view of [T, H+3, D+8] storage: head stride (D+8)*2 = 144 B, token stride
    # (H+3)*(D+8)*2 B, both multiples of 16.
    x = strided((5, H, D), np.float16, ((H + 3) * (D + 8), D + 8, 1))
    p = call(ws, out_partial=x, lse_partial=FakeDev((5, H), np.float32))
    assert p.copy_input is False
    assert (p.in_tok, p.in_head) == ((H + 3) * (D + 8), D + 8)


def test_non_unit_lse_strides_are_passed_in_elements(ws):
    lse_t = strided((5, H), np.float32, (1, 5))  # a transposed [H, T] array
    p = call(ws, out_partial=FakeDev((5, H, D), np.float16), lse_partial=lse_t)
    assert (p.lse_tok, p.lse_head) == (1, 5)
    lse_2 = strided((5, H), np.float16, (2 * H, 2))  # every other column
    p = call(ws, out_partial=FakeDev((5, H, D), np.float16), lse_partial=lse_2)
    assert (p.lse_tok, p.lse_head) == (2 * H, 2)


def test_inner_stride_other_than_itemsize_asks_for_a_copy(ws):
    x = strided((5, H, D), np.float16, (H * 2 * D, 2 * D, 2))
    p = call(ws, out_partial=x, lse_partial=FakeDev((5, H), np.float32))
    assert p.copy_input is True


def test_size_one_dims_ignore_their_strides(ws):
    # T == 1: the token stride is never used, so an odd one is fine.
    x = FakeDev((1, H, D), np.float16, (6, D * 2, 2))
    p = call(ws, out_partial=x, lse_partial=FakeDev((1, H), np.float32, (3, 4)))
    assert p.in_tok == 0 and p.lse_tok == 0


def test_masks_and_outputs_are_described(ws):
    sl, qsl = FakeDev((3,), np.int32), FakeDev((4,), np.int32)
    out, out_lse = FakeDev((5, H_R, D), np.float16), FakeDev((5, H_R), np.float32)
    p = call(ws, **good(T=5), seq_lens=sl, query_start_loc=qsl, out=out, out_lse=out_lse, ubatch=1)
    assert p.num_requests == 3 and p.seq_ptr == sl._ptr and p.qsl_ptr == qsl._ptr
    assert p.out.ptr == out._ptr and p.out_lse.ptr == out_lse._ptr and p.want_lse
    assert p.ubatch == 1


def test_query_start_loc_alone_masks_padding_only(ws):
    p = call(ws, **good(T=5), query_start_loc=FakeDev((1,), np.int32))
    assert p.num_requests == 0 and p.seq_ptr == 0 and p.qsl_ptr != 0


@pytest.mark.parametrize("lse_dtype", [np.float32, np.float16, "bfloat16"])
def test_every_lse_dtype_is_accepted(ws, lse_dtype):
    dt = resolve_dtype(lse_dtype)
    lse = cupy_fake((5, H), dt) if dt == BF16 else FakeDev((5, H), dt)
    assert call(ws, out_partial=FakeDev((5, H, D), np.float16), lse_partial=lse).lse.dtype == dt


def test_bfloat16_workspace_accepts_cupy_bfloat16_arrays():
    w = make_ws(dtype="bfloat16")
    try:
        p = call(
            w,
            out_partial=cupy_fake((3, H, D), BF16),
            lse_partial=cupy_fake((3, H), BF16),
            out=cupy_fake((3, H_R, D), BF16),
        )
        assert p.T == 3 and p.x.dtype == BF16
        with pytest.raises(InvalidType, match=r"out_partial dtype must be one of \[bfloat16\]"):
            call(
                w,
                out_partial=cupy_fake((3, H, D), np.float16),
                lse_partial=cupy_fake((3, H), np.float32),
            )
    finally:
        w._closed = True


def test_return_lse_workspace_wants_lse():
    w = make_ws(return_lse=True)
    try:
        assert call(w, **good()).want_lse is True
        assert w._out_bytes_needed == w._out_part_bytes + w._out_lse_bytes
    finally:
        w._closed = True


# ----------------------------------------------------------------------------- rejected calls
def _bad_calls():
    """(id, kwargs builder, exception, message fragment): every bad input of a call."""
    f16, f32, i32 = np.float16, np.float32, np.int32
    x, l = (lambda T=5: FakeDev((T, H, D), f16)), (lambda T=5: FakeDev((T, H), f32))
    return [
        (
            "host out_partial",
            lambda: dict(out_partial=np.zeros((5, H, D), f16), lse_partial=l()),
            InvalidType,
            "out_partial must be a GPU array",
        ),
        (
            "host lse_partial",
            lambda: dict(out_partial=x(), lse_partial=np.zeros((5, H), f32)),
            InvalidType,
            "lse_partial must be a GPU array",
        ),
        (
            "not an array",
            lambda: dict(out_partial=[[1.0]], lse_partial=l()),
            InvalidType,
            "out_partial must be a GPU array",
        ),
        (
            "None out_partial",
            lambda: dict(out_partial=None, lse_partial=l()),
            InvalidType,
            "out_partial must be a GPU array",
        ),
        (
            "out_partial dtype",
            lambda: dict(out_partial=FakeDev((5, H, D), f32), lse_partial=l()),
            InvalidType,
            "out_partial dtype must be one of [float16] (got float32)",
        ),
        (
            "lse int dtype",
            lambda: dict(out_partial=x(), lse_partial=FakeDev((5, H), i32)),
            InvalidType,
            "lse_partial dtype must be one of",
        ),
        (
            "lse float64",
            lambda: dict(out_partial=x(), lse_partial=FakeDev((5, H), np.float64)),
            InvalidType,
            "lse_partial dtype must be one of",
        ),
        (
            "out_partial 2-D",
            lambda: dict(out_partial=FakeDev((5, H * D), f16), lse_partial=l()),
            InvalidArgument,
            "out_partial must have 3 dimensions [T, H, D_v]",
        ),
        (
            "out_partial heads",
            lambda: dict(out_partial=FakeDev((5, H_R, D), f16), lse_partial=l()),
            InvalidArgument,
            "out_partial shape must be [*, 16, 64]",
        ),
        (
            "out_partial head_dim",
            lambda: dict(out_partial=FakeDev((5, H, D + 8), f16), lse_partial=l()),
            InvalidArgument,
            "out_partial shape must be",
        ),
        (
            "lse tokens",
            lambda: dict(out_partial=x(5), lse_partial=l(4)),
            InvalidArgument,
            "lse_partial shape must be [5, 16]",
        ),
        (
            "lse heads",
            lambda: dict(out_partial=x(), lse_partial=FakeDev((5, H_R), f32)),
            InvalidArgument,
            "lse_partial shape must be",
        ),
        (
            "T > max_tokens",
            lambda: dict(out_partial=x(T_MAX + 1), lse_partial=l(T_MAX + 1)),
            InvalidArgument,
            f"must be <= max_tokens {T_MAX} (got {T_MAX + 1})",
        ),
        (
            "pointer not 16-byte aligned",
            lambda: dict(out_partial=FakeDev((5, H, D), f16, offset=8), lse_partial=l()),
            InvalidArgument,
            "out_partial rows must be 16-byte aligned",
        ),
        (
            "token stride not 16-byte aligned",
            lambda: dict(out_partial=strided((5, H, D), f16, (H * D + 4, D, 1)), lse_partial=l()),
            InvalidArgument,
            "out_partial rows must be 16-byte aligned",
        ),
        (
            "head stride not 16-byte aligned",
            lambda: dict(
                out_partial=strided((5, H, D), f16, (H * (D + 4), D + 4, 1)), lse_partial=l()
            ),
            InvalidArgument,
            "out_partial rows must be 16-byte aligned",
        ),
        (
            "negative stride",
            lambda: dict(out_partial=strided((5, H, D), f16, (-H * D, D, 1)), lse_partial=l()),
            InvalidArgument,
            "out_partial strides must be non-negative",
        ),
        (
            "negative lse stride",
            lambda: dict(out_partial=x(), lse_partial=strided((5, H), f32, (H, -1))),
            InvalidArgument,
            "lse_partial strides must be non-negative",
        ),
        (
            "lse stride not a multiple of its itemsize",
            lambda: dict(out_partial=x(), lse_partial=FakeDev((5, H), f32, (H * 4 + 2, 4))),
            InvalidArgument,
            "lse_partial pointer and strides must be multiples of its itemsize",
        ),
        (
            "out_partial on another GPU",
            lambda: dict(out_partial=FakeDev((5, H, D), f16, device=DEV + 1), lse_partial=l()),
            InvalidArgument,
            "out_partial device must be the workspace's GPU 0 (got GPU 1)",
        ),
        (
            "lse_partial on another GPU",
            lambda: dict(out_partial=x(), lse_partial=FakeDev((5, H), f32, device=DEV + 1)),
            InvalidArgument,
            "lse_partial device must be the workspace's GPU 0 (got GPU 1)",
        ),
        (
            "seq_lens without query_start_loc",
            lambda: dict(out_partial=x(), lse_partial=l(), seq_lens=FakeDev((3,), i32)),
            InvalidArgument,
            "seq_lens requires query_start_loc",
        ),
        (
            "seq_lens int64",
            lambda: dict(
                out_partial=x(),
                lse_partial=l(),
                seq_lens=FakeDev((3,), np.int64),
                query_start_loc=FakeDev((4,), i32),
            ),
            InvalidType,
            "seq_lens dtype must be one of [int32] (got int64)",
        ),
        (
            "query_start_loc float",
            lambda: dict(out_partial=x(), lse_partial=l(), query_start_loc=FakeDev((4,), f32)),
            InvalidType,
            "query_start_loc dtype must be one of [int32]",
        ),
        (
            "seq_lens length",
            lambda: dict(
                out_partial=x(),
                lse_partial=l(),
                seq_lens=FakeDev((3,), i32),
                query_start_loc=FakeDev((3,), i32),
            ),
            InvalidArgument,
            "seq_lens length must be len(query_start_loc) - 1 = 2 (got 3)",
        ),
        (
            "query_start_loc empty",
            lambda: dict(out_partial=x(), lse_partial=l(), query_start_loc=FakeDev((0,), i32)),
            InvalidArgument,
            "query_start_loc length must be >= 1",
        ),
        (
            "query_start_loc 2-D",
            lambda: dict(out_partial=x(), lse_partial=l(), query_start_loc=FakeDev((2, 2), i32)),
            InvalidArgument,
            "query_start_loc must have 1 dimensions [S+1]",
        ),
        (
            "query_start_loc strided",
            lambda: dict(
                out_partial=x(), lse_partial=l(), query_start_loc=strided((4,), i32, (2,))
            ),
            InvalidArgument,
            "query_start_loc must be C-contiguous",
        ),
        (
            "host seq_lens",
            lambda: dict(
                out_partial=x(),
                lse_partial=l(),
                seq_lens=np.zeros(3, i32),
                query_start_loc=FakeDev((4,), i32),
            ),
            InvalidType,
            "seq_lens must be a GPU array",
        ),
        (
            "seq_lens on another GPU",
            lambda: dict(
                out_partial=x(),
                lse_partial=l(),
                seq_lens=FakeDev((3,), i32, device=3),
                query_start_loc=FakeDev((4,), i32),
            ),
            InvalidArgument,
            "seq_lens device must be the workspace's GPU 0 (got GPU 3)",
        ),
        (
            "out dtype",
            lambda: dict(out_partial=x(), lse_partial=l(), out=FakeDev((5, H_R, D), f32)),
            InvalidType,
            "out dtype must be one of [float16]",
        ),
        (
            "out shape (all heads)",
            lambda: dict(out_partial=x(), lse_partial=l(), out=FakeDev((5, H, D), f16)),
            InvalidArgument,
            "out shape must be [5, 4, 64] for [T, H_r, D_v]",
        ),
        (
            "out strided",
            lambda: dict(
                out_partial=x(), lse_partial=l(), out=strided((5, H_R, D), f16, (H_R * D * 2, D, 1))
            ),
            InvalidArgument,
            "out must be C-contiguous",
        ),
        (
            "out misaligned",
            lambda: dict(out_partial=x(), lse_partial=l(), out=FakeDev((5, H_R, D), f16, offset=2)),
            InvalidArgument,
            "out data pointer must be 16-byte aligned",
        ),
        (
            "host out",
            lambda: dict(out_partial=x(), lse_partial=l(), out=np.zeros((5, H_R, D), f16)),
            InvalidType,
            "out must be a GPU array",
        ),
        (
            "out on another GPU",
            lambda: dict(out_partial=x(), lse_partial=l(), out=FakeDev((5, H_R, D), f16, device=2)),
            InvalidArgument,
            "out device must be the workspace's GPU 0 (got GPU 2)",
        ),
        (
            "out_lse dtype",
            lambda: dict(out_partial=x(), lse_partial=l(), out_lse=FakeDev((5, H_R), f16)),
            InvalidType,
            "out_lse dtype must be one of [float32]",
        ),
        (
            "out_lse shape",
            lambda: dict(out_partial=x(), lse_partial=l(), out_lse=FakeDev((5, H), f32)),
            InvalidArgument,
            "out_lse shape must be [5, 4]",
        ),
        (
            "out_lse strided",
            lambda: dict(out_partial=x(), lse_partial=l(), out_lse=strided((5, H_R), f32, (1, 5))),
            InvalidArgument,
            "out_lse must be C-contiguous",
        ),
        (
            "ubatch out of range",
            lambda: dict(out_partial=x(), lse_partial=l(), ubatch=2),
            InvalidArgument,
            "ubatch must lie in [0, 2) (got 2)",
        ),
        (
            "negative ubatch",
            lambda: dict(out_partial=x(), lse_partial=l(), ubatch=-1),
            InvalidArgument,
            "ubatch must lie in [0, 2) (got -1)",
        ),
        (
            "ubatch not an int",
            lambda: dict(out_partial=x(), lse_partial=l(), ubatch="0"),
            InvalidType,
            "ubatch must be an int",
        ),
        (
            "ubatch bool",
            lambda: dict(out_partial=x(), lse_partial=l(), ubatch=True),
            InvalidType,
            "ubatch must be an int",
        ),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("make,exc,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_call_raises_before_anything_is_counted(ws, make, exc, fragment):
    kw = make()
    with pytest.raises(exc) as info:
        ws(**kw)  # the public call: rejected before begin_call / any launch
    assert fragment in str(info.value), str(info.value)
    assert str(info.value).startswith("lse_reduce: "), str(info.value)
    assert ws._calls == [0, 0] and ws._captured == [False, False]
    # The workspace stays usable: a good call still validates.
    assert call(ws, **good()).T == 5


def test_closed_workspace_raises(ws):
    ws._closed = True
    with pytest.raises(ClosedError, match="lse_reduce: the workspace is closed"):
        ws(**good())
    assert ws._calls == [0, 0]


def test_poisoned_workspace_raises_the_timeout_naming_the_peer(ws):
    # state, op (lse_reduce = 1), rank, peer, expected, observed, ubatch, pad
    ws._rec[:] = [2, 1, RANK, 3, 7, 6, 1, 0]
    with pytest.raises(CollectiveTimeout) as info:
        ws(**good())
    e = info.value
    assert (e.op, e.rank, e.peer, e.expected_epoch, e.observed_epoch, e.ubatch) == (
        "lse_reduce",
        RANK,
        3,
        7,
        6,
        1,
    )
    assert "waiting for peer 3" in str(e)
    assert ws._calls == [0, 0]
    assert ws.poisoned


# ----------------------------------------------------------------------------- constructor
@pytest.mark.parametrize(
    "geometry,world,exc,fragment",
    [
        (
            dict(num_heads=6),
            4,
            InvalidArgument,
            "num_heads must be a multiple of world_size 4 (got 6)",
        ),
        (
            dict(head_dim=6, dtype=np.float32),
            4,
            InvalidArgument,
            "head_dim * itemsize must be a multiple of 16 bytes (got 6 * 4 = 24)",
        ),
        (dict(head_dim=4, dtype="bfloat16"), 4, InvalidArgument, "head_dim * itemsize"),
        (dict(dtype=np.int8), 4, InvalidType, "dtype must be one of [bfloat16, float16, float32]"),
        (dict(dtype=np.float64), 4, InvalidType, "dtype must be one of"),
        (dict(dtype="no_such_type"), 4, InvalidType, "dtype must be one of"),
        (dict(lse_base=10), 4, InvalidArgument, "lse_base must be math.e or 2 (got 10)"),
        (dict(lse_base=2.7), 4, InvalidArgument, "lse_base must be math.e or 2"),
        (dict(lse_base=True), 4, InvalidType, "lse_base must be a real number"),
        (dict(max_tokens=0), 4, InvalidArgument, "max_tokens must be >= 1 (got 0)"),
        (dict(max_tokens=2.5), 4, InvalidType, "max_tokens must be an int"),
        (dict(num_heads=0), 4, InvalidArgument, "num_heads must be >= 1"),
        (dict(head_dim=-8), 4, InvalidArgument, "head_dim must be >= 1"),
        (dict(return_lse="yes"), 4, InvalidType, "return_lse must be a bool"),
        (
            dict(num_heads=128),
            MAX_WORLD_SIZE * 2,
            InvalidArgument,
            f"world_size must be <= {MAX_WORLD_SIZE} (got {MAX_WORLD_SIZE * 2})",
        ),
        (dict(max_tokens=2**22, num_heads=4096), 4, InvalidArgument, "must be < 2**31"),
    ],
)
def test_bad_constructor_arguments(geometry, world, exc, fragment):
    g = dict(
        max_tokens=T_MAX,
        num_heads=H,
        head_dim=D,
        dtype=np.float16,
        lse_base=math.e,
        return_lse=False,
    )
    g.update(geometry)
    ws = LseReduce.__new__(LseReduce)
    with pytest.raises(exc) as info:
        ws._init_geometry(world, **g)
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "dtype,expected",
    [
        ("bfloat16", BF16),
        ("bf16", BF16),
        (BF16, BF16),
        (BF16.type, BF16),
        (np.float16, np.dtype(np.float16)),
        ("float16", np.dtype(np.float16)),
        (np.dtype("float32"), np.dtype(np.float32)),
        ("fp32", np.dtype(np.float32)),
    ],
)
def test_dtype_spellings(dtype, expected):
    w = make_ws(dtype=dtype, head_dim=64)
    w._closed = True
    assert w.dtype == expected


@pytest.mark.parametrize(
    "base,scale",
    [(math.e, 1.0), (2, math.log(2.0)), (2.0, math.log(2.0)), (np.float64(math.e), 1.0)],
)
def test_lse_base_spellings(base, scale):
    w = make_ws(lse_base=base)
    w._closed = True
    assert w._lse_scale == np.float32(scale)
    assert w.lse_base in (math.e, 2.0)


def test_layout_of_slots_and_outputs():
    w = make_ws(
        world_size=4, dtype="bfloat16", max_tokens=8, num_heads=128, head_dim=512, return_lse=True
    )
    w._closed = True
    H_r = 32
    assert w.heads_per_rank == H_r and w.launches_per_call == 1
    payload = 4 * 8 * H_r * 512 * 2
    assert w._lse_offset == payload  # already 256-aligned
    assert w._slot_bytes_needed == payload + 4 * 8 * H_r * 4
    assert w._out_part_bytes == 8 * H_r * 512 * 2
    assert w._out_bytes_needed == w._out_part_bytes + 8 * H_r * 4
    # odd sizes are rounded up to 256 bytes per part
    w2 = make_ws(world_size=2, dtype=np.float32, max_tokens=3, num_heads=2, head_dim=4)
    w2._closed = True
    assert w2._lse_offset == 256 and w2._slot_bytes_needed == 512


def test_constructor_rejects_a_non_communicator():
    with pytest.raises(InvalidType, match="comm must be a dcpkit.Communicator"):
        LseReduce(object(), max_tokens=8, num_heads=8, head_dim=64, dtype="bfloat16")


def test_constructor_raises_the_argument_error_before_any_allocation():
    comm = Communicator.single()
    with pytest.raises(InvalidArgument, match="head_dim \\* itemsize must be a multiple of 16"):
        LseReduce(comm, max_tokens=8, num_heads=8, head_dim=3, dtype="bfloat16")


# ----------------------------------------------------------------------------- lse_combine
def _combine_args(W_=3, T=4, H_r=2, D_=64, dtype=np.float16):
    return dict(
        src_out=FakeDev((W_, T, H_r, D_), dtype),
        src_lse=FakeDev((W_, T, H_r), np.float32),
        out=FakeDev((T, H_r, D_), dtype),
        out_lse=FakeDev((T, H_r), np.float32),
    )


def test_combine_plan():
    p = _validate_combine(**_combine_args())
    assert (p.W, p.T, p.H_r, p.D) == (3, 4, 2, 64)


@pytest.mark.parametrize(
    "change,exc,fragment",
    [
        (
            dict(src_out=np.zeros((3, 4, 2, 64), np.float16)),
            InvalidType,
            "src_out must be a GPU array",
        ),
        (dict(src_out=FakeDev((3, 4, 2, 64), np.float64)), InvalidType, "src_out dtype"),
        (
            dict(src_out=FakeDev((4, 2, 64), np.float16)),
            InvalidArgument,
            "src_out must have 4 dimensions",
        ),
        (
            dict(src_out=FakeDev((MAX_WORLD_SIZE + 1, 4, 2, 64), np.float16)),
            InvalidArgument,
            f"src_out sources W must lie in [1, {MAX_WORLD_SIZE}]",
        ),
        (
            dict(src_out=FakeDev((3, 4, 2, 4), np.float16), out=FakeDev((4, 2, 4), np.float16)),
            InvalidArgument,
            "D_v * itemsize",
        ),
        (
            dict(src_out=strided((3, 4, 2, 64), np.float16, (4 * 2 * 128, 2 * 128, 128, 1))),
            InvalidArgument,
            "src_out must be C-contiguous",
        ),
        (dict(src_lse=FakeDev((3, 4, 2), np.float16)), InvalidType, "src_lse dtype"),
        (dict(src_lse=FakeDev((2, 4, 2), np.float32)), InvalidArgument, "src_lse shape"),
        (dict(out=FakeDev((4, 2, 64), np.float32)), InvalidType, "out dtype"),
        (dict(out=FakeDev((4, 3, 64), np.float16)), InvalidArgument, "out shape"),
        (dict(out=FakeDev((4, 2, 64), np.float16, device=1)), InvalidArgument, "out device"),
        (dict(out=FakeDev((4, 2, 64), np.float16, offset=4)), InvalidArgument, "16-byte aligned"),
        (dict(out_lse=FakeDev((4, 2), np.float16)), InvalidType, "out_lse dtype"),
    ],
)
def test_combine_bad_arguments(change, exc, fragment):
    args = _combine_args()
    args.update(change)
    with pytest.raises(exc) as info:
        _validate_combine(**args)
    assert fragment in str(info.value) and str(info.value).startswith("lse_combine: ")


# ----------------------------------------------------------------------------- kernels
def test_every_kernel_the_op_launches_is_registered():
    names = set(jit.VARIANTS["lse_reduce.cu"])
    dts = (BF16, np.dtype(np.float16), np.dtype(np.float32))
    for out_dt in dts:
        assert _combine_variant(out_dt) in names
        for lse_dt in dts:
            for large in (False, True):
                assert _reduce_variant(out_dt, lse_dt, large) in names
    assert len(names) == 21


REG_OPTION = "-DDCPKIT_LSE_REG_SOURCES=4"


@pytest.mark.parametrize("options", [(), (REG_OPTION,)], ids=["warp-merge", "register-merge"])
def test_kernels_compile_for_sm90(options):
    try:
        jit._nvrtc()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not available here: {e}")
    res = jit.compile_only(["lse_reduce.cu"], options=options)
    assert res["lse_reduce.cu"]["variants"] == 21 and res["lse_reduce.cu"]["cubin_bytes"] > 0


class _WarpMerge(LseReduce):
    REG_SOURCES = 0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_worlds_up_to_reg_sources_build_the_register_merge(world):
    """LseReduce.REG_SOURCES = 4: worlds of 1 to 4 ranks load the kernels built with
    -DDCPKIT_LSE_REG_SOURCES=4 (another module: the options key the NVRTC cache), larger
    worlds and REG_SOURCES = 0 the default build; after the protocol options."""
    reg = world <= 4
    for cls, want in ((LseReduce, reg), (_WarpMerge, False)):
        ws = make_ws(world_size=world, rank=world - 1, num_heads=4 * world, cls=cls)
        try:
            assert ws._kernel_options() == ((REG_OPTION,) if want else ()), (cls, world)
            ws._check_protocol_options(
                graph_outputs=None, waiter_ctas=None, programmatic_launch=True, self_check=False
            )
            protocol = ("-DDCPKIT_SELF_CHECK=0", "-DDCPKIT_PDL=1")
            assert ws._kernel_options() == protocol + ((REG_OPTION,) if want else ())
        finally:
            ws._closed = True
    assert LseReduce.REG_SOURCES == 4 and _WarpMerge.REG_SOURCES == 0


@pytest.mark.parametrize("bad", [3, 16, -1, True, 4.0, "4", None])
def test_reg_sources_other_than_the_kernel_values_is_refused(bad):
    class Bad(LseReduce):
        REG_SOURCES = bad

    ws = make_ws(world_size=2, cls=Bad)
    try:
        with pytest.raises(InvalidArgument) as info:
            ws._kernel_options()
        assert str(info.value) == (
            f"lse_reduce: REG_SOURCES must be one of [0, 1, 2, 4, 8] (got {bad!r})"
        )
    finally:
        ws._closed = True


def test_reg_sources_values_are_the_kernels():
    """The values LseReduce accepts are the ones kernels/lse_reduce.cu's static_assert allows;
    a build with another one fails to compile (with that assertion's message)."""
    import re

    from dcpkit.errors import CompileError
    from dcpkit.ops import lse_reduce as lr

    m = re.search(r'"DCPKIT_LSE_REG_SOURCES must be ([\d, ]+) or (\d+)"', jit.source(lr.FILE))
    assert m, "the static_assert message of DCPKIT_LSE_REG_SOURCES is not in lse_reduce.cu"
    allowed = tuple(int(v) for v in m.group(1).split(",")) + (int(m.group(2)),)
    assert allowed == lr._REG_SOURCES
    try:
        jit._nvrtc()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not available here: {e}")
    with pytest.raises(CompileError, match="DCPKIT_LSE_REG_SOURCES must be 0, 1, 2, 4 or 8"):
        jit.compile_only(["lse_reduce.cu"], options="-DDCPKIT_LSE_REG_SOURCES=3")


@pytest.mark.parametrize("value", [1, 2, 8])
def test_every_other_reg_sources_value_builds(value):
    """The values LseReduce accepts besides the shipped 4 (which the GPU tests run) compile too:
    a REG_SOURCES set to one of them never meets a build error at the first call."""
    try:
        jit._nvrtc()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not available here: {e}")
    res = jit.compile_only(["lse_reduce.cu"], options=f"-DDCPKIT_LSE_REG_SOURCES={value}")
    built = res["lse_reduce.cu"]
    assert built["variants"] == len(jit.VARIANTS["lse_reduce.cu"]) and built["cubin_bytes"] > 0


def test_lse_combine_is_public_in_dcpkit_ops():
    """The merge alone is part of dcpkit.ops' public surface (dcpkit.vllm's all-to-all path and
    the NVSHMEM peer rows of the benchmark import it from there)."""
    import dcpkit.ops
    from dcpkit.ops.lse_reduce import lse_combine

    assert "lse_combine" in dcpkit.ops.__all__
    assert dcpkit.ops.lse_combine is lse_combine


def test_host_constants_match_the_kernel():
    """THREADS sizes the grids (one merge item per warp); the kernel's lse_detail constants are
    what the CTAs of a grid cover."""
    import re
    from pathlib import Path

    from dcpkit import jit
    from dcpkit.ops import lse_reduce as lr

    src = (Path(jit.kernels_dir()) / "lse_reduce.cu").read_text()
    consts = dict(re.findall(r"constexpr int (k\w+) = (\d+);", src))
    assert int(consts["kThreads"]) == lr.THREADS
    assert "constexpr int kWarps = kThreads / 32;" in src and lr.WARPS_PER_CTA == lr.THREADS // 32


def test_large_instance_only_where_every_warp_has_enough_rows():
    """The per-T launch table: a call takes the large kernel instance (batched send, wide
    combine) exactly where its rows fill large_rows_per_warp(W) per warp of its grid (SEND_ROWS
    at W <= 2, 4 * SEND_ROWS from W = 3 on), never below SEND_ROWS, the kernel's kSendRows (the
    large instance's own bound); decode sizes keep the small instance at every grid."""
    import re

    from dcpkit.ops._lse_checks import SEND_ROWS, WARPS_PER_CTA, large_rows_per_warp
    from dcpkit.ops.lse_reduce import launch_table

    m = re.search(r"constexpr int kSendRows = (\d+);", jit.source("lse_reduce.cu"))
    assert m and int(m.group(1)) == SEND_ROWS
    assert large_rows_per_warp(2) == SEND_ROWS and large_rows_per_warp(1) == SEND_ROWS
    assert all(large_rows_per_warp(W) == 4 * SEND_ROWS for W in range(3, 65))
    # (4, 32, 32): the grid of 4 ranks sharing one H200 (a quarter of its SMs, less one), where
    # T = 8 fills exactly SEND_ROWS rows per warp and now keeps the small instance.
    for W, H_r, max_ctas in ((2, 64, 66), (4, 32, 33), (4, 32, 32), (8, 16, 132)):
        table = launch_table(W, H_r, 256, max_ctas)
        assert len(table) == 257 and table[0] == (1, False)
        for T, (grid, large) in enumerate(table):
            rows = W * T * H_r
            assert 1 <= grid <= max_ctas
            assert large == (rows >= large_rows_per_warp(W) * WARPS_PER_CTA * grid)
            if large:
                assert rows >= SEND_ROWS * WARPS_PER_CTA * grid
            if T <= 8:
                assert not large, (W, T)  # decode sizes keep the small instance
        assert table[256][1], (W, H_r)
