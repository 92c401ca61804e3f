"""dcpkit.torch on CPU: importing it never needs torch; without torch every entry point raises
MissingDependency naming the ``torch`` extra; with torch, CPU tensors are
refused with a clear message and the custom ops register and refuse unknown handles."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from dcpkit.errors import ClosedError, InvalidArgument, InvalidType, MissingDependency

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH,
    reason="torch is not installed (pip install 'dcpkit[torch-cu12]', or torch-cu13)",
)


@pytest.fixture
def no_torch(monkeypatch):
    """Make ``import torch`` fail, as on a machine without torch."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)


def test_import_needs_no_torch(no_torch, monkeypatch):
    monkeypatch.delitem(sys.modules, "dcpkit.torch", raising=False)  # import it afresh
    mod = importlib.import_module("dcpkit.torch")
    assert hasattr(mod, "TorchOps") and hasattr(mod, "to_cupy")


@pytest.mark.parametrize(
    "call", ["to_cupy", "from_cupy", "TorchOps", "register_custom_ops", "cupy_stream"]
)
def test_without_torch_names_the_extra(no_torch, call):
    import dcpkit.torch as dt

    args = {
        "to_cupy": (object(),),
        "from_cupy": (object(),),
        "TorchOps": (object(),),
        "register_custom_ops": (),
        "cupy_stream": (),
    }[call]
    with pytest.raises(MissingDependency) as ei:
        getattr(dt, call)(*args)
    from dcpkit._cuda import cuda_extra

    extra = {"cuda12": "torch-cu12", "cuda13": "torch-cu13"}[cuda_extra()]
    assert ei.value.extra == extra  # the extra that keeps this CUDA stack's pins
    assert f"pip install 'dcpkit[{extra}]'" in str(ei.value)


def test_communicator_from_torch_without_torch(no_torch):
    from dcpkit.comm import Communicator

    with pytest.raises(MissingDependency, match=r"dcpkit\[torch-cu1[23]\]"):
        Communicator.from_torch()


@pytest.fixture
def gloo_world(tmp_path):
    """A torch.distributed world of one rank (gloo over a file store), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


NOT_GROUPS = ["gloo", 0, True, 1.5, object()]


@needs_torch
@pytest.mark.parametrize("group", NOT_GROUPS, ids=lambda g: type(g).__name__)
def test_from_torch_refuses_what_is_not_a_process_group(group):
    """Before torch.distributed is initialised, too: the type is wrong either way."""
    from dcpkit.comm import Communicator

    with pytest.raises(InvalidType, match="group must be None or a torch.distributed.ProcessGroup"):
        Communicator.from_torch(group)


@needs_torch
@pytest.mark.parametrize("group", NOT_GROUPS, ids=lambda g: type(g).__name__)
def test_from_torch_refuses_what_is_not_a_process_group_in_a_job(gloo_world, group):
    """torch's own ValueError ("Group ... is not registered") came through before."""
    from dcpkit.comm import Communicator

    with pytest.raises(InvalidType, match="group must be None or a torch.distributed.ProcessGroup"):
        Communicator.from_torch(group)


@needs_torch
def test_from_torch_on_a_rank_outside_the_group(gloo_world):
    """new_group returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out; from_torch
    said "world_size must be >= 1 (got -1)" there."""
    from dcpkit.comm import Communicator

    with pytest.raises(InvalidArgument) as e:
        Communicator.from_torch(gloo_world.GroupMember.NON_GROUP_MEMBER)
    msg = str(e.value)
    assert "this rank (global rank 0) is not a member of group" in msg, msg
    assert "NON_GROUP_MEMBER" in msg and "world_size" not in msg, msg


