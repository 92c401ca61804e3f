"""The shape of the package, read from the source: no import cycle, each layer importing only
itself and the layers below it (DESIGN.md, "Layers"), no private name imported across modules,
and the public names of the moved modules still importable."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "dcpkit"

#: Layers from the top down; a module may import its own layer and the ones below.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "tools",
        {
            "dcpkit",
            "dcpkit.__main__",
            "dcpkit.cli",
            "dcpkit._agreed",
            "dcpkit.demo",
            "dcpkit.bench",
            "dcpkit.info",
            "dcpkit._report",
            "dcpkit._stats",
        },
    ),
    (
        "manager",
        {
            "dcpkit.manager",
            "dcpkit._dcp_calls",
            "dcpkit.selection",
            "dcpkit.torch",
            "dcpkit._torch_registry",
            "dcpkit._torch_streams",
            "dcpkit.vllm",
        },
    ),
    ("ops", {"dcpkit.ops", "dcpkit.nccl", "dcpkit.fallback"}),
    (
        "symmetric / multicast",
        {
            "dcpkit.symmetric",
            "dcpkit._cumem",
            "dcpkit.multicast",
            "dcpkit._nvshmem",
            "dcpkit._fdpass",
        },
    ),
    ("jit", {"dcpkit.jit", "dcpkit._strided"}),
    (
        "comm",
        {
            "dcpkit.comm",
            "dcpkit._setup",
            "dcpkit._checks",
            "dcpkit._lifecycle",
            "dcpkit._plan",
            "dcpkit._lse_call",
            "dcpkit._launch",
            "dcpkit._arrays",
            "dcpkit._overlap",
            "dcpkit._cuda",
            "dcpkit._sm_share",
            "dcpkit.reference",
            "dcpkit.errors",
        },
    ),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken) for every import in the file, at any depth (a lazy
    import inside a function counts too), resolved to dcpkit modules."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            for n in names:  # from . import jit: a module
                if f"{target}.{n}" in known:
                    out.append((f"{target}.{n}", []))
            rest = [n for n in names if f"{target}.{n}" not in known]
            if target in known and rest:
                out.append((target, rest))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    out.append((a.name, []))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {t for t, _ in _imports(m, p, known) if t != m} for m, p in mods.items()}


def _layer(module: str) -> int:
    best = None
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if module == m or module.startswith(m + "."):
                if best is None or len(m) > best[1]:
                    best = (i, len(m))
    assert best is not None, f"{module} is in no layer of this test: add it to LAYERS"
    return best[0]


def test_every_relative_import_names_a_module_of_the_package():
    """A lazy ``from .x import y`` inside a function fails only when it runs (on a GPU, say):
    every relative import must resolve to a module of dcpkit, or to a name of one."""
    mods = _modules()
    known = set(mods)
    bad = []
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if target not in known:
                    bad.append(
                        f"{m}:{node.lineno}: from {'.' * node.level}{node.module or ''} -> {target}"
                    )
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    # a package imports its own submodules (it re-exports them): not a cycle of the layout
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_layer_imports_only_itself_and_the_layers_below():
    upward = []
    for m, targets in _graph().items():
        for t in targets:
            if t.startswith(m + ".") or m == "dcpkit":
                continue
            if _layer(t) < _layer(m):
                upward.append(f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert not upward, "\n".join(sorted(upward))


#: Private names the direct ops still share among themselves (their 256-byte rounding).
SHARED_WITHIN_OPS = {("dcpkit.ops._gather", "_round_up"), ("dcpkit.ops.lse_reduce", "_round_up")}


def test_no_private_name_is_imported_across_modules():
    """``from x import _name`` never: a name another module uses is public in its module."""
    mods = _modules()
    known = set(mods)
    bad = []
    for m, path in mods.items():
        for target, names in _imports(m, path, known):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and (m, n) not in SHARED_WITHIN_OPS:
                    bad.append(f"{m} imports {n} from {target}")
    assert not bad, "\n".join(bad)


def test_the_reader_sees_lazy_and_private_imports(tmp_path):
    """The checks above can fail: the reader finds an import inside a function (the kind that
    closed the old symmetric <-> multicast cycle) with the private name it takes."""
    f = tmp_path / "multicast.py"
    f.write_text("from . import _cuda\n\ndef f():\n    from .symmetric import _Transaction\n")
    found = _imports("dcpkit.multicast", f, set(_modules()))
    assert ("dcpkit.symmetric", ["_Transaction"]) in found
    assert ("dcpkit._cuda", []) in found
    assert _layer("dcpkit.nccl.base") == _layer("dcpkit.ops.q_gather") < _layer("dcpkit.jit")


@pytest.mark.parametrize(
    "module,names",
    [
        (
            "dcpkit.fallback",
            [
                "NcclGroup",
                "NcclQGather",
                "NcclKVGather",
                "NcclLseReduce",
                "LSE_ALGORITHMS",
                "PATH_NCCL",
                "nccl_module",
                "strided_copy",
                "copy_plan",
                "CopyPlan",
                "owner_to_heads_plan",
                "heads_to_owner_plan",
                "lse_layout",
                "LseLayout",
            ],
        ),
        (
            "dcpkit.manager",
            [
                "DCPComm",
                "select_path",
                "direct_call_blocker",
                "direct_geometry_blocker",
                "topology_blocker",
                "shared_gpu_blocker",
                "POLICIES",
                "OPS",
                "PATH_DIRECT_UNICAST",
                "PATH_DIRECT_MULTICAST",
                "PATH_NCCL",
                "DIRECT_LSE_DTYPES",
            ],
        ),
        ("dcpkit.reference", ["resolve_dtype", "check_lse_base", "make_inputs"]),
        (
            "dcpkit.ops._workspace",
            ["check_bool", "check_positive_int", "check_timeout_ms", "share_outcome", "guarded"],
        ),
        ("dcpkit.demo", ["main", "run", "parse_args", "Model", "PRESETS", "format_report"]),
    ],
)
def test_moved_names_stay_importable(module, names):
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"
    assert set(getattr(mod, "__all__", names)) >= {
        n
        for n in names
        if not n.startswith("_")
        and module != "dcpkit.ops._workspace"
        and module != "dcpkit.reference"
    }


def test_fallback_is_the_nccl_package_under_its_old_name():
    import dcpkit.fallback as fb
    import dcpkit.nccl as nccl

    assert fb.NcclLseReduce is nccl.NcclLseReduce and fb.NcclGroup is nccl.NcclGroup
    assert "removed in the next release" in " ".join(fb.__doc__.split())


def test_no_module_of_the_package_is_far_above_800_lines():
    long = {
        m: n
        for m, p in _modules().items()
        if (n := len(p.read_text().splitlines())) > 800 and m != "dcpkit.bench"
    }
    assert not long, long
