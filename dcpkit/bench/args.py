"""The command line of ``dcpkit bench``: the parser, and every setting of a run with its
defaults (:func:`resolve_config`).

Every argument is checked when the arguments are parsed, before any MPI, GPU or file work:
a value the benchmark cannot honour is one line on stderr and exit status 2, in the form
``dcpkit bench: argument --min-bytes: must be ... (got '0')``.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from .._checks import decimal_float, decimal_int
from ..cli import CommandParser, file_path, output_file_problem
from .common import ALL_MODES, ALL_OPS, ALL_PATHS, GEOMETRY, KiB, MiB

__all__ = [
    "parse_size",
    "build_parser",
    "resolve_config",
    "check_args",
    "BenchParser",
    "MAX_BYTES_LIMIT",
    "MAX_ITERS",
    "MAX_TOKENS",
    "BENCH_TIMEOUT_MS",
]

#: Largest kv_gather bytes per rank (and egress slice) the benchmark allocates: the output of one
#: call is world_size times this, and the JSON keeps every sample.
MAX_BYTES_LIMIT = 1024 * MiB
#: Most timed samples per case, path and mode (each sample is stored in the JSON).
MAX_ITERS = 10000
#: The bench's wait deadline in ms where neither --timeout-ms nor DCPKIT_TIMEOUT_MS is given
#: (the ops' own default is 5000).
BENCH_TIMEOUT_MS = 10000.0
#: Largest token count of q_gather / lse_reduce (the ops' workspaces hold max_tokens rows).
MAX_TOKENS = 65536
#: kv_gather's smallest bytes per rank without --min-bytes.
DEFAULT_MIN_BYTES = 4 * KiB
#: The egress ceiling's slice per rank: the smallest --egress-bytes, and the default (capped by
#: --max-bytes, never below the smallest).
MIN_EGRESS_BYTES = 16 * KiB
DEFAULT_EGRESS_BYTES = 64 * MiB
#: The egress kernel moves 16-byte vectors: an --egress-bytes must be a multiple of this.
EGRESS_UNIT = 16
#: Fewest seconds --hang-s allows: a host wait for the GPU shorter than this is not a hang.
MIN_HANG_S = 1.0
#: --hang-s without the option, unless twice the device deadline is longer.
DEFAULT_HANG_S = 120.0
#: A size as written on the command line: ASCII digits only (``\d`` would also read the digits
#: of other scripts, such as the Arabic-Indic ``'\u0665\u0660'``, which ``int()`` takes as 50).
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*$", re.I | re.ASCII)
#: Most digits a size may have (far more than any size the benchmark takes): a number read
#: exactly, never a float that overflows or an int() past Python's digit limit.
_MAX_SIZE_DIGITS = 40


class BenchParser(CommandParser):
    """The bench's parser: errors are one line on stderr (exit status 2), no usage block.
    ``--render-md`` runs no op, so it reads no op setting: ``DCPKIT_TIMEOUT_MS`` is neither
    checked nor used there (``timeout_ms`` is None unless ``--timeout-ms`` is given, which
    :func:`check_args` refuses)."""

    def reads_op_settings(self, ns: argparse.Namespace) -> bool:
        return getattr(ns, "render_md", None) is None


def _exact(value: Fraction) -> str:
    """A fractional byte count written exactly where it is short (``1024.0001024``), else as
    ``between N and N + 1`` (a rounded figure could read as the whole number it is not)."""
    whole, rest = divmod(value.numerator, value.denominator)
    den = value.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den == 1:  # a finite decimal
        digits = 0
        while (rest * 10**digits) % value.denominator:
            digits += 1
        if digits <= 12:
            frac = rest * 10**digits // value.denominator
            return f"{whole}.{frac:0{digits}d}"
    return f"between {whole} and {whole + 1}"


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"4K"``, ``"4KiB"``, ``"256M"``, ``"1G"``, ``"1.5K"`` (binary
    units; ASCII digits, at most 40); a whole, positive number of bytes.

    Raises
    ------
    argparse.ArgumentTypeError
        Not a size, more than 40 digits, not a whole number of bytes, or not positive.
    """
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"must be a size like 4096, 4K, 4KiB, 256M or 1G (got {text!r})"
        )
    if len(m.group(1)) > _MAX_SIZE_DIGITS:
        raise argparse.ArgumentTypeError(
            f"must be a size of at most {_MAX_SIZE_DIGITS} digits (got {len(m.group(1))} digits)"
        )
    mult = {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB, "t": 1024 * 1024 * MiB}[m.group(2).lower()]
    value = Fraction(m.group(1)) * mult  # exact: no float rounding, no overflow to inf
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of bytes (got {text!r} = {_exact(value)} bytes)"
        )
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte (got {text!r})")
    return int(value)


