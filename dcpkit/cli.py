"""The ``dcpkit`` command (also ``python -m dcpkit``).

Subcommands::

    dcpkit info [--json]        versions, GPUs, P2P matrix, multicast decision (no GPU needed)
    dcpkit demo [...]           one MLA decode layer with the three ops, checked against a
                                reference and timed, direct path against NCCL
    dcpkit bench [...]          the benchmark harness (table, JSON, PNG)

``demo`` and ``bench`` start one process per GPU: run them under ``mpirun -np N``. Their
modules (``dcpkit.demo``, ``dcpkit.bench``) are imported only when asked for, so ``info`` works
on a machine without CuPy, MPI or a GPU.

Under an MPI launcher every rank parses the same arguments; a usage error, ``--help``,
``--version`` and the other lines a command prints before its ranks share a communicator come
from the launcher's rank 0 only (:func:`job_leader`), and every rank exits with the same status.

Output piped into a reader that stops early (``dcpkit info | grep -q CuPy``, ``dcpkit --help |
head -1``) ends the command quietly with status 141, 128 + SIGPIPE, as for other command-line
tools (:func:`pipe_safe`), never with a ``BrokenPipeError`` traceback; output that cannot be
written (``dcpkit info > /dev/full``) ends it with one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import re
import signal
import stat
import sys
from collections.abc import Callable, Sequence

from ._agreed import gather_outcomes, settle
from ._checks import (
    DEFAULT_TIMEOUT_MS,
    MAX_TIMEOUT_MS,
    MIN_TIMEOUT_MS,
    TIMEOUT_ENV,
    TIMEOUT_RANGE,
    decimal_float,
    default_timeout_ms,
)
from .errors import DcpkitError, InvalidArgument, MissingDependency

__all__ = [
    "main",
    "CommandParser",
    "file_path",
    "output_file",
    "output_file_problem",
    "file_clash",
    "os_error_text",
    "write_output",
    "write_json",
    "milliseconds",
    "launcher_rank",
    "job_leader",
    "launcher_size",
    "pipe_safe",
    "EXIT_BROKEN_PIPE",
]

#: Exit status when the output's pipe was closed early: 128 + SIGPIPE, as ``yes | head -1``.
EXIT_BROKEN_PIPE = 128 + int(getattr(signal, "SIGPIPE", 13))

#: Where launchers publish each process's rank (Open MPI, PMIx, PMI: hydra, Intel MPI).
_LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launcher_rank(env=None) -> int | None:
    """This process's rank as an MPI launcher published it, or None outside a launcher. Reads
    the environment only (no MPI initialisation)."""
    env = os.environ if env is None else env
    for var in _LAUNCHER_RANK_VARS:
        value = env.get(var, "").strip()
        # ASCII digits (int() would also read other scripts' digits), at most 18 of them (no
        # rank has more; int() refuses more than 4300)
        if value.isascii() and value.isdigit() and len(value) <= 18:
            return int(value)
    return None


def job_leader(env=None) -> bool:
    """Whether this process prints the lines of the whole job: True outside a launcher and on
    the launcher's rank 0. Reads the environment only, so it holds before MPI is set up (and
    where MPI cannot be set up at all)."""
    return launcher_rank(env) in (None, 0)


def _point_at_devnull(stream) -> None:
    """Point the file descriptor under ``stream`` at the null device, so that what is still
    buffered for it (flushed again when the interpreter exits) goes nowhere instead of raising."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stream (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _reader_gone(stream) -> bool:
    """Whether ``stream`` writes to a pipe whose reader has closed it (poll reports an error
    on the write end of such a pipe); False for a stream without a file descriptor."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    import select

    if not hasattr(select, "poll"):  # pragma: no cover - no poll(): take the error as ours
        return True
    p = select.poll()
    p.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))


def _output_fails(stream, err: OSError) -> bool:
    """Whether writing to ``stream`` (stdout or stderr) itself fails as ``err`` did: an empty
    write to its file descriptor raises the same error (``/dev/full``, a terminal that hung up),
    or ``err`` says "no space" and the stream is a regular file on a full filesystem (which
    accepts an empty write). False for a stream without a file descriptor."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    try:
        os.write(fd, b"")
    except OSError as e:
        return e.errno == err.errno
    if err.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.fstatvfs(fd).f_bavail == 0
    except (AttributeError, OSError):  # no fstatvfs on this platform
        return False


