"""``python -m dcpkit demo``: the arguments, each validated when parsed, and the entry point."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._checks import INT32_MAX, decimal_int
from ..cli import (
    CommandParser,
    file_path,
    job_leader,
    milliseconds,
    output_file_problem,
    write_output,
)
from ..errors import DcpkitError
from . import environment
from .model import PRESETS
from .report import format_report
from .runner import run
from .steps import EXIT_CANNOT_RUN, EXIT_FAIL, EXIT_PASS, Say

__all__ = ["main", "parse_args", "parser", "integer", "milliseconds", "json_problem", "MAX_ITERS"]

#: Most timed repeats per measurement (the bench's cap on its samples, too).
MAX_ITERS = 10000
#: Largest --batch (one query token per sequence: the decode step's T; the bench's cap on T).
MAX_BATCH = 65536
#: Largest --context (tokens of the longest sequence).
MAX_CONTEXT = 1 << 24
#: Most KV rows of the whole batch (--batch x --context bounds them): the check gathers the whole
#: KV cache onto every rank, 2**27 rows of 576 bf16 values are 154 GB, more than one GPU holds.
MAX_KV_ROWS = 1 << 27


def integer(minimum: int, maximum: int | None = None):
    """An argparse ``type=`` for a decimal integer in ``[minimum, maximum]``, with a readable
    message (``must be an integer in [1, 2147483647] (got '1e20')``), worded as the bench's."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = decimal_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer {bounds} (got {text!r})"
            ) from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {bounds} (got {text!r})")
        return value

    return parse


def json_problem(path: str | None) -> str | None:
    """Why the report cannot be written to ``path`` (None when it can, or without --json): the
    line of :func:`dcpkit.cli.output_file_problem`, after ``--json``."""
    why = None if path is None else output_file_problem(path)
    return None if why is None else f"--json {why}"


def write_report(report: dict[str, Any], f) -> None:
    """The report as ``--json`` writes it into the open file ``f``."""
    json.dump(report, f, indent=2, default=str)
    f.write("\n")


