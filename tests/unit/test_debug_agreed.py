"""Every collective op hands the rank's ``DCPKIT_DEBUG`` to the constructor's one exchange
(:meth:`Communicator.agree_setup`), so that a rank that reads it differently makes every rank
raise ConfigMismatch instead of running a per-call host collective the others skip (a hang)."""

import pytest

from dcpkit.comm import Communicator
from dcpkit.fallback import NcclKVGather, NcclLseReduce, NcclQGather
from dcpkit.ops import KVGather, LseReduce, QGather


class _Seen(Exception):
    pass


OPS = [
    pytest.param(
        QGather, dict(heads_per_rank=4, head_dim=8, max_tokens=2, dtype="float16"), id="QGather"
    ),
    pytest.param(KVGather, dict(row_dim=8, max_tokens=2, dtype="float16"), id="KVGather"),
    pytest.param(
        LseReduce, dict(num_heads=4, head_dim=8, max_tokens=2, dtype="float16"), id="LseReduce"
    ),
    pytest.param(
        NcclQGather,
        dict(heads_per_rank=4, head_dim=8, max_tokens=2, dtype="float16"),
        id="NcclQGather",
    ),
    pytest.param(NcclKVGather, dict(row_dim=8, max_tokens=2, dtype="float16"), id="NcclKVGather"),
    pytest.param(
        NcclLseReduce,
        dict(num_heads=4, head_dim=8, max_tokens=2, dtype="float16"),
        id="NcclLseReduce",
    ),
]


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("0_0", True), ("", False)])
@pytest.mark.parametrize("cls, kw", OPS)
def test_the_constructor_agrees_on_dcpkit_debug(monkeypatch, cls, kw, value, on):
    seen = []

    def agree_setup(self, what, init, geometry="geometry", settings=None):
        seen.append(dict(settings or {}))
        raise _Seen

    monkeypatch.setattr(Communicator, "agree_setup", agree_setup)
    monkeypatch.setenv("DCPKIT_DEBUG", value)
    with pytest.raises(_Seen):
        cls(Communicator.single(), **kw)
    assert seen == [{"DCPKIT_DEBUG": on}], seen
