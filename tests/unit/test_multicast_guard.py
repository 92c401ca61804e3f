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
from dcpkit.errors import InvalidArgument, InvalidType, MulticastDisabled, PeerError

from _threadgroup import run_group

KILL = [name for name, _ in mc.KILL_SWITCHES]

# A value that is no spelling of the guard: the decision raises InvalidArgument once it reads it.
BAD = "bad"

# Values tried for each variable, with whether the value forbids multicast, or BAD (independent
# table, written from the design notes and NOTE [dcpkit multicast guard], not from the code).
NCCL_VALUES = {
    None: False,
    "": False,
    "0": True,
    "1": False,
    "2": False,
    "off": True,
    "bogus": BAD,
    "true": BAD,  # NCCL reads a word as 0 (NVLS off): refused rather than read as on
}
DISABLE_VALUES = {
    None: False,
    "": False,
    "1": True,
    "0": False,
    "true": True,
    "no": False,
    "1_0": BAD,
}
OPT_IN_VALUES = {None: False, "0": False, "1": True, "yes": True, "maybe": BAD}


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

        opted = opt_in if opt_in is not None else OPT_IN_VALUES[opt_var]
        senses = [
            (NCCL_VALUES if name == "NCCL_NVLS_ENABLE" else DISABLE_VALUES)[v]
            for name, v in zip(KILL, values)
        ]
        forbidding = [name for name, f in zip(KILL, senses) if f is True]
        unreadable = [name for name, f in zip(KILL, senses) if f is BAD]
        case = f"opt_in={opt_in} env={env} device_supported={dev_ok}"
        # The opt-in variable is read only for opt_in=None, the disabling ones once opted in.
        if opted is BAD or (opted and unreadable):
            with pytest.raises(InvalidArgument) as e:
                mc.multicast_decision(opt_in, env, device)
            for name in [mc.OPT_IN_VARIABLE] if opted is BAD else unreadable:
                assert f"{name} " in str(e.value), f"{case}: {e.value}"
            assert not calls, case
            count += 1
            continue
        got, reason = mc.multicast_decision(opt_in, env, device)
        expected = bool(opted and not forbidding and dev_ok)
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
        ("00", True),
        ("1", False),
        ("2", False),
        (" 01 ", False),
        ("", False),
        ("  ", False),
    ],
)
def test_nccl_nvls_enable_spellings(value, forbids):
    assert bool(mc.kill_switches_set({"NCCL_NVLS_ENABLE": value})) is forbids


@pytest.mark.parametrize("value", ["true", "True", "yes", "on", "y", "t"])
def test_nccl_nvls_enable_true_words_are_refused(value):
    """NCCL reads NCCL_NVLS_ENABLE with strtoll, so a word is 0 there (NVLS off): a true word
    is refused instead of read as on (dcpkit would use multicast where NCCL does not)."""
    with pytest.raises(InvalidArgument, match="NCCL_NVLS_ENABLE must be written as an integer"):
        mc.kill_switches_set({"NCCL_NVLS_ENABLE": value})
    assert mc.kill_switches_set({"NVSHMEM_DISABLE_NVLS": value})  # its own reader takes words


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
        (" \t", False),
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
    falsy = ("0", "false", "no", "off", "n", "f", "")
    for w in truthy + falsy:
        assert f'"{w}"' in doc, w
    raw = value.strip().lower()
    if raw not in truthy + falsy:
        with pytest.raises(InvalidArgument, match=mc.OPT_IN_VARIABLE):
            mc.multicast_decision(None, {mc.OPT_IN_VARIABLE: value}, True)
        return
    ok, reason = mc.multicast_decision(None, {mc.OPT_IN_VARIABLE: value}, True)
    assert ok is (raw in truthy), (value, reason)


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


# Values that are no spelling of the guard: digit separators and signs that int() takes, digits
# and letters of other scripts (Arabic-Indic five and one, full-width "true", the Kelvin sign
# that lower() turns into "k"), a no-break space, a zero-width space, unknown words.
UNREADABLE = [
    "1_0",
    "\u0665",
    "\u0661",
    "+1",
    "-1",
    "0x1",
    "1.0",
    "\uff54\uff52\uff55\uff45",
    "\u212a",
    "\xa01",
    "on\u200b",
    "maybe",
    "enable",
    "-",
]


@pytest.mark.parametrize("value", UNREADABLE)
def test_unreadable_opt_in_raises_naming_the_variable_and_value(value):
    with pytest.raises(InvalidArgument) as e:
        mc.multicast_decision(None, {mc.OPT_IN_VARIABLE: value}, True)
    assert f"{mc.OPT_IN_VARIABLE} must be" in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize("name", KILL)
