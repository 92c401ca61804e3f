"""File-descriptor exchange over abstract AF_UNIX sockets (dcpkit/_fdpass.py), on the CPU.

Real descriptors (memfds) move between threads of this process and between the processes of
``mpiexec -n 3`` jobs, two jobs at once; missing peers give a clear error within the deadline.
"""

import json
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dcpkit import _fdpass
from dcpkit.errors import FdExchangeError, InvalidArgument

WORKER = Path(__file__).resolve().parent / "mpi_scripts" / "fdpass_worker.py"


def _memfd(text):
    fd = os.memfd_create("dcpkit-test")
    os.write(fd, text.encode())
    return fd


def _read(fd):
    return os.pread(fd, 4096, 0).decode()


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _run_ranks(world, fn):
    """fn(rank) on `world` threads; returns per-rank ("ok", value) / ("err", exc)."""
    out = [None] * world

    def body(r):
        try:
            out[r] = ("ok", fn(r))
        except BaseException as e:  # noqa: BLE001
            out[r] = ("err", e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(not t.is_alive() for t in threads), "a rank hung"
    return out


def _exchange_and_read(token, tag, world, senders=None):
    def fn(r):
        fd = _memfd(f"{token} from {r}") if senders is None or r in senders else None
        try:
            got = _fdpass.exchange_fds(token, tag, r, world, fd, senders=senders, timeout_s=20)
        finally:
            if fd is not None:
                os.close(fd)
        seen = {}
        for s, rfd in enumerate(got):
            if rfd is not None:
                seen[s] = _read(rfd)
                os.close(rfd)
        return seen

    return _run_ranks(world, fn)


def _token():
    return os.urandom(8).hex()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_gets_every_peers_descriptor(world):
    before = _open_fds()
    tok = _token()
    res = _exchange_and_read(tok, "heap0", world)
    for r, (kind, seen) in enumerate(res):
        assert kind == "ok", f"rank {r}: {seen!r}"
        assert seen == {s: f"{tok} from {s}" for s in range(world) if s != r}, f"rank {r}: {seen}"
    assert _open_fds() == before, "descriptors leaked"


@pytest.mark.timeout(60)
def test_broadcast_from_rank_0():
    tok = _token()
    res = _exchange_and_read(tok, "mc", 4, senders=[0])
    assert res[0] == ("ok", {})
    for r in range(1, 4):
        assert res[r] == ("ok", {0: f"{tok} from 0"}), f"rank {r}: {res[r]}"


@pytest.mark.timeout(60)
def test_two_groups_at_once_with_the_same_tag_do_not_meet():
    """Two jobs (tokens) on one host, both using tag 'heap0' at the same time."""
    toks = [_token(), _token()]
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(_exchange_and_read, t, "heap0", 3) for t in toks]
        results = [f.result() for f in futs]
    for tok, res in zip(toks, results):
        for r, (kind, seen) in enumerate(res):
            assert kind == "ok", f"job {tok} rank {r}: {seen!r}"
            assert seen == {s: f"{tok} from {s}" for s in range(3) if s != r}


def test_socket_names_are_per_job_tag_and_rank():
    a = _fdpass.socket_name("abc123", "heap0", 0)
    assert a.startswith(b"\0dcpkit.")
    assert (
        len(
            {
                a,
                _fdpass.socket_name("abc124", "heap0", 0),
                _fdpass.socket_name("abc123", "heap1", 0),
                _fdpass.socket_name("abc123", "heap0", 1),
            }
        )
        == 4
    )


@pytest.mark.timeout(30)
def test_a_taken_name_is_an_error_not_a_mixup():
    tok = _token()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(_fdpass.socket_name(tok, "heap0", 1))
    try:
        fd = _memfd("x")
        with pytest.raises(FdExchangeError, match="already taken"):
            _fdpass.exchange_fds(tok, "heap0", 1, 2, fd, timeout_s=2)
        os.close(fd)
    finally:
        squatter.close()