def pipe_safe(run, *args, prog: str = "dcpkit", **kwargs) -> int:
    """``run(*args, **kwargs)``'s exit status, its output flushed; :data:`EXIT_BROKEN_PIPE`,
    quietly, where stdout or stderr is a pipe whose reader has gone (``| head -1``); 1 where
    stdout or stderr cannot be written (``> /dev/full``, a full disk), after the line
    ``<prog>: could not write to stdout: No space left on device`` on stderr.

    The entry point of every command wraps its ``main`` in it. A ``SystemExit`` (argparse's,
    after ``--help``) passes through once the output is flushed. On a broken pipe or a failed
    output, stdout and stderr are pointed at the null device, so that nothing is printed after
    it (no traceback, no "Exception ignored" when the interpreter flushes them at exit). A
    ``BrokenPipeError`` or other ``OSError`` of another file, pipe or socket (stdout and stderr
    can still be written) propagates.
    """
    try:
        try:
            return run(*args, **kwargs)
        finally:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
    except BrokenPipeError:
        if not any(_reader_gone(s) for s in (sys.stdout, sys.stderr)):
            raise  # another pipe or socket (a peer's): a real error, not the output's reader
        _silence_output()
        return EXIT_BROKEN_PIPE
    except OSError as e:
        failed = [
            name
            for name, s in (("stdout", sys.stdout), ("stderr", sys.stderr))
            if s is not None and _output_fails(s, e)
        ]
        if not failed:
            raise  # another file's: not the output's
        if "stderr" not in failed:
            try:
                sys.stderr.write(f"{prog}: could not write to stdout: {os_error_text(e)}\n")
                sys.stderr.flush()
            except OSError:
                pass
        _silence_output()
        return 1


def _silence_output() -> None:
    """Point stdout and stderr at the null device (see :func:`_point_at_devnull`)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            _point_at_devnull(stream)


def milliseconds(text: str) -> float:
    """An argparse ``type=`` for a wait deadline: a number of milliseconds in [0.001, 3600000]."""
    try:
        value = decimal_float(text)
    except ValueError:
        value = float("nan")
    if not MIN_TIMEOUT_MS <= value <= MAX_TIMEOUT_MS:  # NaN and inf fail too
        raise argparse.ArgumentTypeError(
            f"must be a number of milliseconds in {TIMEOUT_RANGE} (got {text!r})"
        )
    return value


class _DeferredError(Exception):
    """A usage error held back until the ranks agree (NOTE [dcpkit agreed parse])."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def launcher_size() -> int | None:
    """The number of processes a launcher says it started, when more than one, else None."""
    from .comm import launcher_world_size

    found = launcher_world_size(os.environ)
    return None if found is None else found[1]


