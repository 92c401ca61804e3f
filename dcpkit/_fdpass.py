"""Pass file descriptors between the processes of one host over abstract ``AF_UNIX`` sockets.

The symmetric heap exports its ``cuMemCreate`` allocation as a POSIX file descriptor; every peer
on the same host needs a copy of that descriptor to import the allocation. A descriptor is a
per-process number, so it cannot travel through MPI or ``torch.distributed``: the kernel has to
duplicate it into the receiving process, which is what ``SCM_RIGHTS`` on a Unix socket does.
(``pidfd_getfd`` would also do it, but it needs ptrace rights that containers deny.)

Protocol of :func:`exchange_fds`, run by every rank of a group at the same time::

    1. every rank that expects a descriptor listens on the abstract socket
       "\\0dcpkit.<token>.<tag>.<rank>"              (<token>: comm.job_token(), random per job)
    2. every sending rank connects to each peer (retrying until the peer listens or the
       deadline passes) and sends one message: a header (magic, token, tag, sender rank)
       with the descriptor attached as SCM_RIGHTS ancillary data
    3. every rank accepts one connection per sender, checks the header and the peer's uid
       (SO_PEERCRED), keeps the descriptor (close-on-exec) and answers one ack byte
    4. every sender reads one ack per peer, then closes its sockets

Sends never wait for the receiver (the kernel queues the message on the not-yet-accepted
connection), so no ordering between ranks can deadlock. Every blocking operation has the
deadline ``timeout_s``: a peer that never shows up gives a clear error, never a hang.

Abstract socket names live in the network namespace and vanish when the socket closes, so no
file is left behind. Names carry the job token, a per-job tag and the rank, so two jobs on one
host, or two heaps of one job, never meet; a collision (the same name bound twice) is an error.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from collections.abc import Iterable

from .errors import FdExchangeError, InvalidArgument

__all__ = ["socket_name", "exchange_fds", "FdExchangeError"]

_MAGIC = b"DCPKFD01"
_HEADER = struct.Struct("<8s32s32si")  # magic, token, tag, sender rank
_ACK = b"A"
_CONNECT_RETRY_MAX_S = 0.05


def _check_word(what: str, value: str) -> bytes:
    if (
        not isinstance(value, str)
        or not value
        or len(value) > 32
        or not all(c.isalnum() or c in "-_" for c in value)
    ):
        raise InvalidArgument(
            f"exchange_fds: {what} must be 1 to 32 characters from [A-Za-z0-9_-] (got {value!r})"
        )
    return value.encode()


def socket_name(token: str, tag: str, rank: int) -> bytes:
    """The abstract socket address on which ``rank`` receives descriptors.

    ``"\\0dcpkit.<token>.<tag>.<rank>"``: unique per job (``token``), per exchange within the job
    (``tag``) and per rank.
    """
    t = _check_word("token", token).decode()
    g = _check_word("tag", tag).decode()
    return f"\0dcpkit.{t}.{g}.{int(rank)}".encode()


def _printable(name: bytes) -> str:
    return "@" + name[1:].decode(errors="replace")


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _connect(name: bytes, deadline: float, what: str) -> socket.socket:
    """Connect to ``name``, retrying while nobody listens there yet, until ``deadline``."""
    delay = 0.001
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        rem = _remaining(deadline)
        if rem <= 0:
            s.close()
            raise TimeoutError
        s.settimeout(rem)
        try:
            s.connect(name)
            return s
        except (ConnectionRefusedError, FileNotFoundError):
            s.close()
        except OSError as e:
            s.close()
            if e.errno not in (errno.EAGAIN, errno.ECONNREFUSED, errno.ENOENT):
                raise FdExchangeError(f"{what}: connect to {_printable(name)} failed: {e}") from e
        if _remaining(deadline) <= 0:
            raise TimeoutError
        time.sleep(min(delay, max(_remaining(deadline), 0.0)))
        delay = min(delay * 2, _CONNECT_RETRY_MAX_S)


def _recv_header_and_fd(conn: socket.socket, deadline: float):
    """Receive one header plus the descriptor attached to it; returns (header bytes, fds)."""
    data = b""
    fds: list[int] = []
    while len(data) < _HEADER.size:
        rem = _remaining(deadline)
        if rem <= 0:
            raise TimeoutError
        conn.settimeout(rem)
        chunk, got, _flags, _addr = socket.recv_fds(
            conn, _HEADER.size - len(data), 4, socket.MSG_CMSG_CLOEXEC
        )
        fds.extend(got)
        if not chunk:
            break
        data += chunk
    return data, fds


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def exchange_fds(
    token: str,
    tag: str,
    rank: int,
    world_size: int,
    fd: int | None,
    *,
    senders: Iterable[int] | None = None,
    timeout_s: float = 60.0,
) -> list[int | None]:
    """Send this rank's descriptor to every peer and receive every sender's descriptor.

    Naive equivalent: ``received = allgather(fd)`` where each entry is a new descriptor of the
    same open file in this process.

    Parameters
    ----------
    token : str
        Equal on every rank of the job and different for every job (``comm.job_token()``).
    tag : str
        Names this exchange within the job (for example ``"heap3"``); equal on every rank.
    rank, world_size : int
        This process's rank and the number of ranks; every rank must be on this host.
    fd : int or None
        The descriptor to send; ignored (may be ``None``) when this rank is not a sender.
    senders : iterable of int, optional
        The ranks that send (default: every rank). ``senders=[0]`` is a broadcast from rank 0.
    timeout_s : float
        Deadline of the whole exchange, in seconds.

    Returns
    -------
    list of (int or None), length ``world_size``
        Entry ``s`` is the descriptor received from sender ``s`` (a new descriptor, owned by the
        caller, close-on-exec); ``None`` for this rank itself and for ranks that do not send.

    Collective
    ----------
    Every rank of the group calls it with the same ``token``, ``tag``, ``world_size`` and
    ``senders``.

    Raises
    ------
    FdExchangeError
        A peer did not connect or answer before the deadline (named in the message), sent a
        malformed message, runs as another user, or the socket name is already taken. Every
        descriptor received so far is closed first.
    InvalidArgument
        Bad arguments.
    """
    op = "exchange_fds"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"{op}: world_size must be an int >= 1 (got {world_size!r})")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgument(f"{op}: rank must lie in [0, {world_size}) (got {rank!r})")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(
            f"{op}: timeout_s must be a positive number of seconds (got {timeout_s!r})"
        )
    send_set = set(range(world_size)) if senders is None else {int(s) for s in senders}
    if not send_set or any(not 0 <= s < world_size for s in send_set):
        raise InvalidArgument(
            f"{op}: senders must be ranks in [0, {world_size}) (got {sorted(send_set)})"
        )
    sending = rank in send_set
    if sending and (isinstance(fd, bool) or not isinstance(fd, int) or fd < 0):
        raise InvalidArgument(f"{op}: fd must be an open file descriptor (got {fd!r})")
    token_b = _check_word("token", token)
    tag_b = _check_word("tag", tag)
    expected = sorted(s for s in send_set if s != rank)
    where = f"{op} (tag {tag}, rank {rank} of {world_size})"

    deadline = time.monotonic() + float(timeout_s)
    received = {}
    listener = None
    outgoing = []
    try:
        if expected:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            name = socket_name(token, tag, rank)
            try:
                listener.bind(name)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise FdExchangeError(
                        f"{where}: socket name {_printable(name)} is already taken: another "
                        f"process uses the same job token and tag (two groups sharing one "
                        f"token?)"
                    ) from e
                raise
            listener.listen(max(world_size, 16))

        if sending:
            header = _HEADER.pack(_MAGIC, token_b, tag_b, rank)
            for peer in range(world_size):
                if peer == rank:
                    continue
                name = socket_name(token, tag, peer)
                try:
                    s = _connect(name, deadline, where)
                except TimeoutError:
                    raise FdExchangeError(
                        f"{where}: peer rank {peer} did not listen on {_printable(name)} within "
                        f"{timeout_s:g} s (is it running, on this host, in the same network "
                        f"namespace? abstract sockets are per network namespace)"
                    ) from None
                outgoing.append((peer, s))
                s.settimeout(max(_remaining(deadline), 1e-3))
                try:
                    socket.send_fds(s, [header], [fd])
                except OSError as e:
                    raise FdExchangeError(
                        f"{where}: sending the descriptor to peer rank {peer} failed: {e}"
                    ) from e

        uid = os.getuid()
        while len(received) < len(expected):
            rem = _remaining(deadline)
            missing = [s for s in expected if s not in received]
            if rem <= 0:
                raise FdExchangeError(
                    f"{where}: no descriptor from peer rank(s) {missing} within {timeout_s:g} s"
                )
            listener.settimeout(rem)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                raise FdExchangeError(
                    f"{where}: no descriptor from peer rank(s) {missing} within {timeout_s:g} s"
                ) from None
            with conn:
                fds: list[int] = []
                try:
                    if _peer_uid(conn) != uid:
                        raise FdExchangeError(
                            f"{where}: rejected a connection from another user "
                            f"(uid {_peer_uid(conn)}, ours {uid})"
                        )
                    try:
                        data, fds = _recv_header_and_fd(conn, deadline)
                    except TimeoutError:
                        raise FdExchangeError(
                            f"{where}: a peer connected but sent no descriptor "
                            f"within {timeout_s:g} s"
                        ) from None
                    if len(data) != _HEADER.size:
                        raise FdExchangeError(
                            f"{where}: short message from a peer "
                            f"({len(data)} of {_HEADER.size} bytes)"
                        )
                    magic, tok, tg, sender = _HEADER.unpack(data)
                    if magic != _MAGIC or tok.rstrip(b"\0") != token_b or tg.rstrip(b"\0") != tag_b:
                        raise FdExchangeError(
                            f"{where}: a message from another job or exchange "
                            f"arrived (token/tag differ)"
                        )
                    if sender not in expected or sender in received:
                        raise FdExchangeError(
                            f"{where}: unexpected or repeated sender rank "
                            f"{sender} (expected {expected})"
                        )
                    if len(fds) != 1:
                        raise FdExchangeError(
                            f"{where}: peer rank {sender} sent {len(fds)} descriptors (expected 1)"
                        )
                    received[sender] = fds.pop()
                    conn.settimeout(max(_remaining(deadline), 1e-3))
                    conn.sendall(_ACK)
                finally:
                    for extra in fds:
                        os.close(extra)

        for peer, s in outgoing:
            s.settimeout(max(_remaining(deadline), 1e-3))
            try:
                ack = s.recv(1)
            except TimeoutError:
                raise FdExchangeError(
                    f"{where}: peer rank {peer} did not acknowledge the "
                    f"descriptor within {timeout_s:g} s"
                ) from None
            except OSError as e:
                raise FdExchangeError(
                    f"{where}: peer rank {peer} dropped the connection without "
                    f"acknowledging the descriptor ({e}; it failed or "
                    f"exited)"
                ) from e
            if ack != _ACK:
                raise FdExchangeError(
                    f"{where}: peer rank {peer} closed the connection without "
                    f"acknowledging the descriptor (it failed or exited)"
                )
    except BaseException:
        for rfd in received.values():
            try:
                os.close(rfd)
            except OSError:
                pass
        raise
    finally:
        for _peer, s in outgoing:
            s.close()
        if listener is not None:
            listener.close()
    return [received.get(s) for s in range(world_size)]
