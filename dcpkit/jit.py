"""The one entry point that compiles dcpkit's CUDA C++ (``kernels/``) at run time.

* :func:`get_kernel` loads a kernel for the current GPU: NVRTC through CuPy's ``RawModule``,
  every template variant of a file compiled in one NVRTC run (``name_expressions``), the module
  memoised per (file, options, device) and cached on disk by CuPy.
* :func:`compile_only` compiles every kernel file and every template variant with NVRTC alone
  (cuda-python's ``nvrtc`` bindings), for a target architecture (``sm_90`` by default). It needs
  no GPU and no driver, so CI runs it on CPU machines; the multicast variants are included.

Local ``#include "..."`` directives are spliced in before compilation, so the source CuPy hashes
for its disk cache is the whole translation unit and an edited header is never served stale.

Every template variant that dcpkit may launch is listed in :data:`VARIANTS`; ops pick their
kernel by one of these name expressions and :func:`get_kernel` refuses any other.

Target architectures: the kernels need **sm_70 (Volta) or newer** (the PTX memory-model
instructions of the signalling protocol: ``ld.acquire``, ``st.release``, ``fence.sc``); the
multicast variants run only on sm_90+ (below, their ``multimem`` stores compile to a trap and the
multicast guard never selects them). CUDA 13 toolkits start at sm_75 (Turing). dcpkit is
targeted at, and measured on, **sm_90** (H200); CI compiles every file for sm_90, sm_80 and
sm_70 (where the installed NVRTC still supports it).
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from ._cuda import require_cupy
from .errors import CompileError, InvalidArgument, InvalidType, MissingDependency

__all__ = [
    "kernels_dir",
    "VARIANTS",
    "source",
    "get_kernel",
    "compile_only",
    "DEFAULT_OPTIONS",
    "nvrtc_version",
    "nvrtc_archs",
]

#: NVRTC options used for every dcpkit kernel (CuPy adds ``-arch`` for the current device).
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17",)

# C++ names of the element types the kernels are instantiated for.
_FLOAT_TYPES = ("dcpkit::bf16_t", "dcpkit::fp16_t", "float")
_TRANSPORTS = ("dcpkit::Transport::Unicast", "dcpkit::Transport::Multicast")
# Element types of the fallback copy kernel, by size: 1, 2, 4, 8 and 16 bytes.
_COPY_ELEMENTS = ("unsigned char", "unsigned short", "unsigned int", "uint2", "uint4")


def _lse_reduce_variants() -> list[str]:
    out = [
        f"dcpkit::lse_reduce_kernel<{out_t}, {lse_t}, {large}>"
        for out_t, lse_t, large in itertools.product(_FLOAT_TYPES, _FLOAT_TYPES, ("false", "true"))
    ]
    out += [f"dcpkit::lse_combine_kernel<{out_t}>" for out_t in _FLOAT_TYPES]
    return out


def _gather_variants(name: str) -> list[str]:
    return [f"dcpkit::{name}<{t}>" for t in _TRANSPORTS]


#: kernel file -> every template variant (NVRTC name expression) dcpkit may launch from it.
VARIANTS: dict[str, list[str]] = {
    "lse_reduce.cu": _lse_reduce_variants(),
    "q_gather.cu": _gather_variants("q_gather_kernel"),
    "kv_gather.cu": _gather_variants("kv_gather_push_kernel") + ["dcpkit::kv_gather_pull_kernel"],
    "ceilings.cu": [
        "dcpkit::pingpong_kernel",
        "dcpkit::egress_kernel",
        "dcpkit::barrier_kernel",
        "dcpkit::floor_kernel",
    ],
    # what each step of a small exchange costs (scripts/protocol_probe.py; not an op kernel)
    "protocol_probe.cu": ["dcpkit::protocol_probe_kernel"],
    # local kernels of the NCCL fallback ops (dcpkit/fallback.py)
    "fallback.cu": [f"dcpkit::fallback_copy_kernel<{e}>" for e in _COPY_ELEMENTS]
    + [f"dcpkit::fallback_lse_mask_kernel<{t}>" for t in _FLOAT_TYPES + ("double",)]
    + [f"dcpkit::fallback_lse_weight_kernel<{t}>" for t in _FLOAT_TYPES]
    + [f"dcpkit::fallback_cast_kernel<{t}>" for t in _FLOAT_TYPES],
}


def kernels_dir() -> Path:
    """The folder holding the CUDA sources: ``dcpkit/kernels`` in a wheel, ``kernels/`` in a
    source checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):
        if (cand / "dcpkit_ptx.cuh").is_file():
            return cand
    raise FileNotFoundError(
        f"dcpkit: CUDA sources not found in {here / 'kernels'} or {here.parent / 'kernels'}; "
        "reinstall dcpkit"
    )


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)


