"""``python -m dcpkit info``: what dcpkit finds on this machine.

Prints the versions of dcpkit and of everything it runs on (CuPy, cuda-bindings, NVRTC, NCCL,
NVSHMEM, mpi4py and the MPI library), the GPUs with compute capability, SM count and memory,
the peer-to-peer access matrix, and whether multicast is supported, whether dcpkit would use it
and, if not, why; then a ``warning:`` line for each mix of CUDA 12 and CUDA 13 parts it finds.
``--json`` prints the same as one JSON object. Under ``mpirun`` only the launcher's rank 0
prints (read from ``OMPI_COMM_WORLD_RANK`` / ``PMIX_RANK`` / ``PMI_RANK``) unless
``--all-ranks`` is given.

Every probe is read-only: nothing is allocated on a GPU and no multicast object is created.
On a machine without GPU or CUDA driver it says so and exits 0. The library version is read
with ``mpi4py.rc.initialize = False``. MPI is initialised only inside a real launcher's job of
several processes, where the ranks first agree on their command lines (a rank running ``info``
beside ranks running another command would leave those waiting; NOTE [dcpkit agreed parse]).
"""

from __future__ import annotations

import importlib.metadata as _md
import json
import os
import platform
import sys
from typing import Any

from ._cuda import NO_DRIVER as _NO_DRIVER
from .cli import CommandParser, joins_agreement, launcher_rank, pipe_safe

__all__ = [
    "collect",
    "format_text",
    "main",
    "no_driver_reason",
    "launcher_rank",
    "stack_warnings",
    "CUDA_PACKAGES",
]

#: Variables that decide whether multicast may be used (printed when set).
MULTICAST_ENV = (
    "DCPKIT_MULTICAST",
    "DCPKIT_DISABLE_MULTICAST",
    "NCCL_NVLS_ENABLE",
    "NVSHMEM_DISABLE_NVLS",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
)
_OTHER_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def _settings() -> dict[str, Any]:
    """The settings the ops read from the environment: the default wait deadline
    (``DCPKIT_TIMEOUT_MS``, read by ops built without ``timeout_ms``, or why they would refuse
    it) and ``DCPKIT_DEBUG``."""
    from ._checks import default_timeout_ms
    from ._setup import debug_enabled
    from .errors import InvalidArgument

    out: dict[str, Any] = {"debug": debug_enabled(), "timeout_ms": None, "timeout_error": None}
    try:
        out["timeout_ms"] = default_timeout_ms("dcpkit info")
    except InvalidArgument as e:
        out["timeout_error"] = str(e)
    return out