class CommandParser(argparse.ArgumentParser):
    """The argument parser of a subcommand: a usage error is one line on stderr naming the
    argument, ``<prog>: <message> (see <prog> --help)``, and exit status 2 (no usage block).

    Under an MPI launcher only the launcher's rank 0 prints (the error, ``--help``); every
    rank exits with the same status. :meth:`add_timeout_option` adds ``--timeout-ms`` with
    the library's ``DCPKIT_TIMEOUT_MS`` as its default, resolved and checked when parsed.
    """

    _timeout_fallback_ms: float | None = None

    #: Options a rank may give alone under ``alike_options``: the output files, which the
    #: launcher's rank 0 alone writes.
    RANK_LOCAL_OPTIONS = ("json", "profile", "plot", "md_out")

    def __init__(
        self,
        *args,
        help_command: str | None = None,
        agree_across_ranks: bool = True,
        alike_options: bool = False,
        **kwargs,
    ):
        """``help_command``: the command the error line points to, ``<help_command> --help``
        (default: ``prog``); ``agree_across_ranks``: under a launcher of several processes,
        the ranks agree on the outcome of :meth:`parse_args` (NOTE [dcpkit agreed parse]); a
        command that makes no collective (``dcpkit info``) passes False; ``alike_options``:
        the ranks must also have parsed the same value of every option but
        :attr:`RANK_LOCAL_OPTIONS` (a run whose ranks were given different sizes, calls or
        deadlines would wait on each other, or compare different things), unless
        :meth:`parse_agreed` is given a ``mode`` of its own. The other arguments are
        argparse's, except that options are taken by their whole names unless ``allow_abbrev``
        is given: an abbreviation (``--js`` for ``--json``) may mean another option once one is
        added, and a script that passes options on could not tell what it sets."""
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.help_command = help_command or self.prog
        self.agree_across_ranks = bool(agree_across_ranks)
        self.alike_options = bool(alike_options)
        self._distinct: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._deferring = False

    # NOTE [dcpkit agreed parse]
    # --------------------------
    # Every rank of an MPI job parses its own command line and reads its own environment, so a
    # bad argument or DCPKIT_TIMEOUT_MS on some ranks only made those ranks exit while the others
    # went on into their first collective and waited there for ever. Under a launcher that
    # started several processes, parse_args (and any checks given to parse_agreed) therefore
    # runs with the exits deferred, then every rank's outcome -- parsed, a usage error with its
    # line, or --help / --version -- is gathered over MPI.COMM_WORLD before anything else
    # happens: when any rank failed, every rank exits with status 2 and the launcher's rank 0
    # prints one line (naming the ranks when not all of them failed). The dispatcher agrees on
    # the command first, and a command's `mode` (the bench: run or render, with its run options;
    # the demo and the scripts: every option value, alike_options) must match too: ranks
    # running different things would wait on each other, or time and check different calls
    # while each rank reports success. `info` agrees only inside a real
    # launcher's job (joins_agreement). Where MPI cannot start, or its world is not the
    # launcher's (launcher_world_size_mismatch), each rank exits by itself.

    def parse_args(self, args=None, namespace=None):
        return self.parse_agreed(args, namespace=namespace)

    def parse_agreed(self, args=None, check=None, namespace=None, mode=None):
        """:meth:`parse_args`, then ``check(ns)`` (which may call :meth:`error`), agreed across
        the ranks of a launcher's job (NOTE [dcpkit agreed parse]). ``mode(ns)``, when given,
        names what the command line asks for (a str): ranks that parsed but ask for different
        modes exit too, with one line naming them (one rank rendering a report while another
        runs the benchmark would leave the second waiting). Returns the namespace on every
        rank or exits (``SystemExit``) on every rank."""
        if not self.agree_across_ranks or launcher_size() is None:
            ns = super().parse_args(args, namespace)
            if check is not None:
                check(ns)
            return ns
        outcome = None
        ns = None
        self._deferring = True
        try:
            ns = super().parse_args(args, namespace)
            if check is not None:
                check(ns)
        except _DeferredError as e:
            outcome = (2, e.line)
        except SystemExit as e:  # --help, --version: printed on rank 0 already
            outcome = (e.code if isinstance(e.code, int) else 2, None)
        except Exception as e:  # noqa: BLE001 - a check's fault: this rank still agrees
            outcome = self._fault_outcome(e)
        finally:
            self._deferring = False
        if mode is None and self.alike_options:
            mode = self._alike_mode
        key = None
        if mode is not None and outcome is None:
            try:
                key = mode(ns)
            except Exception as e:  # noqa: BLE001 - as above: never a rank left out
                outcome = self._fault_outcome(e)
        gathered = gather_outcomes((self.prog, outcome, key), launcher_rank())
        if gathered is None:  # no agreement possible: each rank as it stands
            if outcome is None:
                return ns
            if outcome[1] is not None and job_leader():
                sys.stderr.write(outcome[1] + "\n")
            sys.exit(outcome[0])
        line, status = settle(self.prog, gathered, "ask for different things")
        if status is None:
            return ns
        if line is not None and job_leader():
            sys.stderr.write(line + "\n")
        sys.exit(status)

    def _fault_outcome(self, e: Exception) -> tuple[int, str]:
        """The agreed outcome (status 2 and one line, as :func:`main` gives a dcpkit error) of
        an exception in a check or a mode, maybe one rank's alone: raised on that rank instead,
        it would leave the others waiting in the agreement."""
        what = "" if isinstance(e, DcpkitError) else f"{type(e).__name__}: "
        text = (str(e).strip().splitlines() or [""])[0]
        return 2, f"{self.prog}: {what}{text}"

    def _alike_mode(self, ns) -> tuple:
        """The mode of ``alike_options``: a run, with the value of every option the ranks must
        give alike (the parser's own options, not what a check added to the namespace: the same
        deadline from ``--timeout-ms`` on one rank and ``DCPKIT_TIMEOUT_MS`` on another is the
        same run)."""
        local = set(self.RANK_LOCAL_OPTIONS)
        dests = sorted(
            {a.dest for a in self._actions if a.dest != argparse.SUPPRESS and a.dest != "help"}
            - local
        )
        return ("a run", {k: getattr(ns, k, None) for k in dests})

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        ns, rest = super().parse_known_args(args, namespace)
        if self._timeout_fallback_ms is not None:
            if self.reads_op_settings(ns):
                ns.timeout_ms, ns.timeout_source = self._resolve_timeout(ns.timeout_ms)
            else:  # DCPKIT_TIMEOUT_MS is not read: no op runs
                ns.timeout_source = None if ns.timeout_ms is None else "--timeout-ms"
        outputs, inputs = self._distinct
        if outputs:
            why = file_clash(self._given(ns, outputs), self._given(ns, inputs))
            if why is not None:
                self.error(why)
        return ns, rest

    def distinct_files(self, outputs: Sequence[str], inputs: Sequence[str] = ()) -> None:
        """Refuse, when the arguments are parsed, an output file (the options ``outputs``, such
        as ``"--json"``) that is the same file as an input (``inputs``) or as another output:
        one line naming both options (:func:`file_clash`), exit status 2."""
        self._distinct = (tuple(outputs), tuple(inputs))

    def _given(self, ns, options: Sequence[str]) -> list[tuple[str, str]]:
        """``(option, path)`` for every path given to ``options`` (one per path of an option
        that takes several)."""
        dests = {o: a.dest for a in self._actions for o in a.option_strings}
        out = []
        for opt in options:
            value = getattr(ns, dests[opt], None)
            if value is None:
                continue
            for path in value if isinstance(value, (list, tuple)) else [value]:
                out.append((opt, path))
        return out

    def reads_op_settings(self, ns: argparse.Namespace) -> bool:
        """Whether the command, as parsed into ``ns``, runs an op and so reads the ops' settings
        (``DCPKIT_TIMEOUT_MS``); True unless a subclass says otherwise for a mode that runs
        none (the bench's ``--render-md``)."""
        return True

    def add_timeout_option(self, waits: str, *, fallback_ms: float = DEFAULT_TIMEOUT_MS) -> None:
        """Add ``--timeout-ms``, the deadline of ``waits`` (help text), in milliseconds.

        Parsing sets ``timeout_ms`` (a float) and ``timeout_source`` (``"--timeout-ms"``,
        ``"DCPKIT_TIMEOUT_MS"`` or ``"default"``). Without ``--timeout-ms`` the value is the
        library's: ``DCPKIT_TIMEOUT_MS`` if set, else ``fallback_ms`` (the ops' own default
        unless the command has another). A set ``DCPKIT_TIMEOUT_MS`` is checked when the
        arguments are parsed, also with ``--timeout-ms`` (an op built without a deadline would
        refuse it): a bad value is a usage error naming the variable, before any MPI or GPU
        work. Where :meth:`reads_op_settings` is False the variable is not read: ``timeout_ms``
        is ``--timeout-ms`` or None, ``timeout_source`` ``"--timeout-ms"`` or None.
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

    def timeout_from_env(self, *, option_given: bool = False) -> float | None:
        """``DCPKIT_TIMEOUT_MS`` in milliseconds, None where it is unset; a bad value is a
        usage error naming the variable and its range (one line, exit status 2). With
        ``option_given`` (``--timeout-ms`` was given) the line also says why the option does
        not make the variable acceptable."""
        raw = os.environ.get(TIMEOUT_ENV, "")
        if not raw.strip():  # empty or blank: unset, as the ops read it
            return None
        try:
            return default_timeout_ms(self.prog)
        except InvalidArgument:
            why = ""
            if option_given:
                why = (
                    f"; the variable itself is invalid, also with --timeout-ms given: an op "
                    f"built without timeout_ms reads it, so fix or unset {TIMEOUT_ENV}"
                )
            self.error(
                f"environment variable {TIMEOUT_ENV}: must be a number of milliseconds in "
                f"{TIMEOUT_RANGE} (got {raw!r}){why}"
            )

    def _resolve_timeout(self, given: float | None) -> tuple[float, str]:
        env_ms = self.timeout_from_env(option_given=given is not None)
        if given is not None:
            return given, "--timeout-ms"
        if env_ms is not None:
            return env_ms, TIMEOUT_ENV
        return self._timeout_fallback_ms, "default"

    def error(self, message: str):
        line = f"{self.prog}: {message}{self._dash_hint(message)} (see {self.help_command} --help)"
        if self._deferring:
            raise _DeferredError(line)
        if job_leader():
            sys.stderr.write(line + "\n")
        sys.exit(2)

    def _print_message(self, message, file=None):
        # --help, usage: once per job. Written here rather than by argparse, which drops a
        # write error: a closed pipe then reaches pipe_safe like any other write's.
        out = file or sys.stderr
        if message and out is not None and job_leader():
            out.write(message)

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


def _same_file(a: str, b: str) -> bool:
    """Whether the paths ``a`` and ``b`` name one file: ``os.path.samefile`` where both exist
    (a hard link, a symbolic link, another spelling), else their resolved paths compared."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.realpath(a) == os.path.realpath(b)