def source(file: str) -> str:
    """The full translation unit of ``kernels/<file>``, local includes spliced in (once each).

    Each spliced header is framed by ``#line`` directives, so NVRTC's diagnostics name the
    original file and line (``dcpkit_ptx.cuh(120): error ...``). System includes
    (``#include <...>``) are left alone.
    """
    root = kernels_dir()
    seen = set()

    def expand(name: str) -> str | None:
        if name in seen:
            return None
        seen.add(name)
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"dcpkit: kernels/{name} does not exist")
        text = path.read_text()

        def splice(m: re.Match[str]) -> str:
            inner = expand(m.group(1))
            if inner is None:  # already spliced above: keep the line count
                return f"// kernels/{m.group(1)} is spliced in above"
            line = text.count("\n", 0, m.start()) + 1
            return f'#line 1 "{m.group(1)}"\n{inner}\n#line {line + 1} "{name}"'

        return _INCLUDE.sub(splice, text)

    return expand(file) or ""


_MODULES: dict[tuple, object] = {}
_LOCK = threading.Lock()


def _known_files() -> str:
    return ", ".join(sorted(VARIANTS))


def _check_file(file, op: str) -> str:
    """``file`` if it is a kernel file registered in :data:`VARIANTS`, else a clear error."""
    if not isinstance(file, str):
        raise InvalidType(
            f"{op}: file must be a kernel file name (str) registered in "
            f"jit.VARIANTS [{_known_files()}] (got {type(file).__name__} {file!r})"
        )
    if file not in VARIANTS:
        raise InvalidArgument(
            f"{op}: file must be one of the kernel files registered in "
            f"jit.VARIANTS [{_known_files()}] (got {file!r})"
        )
    return file


def _files_arg(files, op: str) -> list[str]:
    """``files`` of :func:`compile_only` as a list: None = every file, a str = one file."""
    if files is None:
        return list(VARIANTS)
    if isinstance(files, str):
        return [_check_file(files, op)]
    if isinstance(files, (bytes, bytearray, memoryview)):  # a sequence of ints, not of names
        raise InvalidType(
            f"{op}: files must be None, a kernel file name or a sequence of them "
            f"(got {type(files).__name__} {files!r})"
        )
    try:
        items = list(files)
    except TypeError:
        raise InvalidType(
            f"{op}: files must be None, a kernel file name or a sequence of them "
            f"(got {type(files).__name__} {files!r})"
        ) from None
    return [_check_file(f, op) for f in items]


def _options_arg(options, op: str) -> tuple[str, ...]:
    """Extra NVRTC options as a tuple of str: None = none, a str = one option."""
    if options is None:
        return ()
    if isinstance(options, str):
        return (options,)
    if isinstance(options, (bytes, bytearray, memoryview)):  # a sequence of ints
        raise InvalidType(
            f"{op}: options must be None, a str or a sequence of str "
            f"(got {type(options).__name__} {options!r})"
        )
    try:
        items = tuple(options)
    except TypeError:
        raise InvalidType(
            f"{op}: options must be None, a str or a sequence of str "
            f"(got {type(options).__name__} {options!r})"
        ) from None
    bad = [o for o in items if not isinstance(o, str)]
    if bad:
        raise InvalidType(
            f"{op}: options entries must be str, e.g. '-lineinfo' "
            f"(got {bad[0]!r} of type {type(bad[0]).__name__} in {options!r})"
        )
    return items


