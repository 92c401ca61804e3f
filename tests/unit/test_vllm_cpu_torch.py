"""dcpkit.vllm where torch cannot reach a CUDA GPU (a CPU build of torch, or no device): every
vLLM argument check still comes first, then one clear dcpkit error -- never torch's own
"Torch not compiled with CUDA enabled" assertion."""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed here (pip install 'dcpkit[torch-cu12]', or torch-cu13)"
)

import dcpkit.vllm as dv  # noqa: E402
from dcpkit.errors import DcpkitError  # noqa: E402

from _threadgroup import run_group  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="torch reaches a CUDA GPU here: the GPU tests run these classes for real",
)


def _builders():
    return [
        ("DirectDCPQGatherWorkspace", lambda c, d: dv.DirectDCPQGatherWorkspace(c, d, 8, 16, 576)),
        ("DirectDCPKVGatherWorkspace", lambda c, d: dv.DirectDCPKVGatherWorkspace(c, d, 16, 576)),
        ("DirectDCPA2AWorkspace", lambda c, d: dv.DirectDCPA2AWorkspace(c, d, 8, 4, 512)),
        (
            "MLADCPManager",
            lambda c, d: dv.MLADCPManager(
                c,
                d,
                4,
                576,
                512,
                torch.bfloat16,
                torch.bfloat16,
                None,
                True,
                False,
                max_num_tokens=8,
            ),
        ),
    ]


@pytest.mark.parametrize(
    "device",
    [0, "cuda", "cuda:0", torch.device("cuda", 0)],
    ids=["int", "cuda", "cuda:0", "torch.device"],
)
@pytest.mark.parametrize("name,build", _builders(), ids=[n for n, _ in _builders()])
def test_no_torch_cuda_is_one_clear_error(name, build, device):
    """An int is a CUDA ordinal (as the message of a wrong device type says); without CUDA in
    torch the class names itself and what is missing."""
    for kind, err in run_group(2, lambda c: build(c, device)):
        assert kind == "err" and type(err) is DcpkitError, (kind, err)
        msg = str(err)
        assert msg.startswith(f"{name}:"), msg
        assert ("CPU build" in msg) or ("no CUDA GPU" in msg), msg
        assert "not compiled" not in msg and "checking the" not in msg, msg