@needs_torch
def test_from_torch_when_torch_gives_no_rank_in_the_group(gloo_world, monkeypatch):
    """A process group for which torch reports rank -1 and world size -1 (its answer for a rank
    outside a group), or raises ValueError ("Global rank 0 is not part of group")."""
    from dcpkit.comm import Communicator

    dist = gloo_world
    group = dist.new_group([0])
    real_rank = dist.get_rank
    monkeypatch.setattr(dist, "get_rank", lambda g=None: -1 if g is group else real_rank(g))
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: -1)
    with pytest.raises(InvalidArgument, match=r"this rank \(global rank 0\) is not a member"):
        Communicator.from_torch(group)

    def not_part(g=None):
        if g is group:
            raise ValueError("Global rank 0 is not part of group")
        return real_rank(g)

    monkeypatch.setattr(dist, "get_rank", not_part)
    with pytest.raises(InvalidArgument, match="includes this rank.*Global rank 0 is not part"):
        Communicator.from_torch(group)


@needs_torch
def test_from_torch_refuses_a_destroyed_group(gloo_world):
    from dcpkit.comm import Communicator

    group = gloo_world.new_group([0])
    gloo_world.destroy_process_group(group)
    with pytest.raises(InvalidArgument, match="group must be a live process group of this job"):
        Communicator.from_torch(group)


@needs_torch
def test_from_torch_over_a_subgroup_and_the_world(gloo_world):
    from dcpkit.comm import Communicator

    for group in (None, gloo_world.group.WORLD, gloo_world.new_group([0])):
        with Communicator.from_torch(group) as c:
            assert (c.rank, c.world_size, c.backend) == (0, 1, "torch")
            assert c.allgather({"k": 1}) == [{"k": 1}]
            assert c.broadcast("x", 0) == "x"
            c.barrier()


@needs_torch
def test_cpu_tensor_is_refused():
    import torch

    import dcpkit.torch as dt

    with pytest.raises(InvalidType) as ei:
        dt.to_cupy(torch.zeros(4, dtype=torch.bfloat16), name="q")
    assert str(ei.value) == (
        "dcpkit.torch: q must be a CUDA tensor (got device cpu): move it to the GPU with .cuda()"
    )
    with pytest.raises(InvalidType, match="q must be a torch.Tensor"):
        dt.to_cupy([1, 2], name="q")


@needs_torch
def test_custom_ops_register_and_refuse_unknown_handles():
    import torch

    import dcpkit.torch as dt

    ops = dt.register_custom_ops()
    assert set(ops) == {"q_gather", "kv_gather", "lse_reduce"}
    assert dt.register_custom_ops() is ops  # once per process
    q = torch.zeros(2, 2, 4)
    with pytest.raises(ClosedError, match="handle 987654 must name a live"):
        torch.ops.dcpkit.q_gather(987654, q, torch.zeros(2, 4, 4), 0)


@needs_torch
def test_dispatcher_probe_has_q_gathers_schema_and_does_nothing():
    """The host-time scripts' dispatcher probe: q_gather's schema, an empty body, once per
    process."""
    import torch

    from dcpkit._torch_registry import _SCHEMAS, dispatcher_probe

    probe = dispatcher_probe()
    assert dispatcher_probe() is probe
    q, out = torch.ones(2, 2, 4), torch.full((2, 4, 4), 7.0)
    assert probe(987654, q, out, 0) is None  # no handle lookup, no write
    assert bool((out == 7.0).all())
    assert str(probe.default._schema).endswith(_SCHEMAS["q_gather"][0])
    with pytest.raises(RuntimeError):
        probe(0, q)  # the schema is enforced: out and ubatch are required


# ----------------------------------------------------------------------------- conversions
def _cpu_check(t, name, device):
    """The tensor checks, with the CPU standing in for the GPU."""
    import torch

    import dcpkit.torch as dt

    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"dcpkit.torch: {name} must be a torch.Tensor")
    if t.dtype not in dt.supported_dtypes():
        raise InvalidType(f"dcpkit.torch: {name} dtype must be one of ...")


