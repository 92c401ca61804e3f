"""dcpkit.vllm without torch: importing it needs no torch (the constructors raise
MissingDependency naming the ``torch`` extra); the ubatch context; the error classes are
``ValueError`` and dcpkit errors. Runs where torch is not installed (CI) as well."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dcpkit.vllm as dv
from dcpkit.errors import DcpkitError, InvalidArgument, InvalidType


def test_import_needs_no_torch_and_construction_names_the_extra(run_python):
    code = """
import sys
sys.modules['torch'] = None
sys.modules['torch.distributed'] = None
import dcpkit.vllm as dv
from dcpkit.comm import Communicator
from dcpkit.errors import MissingDependency
with dv.ubatch(1):
    assert dv.current_ubatch() == 1
c = Communicator.single()
for make in (lambda: dv.DirectDCPA2AWorkspace(c, 'cuda:0', 8, 4, 512),
             lambda: dv.DirectDCPQGatherWorkspace(c, 'cuda:0', 8, 4, 576),
             lambda: dv.DirectDCPKVGatherWorkspace(c, 'cuda:0', 8, 576),
             lambda: dv.MLADCPManager(c, 'cuda:0', 4, 576, 512, None, None, None, True, False,
                                      max_num_tokens=8)):
    try:
        make()
    except MissingDependency as e:
        assert e.extra in ('torch-cu12', 'torch-cu13'), e
        assert f"pip install 'dcpkit[{e.extra}]'" in str(e), e
    else:
        raise SystemExit('no MissingDependency')
print('OK', repr(dv.BFLOAT16))
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert "OK torch.bfloat16" in r.stdout


def test_ubatch_context():
    assert dv.current_ubatch() == 0
    with dv.ubatch(1) as u:
        assert u == 1 and dv.current_ubatch() == 1
        with dv.ubatch(np.int64(3)):
            assert dv.current_ubatch() == 3
        assert dv.current_ubatch() == 1
        seen = []
        t = threading.Thread(target=lambda: seen.append(dv.current_ubatch()))
        t.start()
        t.join()
        assert seen == [0], "a new thread starts at ubatch 0"
    assert dv.current_ubatch() == 0
    with pytest.raises(InvalidType, match="index must be an int"):
        with dv.ubatch(True):
            pass
    with pytest.raises(dv.UbatchOutOfRange, match=r"index must be >= 0 \(got -1\)") as ei:
        with dv.ubatch(-1):
            pass
    assert isinstance(ei.value, ValueError)


def test_error_classes_are_value_errors_and_dcpkit_errors():
    for cls, base in (
        (dv.UnsupportedDtype, InvalidType),
        (dv.InvalidGeometry, InvalidArgument),
        (dv.UbatchOutOfRange, InvalidArgument),
    ):
        assert issubclass(cls, ValueError) and issubclass(cls, base)
        assert issubclass(cls, DcpkitError)
    assert issubclass(dv.UnsupportedDtype, TypeError)


def test_example_without_a_gpu_says_so_and_exits_2(repo_root, mpi_launcher, run_cmd):
    """``mpirun -np 2 python examples/vllm_api.py`` without a GPU (or without torch): exit 2 on
    every rank and one line from rank 0 saying why, never a traceback or a PASS."""
    import sys

    from dcpkit import info

    example = repo_root / "examples" / "vllm_api.py"
    if not example.is_file():
        pytest.skip(f"no {example} (tests run from an installed copy without the checkout)")
    if info.collect()["gpu_count"] > 0:
        pytest.skip("this machine has a GPU: tests/gpu/test_examples.py runs the example")
    proc = run_cmd(mpi_launcher.command(2, sys.executable, str(example)), timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("vllm_api: "), proc.stdout
    assert "PASS" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