def file_clash(
    outputs: Sequence[tuple[str, str]], inputs: Sequence[tuple[str, str]] = ()
) -> str | None:
    """Why a command would overwrite one of its own files, or None.

    ``outputs`` and ``inputs`` are ``(option, path)`` pairs (``("--json", "r.json")``). An
    output must be neither the same file as an input nor as another output; the answer is one
    line, ``argument --md-out: must not be the same file as --render-md b.json (got 'b.json')``.
    """
    for i, (opt, path) in enumerate(outputs):
        for other_opt, other in list(outputs[:i]) + list(inputs):
            if _same_file(path, other):
                return (
                    f"argument {opt}: must not be the same file as {other_opt} {other} "
                    f"(got {path!r})"
                )
    return None


def os_error_text(e: BaseException) -> str:
    """``No such file or directory`` rather than ``[Errno 2] No such file or directory: 'x'``
    (the path is named by the caller's line)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"


def write_output(
    path: str,
    write: Callable,
    *,
    prog: str,
    make_folders: bool = False,
    atomic: bool = True,
    binary: bool = False,
) -> str | None:
    """Write the file ``path`` with ``write(f)`` (``f`` open for writing text, or bytes with
    ``binary``); None once it is written, else the line ``could not write <path>: <OS error>``,
    also printed to stderr as ``<prog>: <line>``, never a traceback.

    For the files a command writes at the end of its run (``--json``, ``--profile``): the
    caller returns a non-zero status on a line. Under MPI only the writing rank knows; it writes
    after the job's last collective step, or shares the line with the others (``dcpkit demo``
    broadcasts it), so that no rank is left waiting. ``make_folders`` creates missing folders
    first.

    ``atomic`` (the default) writes a temporary file beside the file (beside its target, for a
    symbolic link) and renames it over it once ``write`` has returned and the data is on disk,
    so that a reader never sees half a file and a run that stops half-way (a full disk, an
    interrupt, an error in ``write``) leaves the old file as it was and no temporary file. A
    path that is neither a regular file nor missing (``/dev/stdout``, a named pipe) is written
    in place: there is no file to replace.
    """
    target = _replaceable(path) if atomic else None
    tmp = None if target is None else f"{target}.tmp{os.getpid()}"
    try:
        folder = os.path.dirname(os.path.abspath(path))
        if make_folders and not os.path.lexists(folder):  # a file there: open() says so
            os.makedirs(folder, exist_ok=True)
        mode, encoding = ("wb", None) if binary else ("w", "utf-8")
        with open(tmp or path, mode, encoding=encoding) as f:
            write(f)
            if tmp is not None:
                f.flush()
                os.fsync(f.fileno())
        if tmp is not None:
            _keep_mode(target, tmp)
            os.replace(tmp, target)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if not isinstance(e, OSError):
            raise
        line = f"could not write {path}: {os_error_text(e)}"
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
        return line
    return None


def _replaceable(path: str) -> str | None:
    """The file an atomic write of ``path`` renames its temporary file over: ``path`` with its
    symbolic links resolved, when that is a regular file or nothing yet; None for anything else
    (a device such as ``/dev/stdout``, a named pipe), which is written in place."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return real  # missing (or unreadable: open() says why)
    return real if stat.S_ISREG(st.st_mode) else None