def parser() -> argparse.ArgumentParser:
    """The demo's argument parser; every numeric argument is validated when parsed."""
    p = CommandParser(
        prog="dcpkit demo",
        description="One MLA decode attention layer with decode context parallelism "
        "(q_gather -> partial attention -> lse_reduce), checked against a reference "
        "over the whole KV and timed against NCCL. Run it as "
        "'mpirun -np N python -m dcpkit demo' with N GPUs (N = 2, 4 or 8).",
        alike_options=True,
    )
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default="deepseek-v3",
        help="geometry preset: deepseek-v3 = 128 query heads, kimi-k2 = 64; both with "
        "a latent KV row of 576 (512 latent + 64 rope) and values of 512 "
        "(default: deepseek-v3)",
    )
    p.add_argument(
        "--batch",
        type=integer(1, MAX_BATCH),
        default=8,
        help="sequences decoded together, one query token each (default: 8)",
    )
    p.add_argument(
        "--context",
        type=integer(1, MAX_CONTEXT),
        default=16384,
        help="context tokens of the longest sequence; the others are shorter (default: 16384)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16"),
        default="bfloat16",
        help="dtype of queries, KV and outputs (default: bfloat16)",
    )
    p.add_argument(
        "--seed",
        type=integer(0, INT32_MAX),
        default=0,
        help=f"random seed of the inputs, 0 to {INT32_MAX} (default: 0)",
    )
    p.add_argument(
        "--iters",
        type=integer(0, MAX_ITERS),
        default=200,
        help=f"timed repeats per measurement, 0 to {MAX_ITERS}; 0 skips the timings (default: 200)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        type=file_path,
        default=None,
        help="also write the report as JSON to PATH (written by rank 0; its folder must exist)",
    )
    p.add_timeout_option("every wait of the direct ops")
    p.add_argument(
        "--allow-shared-gpu",
        action="store_true",
        help="let several ranks share one GPU (functional checks on a machine with "
        "fewer GPUs than ranks): under an MPS daemon the ranks' kernels run concurrently, "
        "without one they time-slice the GPU; either way the timings mean nothing",
    )
    p.add_argument(
        "--torch",
        action="store_true",
        help="run the layer with torch tensors through dcpkit.torch and check it "
        "against torch.nn.functional.scaled_dot_product_attention",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the demo's arguments (``timeout_ms`` resolved: ``--timeout-ms``, else
    ``DCPKIT_TIMEOUT_MS``, else 5000). Raises ``SystemExit`` (2 on bad arguments or a bad
    ``DCPKIT_TIMEOUT_MS``, 0 on --help); under an MPI launcher only its rank 0 prints."""
    p = parser()

    def check(args: argparse.Namespace) -> None:
        why = json_problem(args.json)  # on every rank: a bad path on any rank is refused
        if why is not None:
            p.error(f"argument {why}")
        if args.batch * args.context > MAX_KV_ROWS:
            p.error(
                f"argument --context: --batch x --context must be at most {MAX_KV_ROWS} KV "
                f"rows (the check gathers the whole KV cache onto every rank) (got "
                f"{args.batch} x {args.context})"
            )

    # every rank's outcome is agreed under a launcher (NOTE [dcpkit agreed parse])
    return p.parse_agreed(None if argv is None else list(argv), check=check)


def versions() -> dict[str, Any]:
    v: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import cupy

        v["cupy"] = cupy.__version__
        v["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        v["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        from .. import __version__

        v["dcpkit"] = __version__
    except ImportError:  # pragma: no cover
        pass
    return v


def main(argv: Sequence[str] | None = None, *, comm=None) -> int:
    """``python -m dcpkit demo [options]``; returns the exit status (0 PASS, 1 FAIL, 2 the demo
    could not run). Every rank of the MPI job calls it with the same arguments.

    Parameters
    ----------
    argv : list of str, optional
        The demo's arguments (default ``sys.argv[1:]``).
    comm : Communicator, optional
        The group to run on (default: ``Communicator.from_mpi()``, the ``mpirun`` world).

    Collective
    ----------
    Every rank calls it. Errors on any rank are agreed before any later collective, so all
    ranks return the same status and none is left waiting.
    """
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_CANNOT_RUN
    model = PRESETS[args.model]

    owns_comm = comm is None
    if comm is None:
        try:
            from ..comm import Communicator

            comm = Communicator.from_mpi()
        except DcpkitError as e:  # no mpi4py / MPI, or a launcher of another MPI library
            if job_leader():  # no shared communicator: the launcher's rank 0 speaks
                print(f"dcpkit demo: {e}", file=sys.stderr, flush=True)
            return EXIT_CANNOT_RUN
    say = Say(comm.rank)

    # ---------------------------------------------------------------- environment, agreed
    problems = comm.allgather(environment.environment_problem(comm, args, model))
    if any(problems):
        if comm.rank == 0:
            seen: dict[str, list[int]] = {}
            for r, p in enumerate(problems):
                if p:
                    seen.setdefault(p, []).append(r)
            for p, ranks in seen.items():
                where = "" if len(ranks) == comm.world_size else f" (rank {ranks})"
                print(f"dcpkit demo: {p}{where}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN
    try:
        # every setting but --json (only rank 0 writes it) must be equal on every rank
        comm.agree("demo arguments", sorted((k, v) for k, v in vars(args).items() if k != "json"))
    except DcpkitError as e:
        if comm.rank == 0:
            print(f"dcpkit demo: {e}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN

    import cupy

    cupy.cuda.Device(comm.local_rank % environment.gpu_count()[0]).use()
    say(
        f"{comm.world_size} ranks; model {model.name} (H = {model.num_heads}, D_qk = "
        f"{model.qk_dim}, D_v = {model.v_dim}), {args.dtype}, batch {args.batch}, context up to "
        f"{args.context}" + (", torch tensors" if args.torch else "")
    )

    try:
        report = run(args, comm, say)
    except DcpkitError as e:
        cause = e.__cause__
        if cause is not None and not isinstance(cause, DcpkitError):
            # a bug, not a refused input: the rank that hit it shows where
            traceback.print_exception(type(cause), cause, cause.__traceback__)
        if comm.rank == 0:
            print(f"dcpkit demo: {e}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN
    except Exception:
        if not owns_comm or comm.world_size == 1:
            raise
        # an error outside the agreed steps: the peers may be inside a collective already;
        # end the whole job rather than leave them waiting
        traceback.print_exc()
        print(
            f"dcpkit demo: rank {comm.rank} failed outside an agreed step; aborting the MPI "
            "job so that no rank is left waiting",
            file=sys.stderr,
            flush=True,
        )
        comm.handle.Abort(EXIT_CANNOT_RUN)
        raise
    report["versions"] = versions()
    report["argv"] = list(sys.argv[1:] if argv is None else argv)
    json_error = None
    if comm.rank == 0:
        print(format_report(report), flush=True)
        if args.json:
            json_error = write_output(
                args.json, lambda f: write_report(report, f), prog="dcpkit demo"
            )
            if json_error is None:
                say(f"report written to {args.json}")
    # the JSON exists before any rank returns
    if comm.broadcast(json_error, root=0) is not None:
        return EXIT_CANNOT_RUN
    return EXIT_PASS if report["check"]["verdict"] == "PASS" else EXIT_FAIL