def _bounded_size(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = parse_size(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must lie in [{_fmt(lo)}, {_fmt(hi)}] (got {text!r})")
        return v

    parse.__name__ = "size"
    return parse


def _fmt(n: int) -> str:
    for unit, k in (("G", 1024 * MiB), ("M", MiB), ("K", KiB)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def _int_in(lo: int, hi: int, what: str = "an integer") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = decimal_int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {what} in [{lo}, {hi}] (got {text!r})"
            ) from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be {what} in [{lo}, {hi}] (got {text!r})")
        return v

    parse.__name__ = "integer"
    return parse


def _float_in(lo: float, hi: float, unit: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = decimal_float(text)
        except ValueError:
            v = math.nan
        if not lo <= v <= hi:  # NaN fails too
            raise argparse.ArgumentTypeError(
                f"must be a number of {unit} in [{lo:g}, {hi:g}] (got {text!r})"
            )
        return v

    parse.__name__ = "number"
    return parse


def _egress_size(text: str) -> int:
    v = _bounded_size(MIN_EGRESS_BYTES, MAX_BYTES_LIMIT)(text)
    if v % EGRESS_UNIT:
        raise argparse.ArgumentTypeError(
            f"must be a multiple of {EGRESS_UNIT} bytes (the egress kernel moves "
            f"{EGRESS_UNIT}-byte vectors) (got {text!r})"
        )
    return v


def _items(text: str, what: str) -> list[str]:
    """The items of a comma list, none of them empty (``1,,8`` is a typo, not ``1,8``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a comma list of {what} (got {text!r})")
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"must not have an empty item (got {text!r})")
    return items


def _no_repeats(values: Sequence[Any], text: str) -> None:
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"must not repeat an item (got {text!r})")


def _csv(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    what = ", ".join(allowed)

    def parse(text: str) -> list[str]:
        items = _items(text, what)
        if any(t not in allowed for t in items):
            raise argparse.ArgumentTypeError(f"must be a comma list of {what} (got {text!r})")
        _no_repeats(items, text)
        return items

    parse.__name__ = "list"
    return parse


def _int_list(text: str) -> list[int]:
    what = f"integers in [1, {MAX_TOKENS}]"
    items = _items(text, what)
    try:
        v = [decimal_int(t) for t in items]
    except ValueError:
        v = []
    if not v or any(not 1 <= x <= MAX_TOKENS for x in v):
        raise argparse.ArgumentTypeError(f"must be a comma list of {what} (got {text!r})")
    _no_repeats(v, text)
    return v


def _kv_row_dim(text: str) -> int:
    v = _int_in(8, 1 << 16, "an integer")(text)
    if v % 8:
        raise argparse.ArgumentTypeError(
            f"must be a multiple of 8 elements (16-byte bf16 rows) (got {text!r})"
        )
    return v


def build_parser() -> BenchParser:
    """The argument parser of ``dcpkit bench`` (errors: one line, exit status 2)."""
    p = BenchParser(
        prog="dcpkit bench",
        description="Benchmark dcpkit's ops against a floor kernel, NVSHMEM, NCCL and the "
        "machine's measured ceilings (run under mpirun -np N, one process per GPU).",
        # options by their whole names: an abbreviation (--js for --json) may mean another
        # option once one is added, and scripts that pass options on (gpu_suite.sh) could not
        # tell what it sets
        allow_abbrev=False,
    )
    p.add_argument(
        "--ops",
        type=_csv(ALL_OPS),
        default=list(ALL_OPS),
        help=f"comma list of {', '.join(ALL_OPS)} (default: all)",
    )
    p.add_argument(
        "--paths",
        type=_csv(ALL_PATHS),
        default=list(ALL_PATHS),
        help=f"comma list of {', '.join(ALL_PATHS)} (default: all available; "
        f"multicast only where allowed)",
    )
    p.add_argument(
        "--modes",
        type=_csv(ALL_MODES),
        default=list(ALL_MODES),
        help="eager, graph (default: both)",
    )
    p.add_argument(
        "--min-bytes",
        type=_bounded_size(1, MAX_BYTES_LIMIT),
        default=None,
        help=f"kv_gather: smallest bytes per rank (default {_fmt(DEFAULT_MIN_BYTES)}, or one row "
        "where --kv-row-dim makes a row larger)",
    )
    p.add_argument(
        "--max-bytes",
        type=_bounded_size(1, MAX_BYTES_LIMIT),
        default=None,
        help=f"kv_gather: largest bytes per rank, at most {_fmt(MAX_BYTES_LIMIT)} "
        f"(default 256M; --quick 16M); also caps the default egress slice "
        f"({_fmt(DEFAULT_EGRESS_BYTES)}), never below {_fmt(MIN_EGRESS_BYTES)}",
    )
    p.add_argument(
        "--tokens",
        type=_int_list,
        default=None,
        help="q_gather / lse_reduce token counts T (default 1,8,32,128)",
    )
    p.add_argument(
        "--iters",
        type=_int_in(1, MAX_ITERS, "an integer"),
        default=None,
        help=f"timed samples per case, path and mode, exactly (1 to {MAX_ITERS}; "
        f"default: 30 within a time budget per mode, --quick 8)",
    )
    p.add_argument(
        "--json",
        type=file_path,
        default=None,
        help="write the results as JSON into this file (rank 0; its folder must exist)",
    )
    p.add_argument(
        "--plot",
        type=file_path,
        default=None,
        metavar="PNG",
        help="draw the plots into this PNG file, a path ending in .png (rank 0; its folder "
        "must exist; needs matplotlib: pip install 'dcpkit[bench]')",
    )
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    p.add_argument(
        "--seed",
        type=_int_in(0, 2**31 - 1, "an integer"),
        default=None,
        help="base seed of the random inputs (default: fresh, printed)",
    )
    p.add_argument(
        "--kv-row-dim",
        type=_kv_row_dim,
        default=GEOMETRY["D_kv"],
        help="kv_gather row width D_kv in elements, a multiple of 8 (default 576)",
    )
    p.add_timeout_option("every device wait (ops and ceilings)", fallback_ms=BENCH_TIMEOUT_MS)
    p.add_argument(
        "--hang-s",
        type=_float_in(MIN_HANG_S, 86400.0, "seconds"),
        default=None,
        help=f"abort the job when a host wait for the GPU exceeds this many seconds, in "
        f"[{MIN_HANG_S:g}, 86400] and longer than the device deadline (--timeout-ms), so that "
        f"a stuck op times out first (default {DEFAULT_HANG_S:g}, or twice the deadline where "
        f"that is longer)",
    )
    p.add_argument(
        "--round-trips",
        type=_int_in(1, 10**7, "an integer"),
        default=None,
        help="ping-pong round trips per launch (default 20000; --quick 2000)",
    )
    p.add_argument(
        "--egress-bytes",
        type=_egress_size,
        default=None,
        help=f"egress ceiling slice per rank, >= {_fmt(MIN_EGRESS_BYTES)}, a multiple of "
        f"{EGRESS_UNIT} bytes (default "
        f"max({_fmt(MIN_EGRESS_BYTES)}, min({_fmt(DEFAULT_EGRESS_BYTES)}, --max-bytes)))",
    )
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed stages")
    p.add_argument(
        "--check-args",
        action="store_true",
        help="check the arguments as a run would (with --render-md: read and render its "
        "input files), then exit: status 0 and no output, or 2 with the one-line error (no "
        "MPI, no GPU, nothing written; for scripts that check a command line before starting)",
    )
    g = p.add_argument_group("BENCHMARKS.md (no GPU, no MPI)")
    g.add_argument(
        "--render-md",
        nargs="+",
        metavar="JSON",
        default=None,
        help="render BENCHMARKS.md from these JSON files (one per world size) and "
        "exit; the markdown goes to stdout unless --md-out is given",
    )
    g.add_argument(
        "--baseline",
        nargs="+",
        metavar="JSON",
        default=None,
        help="with --render-md: JSON files of an older commit at the same world "
        "sizes, shown as before/after",
    )
    g.add_argument(
        "--md-out", type=file_path, default=None, help="with --render-md: write the markdown here"
    )
    g.add_argument(
        "--notes",
        default=None,
        help="with --render-md: a markdown file kept by hand, shown under 'Notes'",
    )
    g.add_argument(
        "--host-overhead",
        nargs="+",
        metavar="JSON",
        default=None,
        help="with --render-md: JSON files of scripts/host_overhead.py --json (one per world "
        "size), shown as the host-time section",
    )
    p.distinct_files(
        outputs=("--json", "--plot", "--md-out"),
        inputs=("--render-md", "--baseline", "--notes", "--host-overhead"),
    )
    return p


def _min_bytes(args: argparse.Namespace) -> int:
    """``--min-bytes``, or its default: DEFAULT_MIN_BYTES, or one kv_gather row where
    ``--kv-row-dim`` makes a row larger (kv_gather moves whole rows: a smaller size would run as
    one row under another name, and several such sizes as one case)."""
    if args.min_bytes is not None:
        return args.min_bytes
    return max(DEFAULT_MIN_BYTES, 2 * int(getattr(args, "kv_row_dim", 0) or 0))


def _bytes_range_problem(args: argparse.Namespace) -> str | None:
    """Why ``--min-bytes`` and ``--max-bytes`` (given or default) make no sweep, or None; the
    line names the flag the user gave."""
    q = bool(args.quick)
    max_bytes = args.max_bytes if args.max_bytes is not None else (16 * MiB if q else 256 * MiB)
    min_bytes = _min_bytes(args)
    if min_bytes <= max_bytes:
        return None
    if args.min_bytes is None:
        return (
            f"argument --max-bytes: must be >= the default --min-bytes {min_bytes}, or give a "
            f"smaller --min-bytes too (got {max_bytes})"
        )
    return f"argument --min-bytes: must be <= --max-bytes {max_bytes} (got {min_bytes})"


def _hang_s(args: argparse.Namespace) -> float:
    """``--hang-s``, or its default: 120 s, or twice the device deadline where that is longer."""
    if args.hang_s is not None:
        return float(args.hang_s)
    return max(DEFAULT_HANG_S, 2 * float(args.timeout_ms) / 1000)


def _matplotlib_problem() -> str | None:
    """Why matplotlib cannot draw the plots, or None (asked at parse time, not after the run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Checks across arguments (``parser.error`` on the first problem: one line, exit 2)."""
    if args.render_md is None:
        for opt in ("md_out", "notes", "baseline", "host_overhead"):
            if getattr(args, opt) is not None:
                parser.error(f"argument --{opt.replace('_', '-')}: needs --render-md")
        for opt in ("json", "plot"):
            v = getattr(args, opt)
            if v is not None:
                why = output_file_problem(v)
                if why:
                    parser.error(f"argument --{opt}: {why}")
        if args.plot is not None:
            if not args.plot.lower().endswith(".png"):
                parser.error(f"argument --plot: must name a .png file (got {args.plot!r})")
            why = _matplotlib_problem()
            if why:
                parser.error(
                    f"argument --plot: needs matplotlib ({why}): pip install 'dcpkit[bench]'"
                )
        if args.hang_s is not None and args.hang_s * 1000 <= args.timeout_ms:
            source = {"default": "the default"}.get(args.timeout_source, args.timeout_source)
            parser.error(
                f"argument --hang-s: must be longer than the device deadline, "
                f"{args.timeout_ms:g} ms from {source}, so that a stuck op times out before "
                f"the job is aborted (got {args.hang_s:g})"
            )
    else:
        render_opts = {
            "render_md",
            "baseline",
            "md_out",
            "notes",
            "host_overhead",
            "help",
            "check_args",
        }
        for action in parser._actions:
            dest = action.dest
            if dest in render_opts or not action.option_strings or dest == "version":
                continue
            if dest == "timeout_ms" and args.timeout_source != "--timeout-ms":
                continue  # resolved from DCPKIT_TIMEOUT_MS or the fallback, not given
            if getattr(args, dest, action.default) != action.default:
                parser.error(f"argument {action.option_strings[0]}: not used with --render-md")
        if args.baseline is not None and len(args.baseline) != len(args.render_md):
            parser.error(
                f"argument --baseline: must name one JSON per --render-md JSON "
                f"({len(args.render_md)}) (got {len(args.baseline)})"
            )
    why = _bytes_range_problem(args)
    if why is not None:
        parser.error(why)
    # kv_gather moves whole rows: a size below one row would run as one row under another name
    # (and several such sizes as the same case)
    row = int(args.kv_row_dim) * 2
    for opt, given in (("--min-bytes", args.min_bytes), ("--max-bytes", args.max_bytes)):
        if given is not None and given < row:
            parser.error(
                f"argument {opt}: must be at least one kv_gather row, {row} bytes at "
                f"--kv-row-dim {args.kv_row_dim} (got {given})"
            )


def resolve_config(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of a run, defaults filled in (``--quick`` shrinks them).

    Raises
    ------
    argparse.ArgumentTypeError
        ``--min-bytes`` above ``--max-bytes`` (for callers that skip :func:`check_args`).
    """
    q = bool(args.quick)
    max_bytes = args.max_bytes if args.max_bytes is not None else (16 * MiB if q else 256 * MiB)
    min_bytes = _min_bytes(args)
    why = _bytes_range_problem(args)
    if min_bytes < 1 or why is not None:
        raise argparse.ArgumentTypeError(
            why or f"argument --min-bytes: must be >= 1 (got {min_bytes})"
        )
    step = 16 if q else 4
    sizes = []
    s = min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= step
    egress = (
        args.egress_bytes
        if args.egress_bytes is not None
        else max(MIN_EGRESS_BYTES, min(DEFAULT_EGRESS_BYTES, max_bytes))
    )
    egress = egress // EGRESS_UNIT * EGRESS_UNIT  # the default, from --max-bytes
    tokens = args.tokens or ([1, 128] if q else [1, 8, 32, 128])
    iters = args.iters if args.iters is not None else (8 if q else 30)
    return {
        "ops": [o for o in ALL_OPS if o in args.ops],
        "paths": [p for p in ALL_PATHS if p in args.paths],
        "modes": [m for m in ALL_MODES if m in args.modes],
        "kv_sizes": sizes,
        "min_bytes": min_bytes,
        "max_bytes": max_bytes,
        "tokens": sorted(set(tokens)),
        "iters": iters,
        "iters_exact": args.iters is not None,
        "quick": q,
        "json": args.json,
        "plot": args.plot,
        "seed": args.seed,
        "geometry": dict(GEOMETRY, D_kv=int(args.kv_row_dim)),
        "timeout_ms": float(args.timeout_ms),
        "hang_s": _hang_s(args),
        "round_trips": args.round_trips if args.round_trips is not None else (2000 if q else 20000),
        "pingpong_repeats": 3 if q else 5,
        "egress_slice_bytes": int(egress),
        "egress_samples": 3 if q else 10,
        "sample_target_us": 500.0 if q else 1000.0,
        "mode_budget_s": 0.05 if q else 0.3,
        "graph_calls": 20,
        "verbose": bool(args.verbose),
    }