def _keep_mode(target: str, tmp: str) -> None:
    """Give ``tmp`` the permission bits of the file ``target`` it replaces, if there is one."""
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
    except FileNotFoundError:
        pass


def write_json(
    path: str, doc, *, prog: str, make_folders: bool = False, sort_keys: bool = False
) -> int:
    """Write ``doc`` as indented JSON to ``path`` through :func:`write_output` (atomically); the
    exit status of a command whose last step this is: 0, or 1 after the one line on stderr."""

    def write(f):
        json.dump(doc, f, indent=1, sort_keys=sort_keys)

    return 0 if write_output(path, write, prog=prog, make_folders=make_folders) is None else 1


_COMMANDS = {
    "info": ("dcpkit.info", "print versions, GPUs, P2P access and the multicast decision"),
    "demo": (
        "dcpkit.demo",
        "run one MLA decode layer through the three ops, check it against a reference and "
        "time the direct path against NCCL (--iters, default 200; under mpirun -np N)",
    ),
    "bench": ("dcpkit.bench", "benchmark the ops against NCCL (under mpirun -np N)"),
}


def _usage() -> str:
    import textwrap

    lines = [
        "usage: dcpkit {info,demo,bench} [options]   (or: python -m dcpkit ...)",
        "       dcpkit --version",
        "",
        "dcpkit: low-latency multi-GPU collectives for decode context parallelism.",
        "",
        "commands:",
    ]
    for name, (_, summary) in _COMMANDS.items():
        lines += textwrap.wrap(
            summary, 88, initial_indent=f"  {name:<7}", subsequent_indent=" " * 9
        )
    lines += ["", "Run 'dcpkit <command> --help' for the options of a command."]
    return "\n".join(lines)


