"""dcpkit.torch on CPU: importing it never needs torch; without torch every entry point raises
MissingDependency naming the ``torch`` extra; with torch (GPU machines), CPU tensors are
refused with a clear message and the custom ops register and refuse unknown handles."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from dcpkit.errors import ClosedError, InvalidType, MissingDependency

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed here "
                                 "(pip install 'dcpkit[torch]'); the GPU machines have it")


@pytest.fixture
def no_torch(monkeypatch):
    """Make ``import torch`` fail, as on a machine without torch."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)


def test_import_needs_no_torch(no_torch, monkeypatch):
    monkeypatch.delitem(sys.modules, "dcpkit.torch", raising=False)   # import it afresh
    mod = importlib.import_module("dcpkit.torch")
    assert hasattr(mod, "TorchOps") and hasattr(mod, "to_cupy")


@pytest.mark.parametrize("call", ["to_cupy", "from_cupy", "TorchOps", "register_custom_ops",
                                  "cupy_stream"])
def test_without_torch_names_the_extra(no_torch, call):
    import dcpkit.torch as dt

    args = {"to_cupy": (object(),), "from_cupy": (object(),), "TorchOps": (object(),),
            "register_custom_ops": (), "cupy_stream": ()}[call]
    with pytest.raises(MissingDependency) as ei:
        getattr(dt, call)(*args)
    assert ei.value.extra == "torch"
    assert "pip install 'dcpkit[torch]'" in str(ei.value)


def test_communicator_from_torch_without_torch(no_torch):
    from dcpkit.comm import Communicator

    with pytest.raises(MissingDependency, match=r"dcpkit\[torch\]"):
        Communicator.from_torch()


@needs_torch
def test_cpu_tensor_is_refused():
    import torch

    import dcpkit.torch as dt

    with pytest.raises(InvalidType) as ei:
        dt.to_cupy(torch.zeros(4, dtype=torch.bfloat16), name="q")
    assert str(ei.value) == ("dcpkit.torch: q must be a CUDA tensor (got device cpu): move it "
                             "to the GPU with .cuda()")
    with pytest.raises(InvalidType, match="q must be a torch.Tensor"):
        dt.to_cupy([1, 2], name="q")


@needs_torch
def test_custom_ops_register_and_refuse_unknown_handles():
    import torch

    import dcpkit.torch as dt

    ops = dt.register_custom_ops()
    assert set(ops) == {"q_gather", "kv_gather", "lse_reduce"}
    assert dt.register_custom_ops() is ops          # once per process
    q = torch.zeros(2, 2, 4)
    with pytest.raises(ClosedError, match="handle 987654 must name a live"):
        torch.ops.dcpkit.q_gather(987654, q, torch.zeros(2, 4, 4), 0)
