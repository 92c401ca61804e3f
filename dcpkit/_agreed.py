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


def gather_outcomes(outcome):
    """Every rank's parse outcome (a list indexed by rank), or None where the ranks cannot
    agree: MPI does not start, or its world is not the launcher's."""
    try:
        from .comm import import_mpi, launcher_world_size_mismatch

        MPI = import_mpi()
        if launcher_world_size_mismatch(os.environ, MPI) is not None:
            return None
        return MPI.COMM_WORLD.allgather(outcome)
    except Exception:  # noqa: BLE001 - no MPI: the command says so itself later, or never runs
        return None


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