def _say(text: str, file) -> None:
    """Print a line of the whole job: once, from the launcher's rank 0 (every process outside
    a launcher)."""
    if job_leader():
        print(text, file=file)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit status.

    Returns 2 on a usage error (no command, an unknown one, arguments after ``--help`` or
    ``--version``), when the subcommand's module is not part of this installation, an optional
    dependency it needs is missing (the message names the extra to install), or the subcommand
    stops on a dcpkit error it did not handle itself: one line ``dcpkit <command>: <error>`` on
    stderr, no traceback. Under an MPI launcher the usage, ``--version`` and these errors are
    printed by the launcher's rank 0 only and every rank returns the same status; the one
    exception is a dcpkit error a subcommand did not handle, which may be a single rank's and
    is printed by each rank that stops on it. A closed output pipe returns
    :data:`EXIT_BROKEN_PIPE` quietly, an output that cannot be written 1 after one line on
    stderr (:func:`pipe_safe`).
    """
    return pipe_safe(_main, argv, prog="dcpkit")


def _dispatch(argv: list[str]):
    """``(module, None)`` for a command line this process can run, else ``(None, (status,
    error line or None, text for stdout or None))``: a usage error, --help / --version, a
    module not in this installation or a missing dependency."""
    if argv and argv[0] in ("-V", "--version", "-h", "--help"):
        if len(argv) > 1:
            msg = f"{argv[0]} takes no arguments (got {' '.join(argv[1:])!r})"
            return None, (2, f"dcpkit: {msg} (see dcpkit --help)", None)
        if argv[0] in ("-V", "--version"):
            from . import __version__

            return None, (0, None, f"dcpkit {__version__}")
        return None, (0, None, _usage())
    if not argv:
        return None, (2, _usage(), None)
    command = argv[0]
    if command not in _COMMANDS:
        what = "option" if command.startswith("-") else "command"
        msg = (
            f"unknown {what} {command!r}: must be one of {', '.join(_COMMANDS)}, --help or "
            f"--version"
        )
        return None, (2, f"dcpkit: {msg} (see dcpkit --help)", None)
    mod_name = _COMMANDS[command][0]
    try:
        return importlib.import_module(mod_name), None
    except ModuleNotFoundError as e:
        if e.name != mod_name:
            raise
        return None, (
            2,
            f"dcpkit {command}: {mod_name} is not available in this installation",
            None,
        )
    except MissingDependency as e:
        return None, (2, f"dcpkit {command}: {e}", None)


def joins_agreement(command: str | None) -> bool:
    """Whether this rank agrees with the others before ``command`` (NOTE [dcpkit agreed parse]):
    ``info``, which makes no collective, only inside a real launcher's job (not where stale
    variables name a PMI descriptor that is not open: MPI_Init would abort there)."""
    from .comm import mpi_init_may_join_a_job

    if launcher_size() is None:
        return False
    if command != "info":
        return True
    fd = os.environ.get("PMI_FD")
    try:
        if fd is not None:
            os.fstat(int(fd))
    except (ValueError, OSError):
        return False
    return mpi_init_may_join_a_job(os.environ)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mod, problem = _dispatch(argv)
    if joins_agreement(argv[0] if argv else None):
        # the ranks agree on the command and the dispatch before the command's own collectives
        # (NOTE [dcpkit agreed parse])
        command = {"-V": "--version", "-h": "--help"}.get(argv[0], argv[0]) if argv else ""
        gathered = gather_outcomes(
            ("dcpkit", None if problem is None else (problem[0], problem[1]), command),
            launcher_rank(),
        )
        if gathered is not None:
            line, status = settle("dcpkit", gathered, "run different commands")
            if status is not None:
                if line is not None:
                    _say(line, sys.stderr)
                elif problem is not None and problem[2] is not None:
                    _say(problem[2], sys.stdout)  # --help / --version, asked on every rank
                return status
    if problem is not None:
        status, line, text = problem
        if line is not None:
            _say(line, sys.stderr)
        if text is not None:
            _say(text, sys.stdout)
        return status
    command, args = argv[0], argv[1:]
    try:
        rc = mod.main(args)
    except DcpkitError as e:  # MissingDependency included
        # possibly one rank's alone: every rank that stops on it says so
        print(f"dcpkit {command}: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)