def _dist_version(name: str) -> str | None:
    try:
        return _md.version(name)
    except _md.PackageNotFoundError:
        return None


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def _versions() -> dict[str, Any]:
    import dcpkit

    v: dict[str, Any] = {
        "dcpkit": dcpkit.__version__,
        "dcpkit_path": os.path.dirname(os.path.abspath(dcpkit.__file__)),
        "python": platform.python_version(),
        "numpy": _dist_version("numpy"),
    }
    # CuPy and the CUDA runtime it loads (the runtime version needs no driver).
    try:
        import cupy

        v["cupy"] = cupy.__version__
        try:
            rt = cupy.cuda.runtime.runtimeGetVersion()
            v["cuda_runtime"] = f"{rt // 1000}.{(rt % 1000) // 10}"
        except Exception as e:  # noqa: BLE001 - report, never crash
            v["cuda_runtime"] = None
            v["cuda_runtime_error"] = _err(e)
    except Exception as e:  # noqa: BLE001
        v["cupy"] = None
        v["cupy_error"] = _err(e)
    v["cuda_bindings"] = _dist_version("cuda-bindings") or _dist_version("cuda-python")
    from . import jit

    nv = jit.nvrtc_version()
    v["nvrtc"] = f"{nv[0]}.{nv[1]}" if nv else None
    # NCCL through CuPy (the fallback path uses cupy.cuda.nccl).
    v["nccl"] = None
    try:
        from cupy.cuda import nccl

        if getattr(nccl, "available", True):
            n = int(nccl.get_version())
            # NCCL >= 2.9 encodes major*10000 + minor*100 + patch; older ones major*1000 + ...
            v["nccl"] = (
                f"{n // 10000}.{(n % 10000) // 100}.{n % 100}"
                if n >= 20900
                else f"{n // 1000}.{(n % 1000) // 100}.{n % 100}"
            )
        else:
            v["nccl_error"] = "cupy.cuda.nccl is not available (no NCCL library found)"
    except Exception as e:  # noqa: BLE001
        v["nccl_error"] = _err(e)
    # NVSHMEM: distribution metadata only (importing nvshmem4py may initialise things).
    v["nvshmem"] = {
        name: ver
        for name in (
            "nvshmem4py-cu12",
            "nvshmem4py-cu13",
            "nvidia-nvshmem-cu12",
            "nvidia-nvshmem-cu13",
        )
        if (ver := _dist_version(name)) is not None
    }
    # mpi4py and the MPI library, without initialising MPI.
    v["mpi4py"] = _dist_version("mpi4py")
    v["mpi_library"] = None
    if v["mpi4py"] is not None:
        try:
            if "mpi4py.MPI" not in sys.modules:
                import mpi4py

                mpi4py.rc.initialize = False
                mpi4py.rc.finalize = False
            from mpi4py import MPI

            from .comm import library_line

            text = MPI.Get_library_version()
            v["mpi_library"] = library_line(text)
            v["mpi_launcher_mismatch"] = _launcher_mismatch(MPI, text)
        except Exception as e:  # noqa: BLE001
            v["mpi_library_error"] = _err(e)
    v["torch"] = _dist_version("torch")
    v["cuda_packages"] = {
        name: ver for name in CUDA_PACKAGES if (ver := _dist_version(name)) is not None
    }
    return v


def _launcher_mismatch(MPI, library_version: str) -> str | None:
    """What :meth:`Communicator.from_mpi` would refuse under this launcher, by its own checks,
    or None: a library that cannot start under the launcher (asked before ``MPI_Init``); else,
    where a launcher says it started several processes but no variable lets ``MPI_Init`` join
    them (:func:`~dcpkit.comm.mpi_init_may_join_a_job`), the one-rank ``MPI.COMM_WORLD`` that
    ``MPI_Init`` then starts (MPI is initialised for that, as ``from_mpi`` would: at once, no
    peer to wait for). Under a launcher whose job ``MPI_Init`` would join, MPI is left alone:
    the ranks other than 0 print nothing and would never join it."""
    from .comm import (
        import_mpi,
        launcher_library_mismatch,
        launcher_world_size,
        launcher_world_size_mismatch,
        mpi_init_may_join_a_job,
    )

    if not MPI.Is_initialized():
        why = launcher_library_mismatch(os.environ, library_version)
        if why is not None or launcher_world_size(os.environ) is None:
            return why
        if mpi_init_may_join_a_job(os.environ):
            return None
    return launcher_world_size_mismatch(os.environ, import_mpi())


#: Installed distributions that belong to one CUDA major, and that major (``dcpkit info`` warns
#: when those of two majors sit in one environment); None: the major of the package's own
#: version (the CUDA 13 wheels dropped the ``-cuXX`` suffix).
CUDA_PACKAGES = {
    "cupy-cuda12x": 12,
    "cupy-cuda13x": 13,
    "nvidia-cuda-runtime-cu12": 12,
    "nvidia-cuda-runtime": None,
    "nvidia-cuda-nvrtc-cu12": 12,
    "nvidia-cuda-nvrtc": None,
    "nvidia-nccl-cu12": 12,
    "nvidia-nccl-cu13": 13,
    "nvidia-nvshmem-cu12": 12,
    "nvidia-nvshmem-cu13": 13,
    "nvshmem4py-cu12": 12,
    "nvshmem4py-cu13": 13,
}


