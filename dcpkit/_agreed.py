"""How the ranks of an MPI job agree on their command lines before any collective (NOTE
[dcpkit agreed parse] in dcpkit/cli.py): every rank's outcome is gathered, and one line and
one exit status follow from them."""

from __future__ import annotations

import os

__all__ = [
    "gather_outcomes",
    "agreed_exit",
    "programs_line",
    "differing_line",
    "shown_modes",
    "ranks_text",
    "settle",
]


#: Seconds every rank of a job has to reach the agreement (NOTE [dcpkit start watchdog]).
START_TIMEOUT_S = 120.0
#: Seconds rank 1's watchdog waits beyond rank 0's (the others' twice that), so that rank 0's
#: line, or else rank 1's, is written before the launcher tears the job down.
START_GRACE_S = 5.0

# NOTE [dcpkit start watchdog]
# ----------------------------
# A rank that never reaches the agreement (another program on one rank of an MPMD line, a
# mistyped script path, an import that fails on one host) leaves the others waiting in
# MPI_Init or in the agreement's allgather, and some launchers (MPICH's Hydra) do not end the
# job when that rank exits. Neither wait can be bounded from Python: a timer thread or a signal
# handler does not run while MPI blocks in C. So every rank that agrees first starts a small
# watchdog process (spawned, not forked: a multi-threaded parent is safe) that waits on a pipe:
# the rank closes it once the allgather returned (or by dying), and the watchdog exits. After
# START_TIMEOUT_S without that, the watchdog of the launcher's rank 0 prints one line, lets go
# of the launcher's stderr, and ends its rank (SIGTERM, then SIGKILL if it is still there after
# 3 s); the launcher then ends the job. Rank 1's watchdog does the same START_GRACE_S later,
# the others' twice that later: were they first, the launcher could kill rank 0 and its
# watchdog before the line. Where rank 0 is the rank that never came (a program that keeps
# running, or an error of its own), the job is still there after the first grace, and rank 1's
# watchdog prints the line, naming rank 0 as the rank that did not end it; the others' stay
# silent, so a job shows one line (none only where ranks 0 and 1 both never came). The
# watchdogs ignore SIGINT: a Ctrl-C ends the ranks, and so their pipes.

_WATCHDOG = """
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, seconds, line = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    if line:
        sys.stderr.write(line + "\\n")
        sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the launcher's stream: not held open
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(parent, sig)
        except OSError:
            break
        end = time.monotonic() + 3.0
        while os.getppid() == parent and time.monotonic() < end:
            time.sleep(0.02)
        if os.getppid() != parent:
            break
"""


def _start_watchdog(
    prog: str, rank: int | None, pid: int | None = None, seconds: float | None = None
):
    """The watchdog process of NOTE [dcpkit start watchdog] for process ``pid`` (default: this
    one) of launcher rank ``rank`` (None: no launcher, the leader) after ``seconds`` (default
    :data:`START_TIMEOUT_S`): rank 0's prints its line then, rank 1's its own line
    :data:`START_GRACE_S` later, the others' nothing, twice that later. None where it cannot
    start (the agreement then waits as it did before)."""
    import subprocess
    import sys

    seconds = START_TIMEOUT_S if seconds is None else float(seconds)
    leader = rank in (None, 0)
    # rank 0's first, then rank 1's, then the others' (each line before any other rank ends)
    wait = seconds if leader else seconds + (1 if rank == 1 else 2) * START_GRACE_S
    what = f"not every rank of the job reached its start within {seconds:g} s"
    if leader:
        line = f"{prog}: {what} (a rank runs another program, or stopped before it): ending the job"
    elif rank == 1:
        line = (
            f"{prog}: rank 1: {what}, and rank 0 did not end the job {START_GRACE_S:g} s later "
            "(rank 0 runs another program, or stopped before it): ending the job"
        )
    else:
        line = ""
    pid = os.getpid() if pid is None else int(pid)
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(pid), str(wait), line],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:
        return None


def _stop_watchdog(proc) -> None:
    """End of file on the watchdog's pipe: it exits as soon as it reads it (maybe still
    starting up); a daemon thread reaps it, so the rank does not wait for that."""
    if proc is None:
        return
    import threading

    try:
        proc.stdin.close()
    except OSError:  # a watchdog that is gone already
        pass
    threading.Thread(target=proc.wait, name="dcpkit-watchdog-reaper", daemon=True).start()


