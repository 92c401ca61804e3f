"""The multicast guard (NOTE [dcpkit multicast guard] in dcpkit/multicast.py), on the CPU.

Every combination of opt-in, opt-in variable, disabling variables and device attribute is
checked against an independent table; ranks that disagree turn multicast off everywhere; and a
MulticastObject (or a granularity query) refuses before any driver call whenever a disabling
variable is set, on any rank. No test here can reach cuMulticastCreate: the driver is replaced
by a stub that fails the test on first use. The guard reads a dict the test controls (through a
stand-in for ``os`` in dcpkit.multicast); the process's environment is never changed.
"""

import itertools
import os
import threading

import pytest

import dcpkit._cuda
import dcpkit.multicast as mc
from dcpkit.comm import Communicator
from dcpkit.errors import InvalidType, MulticastDisabled

from _threadgroup import run_group

KILL = [name for name, _ in mc.KILL_SWITCHES]

# Values tried for each variable, with whether the value forbids multicast (independent table,
# written from the design notes and NOTE [dcpkit multicast guard], not from the code).
NCCL_VALUES = {
    None: False,
    "": False,
    "0": True,
    "1": False,
    "2": False,
    "off": True,
    "bogus": True,
}
DISABLE_VALUES = {
    None: False,
    "": False,
    "1": True,
    "0": False,
    "true": True,
    "no": False,
    "bogus": True,
}
OPT_IN_VALUES = {None: False, "0": False, "1": True, "yes": True, "bogus": False}


class DriverStub:
    """Stands in for cuda.bindings.driver: any use fails the test (and is recorded)."""

    def __init__(self):
        self.touched = []

    def __getattr__(self, name):
        self.touched.append(name)
        raise AssertionError(f"driver.{name} was reached although multicast is disabled")


@pytest.fixture
def no_driver(monkeypatch):
    stub = DriverStub()
    monkeypatch.setattr(dcpkit._cuda, "driver", lambda: stub)
    return stub


class _EnvOs:
    """Stands in for the ``os`` module of dcpkit.multicast, so that the guard reads ``environ``
    from a dict the test controls (per thread, for ranks that disagree). The process's own
    environment is never changed: its disabling variables stay as they are."""

    tls = threading.local()

    def __getattr__(self, attr):
        return getattr(os, attr)

    @property
    def environ(self):
        return getattr(_EnvOs.tls, "env", {})


@pytest.fixture
def guard_env(monkeypatch):
    """``guard_env(dict)``: the environment the guard sees on this thread."""
    monkeypatch.setattr(mc, "os", _EnvOs())

    def set_env(env):
        _EnvOs.tls.env = dict(env)

    set_env({})
    yield set_env
    _EnvOs.tls.env = {}


def _env(opt_var, values):
    env = {}
    if opt_var is not None:
        env[mc.OPT_IN_VARIABLE] = opt_var
    for name, v in zip(KILL, values):
        if v is not None:
            env[name] = v
    return env


def test_kill_switches_are_the_design_ones():
    assert set(KILL) == {
        "NCCL_NVLS_ENABLE",
        "NVSHMEM_DISABLE_NVLS",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "DCPKIT_DISABLE_MULTICAST",
    }