def _major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def stack_warnings(versions: dict[str, Any], driver: dict[str, Any] | None = None) -> list[str]:
    """Warnings about a mixed CUDA stack, one line each (empty when the stack is consistent).

    A CUDA 12 and a CUDA 13 stack in one environment (both ``cuda12`` and ``cuda13`` extras
    installed, or parts of each) make CuPy warn at every import and load libraries of the wrong
    major. Compared: the CUDA major of every installed CUDA wheel (:data:`CUDA_PACKAGES`),
    cuda-bindings' major, the CUDA runtime CuPy loads and the NVRTC dcpkit loads; and the driver
    against the runtime (a CUDA 13 runtime needs a CUDA 13 driver).
    """
    out: list[str] = []
    pkgs = versions.get("cuda_packages") or {}
    by_major: dict[int, list[str]] = {}
    for name, ver in pkgs.items():
        major = CUDA_PACKAGES.get(name) or _major(ver)
        if major is not None:
            by_major.setdefault(major, []).append(f"{name} {ver}")
    parts = {}  # component -> major
    if versions.get("cuda_bindings"):
        parts["cuda-bindings"] = (_major(versions["cuda_bindings"]), versions["cuda_bindings"])
    if versions.get("cuda_runtime"):
        parts["CUDA runtime"] = (_major(versions["cuda_runtime"]), versions["cuda_runtime"])
    if versions.get("nvrtc"):
        parts["NVRTC"] = (_major(versions["nvrtc"]), versions["nvrtc"])
    if "cupy-cuda12x" in pkgs and "cupy-cuda13x" in pkgs:
        out.append(
            f"both cupy-cuda12x {pkgs['cupy-cuda12x']} and cupy-cuda13x "
            f"{pkgs['cupy-cuda13x']} are installed: they share the cupy module, so one "
            f"overwrites the other; uninstall the one that does not match the driver"
        )
    if len(by_major) > 1:
        listed = "; ".join(f"CUDA {m}: {', '.join(sorted(n))}" for m, n in sorted(by_major.items()))
        out.append(
            f"wheels of two CUDA majors are installed ({listed}): install one of the "
            f"cuda12 / cuda13 extras per environment, never both"
        )
    majors = {m for m, _ in parts.values() if m is not None}
    if len(majors) > 1:
        listed = ", ".join(f"{k} {ver}" for k, (_, ver) in parts.items())
        out.append(
            f"mixed CUDA majors: {listed}; they must all be CUDA 12 (extra cuda12) or "
            f"all CUDA 13 (extra cuda13)"
        )
    drv = driver or {}
    rt = versions.get("cuda_runtime")
    if drv.get("ok") and drv.get("version") and rt:
        try:
            older = tuple(map(int, str(drv["version"]).split("."))) < tuple(
                map(int, str(rt).split("."))
            )
        except ValueError:
            older = False
        if older and _major(drv["version"]) != _major(rt):
            out.append(
                f"the CUDA driver ({drv['version']}) is older than the CUDA runtime CuPy "
                f"loads ({rt}): install the cuda{_major(drv['version'])} extra instead"
            )
    return out


def _driver_probe() -> dict[str, Any]:
    """cuInit and the driver version through cuda-bindings; never raises."""
    out: dict[str, Any] = {"ok": False, "version": None, "error": None}
    try:
        from ._cuda import driver

        drv = driver()
        (res,) = drv.cuInit(0)
        if int(res) != 0:
            out["error"] = f"cuInit failed with {getattr(res, 'name', res)}"
            return out
        res, ver = drv.cuDriverGetVersion()
        if int(res) == 0:
            out["version"] = f"{ver // 1000}.{(ver % 1000) // 10}"
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - DynamicLibNotFoundError when libcuda is missing
        out["error"] = _err(e)
    return out


