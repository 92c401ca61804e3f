"""The one lifecycle of dcpkit's resources (dcpkit._lifecycle.Resource): close() once and
idempotent, ``with`` closes, a ResourceWarning naming the resource when one is dropped open, and
none for a Communicator (it holds nothing of its own)."""

from __future__ import annotations

import warnings

import pytest

from dcpkit._lifecycle import Resource
from dcpkit.comm import Communicator
from dcpkit.errors import ClosedError
from dcpkit.manager import DCPComm
from dcpkit.multicast import MulticastObject
from dcpkit.nccl import NcclGroup, NcclKVGather, NcclLseReduce, NcclQGather
from dcpkit.symmetric import SymmetricHeap
from dcpkit.vllm import DirectDCPA2AWorkspace, DirectDCPKVGatherWorkspace, DirectDCPQGatherWorkspace


class Held(Resource):
    _resource_name = "Held"

    def __init__(self):
        self.released = 0
        self._closed = False

    def _close(self):
        self.released += 1


def _warnings_of(obj):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        obj.__del__()
    return [str(w.message) for w in got if issubclass(w.category, ResourceWarning)]


def test_close_runs_once_and_with_closes():
    h = Held()
    assert not h.closed
    h.close()
    h.close()
    assert h.closed and h.released == 1
    with Held() as h2:
        assert not h2.closed
    assert h2.closed and h2.released == 1


def test_a_resource_dropped_open_warns_naming_it_and_a_closed_one_does_not():
    h = Held()
    assert _warnings_of(h) == ["dcpkit Held was not closed; call close() on every rank"]
    h.close()
    assert _warnings_of(h) == []


@pytest.mark.parametrize(
    "cls,name",
    [
        (SymmetricHeap, "SymmetricHeap"),
        (MulticastObject, "MulticastObject"),
        (NcclGroup, "NcclGroup"),
        (NcclQGather, "q_gather (nccl)"),
        (NcclKVGather, "kv_gather (nccl)"),
        (NcclLseReduce, "lse_reduce (nccl)"),
        (DCPComm, "DCPComm"),
    ],
)
def test_every_resource_class_has_the_lifecycle(cls, name):
    assert issubclass(cls, Resource)
    obj = cls.__new__(cls)
    obj.comm = object()  # SymmetricHeap warns only for a heap of a group
    assert obj.closed  # never built: holds nothing, never warns
    assert _warnings_of(obj) == []
    obj._closed = False
    msgs = _warnings_of(obj)
    obj._closed = True
    assert len(msgs) == 1 and msgs[0].startswith(f"dcpkit {name} was not closed"), msgs


def test_a_communicator_is_a_resource_that_never_warns():
    c = Communicator.single()
    assert isinstance(c, Resource) and not c.closed
    assert _warnings_of(c) == []
    c.close()
    c.close()
    assert c.closed


def test_check_open_names_the_call_and_the_resource_once_closed():
    h = Held()
    h._noun = "held thing"
    h._check_open("Held.use")  # open: nothing raised
    h.close()
    with pytest.raises(ClosedError, match=r"^Held\.use: the held thing is closed$"):
        h._check_open("Held.use")


def _closed(cls):
    obj = cls.__new__(cls)
    obj._closed = True
    return obj


@pytest.mark.parametrize(
    "check,message",
    [
        (
            lambda: _closed(SymmetricHeap)._check_open("SymmetricHeap.view"),
            "SymmetricHeap.view: the heap is closed",
        ),
        (
            lambda: _closed(Communicator)._check_open("barrier"),
            "Communicator.barrier: the communicator is closed",
        ),
        (lambda: _closed(NcclQGather).check_open(), "q_gather: the workspace is closed"),
        (lambda: _closed(NcclLseReduce).check_open(), "lse_reduce: the workspace is closed"),
        (
            lambda: _closed(DirectDCPQGatherWorkspace)._check_open(
                "DirectDCPQGatherWorkspace.gather"
            ),
            "DirectDCPQGatherWorkspace.gather: the workspace is closed",
        ),
    ],
)
def test_every_resource_says_what_is_closed(check, message):
    with pytest.raises(ClosedError) as got:
        check()
    assert str(got.value) == message


@pytest.mark.parametrize(
    "cls", [DirectDCPA2AWorkspace, DirectDCPQGatherWorkspace, DirectDCPKVGatherWorkspace]
)
def test_a_vllm_workspace_closes_its_op_once_and_leaves_the_warning_to_it(cls):
    class Op:
        closes = 0

        def close(self):
            Op.closes += 1

    ws = cls.__new__(cls)
    ws._op, ws._ops, ws._closed = Op(), Op(), False
    assert isinstance(ws, Resource) and not ws.closed
    assert _warnings_of(ws) == []  # the dcpkit op under it warns for itself
    with ws:
        pass
    ws.close()
    assert ws.closed and Op.closes == 2  # the op and its torch front end, once each
