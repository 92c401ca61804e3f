"""The ``dcpkit`` command (also ``python -m dcpkit``).

Subcommands::

    dcpkit info [--json]        versions, GPUs, P2P matrix, multicast decision (no GPU needed)
    dcpkit demo [...]           the three ops on random inputs, checked against the references
    dcpkit bench [...]          the benchmark harness (table, JSON, PNG)

``demo`` and ``bench`` start one process per GPU: run them under ``mpirun -np N``. Their
modules (``dcpkit.demo``, ``dcpkit.bench``) are imported only when asked for, so ``info`` works
on a machine without CuPy, MPI or a GPU.

Under an MPI launcher every rank parses the same arguments; a usage error, ``--help`` and the
other lines a command prints before its ranks share a communicator come from the launcher's
rank 0 only (:func:`job_leader`), and every rank exits with the same status.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from ._checks import (
    DEFAULT_TIMEOUT_MS,
    MAX_TIMEOUT_MS,
    MIN_TIMEOUT_MS,
    TIMEOUT_ENV,
    TIMEOUT_RANGE,
    default_timeout_ms,
)
from .errors import DcpkitError, InvalidArgument, MissingDependency

__all__ = [
    "main",
    "CommandParser",
    "file_path",
    "output_file",
    "output_file_problem",
    "milliseconds",
    "launcher_rank",
    "job_leader",
]

#: Variables in which MPI launchers publish each process's rank (Open MPI, PMIx, PMI-1/2
#: launchers such as MPICH's hydra and Intel MPI).
_LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launcher_rank(env=None) -> int | None:
    """This process's rank as an MPI launcher published it, or None outside a launcher. Reads
    the environment only (no MPI initialisation)."""
    env = os.environ if env is None else env
    for var in _LAUNCHER_RANK_VARS:
        try:
            return int(env[var])
        except (KeyError, ValueError):
            continue
    return None


def job_leader(env=None) -> bool:
    """Whether this process prints the lines of the whole job: True outside a launcher and on
    the launcher's rank 0. Reads the environment only, so it holds before MPI is set up (and
    where MPI cannot be set up at all)."""
    return launcher_rank(env) in (None, 0)


def milliseconds(text: str) -> float:
    """An argparse ``type=`` for a wait deadline: a number of milliseconds in [0.001, 3600000]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not MIN_TIMEOUT_MS <= value <= MAX_TIMEOUT_MS:  # NaN and inf fail too
        raise argparse.ArgumentTypeError(
            f"must be a number of milliseconds in {TIMEOUT_RANGE} (got {text!r})"
        )
    return value


class CommandParser(argparse.ArgumentParser):
    """The argument parser of a subcommand: a usage error is one line on stderr naming the
    argument, ``<prog>: <message> (see <prog> --help)``, and exit status 2 (no usage block).

    Under an MPI launcher only the launcher's rank 0 prints (the error, ``--help``); every
    rank exits with the same status. :meth:`add_timeout_option` adds ``--timeout-ms`` with
    the library's ``DCPKIT_TIMEOUT_MS`` as its default, resolved and checked when parsed.
    """

    _timeout_fallback_ms: float | None = None

    def __init__(self, *args, help_command: str | None = None, **kwargs):
        """``help_command``: the command the error line points to, ``<help_command> --help``
        (default: ``prog``); the other arguments are argparse's."""
        super().__init__(*args, **kwargs)
        self.help_command = help_command or self.prog

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        ns, rest = super().parse_known_args(args, namespace)
        if self._timeout_fallback_ms is not None:
            ns.timeout_ms, ns.timeout_source = self._resolve_timeout(ns.timeout_ms)
        return ns, rest

    def add_timeout_option(self, waits: str, *, fallback_ms: float = DEFAULT_TIMEOUT_MS) -> None:
        """Add ``--timeout-ms``, the deadline of ``waits`` (help text), in milliseconds.

        Parsing sets ``timeout_ms`` (a float) and ``timeout_source`` (``"--timeout-ms"``,
        ``"DCPKIT_TIMEOUT_MS"`` or ``"default"``). Without ``--timeout-ms`` the value is the
        library's: ``DCPKIT_TIMEOUT_MS`` if set, else ``fallback_ms`` (the ops' own default
        unless the command has another). A set ``DCPKIT_TIMEOUT_MS`` is checked when the
        arguments are parsed, also with ``--timeout-ms`` (an op built without a deadline would
        refuse it): a bad value is a usage error naming the variable, before any MPI or GPU
        work.
        """
        self._timeout_fallback_ms = float(fallback_ms)
        self.add_argument(
            "--timeout-ms",
            type=milliseconds,
            default=None,
            metavar="MS",
            help=f"deadline of {waits}, in {TIMEOUT_RANGE} ms (default: {TIMEOUT_ENV} if set, "
            f"else {fallback_ms:g})",
        )

    def timeout_from_env(self) -> float | None:
        """``DCPKIT_TIMEOUT_MS`` in milliseconds, None where it is unset; a bad value is a
        usage error naming the variable and its range (one line, exit status 2)."""
        raw = os.environ.get(TIMEOUT_ENV, "")
        if not raw:
            return None
        try:
            return default_timeout_ms(self.prog)
        except InvalidArgument:
            self.error(
                f"environment variable {TIMEOUT_ENV}: must be a number of milliseconds in "
                f"{TIMEOUT_RANGE} (got {raw!r})"
            )

    def _resolve_timeout(self, given: float | None) -> tuple[float, str]:
        env_ms = self.timeout_from_env()
        if given is not None:
            return given, "--timeout-ms"
        if env_ms is not None:
            return env_ms, TIMEOUT_ENV
        return self._timeout_fallback_ms, "default"

    def error(self, message: str):
        if job_leader():
            sys.stderr.write(
                f"{self.prog}: {message}{self._dash_hint(message)} "
                f"(see {self.help_command} --help)\n"
            )
        sys.exit(2)

    def _print_message(self, message, file=None):
        if job_leader():  # --help, usage: once per job
            super()._print_message(message, file)

    def _dash_hint(self, message: str) -> str:
        """For "expected one argument" where the value given starts with '-' and a digit (argparse
        reads ``--tokens -1,8`` as two options): how to pass such a value."""
        m = re.match(r"argument ([^:/ ]+)(?:/\S+)?: expected one argument$", message)
        argv = getattr(self, "_argv", [])
        if m is None or m.group(1) not in argv:
            return ""
        i = argv.index(m.group(1))
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if not re.match(r"-[0-9.]", nxt):
            return ""
        return f" (got {nxt!r}, read as an option: write {m.group(1)}={nxt})"