@needs_torch
def test_converter_describes_each_tensor_exactly_and_memoises_per_description():
    pytest.importorskip("cupy")
    import torch

    from dcpkit._arrays import array_info
    from dcpkit.torch import TensorConverter

    conv = TensorConverter(None, check=_cpu_check)
    base = torch.zeros(8, 16, dtype=torch.bfloat16)
    views = [
        base,
        base[2:],
        base[:, 4:],
        base[1::2],
        base.t(),
        base.as_strided((4, 16), (32, 1)),  # same pointer, other strides
        base.view(torch.int16),
        base.view(16, 8),
    ]  # same pointer, other dtype/shape
    arrays = [conv(v, "x") for v in views]
    for v, a in zip(views, arrays):
        i = array_info(a, "op", "x")
        assert i.ptr == v.data_ptr(), "a slice must start at its first element"
        assert i.shape == tuple(v.shape)
        assert i.strides == tuple(s * v.element_size() for s in v.stride())
        assert i.itemsize == v.element_size()
    assert len({id(a) for a in arrays}) == len(views)  # every layout its own array
    assert conv.misses == len(views) and conv.hits == 0
    again = base[2:]  # another tensor, same description
    assert conv(again, "x") is arrays[1] and conv.hits == 1
    with pytest.raises(InvalidType, match="x dtype must be"):
        conv(torch.zeros(2, dtype=torch.complex64), "x")  # a refused tensor is never stored
    with pytest.raises(InvalidType, match="x dtype must be"):
        conv(torch.zeros(2, dtype=torch.complex64), "x")
    with pytest.raises(InvalidType, match="must be a torch.Tensor"):
        conv([1, 2], "x")


@needs_torch
def test_converter_refuses_cpu_tensors_with_the_default_checks():
    import torch

    from dcpkit.torch import TensorConverter

    conv = TensorConverter(0)
    for _ in range(2):
        with pytest.raises(InvalidType, match="q must be a CUDA tensor"):
            conv(torch.zeros(4), "q")
    assert conv.hits == 0


@needs_torch
def test_custom_ops_bump_the_version_of_what_they_write_and_trace():
    import torch

    import dcpkit.torch as dt

    dt.register_custom_ops()
    seen = []

    class Target:
        op_name = "q_gather"
        device = 0

    ops = dt.TorchOps(Target())
    ops._invoke = lambda op, args, kw: seen.append((op, [n for n, _ in args], sorted(kw)))
    q, out = torch.zeros(2, 2, 4), torch.zeros(2, 4, 4)
    v = out._version
    torch.ops.dcpkit.q_gather(ops.handle, q, out, 0)
    assert seen == [("q_gather", ["q"], ["out", "ubatch"])]
    assert out._version == v + 1, "autograd must see that out was written"
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b):
        torch.ops.dcpkit.q_gather(ops.handle, a, b, 0)
        return b + 1

    code = make_fx(f, tracing_mode="fake")(q, out).code
    assert "torch.ops.dcpkit.q_gather.default" in code
    ops.close()
    with pytest.raises(ClosedError, match="must name a live"):
        torch.ops.dcpkit.q_gather(ops.handle, q, out, 0)