def test_guard_table_exhaustive():
    """Every opt-in x variable value x device attribute combination."""
    per_var = [list(NCCL_VALUES)] + [list(DISABLE_VALUES)] * (len(KILL) - 1)
    count = 0
    for opt_in, opt_var, dev_ok, *values in itertools.product(
        (True, False, None), list(OPT_IN_VALUES), (True, False), *per_var
    ):
        env = _env(opt_var, values)
        calls = []

        def device():
            calls.append(1)
            return dev_ok

        got, reason = mc.multicast_decision(opt_in, env, device)
        opted = opt_in if opt_in is not None else OPT_IN_VALUES[opt_var]
        forbidding = [
            name
            for name, v in zip(KILL, values)
            if (NCCL_VALUES if name == "NCCL_NVLS_ENABLE" else DISABLE_VALUES)[v]
        ]
        expected = bool(opted and not forbidding and dev_ok)
        case = f"opt_in={opt_in} env={env} device_supported={dev_ok}"
        assert got is expected, f"{case}: got {got} ({reason})"
        assert isinstance(reason, str) and reason, case
        if not opted:
            assert (
                ("multicast=False" in reason) if opt_in is False else (mc.OPT_IN_VARIABLE in reason)
            ), f"{case}: reason {reason!r}"
        elif forbidding:
            for name in forbidding:
                assert name in reason, f"{case}: reason {reason!r} must name {name}"
            for name in set(KILL) - set(forbidding):
                assert name not in reason, f"{case}: reason {reason!r} names {name}"
        elif not dev_ok:
            assert "MULTICAST_SUPPORTED" in reason, f"{case}: reason {reason!r}"
        # The device is queried only when rules 1 and 2 pass (no driver call otherwise).
        assert len(calls) == (1 if opted and not forbidding else 0), case
        count += 1
    assert count == 3 * len(OPT_IN_VALUES) * 2 * len(NCCL_VALUES) * len(DISABLE_VALUES) ** 3


@pytest.mark.parametrize(
    "value,forbids",
    [
        ("0", True),
        (" 0 ", True),
        ("false", True),
        ("FALSE", True),
        ("no", True),
        ("off", True),
        ("n", True),
        ("f", True),
        ("garbage", True),
        ("-", True),
        ("1", False),
        ("2", False),
        ("true", False),
        ("True", False),
        ("yes", False),
        ("on", False),
        ("", False),
        ("  ", False),
    ],
)
def test_nccl_nvls_enable_spellings(value, forbids):
    assert bool(mc.kill_switches_set({"NCCL_NVLS_ENABLE": value})) is forbids


@pytest.mark.parametrize("name", KILL[1:])
@pytest.mark.parametrize(
    "value,forbids",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        ("y", True),
        ("2", True),
        ("garbage", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
        ("n", False),
        ("f", False),
        ("", False),
        (" ", False),
    ],
)
def test_disable_variable_spellings(name, value, forbids):
    assert bool(mc.kill_switches_set({name: value})) is forbids


@pytest.mark.parametrize(
    "value,opted",
    [
        ("1", True),
        ("true", True),
        ("ON", True),
        ("7", True),
        ("0", False),
        ("", False),
        ("maybe", False),
    ],
)
def test_opt_in_variable_spellings(value, opted):
    ok, reason = mc.multicast_decision(None, {mc.OPT_IN_VARIABLE: value}, True)
    assert ok is opted, reason


@pytest.mark.parametrize(
    "value",
    ["1", "true", "yes", "on", "y", "t", " Yes ", "TRUE", "0", "false", "no", "off", "", "maybe"],
)
def test_naive_equivalent_of_the_docstring_matches_the_opt_in(value):
    """The "naive equivalent" in multicast_decision's docstring is the opt-in rule (for the
    words it lists; integers other than 0/1 are covered by test_opt_in_variable_spellings)."""
    doc = mc.multicast_decision.__doc__
    assert '== "1"' not in doc, "the naive equivalent must not claim only '1' opts in"
    truthy = ("1", "true", "yes", "on", "y", "t")
    for w in truthy:
        assert f'"{w}"' in doc, w
    naive = value.strip().lower() in truthy
    ok, reason = mc.multicast_decision(None, {mc.OPT_IN_VARIABLE: value}, True)
    assert ok is naive, (value, reason)


def test_docstrings_cite_only_files_in_the_repository():
    """DESIGN.md is kept outside the repository: the module must not send readers there."""
    assert "DESIGN.md" not in (mc.__doc__ or "")
    assert "Known limits" in mc.__doc__


