"""The construction sequence of the NCCL ops on the CPU: every constructor keyword reaches the
geometry check, the derived sizes follow from it, and the buffers allocated have the sizes the
calls use. The NCCL group, the GPU and the warm-up are stubbed (tests/mpi/test_fallback.py runs
the real thing with one GPU per rank)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from dcpkit.errors import InvalidArgument, InvalidType
from dcpkit.nccl import NcclKVGather, NcclLseReduce, NcclQGather
from dcpkit.nccl.base import NcclOp


@pytest.fixture
def stubbed(monkeypatch):
    """NcclOp without NCCL, GPU or collective: the geometry check runs as in the constructor;
    a buffer is its byte count."""
    seen = {}

    def agree(self, comm, arguments, what, nccl_group, **unused):
        seen.update(what=what, unused=unused, arguments=arguments)
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self._check_arguments(comm.world_size, **arguments)

    monkeypatch.setattr(NcclOp, "_agree_geometry", agree)
    monkeypatch.setattr(NcclOp, "_setup_nccl", lambda self, group: None)
    monkeypatch.setattr(NcclOp, "_allocate", lambda self, build: build())
    monkeypatch.setattr(NcclOp, "_alloc", lambda self, nbytes: max(int(nbytes), 256))
    monkeypatch.setattr(NcclOp, "_finish", lambda self: setattr(self, "_closed", False))
    return seen


COMM = types.SimpleNamespace(rank=1, world_size=4)


def test_q_gather_buffers_and_sizes(stubbed):
    op = NcclQGather(
        COMM, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16", padded_num_heads=10
    )
    assert stubbed["arguments"] == dict(
        max_tokens=8,
        heads_per_rank=2,
        head_dim=64,
        dtype="float16",
        num_ubatches=1,
        padded_num_heads=10,
        timeout_ms=None,
    )
    assert stubbed["unused"] == {"heap": None, "multicast": None}
    assert stubbed["what"] == op.agreed_names and "padded_num_heads" in op.agreed_names
    assert op.row_bytes == 2 * 64 * 2 and op._token_bytes == 10 * 64 * 2
    assert op._send == [8 * op.row_bytes] and op._gather == [4 * 8 * op.row_bytes]
    assert op._outs == [[8 * op._token_bytes] * 3]
    op._free_buffers()
    assert op._send is None and op._gather is None and op._outs is None


def test_kv_gather_buffers_and_sizes(stubbed):
    op = NcclKVGather(COMM, max_tokens=5, row_dim=576, dtype="bfloat16", num_ubatches=2)
    assert stubbed["arguments"]["num_ubatches"] == 2 and stubbed["arguments"]["row_dim"] == 576
    assert op.row_bytes == 576 * 2
    assert op._send == [5 * op.row_bytes] * 2
    assert op._outs == [[4 * 5 * op.row_bytes] * 3] * 2
    op._free_buffers()
    assert op._send is None and op._outs is None


@pytest.mark.parametrize(
    "algorithm,out_heads,launches",
    [("all_to_all", 2, 6), ("allgather_reduce_scatter", 2, 5), ("allgather_all_reduce", 8, 5)],
)
@pytest.mark.parametrize("lse_base", [math.e, 2.0])
def test_lse_reduce_buffers_and_sizes(stubbed, algorithm, out_heads, launches, lse_base):
    T, H, D = 3, 8, 64
    op = NcclLseReduce(
        COMM,
        max_tokens=T,
        num_heads=H,
        head_dim=D,
        dtype="float16",
        lse_base=lse_base,
        algorithm=algorithm,
    )
    assert stubbed["unused"] == {"heap": None}  # lse_reduce takes no multicast
    assert stubbed["arguments"]["algorithm"] == algorithm
    assert (op.heads_per_rank, op.out_heads, op.launches_per_call) == (2, out_heads, launches)
    assert op._scale == np.float32(1.0 if lse_base == math.e else math.log(2.0))
    assert op._row_bytes == D * 2
    assert op._outs == [[T * out_heads * D * 2] * 3]
    assert op._lse_outs == [[max(T * out_heads * 4, 256)] * 3]
    if algorithm == "all_to_all":
        assert op._send_out == op._recv_out == [T * H * D * 2]
        assert op._send_lse == op._recv_lse == [max(T * H * 4, 256)]
    else:
        assert op._lse_all == [4 * T * H * 4] and op._y == [T * H * D * 4]
        assert hasattr(op, "_rs") == (algorithm == "allgather_reduce_scatter")


def test_a_bad_keyword_is_still_checked(stubbed):
    with pytest.raises(InvalidArgument, match="num_heads must be a multiple of world_size 4"):
        NcclLseReduce(COMM, max_tokens=3, num_heads=6, head_dim=64, dtype="float16")
    with pytest.raises(InvalidType):
        NcclKVGather(COMM, max_tokens=3, row_dim=8, dtype="float16", timeout_ms="soon")