def file_path(text: str) -> str:
    """An argparse ``type=`` for a file to write (``--json``, ``--plot``, ...): refuses the
    empty path, which would otherwise read as "no file" and end the run without it."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a file (got {text!r})")
    return text


def output_file_problem(path: str, *, folder_must_exist: bool = True) -> str | None:
    """Why a file cannot be written at ``path`` (``"<path> is a directory"``, ...), or None.

    With ``folder_must_exist=False`` a missing folder is accepted (the caller creates it), but
    not a path below an existing file.
    """
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        return f"{path} is a directory"
    folder = os.path.dirname(os.path.abspath(path))
    probe = folder
    if not folder_must_exist:
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "is below a file" if os.path.exists(probe) else "is in a folder that does not exist"
        return f"{path} {what} ({probe})"
    if not os.access(probe, os.W_OK):
        return f"{path} is in a folder that is not writable ({probe})"
    return None


def output_file(*, folder_must_exist: bool = True):
    """An argparse ``type=`` for a file to write, checked when parsed: :func:`file_path`, then
    :func:`output_file_problem` (not a directory; its folder exists, or can be created when
    ``folder_must_exist=False``, and is writable)."""

    def parse(text: str) -> str:
        path = file_path(text)
        why = output_file_problem(path, folder_must_exist=folder_must_exist)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return path

    return parse


_COMMANDS = {
    "info": ("dcpkit.info", "print versions, GPUs, P2P access and the multicast decision"),
    "demo": ("dcpkit.demo", "run the three ops once and check them (under mpirun -np N)"),
    "bench": ("dcpkit.bench", "benchmark the ops against NCCL (under mpirun -np N)"),
}


def _usage() -> str:
    lines = [
        "usage: dcpkit {info,demo,bench} [options]   (or: python -m dcpkit ...)",
        "       dcpkit --version",
        "",
        "dcpkit: low-latency multi-GPU collectives for decode context parallelism.",
        "",
        "commands:",
    ]
    lines += [f"  {k:<7}{v[1]}" for k, v in _COMMANDS.items()]
    lines += ["", "Run 'dcpkit <command> --help' for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit status.

    Returns 2 when the subcommand's module is not part of this installation, an optional
    dependency it needs is missing (the message names the extra to install), or the
    subcommand stops on a dcpkit error it did not handle itself (a launcher of another MPI
    library, say): one line ``dcpkit <command>: <error>`` on stderr, no traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"dcpkit {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, args = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(
            f"dcpkit: unknown command {command!r}: must be one of {', '.join(_COMMANDS)} "
            f"(see dcpkit --help)",
            file=sys.stderr,
        )
        return 2
    mod_name = _COMMANDS[command][0]
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name != mod_name:
            raise
        print(
            f"dcpkit {command}: {mod_name} is not available in this installation", file=sys.stderr
        )
        return 2
    except MissingDependency as e:
        print(f"dcpkit {command}: {e}", file=sys.stderr)
        return 2
    try:
        rc = mod.main(args)
    except DcpkitError as e:  # MissingDependency included
        print(f"dcpkit {command}: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)
