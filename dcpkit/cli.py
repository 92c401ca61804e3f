"""The ``dcpkit`` command (also ``python -m dcpkit``).

Subcommands::

    dcpkit info [--json]        versions, GPUs, P2P matrix, multicast decision (no GPU needed)
    dcpkit demo [...]           the three ops on random inputs, checked against the references
    dcpkit bench [...]          the benchmark harness (table, JSON, PNG)

``demo`` and ``bench`` start one process per GPU: run them under ``mpirun -np N``. Their
modules (``dcpkit.demo``, ``dcpkit.bench``) are imported only when asked for, so ``info`` works
on a machine without CuPy, MPI or a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .errors import DcpkitError, MissingDependency

__all__ = ["main", "CommandParser", "file_path", "output_file", "output_file_problem"]


class CommandParser(argparse.ArgumentParser):
    """The argument parser of a subcommand: a usage error is one line on stderr naming the
    argument, ``<prog>: <message> (see <prog> --help)``, and exit status 2 (no usage block)."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        sys.stderr.write(
            f"{self.prog}: {message}{self._dash_hint(message)} (see {self.prog} --help)\n"
        )
        sys.exit(2)

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
