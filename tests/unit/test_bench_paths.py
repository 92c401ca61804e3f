"""Which paths a bench run takes, and why one is dropped: a malformed guard variable drops the
multicast path as an error the run reports, never silently."""

from __future__ import annotations

import types

import pytest

from dcpkit.bench import factory


@pytest.mark.parametrize(
    "env, allowed, error",
    [
        ({}, False, False),
        ({"DCPKIT_MULTICAST": "0"}, False, False),
        ({"DCPKIT_MULTICAST": "1"}, True, False),
        ({"DCPKIT_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}, False, False),
        ({"DCPKIT_MULTICAST": "maybe"}, False, True),
        ({"DCPKIT_MULTICAST": "1", "NCCL_NVLS_ENABLE": "true"}, False, True),
    ],
)
def test_multicast_allowed_says_why_and_whether_it_is_an_error(env, allowed, error):
    ok, why, is_error = factory.multicast_allowed(env)
    assert (ok, is_error) == (allowed, error)
    assert why  # every answer names its reason
    if error:
        assert "must be" in why


def test_local_paths_names_each_dropped_path(monkeypatch):
    monkeypatch.setenv("DCPKIT_MULTICAST", "maybe")
    ctx = types.SimpleNamespace(cfg={"paths": ["direct", "multicast", "floor"]})
    paths, dropped = factory.local_paths(ctx)
    assert paths == ["direct", "floor"]
    why, error = dropped["multicast"]
    assert error and "DCPKIT_MULTICAST" in why and "'maybe'" in why


def test_a_malformed_guard_variable_is_an_error_of_the_run(monkeypatch):
    from dcpkit.bench import sweep

    monkeypatch.setenv("DCPKIT_MULTICAST", "maybe")
    logged: list[str] = []
    ctx = types.SimpleNamespace(
        cfg={"paths": ["direct", "multicast"]}, errors=[], log=logged.append, meta={}
    )
    monkeypatch.setattr(sweep, "stage", lambda c, what, fn: [fn(), fn()])  # two ranks
    monkeypatch.setattr(sweep, "_gpu_layout", lambda c: None)
    assert sweep._agree_paths(ctx) == ["direct"]
    assert len(ctx.errors) == 1
    assert "path multicast not run on every rank" in ctx.errors[0]
    assert "'maybe'" in ctx.errors[0]
    assert any("path multicast not run on every rank" in m for m in logged)


def test_an_unset_guard_variable_is_logged_not_an_error(monkeypatch):
    from dcpkit.bench import sweep

    monkeypatch.delenv("DCPKIT_MULTICAST", raising=False)
    logged: list[str] = []
    ctx = types.SimpleNamespace(
        cfg={"paths": ["direct", "multicast"]}, errors=[], log=logged.append, meta={}
    )
    monkeypatch.setattr(sweep, "stage", lambda c, what, fn: [fn()])
    monkeypatch.setattr(sweep, "_gpu_layout", lambda c: None)
    assert sweep._agree_paths(ctx) == ["direct"]
    assert ctx.errors == []
    assert any("not opted in" in m for m in logged)