@pytest.mark.parametrize("value", UNREADABLE)
def test_unreadable_disabling_variable_raises_naming_it(name, value):
    """Opted in by either route, a disabling variable the guard cannot read is an error, never
    a yes; so is it for kill_switches_set, which every other reader of the variables uses."""
    for opt_in, env in ((True, {}), (None, {mc.OPT_IN_VARIABLE: "1"})):
        with pytest.raises(InvalidArgument) as e:
            mc.multicast_decision(opt_in, {**env, name: value}, True)
        assert f"{name} must be" in str(e.value) and repr(value) in str(e.value)
    with pytest.raises(InvalidArgument, match=name):
        mc.kill_switches_set({name: value})


def test_every_unreadable_disabling_variable_is_named():
    env = {"NCCL_NVLS_ENABLE": "1_0", "NVSHMEM_DISABLE_NVLS": "1", "DCPKIT_DISABLE_MULTICAST": "x"}
    with pytest.raises(InvalidArgument) as e:
        mc.kill_switches_set(env, "SymmetricHeap")
    msg = str(e.value)
    assert msg.startswith("SymmetricHeap: NCCL_NVLS_ENABLE and DCPKIT_DISABLE_MULTICAST must each")
    assert "'1_0' and 'x'" in msg and "NVSHMEM_DISABLE_NVLS" not in msg


def test_unread_variables_do_not_raise():
    """multicast=False reads no variable; multicast=True does not read DCPKIT_MULTICAST; a
    refusal by DCPKIT_MULTICAST reads no disabling variable."""
    bad = {mc.OPT_IN_VARIABLE: "1_0", **dict.fromkeys(KILL, "1_0")}
    assert mc.multicast_decision(False, bad, True)[0] is False
    assert mc.multicast_decision(None, {**bad, mc.OPT_IN_VARIABLE: "0"}, True)[0] is False
    with pytest.raises(InvalidArgument, match="NCCL_NVLS_ENABLE"):
        mc.multicast_decision(True, bad, True)


@pytest.mark.parametrize("value", ["1_0", "\u0665", "maybe"])
def test_multicast_object_refuses_an_unreadable_variable_before_any_driver_call(
    guard_env, no_driver, value
):
    guard_env({"DCPKIT_DISABLE_MULTICAST": value})
    with pytest.raises(InvalidArgument, match="MulticastObject: DCPKIT_DISABLE_MULTICAST must"):
        mc.MulticastObject(Communicator.single(), 2 << 20, 0, mem_handle=object())
    with pytest.raises(InvalidArgument, match="multicast_granularity: DCPKIT_DISABLE_MULTICAST"):
        mc.multicast_granularity(2, 0, "posix_fd")
    assert no_driver.touched == []


def test_unreadable_variable_on_one_rank_fails_every_rank(guard_env, no_driver):
    """Rank 1 alone has NCCL_NVLS_ENABLE=1_0: it raises InvalidArgument, the others PeerError
    naming it, and nobody waits; no rank reaches the driver."""

    def body(comm):
        guard_env({"NCCL_NVLS_ENABLE": "1_0"} if comm.rank == 1 else {})
        mc.MulticastObject(comm, 2 << 20, 0, mem_handle=object())

    res = run_group(3, body)
    kinds = [type(v) for _, v in res]
    assert kinds == [PeerError, InvalidArgument, PeerError], res
    assert all("NCCL_NVLS_ENABLE" in str(v) for _, v in res), res
    assert no_driver.touched == []


def test_agree_multicast_runs_a_callable_decision_inside_the_exchange():
    """A decision that raises on one rank (an unreadable DCPKIT_MULTICAST) fails every rank,
    instead of leaving the others in the allgather; decisions that do not raise are agreed."""

    def body(comm):
        env = {mc.OPT_IN_VARIABLE: "1_0" if comm.rank == 2 else "1"}
        return mc.agree_multicast(comm, lambda: mc.multicast_decision(None, env, True))

    res = run_group(3, body)
    kinds = [type(v) for _, v in res]
    assert kinds == [PeerError, PeerError, InvalidArgument], res
    assert "rank 2" in str(res[0][1]) and "'1_0'" in str(res[0][1]), res

    def agreed(comm):
        return mc.agree_multicast(comm, lambda: (comm.rank != 1, f"why-{comm.rank}"))

    res = run_group(3, agreed)
    assert [kind for kind, _ in res] == ["ok"] * 3, res
    ok, reason = res[0][1]
    assert ok is False and "rank(s) [1]" in reason and "why-1" in reason
    assert len({value for _, value in res}) == 1