def _libcuda_loads() -> bool:
    """Whether the CUDA driver library can be loaded (ctypes; no cuInit, no other side effect
    than mapping the library)."""
    from ._cuda import driver_library_loads

    return driver_library_loads()


def no_driver_reason(probe: dict[str, Any] | None = None) -> str | None:
    """``"no CUDA driver found (...)"`` when this machine has no CUDA driver library, else None.

    The answer of :func:`_driver_probe` (cuda-bindings' loader) where it ran; where
    cuda-bindings is missing, whether ``libcuda`` loads with ctypes. ``demo`` and ``bench`` use
    it so that a machine without driver is not reported as a driver/runtime version mismatch
    (CuPy's ``cudaErrorInsufficientDriver``). Never raises.
    """
    try:
        p = _driver_probe() if probe is None else probe
        if p.get("ok"):
            return None
        err = str(p.get("error") or "")
        missing_lib = err.startswith("DynamicLibNotFoundError") or (
            ("libcuda" in err or "nvcuda" in err) and "cannot open" in err
        )
        if not missing_lib and (err.startswith("MissingDependency") or not err):
            missing_lib = not _libcuda_loads()
        if missing_lib:
            return (
                "no CUDA driver found (the NVIDIA driver library libcuda.so.1 cannot be "
                "loaded on this machine)"
            )
    except Exception:  # noqa: BLE001 - a probe never raises
        return None
    return None


def _attr(drv, dev, name: str) -> int | None:
    attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name, None)
    if attr is None:
        return None
    res, val = drv.cuDeviceGetAttribute(attr, dev)
    return int(val) if int(res) == 0 else None