def gather_outcomes(outcome, rank: int | None = None):
    """Every rank's parse outcome (a list indexed by rank), or None where the ranks cannot
    agree: MPI does not start, or its world is not the launcher's. ``outcome`` starts with the
    program's name; ``rank`` is this process's launcher rank (``dcpkit.cli.launcher_rank``, None
    outside a launcher). Bounded by the start watchdog (NOTE [dcpkit start watchdog])."""
    import sys

    prog = outcome[0] if isinstance(outcome, tuple) and outcome else "dcpkit"
    # Not once MPI is up (a later agreement of the same process, after the first one passed):
    # a process is not spawned from a rank whose MPI may have pinned memory.
    watchdog = None if "mpi4py.MPI" in sys.modules else _start_watchdog(str(prog), rank)
    try:
        from .comm import import_mpi, launcher_world_size_mismatch

        MPI = import_mpi()
        if launcher_world_size_mismatch(os.environ, MPI) is not None:
            return None
        return MPI.COMM_WORLD.allgather(outcome)
    except Exception:  # noqa: BLE001 - no MPI: the command says so itself later, or never runs
        return None
    finally:
        _stop_watchdog(watchdog)


def agreed_exit(prog: str, outcomes: list) -> tuple[str | None, int | None]:
    """(the line rank 0 prints, the status every rank exits with) from every rank's parse
    outcome; status None: every rank parsed, go on."""
    if all(o is None for o in outcomes):
        return None, None
    n = len(outcomes)
    errors: dict[str, list[int]] = {}
    for r, o in enumerate(outcomes):
        if o is not None and o[1] is not None:
            errors.setdefault(o[1], []).append(r)
    if errors:
        line, ranks = next(iter(errors.items()))
        if len(errors) == 1 and len(ranks) == n:
            return line, 2  # every rank: the usual one line
        rest = line[len(prog) + 2 :] if line.startswith(prog + ": ") else line
        rest = rest.splitlines()[0] if rest.strip() else rest  # one line (a usage text: its first)
        more = sum(len(v) for v in errors.values()) - len(ranks)
        tail = f" (and {more} other rank(s) with another error)" if more else ""
        return f"{prog}: on rank(s) {ranks_text(ranks)} of {n}: {rest}{tail}", 2
    codes = {o[0] for o in outcomes if o is not None}
    if len(codes) == 1 and all(o is not None for o in outcomes):
        return None, codes.pop()  # --help or --version on every rank
    asked = [r for r, o in enumerate(outcomes) if o is not None]
    return (
        f"{prog}: --help or --version on rank(s) {ranks_text(asked)} of {n} only: give every "
        f"rank the same arguments"
    ), 2


def programs_line(prog: str, gathered: list) -> str | None:
    """Where the ranks' first exchange came from different programs (the dispatcher on one,
    a subcommand's or a script's own parser on another: ``(program, outcome, key)`` each), the
    line naming them; None where it is one program."""
    names = [
        f"dcpkit {g[2]}" if g[0] == "dcpkit" else f"{g[0]} (started directly)" for g in gathered
    ]
    if len({g[0] for g in gathered}) <= 1:
        return None
    return differing_line(prog, names, "run different programs")


def differing_line(prog: str, keys: list, what: str) -> str | None:
    """The line naming the ranks of each ``keys`` value (a command, a mode), or None if equal."""
    groups: dict = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    if len(groups) <= 1:
        return None
    parts = "; ".join(f"rank(s) {ranks_text(rs)}: {k}" for k, rs in groups.items())
    return f"{prog}: the ranks {what} ({parts}): give every rank the same command line"


def ranks_text(ranks: list[int]) -> str:
    """``ranks`` (ints) as a line names them: the first eight, then how many more."""
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _shown_value(v) -> str:
    if v is None:
        return "(default)"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def shown_modes(keys: list) -> list:
    """The ranks' modes as the line shows them. A mode is a str, or ``(label, {option: value})``
    (a run and the options every rank must give alike): those show the label and only the
    options that differ between the ranks, so that equal modes show alike."""
    full = [isinstance(k, tuple) and len(k) == 2 and isinstance(k[1], dict) for k in keys]
    labels = [str(k[0]) if f else str(k) for k, f in zip(keys, full)]
    if len(set(labels)) > 1 or not all(full):
        return labels
    names = sorted({n for _, d in keys for n in d})
    differ = [n for n in names if len({repr(d.get(n)) for _, d in keys}) > 1]
    return [
        label
        + (
            " with " + " ".join(f"--{n.replace('_', '-')} {_shown_value(d.get(n))}" for n in differ)
            if differ
            else ""
        )
        for label, d in keys
    ]


def settle(prog: str, gathered: list, what: str) -> tuple[str | None, int | None]:
    """(the line rank 0 prints, the status every rank exits with; None: go on) from every
    rank's ``(program, outcome, key)``: different programs first; then, where the ranks are
    alike in outcome (all parsed, or all asked for --help / --version), different keys (the
    command, the mode: ``what`` they differ in); then the outcomes (:func:`agreed_exit`)."""
    line = programs_line(prog, gathered)
    if line is not None:
        return line, 2
    outcomes = [g[1] for g in gathered]
    if all(o is None for o in outcomes) or all(o is not None and o[1] is None for o in outcomes):
        line = differing_line(prog, shown_modes([g[2] for g in gathered]), what)
        if line is not None:
            return line, 2
    return agreed_exit(prog, outcomes)