def test_device_query_failure_means_no():
    def broken():
        raise RuntimeError("no driver")

    ok, reason = mc.multicast_decision(True, {}, broken)
    assert ok is False and "no driver" in reason and "MULTICAST_SUPPORTED" in reason


def test_decision_rejects_non_bool_opt_in():
    with pytest.raises(InvalidType, match="opt_in"):
        mc.multicast_decision("yes", {}, True)


def test_agree_multicast_every_combination_of_three_ranks():
    for votes in itertools.product((True, False), repeat=3):

        def body(comm):
            yes = votes[comm.rank]
            return mc.agree_multicast(comm, (yes, f"reason-of-rank-{comm.rank}"))

        res = run_group(3, body)
        assert all(kind == "ok" for kind, _ in res), res
        decisions = [value for _, value in res]
        assert len(set(decisions)) == 1, f"votes {votes}: ranks disagree: {decisions}"
        ok, reason = decisions[0]
        assert ok is all(votes), f"votes {votes}: {reason}"
        refusing = [r for r, v in enumerate(votes) if not v]
        if refusing:
            assert f"rank(s) {refusing}" in reason, reason
            for r in range(3):
                assert (f"reason-of-rank-{r}" in reason) is (r in refusing), reason


def test_agree_multicast_accepts_bare_bool():
    assert mc.agree_multicast(Communicator.single(), True)[0] is True
    assert mc.agree_multicast(Communicator.single(), False)[0] is False


@pytest.mark.parametrize(
    "name,value",
    [
        ("NCCL_NVLS_ENABLE", "0"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("DCPKIT_DISABLE_MULTICAST", "1"),
    ],
)
def test_multicast_object_refuses_before_any_driver_call(guard_env, no_driver, name, value):
    guard_env({name: value, mc.OPT_IN_VARIABLE: "1"})  # an opt-in does not override it
    with pytest.raises(MulticastDisabled, match=name):
        mc.MulticastObject(Communicator.single(), 2 << 20, 0, mem_handle=object())
    assert no_driver.touched == []


@pytest.mark.parametrize(
    "name,value",
    [
        ("NCCL_NVLS_ENABLE", "0"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("DCPKIT_DISABLE_MULTICAST", "1"),
    ],
)
def test_granularity_query_refuses_before_any_driver_call(guard_env, no_driver, name, value):
    guard_env({name: value})
    with pytest.raises(MulticastDisabled, match=name):
        mc.multicast_granularity(2, 0, "posix_fd")
    assert no_driver.touched == []


def test_multicast_object_refuses_on_every_rank_when_one_rank_is_forbidden(guard_env, no_driver):
    """Rank 1 alone has NVSHMEM_DISABLE_NVLS=1: all three ranks refuse, none calls the driver."""

    def body(comm):
        guard_env({"NVSHMEM_DISABLE_NVLS": "1"} if comm.rank == 1 else {})
        mc.MulticastObject(comm, 2 << 20, 0, mem_handle=object())

    res = run_group(3, body)
    for r, (kind, value) in enumerate(res):
        assert kind == "err" and isinstance(value, MulticastDisabled), f"rank {r}: {value!r}"
        assert "rank 1" in str(value) and "NVSHMEM_DISABLE_NVLS" in str(value), f"rank {r}: {value}"
    assert no_driver.touched == []


def test_multicast_object_rejects_bad_arguments_before_driver(guard_env, no_driver):
    comm = Communicator.single()
    with pytest.raises(InvalidType, match="heap_nbytes"):
        mc.MulticastObject(comm, 1.5, 0, mem_handle=object())
    with pytest.raises(Exception, match="handle_type"):
        mc.MulticastObject(comm, 2 << 20, 0, mem_handle=object(), handle_type="nope")
    with pytest.raises(Exception, match="mem_handle"):
        mc.MulticastObject(comm, 2 << 20, 0, mem_handle=None)
    with pytest.raises(InvalidType, match="comm"):
        mc.MulticastObject("not a comm", 2 << 20, 0, mem_handle=object())
    assert no_driver.touched == []