def get_kernel(file: str, name_expr: str, options: Sequence[str] = ()):
    """The ``cupy.RawKernel`` for one template variant of ``kernels/<file>``, on the current
    device.

    Parameters
    ----------
    file : str
        Kernel file name in ``kernels/``, e.g. ``"lse_reduce.cu"``.
    name_expr : str
        One of ``VARIANTS[file]``.
    options : str or sequence of str, optional
        Extra NVRTC options (appended to :data:`DEFAULT_OPTIONS`); a str is one option, None
        none.

    Raises
    ------
    InvalidArgument
        ``file`` is not a registered kernel file, or ``name_expr`` not one of its variants.
    InvalidType
        ``file`` / ``name_expr`` is not a str, or ``options`` holds something else than str.
    CompileError
        NVRTC rejected the file; carries the file name, the options and the NVRTC log.
    """
    op = "jit.get_kernel"
    _check_file(file, op)
    if not isinstance(name_expr, str):
        raise InvalidType(
            f"{op}: name_expr must be a str, one of jit.VARIANTS[{file!r}] "
            f"(got {type(name_expr).__name__} {name_expr!r})"
        )
    if name_expr not in VARIANTS[file]:
        raise InvalidArgument(
            f"{op}: name_expr must be a registered variant of kernels/{file}, one of "
            f"jit.VARIANTS[{file!r}]: {', '.join(VARIANTS[file])} (got {name_expr!r})"
        )
    opts = tuple(DEFAULT_OPTIONS) + _options_arg(options, op)
    cupy = require_cupy()
    from ._cuda import require_device

    require_device("jit.get_kernel")
    dev = cupy.cuda.runtime.getDevice()
    key = (file, opts, dev)
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is None:
            code = source(file)
            try:
                mod = cupy.RawModule(code=code, options=opts, name_expressions=VARIANTS[file])
                mod.compile()
            except cupy.cuda.compiler.CompileException as e:
                raise CompileError(file, opts, str(e)) from None
            _MODULES[key] = mod
    try:
        return mod.get_function(name_expr)
    except cupy.cuda.compiler.CompileException as e:  # pragma: no cover - lazy compile path
        raise CompileError(file, opts, str(e)) from None


def module_global(file: str, name: str, options: Sequence[str] = ()) -> int:
    """Device address of the ``extern "C"`` global ``name`` in the module of ``kernels/<file>``
    compiled with ``options`` on the current device (compiled here if no kernel of it was
    taken yet). For diagnostics builds, e.g. the timeline buffer of ``-DDCPKIT_TIMELINE=1``
    (scripts/kernel_timeline.py).

    Raises
    ------
    InvalidArgument, InvalidType
        As :func:`get_kernel` for ``file`` / ``options``; ``name`` is not a str or not a global
        of that module.
    CompileError
        As :func:`get_kernel`.
    """
    op = "jit.module_global"
    if not isinstance(name, str):
        raise InvalidType(f"{op}: name must be a str (got {type(name).__name__} {name!r})")
    get_kernel(file, VARIANTS[_check_file(file, op)][0], options)  # compiled and cached
    cupy = require_cupy()
    key = (file, tuple(DEFAULT_OPTIONS) + _options_arg(options, op), cupy.cuda.runtime.getDevice())
    with _LOCK:
        mod = _MODULES[key]
    try:
        return int(mod.get_global(name).ptr)
    except Exception as e:  # noqa: BLE001 - CuPy raises its own error type for an unknown name
        raise InvalidArgument(
            f"{op}: name must be a global of kernels/{file} built with {list(options)} "
            f"(got {name!r}: {e})"
        ) from None


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc
        except ImportError as e:
            from ._cuda import cuda_extra

            raise MissingDependency("cuda-bindings (NVRTC)", cuda_extra(), str(e)) from None
    return nvrtc


def nvrtc_version() -> tuple[int, int] | None:
    """The NVRTC library version as ``(major, minor)``, or None when NVRTC cannot be loaded."""
    try:
        nvrtc = _nvrtc()
        err, major, minor = nvrtc.nvrtcVersion()
        if int(err) != 0:
            return None
        return int(major), int(minor)
    except Exception:  # noqa: BLE001
        return None


def nvrtc_archs() -> list[int] | None:
    """The ``sm_XY`` targets the loaded NVRTC can compile for, as ints ``XY`` (e.g. ``[75, 80,
    86, 89, 90, ...]``), or None when NVRTC cannot be loaded or cannot tell."""
    try:
        nvrtc = _nvrtc()
        err, archs = nvrtc.nvrtcGetSupportedArchs()
        if int(err) != 0:
            return None
        return [int(a) for a in archs]
    except Exception:  # noqa: BLE001
        return None