def _gpus(driver_ok: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"count": 0, "gpus": [], "p2p": [], "error": None}
    try:
        import cupy

        rt = cupy.cuda.runtime
        n = rt.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError without driver, ImportError, ...
        out["error"] = _err(e)
        return out
    out["count"] = n
    drv = None
    if driver_ok:
        from ._cuda import driver

        drv = driver()
    for d in range(n):
        g: dict[str, Any] = {"index": d}
        try:
            p = rt.getDeviceProperties(d)
            name = p["name"]
            g["name"] = name.decode() if isinstance(name, bytes) else str(name)
            g["compute_capability"] = f"{p['major']}.{p['minor']}"
            g["sm_count"] = int(p["multiProcessorCount"])
            g["memory_bytes"] = int(p["totalGlobalMem"])
        except Exception as e:  # noqa: BLE001
            g["error"] = _err(e)
        if drv is not None:
            try:
                res, dev = drv.cuDeviceGet(d)
                if int(res) == 0:
                    g["multicast_supported"] = _attr(drv, dev, "MULTICAST_SUPPORTED")
                    g["vmm_supported"] = _attr(drv, dev, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")
                    g["posix_fd_handles"] = _attr(
                        drv, dev, "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
                    )
                    g["fabric_handles"] = _attr(drv, dev, "HANDLE_TYPE_FABRIC_SUPPORTED")
            except Exception as e:  # noqa: BLE001
                g["attribute_error"] = _err(e)
        out["gpus"].append(g)
    p2p: list[list[bool | None]] = []
    for i in range(n):
        row: list[bool | None] = []
        for j in range(n):
            if i == j:
                row.append(None)
                continue
            try:
                row.append(bool(rt.deviceCanAccessPeer(i, j)))
            except Exception:  # noqa: BLE001
                row.append(False)
        p2p.append(row)
    out["p2p"] = p2p
    return out


def _multicast(gpus: list[dict[str, Any]]) -> dict[str, Any]:
    flags = [g.get("multicast_supported") for g in gpus]
    # None: no GPU, or the attribute could not be read: then nothing was queried and the
    # answer is "unknown", never "the device reports 0".
    known = bool(gpus) and all(f is not None for f in flags)
    supported = known and all(f == 1 for f in flags)
    if known:
        unknown_why = None
    elif not gpus:
        unknown_why = (
            "unknown (no GPU/driver: CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED was not queried)"
        )
    else:
        unknown_why = "unknown (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED could not be read)"
    asked = []

    def device_supported() -> bool:  # called by the guard only when rules 1 and 2 pass
        asked.append(True)
        return supported

    out: dict[str, Any] = {
        "device_supported": supported if known else None,
        "used": None,
        "reason": None,
    }
    try:
        from .errors import InvalidArgument
        from .multicast import multicast_decision
    except ModuleNotFoundError as e:
        if e.name not in ("dcpkit.multicast",):
            out["reason"] = f"unknown (dcpkit.multicast failed to import: {_err(e)})"
        else:
            out["reason"] = "unknown (dcpkit.multicast not available)"
        return out
    except Exception as e:  # noqa: BLE001
        out["reason"] = f"unknown (dcpkit.multicast failed to import: {_err(e)})"
        return out
    env = dict(os.environ)

    def decide(opt_in: bool | None) -> tuple[bool | None, str]:
        """One question to the guard; each is asked on its own, so that a variable that only
        one of them reads (DCPKIT_MULTICAST without opt-in, the disabling variables with it)
        spoils only that answer."""
        asked.clear()
        try:
            use, reason = multicast_decision(opt_in, env, device_supported)
        except InvalidArgument as e:  # the ops raise the same at construction
            return None, f"refused: {e} (an op asked this question raises this error)"
        except Exception as e:  # noqa: BLE001
            return None, f"unknown (multicast_decision failed: {_err(e)})"
        if asked and unknown_why is not None:  # the answer hinged on the unknown attribute
            return (bool(use) if opt_in is None else None), unknown_why
        return bool(use), str(reason)

    out["used"], out["reason"] = decide(None)
    # The same question for a user who opts in: shows which variable or attribute would still
    # refuse (a decision only: nothing is created).
    out["used_if_opted_in"], out["reason_if_opted_in"] = decide(True)
    return out


def collect() -> dict[str, Any]:
    """Everything ``info`` reports, as a JSON-serialisable dict. Never raises for a missing
    GPU, driver or optional package."""
    info: dict[str, Any] = {"versions": _versions()}
    drv = _driver_probe()
    info["driver"] = drv
    g = _gpus(drv["ok"])
    info["gpu_count"] = g["count"]
    info["gpus"] = g["gpus"]
    info["p2p"] = g["p2p"]
    v = info["versions"]
    missing = []  # packages without which GPUs and driver cannot be checked
    if v.get("cupy") is None:
        missing.append("CuPy")
    if not drv["ok"] and str(drv["error"]).startswith("MissingDependency"):
        missing.append("cuda-bindings")
    info["missing"] = missing
    if missing:
        from ._cuda import cuda_extra

        info["missing_hint"] = (
            f"missing or not importable: {', '.join(missing)}; pip install 'dcpkit[{cuda_extra()}]'"
        )
    info["driver_library"] = None if drv["ok"] else _libcuda_loads()
    if g["count"] == 0:
        if "CuPy" in missing:
            why = f"not checked ({info['missing_hint']})"
        elif not drv["ok"] and not info["driver_library"]:
            why = _NO_DRIVER
        elif not drv["ok"] and "cuda-bindings" not in missing:
            why = f"no usable CUDA driver on this machine: {drv['error']}"
        else:
            why = g["error"] or "the CUDA driver reports no device"
        info["no_gpu_reason"] = why
    info["warnings"] = stack_warnings(v, drv)
    if v.get("mpi_launcher_mismatch"):
        info["warnings"].append(
            f"{v['mpi_launcher_mismatch']}: Communicator.from_mpi (demo, bench, the examples) "
            "refuses to start here; launch with the mpirun of that library, or install mpi4py "
            "against the MPI of this mpirun"
        )
    info["multicast"] = _multicast(g["gpus"])
    info["settings"] = st = _settings()
    if st["timeout_error"]:
        info["warnings"].append(
            f"{st['timeout_error']}; until it is fixed or unset, ops built without timeout_ms "
            "refuse to build (an explicit timeout_ms= does not read the variable), and dcpkit "
            "demo, dcpkit bench and scripts/soak.py refuse to start, also with --timeout-ms"
        )
    info["env"] = {k: os.environ[k] for k in MULTICAST_ENV + _OTHER_ENV if k in os.environ}
    return info


def _yn(v) -> str:
    return "n/a" if v is None else ("yes" if v else "no")


def format_text(info: dict[str, Any]) -> str:
    """The human-readable report of :func:`collect`'s dict."""
    v = info["versions"]
    who = f"  [launcher rank {info['launcher_rank']}]" if "launcher_rank" in info else ""
    lines = [
        f"dcpkit {v['dcpkit']}  ({v['dcpkit_path']}){who}",
        f"python {v['python']}, numpy {v['numpy']}",
        "",
        "versions",
    ]

    def row(name, val, err_key=None):
        if val is None:
            val = "not installed"
            if err_key and v.get(err_key):
                val = f"not available ({v[err_key]})"
        lines.append(f"  {name:<15}{val}")

    cupy_v = v.get("cupy")
    if cupy_v is not None and v.get("cuda_runtime"):
        cupy_v = f"{cupy_v} (CUDA runtime {v['cuda_runtime']})"
    row("CuPy", cupy_v, "cupy_error")
    row("cuda-bindings", v.get("cuda_bindings"))
    row("NVRTC", v.get("nvrtc"))
    row("NCCL", v.get("nccl"), "nccl_error")
    nvs = v.get("nvshmem") or {}
    row("NVSHMEM", ", ".join(f"{k} {x}" for k, x in nvs.items()) or None)
    row("mpi4py", v.get("mpi4py"))
    row("MPI library", v.get("mpi_library"), "mpi_library_error")
    row("torch", v.get("torch"))
    lines.append("")
    drv = info["driver"]
    missing = info.get("missing") or []
    if drv["ok"]:
        drv_text = drv["version"]
    elif "cuda-bindings" in missing:
        lib = {
            True: "libcuda.so.1 loads",
            False: "libcuda.so.1 cannot be loaded",
            None: "libcuda.so.1 not checked",
        }[info.get("driver_library")]
        drv_text = f"version not read ({info['missing_hint']}); {lib}"
    elif info.get("driver_library") is False:
        drv_text = f"not found ({_NO_DRIVER})"
    else:
        drv_text = f"not usable: {drv['error']}"
    lines.append(f"CUDA driver      {drv_text}")
    n = info["gpu_count"]
    if n == 0 and "CuPy" in missing:
        lines.append(f"GPUs             not checked ({info['missing_hint']})")
        lines.append("P2P access       not checked")
    elif n == 0:
        lines.append(f"GPUs             none: no GPU here ({info.get('no_gpu_reason')})")
        lines.append("P2P access       n/a (no GPU)")
    else:
        lines.append(f"GPUs             {n}")
        for g in info["gpus"]:
            if "error" in g:
                lines.append(f"  {g['index']}  {g['error']}")
                continue
            extra = (
                f"  multicast {_yn(g.get('multicast_supported'))}, "
                f"VMM {_yn(g.get('vmm_supported'))}, "
                f"POSIX-fd handles {_yn(g.get('posix_fd_handles'))}, "
                f"fabric handles {_yn(g.get('fabric_handles'))}"
            )
            sm = g["compute_capability"].replace(".", "")
            lines.append(
                f"  {g['index']}  {g['name']}  sm_{sm}"
                f"  {g['sm_count']} SMs  {g['memory_bytes'] / 2**30:.1f} GiB{extra}"
            )
        lines.append("P2P access       (row: from, column: to; Y = can access peer)")
        lines.append("      " + "".join(f"{j:>3}" for j in range(n)))
        for i, r in enumerate(info["p2p"]):
            cells = "".join(f"{'-' if c is None else ('Y' if c else 'N'):>3}" for c in r)
            lines.append(f"  {i:>3} {cells}")
        full = all(c is None or c for r in info["p2p"] for c in r)
        lines.append(f"  full P2P: {_yn(full)}")
    mc = info["multicast"]
    if mc["used"] is None and mc["reason"] and mc["reason"].startswith("unknown"):
        lines.append(f"multicast: {mc['reason']}")
    else:
        if mc["device_supported"] is not None:
            sup = _yn(mc["device_supported"])
        elif info["gpu_count"] == 0:
            sup = "n/a (no GPU)"
        else:
            sup = "unknown (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED not readable)"
        lines.append(f"multicast        supported by every GPU: {sup}")
        used = mc["reason"] if mc["used"] is None else f"{_yn(mc['used'])} ({mc['reason']})"
        lines.append(f"  dcpkit would use it: {used}")
        if "used_if_opted_in" in mc:
            ans = (
                mc["reason_if_opted_in"]
                if mc["used_if_opted_in"] is None
                else f"{_yn(mc['used_if_opted_in'])} ({mc['reason_if_opted_in']})"
            )
            lines.append(f"  if opted in (multicast=True or DCPKIT_MULTICAST=1): {ans}")
    st = info.get("settings") or {}
    if st:
        if st.get("timeout_ms") is not None:
            src = (
                "DCPKIT_TIMEOUT_MS"
                if os.environ.get("DCPKIT_TIMEOUT_MS", "").strip()
                else "default"
            )
            dl = f"{st['timeout_ms']:g} ms ({src})"
        else:
            raw = os.environ.get("DCPKIT_TIMEOUT_MS", "")
            dl = f"invalid DCPKIT_TIMEOUT_MS={raw!r} (see the warning below)"
        dbg = "on (host-side agreement check per call)" if st.get("debug") else "off"
        lines.append(f"settings         wait deadline {dl}, DCPKIT_DEBUG {dbg}")
    env = info["env"]
    env_text = ", ".join(f"{k}={x}" for k, x in env.items())
    lines.append(
        "environment      " + (env_text or "(none of the multicast, device or MPS variables set)")
    )
    for w in info.get("warnings") or []:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dcpkit info [--json] [--all-ranks]``; returns the exit status
    (0). Under an MPI launcher, ranks other than 0 print nothing unless ``--all-ranks``."""
    p = CommandParser(
        prog="dcpkit info",
        # no collective; under a real launcher's job the ranks agree on the command line,
        # elsewhere MPI is never initialised here
        agree_across_ranks=joins_agreement("info"),
        description="Print what dcpkit finds on this machine: versions, GPUs, P2P access, "
        "and whether multicast would be used (and why not). Needs no GPU.",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead of text (with --all-ranks: one line per rank, "
        "JSON Lines)",
    )
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help="under mpirun, print the report on every rank (default: only on the "
        "launcher's rank 0)",
    )
    args = p.parse_args(argv)
    rank = launcher_rank()
    if rank is not None and rank != 0 and not args.all_ranks:
        return 0  # one report per job: rank 0 prints it
    info = collect()
    if rank is not None:
        info["launcher_rank"] = rank
    if args.json and args.all_ranks and rank is not None:
        # One line per rank, written at once: the ranks' reports share one stdout, and a line
        # is what the launcher forwards whole (JSON Lines: one json.loads per line).
        sys.stdout.write(json.dumps(info, sort_keys=False) + "\n")
        sys.stdout.flush()
    elif args.json:
        print(json.dumps(info, indent=2, sort_keys=False))
    else:
        print(format_text(info))
    return 0


if __name__ == "__main__":
    sys.exit(pipe_safe(main))
