"""Load a file of the checkout that is not a package module (a script under scripts/, an
example) as a module, so that a unit test can call its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

#: The checkout's root (tests/unit/ is two levels below it).
ROOT = Path(__file__).resolve().parents[2]


def load_file(path: str | Path, name: str | None = None) -> ModuleType:
    """The file at ``path`` executed as a fresh module named ``name`` (default: its stem)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a fresh module named ``name``."""
    return load_file(ROOT / "scripts" / f"{name}.py", name)