_ARCH = re.compile(r"sm_([0-9]+)[af]?")  # fullmatch; ASCII digits (int() reads others too)
#: Oldest target the kernels compile for (kernels/dcpkit_ptx.cuh, "Target architectures").
MIN_ARCH = 70

# What NVRTC itself prints for an old but still supported target: a note about the toolkit, not a
# warning in dcpkit's kernels.
_NVRTC_ARCH_NOTE = re.compile(r"^nvrtc: warning: Architectures prior to .* are deprecated.*$", re.M)


def _compile_one(nvrtc, file: str, exprs: Iterable[str], opts: list[str]) -> dict[str, int]:
    code = source(file).encode()
    err, prog = nvrtc.nvrtcCreateProgram(code, file.encode(), 0, [], [])
    if int(err) != 0:
        raise CompileError(file, opts, f"nvrtcCreateProgram: {err}")
    try:
        exprs = list(exprs)
        for e in exprs:
            (r,) = nvrtc.nvrtcAddNameExpression(prog, e.encode())
            if int(r) != 0:
                raise CompileError(file, opts, f"nvrtcAddNameExpression({e}): {r}")
        bopts = [o.encode() for o in opts]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        # NVRTC writes into the buffer: a bytearray of its own. (b" " * n is immutable, and for
        # n = 1, a clean compile's log, it is the interpreter's shared b" ", which the NUL then
        # overwrote for the whole process.)
        log = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_s = log.decode(errors="replace").rstrip("\x00").strip()
        if int(res) != 0:
            raise CompileError(file, opts, log_s)
        if "warning" in _NVRTC_ARCH_NOTE.sub("", log_s).lower():
            # A warning in our own kernels is a bug to fix, not noise to ship.
            raise CompileError(file, opts, "warnings are errors in dcpkit kernels:\n" + log_s)
        lowered = {}
        for e in exprs:
            r, name = nvrtc.nvrtcGetLoweredName(prog, e.encode())
            if int(r) != 0:
                raise CompileError(file, opts, f"nvrtcGetLoweredName({e}): {r}")
            lowered[e] = name
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        return {"cubin_bytes": int(size), "variants": len(exprs)}
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_only(
    files: Sequence[str] | None = None, arch: str = "sm_90", options: Sequence[str] = ()
) -> dict[str, dict[str, int]]:
    """Compile kernel files and all their template variants with NVRTC, without a GPU.

    Parameters
    ----------
    files : str or sequence of str, optional
        Kernel file names registered in :data:`VARIANTS` (default None: every file); a str is
        one file.
    arch : str
        Target, ``sm_XY`` (default ``sm_90``, Hopper; the kernels need ``sm_70`` or newer).
    options : str or sequence of str, optional
        Extra NVRTC options; a str is one option, None none.

    Returns
    -------
    dict
        file -> ``{"cubin_bytes": int, "variants": int}``.

    Raises
    ------
    InvalidArgument
        A file is not registered in :data:`VARIANTS`, or ``arch`` is not an ``sm_XY`` target.
    InvalidType
        ``files``, ``arch`` or ``options`` has the wrong type.
    CompileError
        NVRTC rejected a file, or printed a warning for it (NVRTC's own note that an old
        target is deprecated is not one).
    """
    op = "jit.compile_only"
    todo = _files_arg(files, op)
    if not isinstance(arch, str):
        raise InvalidType(
            f"{op}: arch must be a str such as 'sm_90' (got {type(arch).__name__} {arch!r})"
        )
    m = _ARCH.fullmatch(arch)
    if not m:
        raise InvalidArgument(f"{op}: arch must be a real target such as 'sm_90' (got {arch!r})")
    extra = _options_arg(options, op)
    nvrtc = _nvrtc()
    archs = nvrtc_archs()
    if archs and int(m.group(1)) not in archs:
        raise InvalidArgument(
            f"{op}: arch must be a target this NVRTC supports "
            f"[{', '.join(f'sm_{a}' for a in archs)}] (got {arch!r})"
        )
    if int(m.group(1)) < MIN_ARCH:
        raise InvalidArgument(
            f"{op}: arch must be sm_{MIN_ARCH} or newer: the kernels use the memory-model "
            f"instructions of Volta (got {arch!r})"
        )
    opts = list(DEFAULT_OPTIONS) + [f"-arch={arch}"] + list(extra)
    out = {}
    for f in todo:
        out[f] = _compile_one(nvrtc, f, VARIANTS[f], opts)
    return out
