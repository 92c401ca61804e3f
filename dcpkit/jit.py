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
"""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import CompileError, MissingDependency

__all__ = ["kernels_dir", "VARIANTS", "source", "get_kernel", "compile_only", "DEFAULT_OPTIONS"]

#: NVRTC options used for every dcpkit kernel (CuPy adds ``-arch`` for the current device).
DEFAULT_OPTIONS: Tuple[str, ...] = ("-std=c++17",)

# C++ names of the element types the kernels are instantiated for.
_FLOAT_TYPES = ("dcpkit::bf16_t", "dcpkit::fp16_t", "float")
_TRANSPORTS = ("dcpkit::Transport::Unicast", "dcpkit::Transport::Multicast")
# Element types of the fallback copy kernel, by size: 1, 2, 4, 8 and 16 bytes.
_COPY_ELEMENTS = ("unsigned char", "unsigned short", "unsigned int", "uint2", "uint4")


def _lse_reduce_variants() -> List[str]:
    out = [f"dcpkit::lse_reduce_kernel<{out_t}, {lse_t}>"
           for out_t, lse_t in itertools.product(_FLOAT_TYPES, _FLOAT_TYPES)]
    out += [f"dcpkit::lse_combine_kernel<{out_t}>" for out_t in _FLOAT_TYPES]
    return out


def _gather_variants(name: str) -> List[str]:
    return [f"dcpkit::{name}<{t}>" for t in _TRANSPORTS]


#: kernel file -> every template variant (NVRTC name expression) dcpkit may launch from it.
VARIANTS: Dict[str, List[str]] = {
    "lse_reduce.cu": _lse_reduce_variants(),
    "q_gather.cu": _gather_variants("q_gather_kernel"),
    "kv_gather.cu": _gather_variants("kv_gather_push_kernel")
    + ["dcpkit::kv_gather_pull_kernel"],
    "ceilings.cu": [
        "dcpkit::pingpong_kernel", "dcpkit::egress_kernel", "dcpkit::barrier_kernel"],
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
        "reinstall dcpkit")


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)


def source(file: str) -> str:
    """The full translation unit of ``kernels/<file>``, local includes spliced in (once each).

    Each spliced header is framed by ``#line`` directives, so NVRTC's diagnostics name the
    original file and line (``dcpkit_ptx.cuh(120): error ...``). System includes
    (``#include <...>``) are left alone.
    """
    root = kernels_dir()
    seen = set()

    def expand(name: str) -> Optional[str]:
        if name in seen:
            return None
        seen.add(name)
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"dcpkit: kernels/{name} does not exist")
        text = path.read_text()

        def splice(m: "re.Match[str]") -> str:
            inner = expand(m.group(1))
            if inner is None:  # already spliced above: keep the line count
                return f"// kernels/{m.group(1)} is spliced in above"
            line = text.count("\n", 0, m.start()) + 1
            return f'#line 1 "{m.group(1)}"\n{inner}\n#line {line + 1} "{name}"'

        return _INCLUDE.sub(splice, text)

    return expand(file) or ""


_MODULES: Dict[tuple, object] = {}
_LOCK = threading.Lock()


def _cupy():
    try:
        import cupy  # noqa: WPS433
    except ImportError as e:
        from ._cuda import cuda_extra

        raise MissingDependency("cupy", cuda_extra(), str(e)) from None
    return cupy


def get_kernel(file: str, name_expr: str, options: Sequence[str] = ()):
    """The ``cupy.RawKernel`` for one template variant of ``kernels/<file>``, on the current
    device.

    Parameters
    ----------
    file : str
        Kernel file name in ``kernels/``, e.g. ``"lse_reduce.cu"``.
    name_expr : str
        One of ``VARIANTS[file]``.
    options : sequence of str
        Extra NVRTC options (appended to :data:`DEFAULT_OPTIONS`).

    Raises
    ------
    KeyError
        ``name_expr`` is not a registered variant of ``file``.
    CompileError
        NVRTC rejected the file; carries the file name, the options and the NVRTC log.
    """
    if name_expr not in VARIANTS.get(file, ()):
        raise KeyError(f"dcpkit.jit: {name_expr!r} is not a registered variant of kernels/{file}")
    cupy = _cupy()
    opts = tuple(DEFAULT_OPTIONS) + tuple(options)
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


def _nvrtc():
    try:
        from cuda.bindings import nvrtc  # noqa: WPS433
    except ImportError:
        try:
            from cuda import nvrtc  # noqa: WPS433
        except ImportError as e:
            from ._cuda import cuda_extra

            raise MissingDependency("cuda-bindings (NVRTC)", cuda_extra(), str(e)) from None
    return nvrtc


def nvrtc_version() -> Optional[Tuple[int, int]]:
    """The NVRTC library version as ``(major, minor)``, or None when NVRTC cannot be loaded."""
    try:
        nvrtc = _nvrtc()
        err, major, minor = nvrtc.nvrtcVersion()
        if int(err) != 0:
            return None
        return int(major), int(minor)
    except Exception:  # noqa: BLE001
        return None


def _compile_one(nvrtc, file: str, exprs: Iterable[str], opts: List[str]) -> Dict[str, int]:
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
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_s = log.decode(errors="replace").rstrip("\x00").strip()
        if int(res) != 0:
            raise CompileError(file, opts, log_s)
        if "warning" in log_s.lower():
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


def compile_only(files: Optional[Sequence[str]] = None, arch: str = "sm_90",
                 options: Sequence[str] = ()) -> Dict[str, Dict[str, int]]:
    """Compile kernel files and all their template variants with NVRTC, without a GPU.

    Parameters
    ----------
    files : sequence of str, optional
        Kernel file names (default: every file in :data:`VARIANTS`).
    arch : str
        Target, ``sm_XY`` (default ``sm_90``, Hopper).
    options : sequence of str
        Extra NVRTC options.

    Returns
    -------
    dict
        file -> ``{"cubin_bytes": int, "variants": int}``.

    Raises
    ------
    CompileError
        NVRTC rejected a file, or printed a warning for it.
    """
    nvrtc = _nvrtc()
    opts = list(DEFAULT_OPTIONS) + [f"-arch={arch}"] + list(options)
    out = {}
    for f in (files if files is not None else list(VARIANTS)):
        if f not in VARIANTS:
            raise KeyError(f"dcpkit.jit: kernels/{f} is not registered in VARIANTS")
        out[f] = _compile_one(nvrtc, f, VARIANTS[f], opts)
    return out