@needs_torch
def test_eager_out_calls_skip_the_dispatcher_only_where_torch_need_not_see_them():
    """A plain eager ``out=`` call does the custom op's work directly (the same call, the same
    version bump); under a dispatch mode, or with a tensor subclass, it is the custom op."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import dcpkit.torch as dt

    dt.register_custom_ops()

    class Target:
        op_name = "q_gather"
        device = 0

    ops = dt.TorchOps(Target())
    seen, custom = [], []
    ops._invoke = lambda op, args, kw: seen.append((op, [n for n, _ in args], sorted(kw)))
    real_custom = ops._custom
    ops._custom = lambda op: (custom.append(op), real_custom(op))[1]
    q, out = torch.zeros(2, 2, 4), torch.zeros(2, 4, 4)
    v = out._version
    assert ops.q_gather(q, out=out) is out
    assert seen == [("q_gather", ["q"], ["out", "ubatch"])] and custom == []
    assert out._version == v + 1, "autograd must see that out was written"

    class Watch(TorchDispatchMode):
        ops_seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops_seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Watch():
        ops.q_gather(q, out=out)
    assert custom == ["q_gather"] and any("dcpkit.q_gather" in f for f in Watch.ops_seen)
    assert len(seen) == 2 and out._version == v + 2
    ops.close()


def test_public_signatures_are_stable():
    """What callers of dcpkit.torch bind to: every public function and method, as written."""
    import inspect

    import dcpkit.torch as dt

    want = {
        "TensorConverter": "(device: 'int | None' = None, max_entries: 'int' = 256, check=None)",
        "TensorConverter.__call__": "(self, t, name: 'str' = 'tensor')",
        "TensorConverter.cached": "(self, key) -> 'bool'",
        "TensorConverter.clear": "(self) -> 'None'",
        "TorchOps": "(target)",
        "TorchOps.__call__": "(self, *args, **kwargs)",
        "TorchOps.close": "(self) -> 'None'",
        "TorchOps.q_gather": "(self, q, *, ubatch: 'int' = 0, out=None)",
        "TorchOps.kv_gather": "(self, kv, *, ubatch: 'int' = 0, out=None)",
        "TorchOps.lse_reduce": "(self, out_partial, lse_partial, *, seq_lens=None, "
        "query_start_loc=None, ubatch: 'int' = 0, out=None, out_lse=None)",
        "cupy_stream": "(device: 'int | None' = None)",
        "describe": "(t) -> 'tuple'",
        "from_cupy": "(a)",
        "register_custom_ops": "() -> 'dict[str, Any]'",
        "supported_dtypes": "() -> 'tuple'",
        "to_cupy": "(t, *, name: 'str' = 'tensor', device: 'int | None' = None)",
    }
    got = {}
    for name in want:
        obj = dt
        for part in name.split("."):
            obj = getattr(obj, part)
        got[name] = str(inspect.signature(obj))
    assert got == want


@needs_torch
@pytest.mark.parametrize(
    "a, got", [("numpy", "numpy.ndarray"), (None, "builtins.NoneType"), ("tensor", "torch.Tensor")]
)
def test_from_cupy_refuses_what_is_not_a_cupy_array(a, got):
    import numpy as np
    import torch

    import dcpkit.torch as dt

    a = {"numpy": np.zeros(3), "tensor": torch.zeros(3)}.get(a, a)
    with pytest.raises(InvalidType) as ei:
        dt.from_cupy(a)
    assert str(ei.value) == f"dcpkit.torch.from_cupy: a must be a CuPy array (got {got})"


@needs_torch
def test_cupy_stream_without_a_cuda_torch_is_a_dcpkit_error(monkeypatch):
    import torch

    import dcpkit.torch as dt
    from dcpkit.errors import DcpkitError, InvalidArgument

    with pytest.raises(InvalidType, match=r"cupy_stream: device must be an int \(got str 'x'\)"):
        dt.cupy_stream("x")
    with pytest.raises(InvalidArgument, match=r"cupy_stream: device must be >= 0 \(got -1\)"):
        dt.cupy_stream(-1)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DcpkitError) as ei:
        dt.cupy_stream()
    assert type(ei.value) is DcpkitError and "\n" not in str(ei.value)
    assert str(ei.value).startswith(
        f"dcpkit.torch.cupy_stream: torch {torch.__version__} is a CPU build (no CUDA)"
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DcpkitError, match="cupy_stream: torch sees no CUDA GPU"):
        dt.cupy_stream(0)


@needs_torch
@pytest.mark.parametrize(
    "kwargs, error, says",
    [
        ({"max_entries": 0}, "InvalidArgument", "max_entries must be >= 1 (got 0)"),
        ({"max_entries": "8"}, "InvalidType", "max_entries must be an int (got str '8')"),
        ({"device": -1}, "InvalidArgument", "device must be >= 0 (got -1)"),
        ({"device": 1.0}, "InvalidType", "device must be an int (got float 1.0)"),
        ({"check": 5}, "InvalidType", "check must be None or a callable"),
    ],
)
def test_converter_arguments_are_checked(kwargs, error, says):
    import dcpkit.errors as errors
    import dcpkit.torch as dt

    with pytest.raises(getattr(errors, error)) as ei:
        dt.TensorConverter(**kwargs)
    assert str(ei.value).startswith(f"TensorConverter: {says}"), str(ei.value)