@pytest.mark.timeout(30)
def test_missing_peer_is_a_clear_error_within_the_deadline():
    before = _open_fds()
    fd = _memfd("lonely")
    with pytest.raises(FdExchangeError, match=r"peer rank 1 did not listen .* within 0.5 s"):
        _fdpass.exchange_fds(_token(), "heap0", 0, 3, fd, timeout_s=0.5)
    os.close(fd)
    assert _open_fds() == before


@pytest.mark.timeout(30)
def test_missing_sender_is_a_clear_error_within_the_deadline():
    with pytest.raises(FdExchangeError, match=r"no descriptor from peer rank\(s\) \[0\]"):
        _fdpass.exchange_fds(_token(), "mc", 1, 2, None, senders=[0], timeout_s=0.5)


@pytest.mark.timeout(30)
def test_sender_whose_receiver_dies_gets_an_error():
    """Rank 1 accepts the connection and closes it without acknowledging."""
    tok = _token()
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(_fdpass.socket_name(tok, "t", 1))
    lst.listen(4)

    def rude_receiver():
        conn, _ = lst.accept()
        conn.close()

    t = threading.Thread(target=rude_receiver, daemon=True)
    t.start()
    fd = _memfd("x")
    try:
        with pytest.raises(FdExchangeError, match="peer rank 1"):
            _fdpass.exchange_fds(tok, "t", 0, 2, fd, senders=[0], timeout_s=5)
    finally:
        os.close(fd)
        t.join(5)
        lst.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(token="bad token", tag="t", rank=0, world_size=2, fd=0), "token"),
        (dict(token="abc", tag="t/x", rank=0, world_size=2, fd=0), "tag"),
        (dict(token="abc", tag="t", rank=2, world_size=2, fd=0), "rank"),
        (dict(token="abc", tag="t", rank=0, world_size=0, fd=0), "world_size"),
        (dict(token="abc", tag="t", rank=0, world_size=2, fd=None), "fd"),
        (dict(token="abc", tag="t", rank=0, world_size=2, fd=0, timeout_s=0), "timeout_s"),
        (dict(token="abc", tag="t", rank=0, world_size=2, fd=0, senders=[5]), "senders"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        _fdpass.exchange_fds(
            kwargs.pop("token"),
            kwargs.pop("tag"),
            kwargs.pop("rank"),
            kwargs.pop("world_size"),
            kwargs.pop("fd"),
            **kwargs,
        )


@pytest.mark.timeout(400)
def test_three_processes_two_jobs_at_once(mpi_launcher, run_cmd, tmp_path):
    """Two `mpiexec -n 3` jobs started together; each passes memfds between its processes."""
    outdirs = [tmp_path / "job0", tmp_path / "job1"]
    for d in outdirs:
        d.mkdir()
    cmds = [mpi_launcher.command(3, sys.executable, str(WORKER), str(d), "3") for d in outdirs]
    with ThreadPoolExecutor(2) as ex:
        procs = list(ex.map(lambda c: run_cmd(c, timeout=180), cmds))
    tokens = []
    for j, (d, proc) in enumerate(zip(outdirs, procs)):
        detail = f"\n--- job {j} exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert proc.returncode == 0, detail
        res = [json.loads((d / f"rank{r}.json").read_text()) for r in range(3)]
        for r, x in enumerate(res):
            assert x["rank"] == r and x["world_size"] == 3, detail
            for k, rnd in enumerate(x["rounds"]):
                want = {
                    str(s): f"job {rnd['token']} rank {s} round {k}" for s in range(3) if s != r
                }
                assert rnd["seen"] == want, f"job {j} rank {r} round {k}: {rnd}" + detail
                assert rnd["none_at"] == [r]
                tokens.append(rnd["token"])
            b = x["broadcast"]
            assert b["value"] == (None if r == 0 else f"broadcast {b['token']}"), detail
            assert x["fds_after"] == x["fds_before"], f"job {j} rank {r} leaked descriptors"
    # Every round of both jobs had its own token (3 ranks agree on each).
    assert len(set(tokens)) == 2 * 3
