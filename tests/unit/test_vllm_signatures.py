"""dcpkit.vllm keeps the signatures of vLLM's direct DCP module (``vllm.v1.attention.ops.dcp``):
parameter names, order, kinds and defaults of every constructor and public method, compared with
``inspect.signature``.

The expected signatures are stated below from vLLM's published API. Where
``DCPKIT_VLLM_REFERENCE`` names a text file holding that module's source (class definitions),
the table itself is checked against it (parsed with :mod:`ast`), so that a change of vLLM's API
is noticed.
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed here "
    "(pip install 'dcpkit[torch-cu12]', or torch-cu13): the defaults are torch dtypes",
)

import dcpkit.vllm as dv  # noqa: E402

P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
REQUIRED = inspect.Parameter.empty

#: vLLM's signatures: (class, method) -> [(name, default source or REQUIRED)], without self.
VLLM = {
    ("DirectDCPA2AWorkspace", "__init__"): [
        ("group", REQUIRED),
        ("device", REQUIRED),
        ("max_num_tokens", REQUIRED),
        ("heads_per_rank", REQUIRED),
        ("head_dim", REQUIRED),
        ("dtype", "torch.bfloat16"),
        ("num_ubatches", "1"),
    ],
    ("DirectDCPA2AWorkspace", "lse_reduce"): [
        ("partial_output", REQUIRED),
        ("partial_lse", REQUIRED),
        ("is_lse_base_on_e", REQUIRED),
        ("seq_lens", "None"),
        ("query_start_loc", "None"),
    ],
    ("DirectDCPQGatherWorkspace", "__init__"): [
        ("group", REQUIRED),
        ("device", REQUIRED),
        ("max_num_tokens", REQUIRED),
        ("heads_per_rank", REQUIRED),
        ("head_dim", REQUIRED),
        ("dtype", "torch.bfloat16"),
        ("num_ubatches", "1"),
        ("padded_num_heads", "None"),
    ],
    ("DirectDCPQGatherWorkspace", "gather"): [("local_query", REQUIRED)],
    ("DirectDCPKVGatherWorkspace", "__init__"): [
        ("group", REQUIRED),
        ("device", REQUIRED),
        ("max_gathered_tokens", REQUIRED),
        ("token_dim", REQUIRED),
        ("dtype", "torch.bfloat16"),
        ("num_ubatches", "1"),
    ],
    ("DirectDCPKVGatherWorkspace", "gather"): [("gathered_kv", REQUIRED), ("local_kv", REQUIRED)],
    ("MLADCPManager", "__init__"): [
        ("vllm_config", REQUIRED),
        ("device", REQUIRED),
        ("num_heads", REQUIRED),
        ("query_head_dim", REQUIRED),
        ("output_head_dim", REQUIRED),
        ("query_dtype", REQUIRED),
        ("output_dtype", REQUIRED),
        ("padded_num_heads", REQUIRED),
        ("is_lse_base_on_e", REQUIRED),
        ("use_pcp", REQUIRED),
    ],
    ("MLADCPManager", "init_kv_gather"): [
        ("workspace", REQUIRED),
        ("max_gathered_tokens", REQUIRED),
    ],
    ("MLADCPManager", "kv_gather"): [("gathered_kv", REQUIRED), ("local_kv", REQUIRED)],
}

#: What dcpkit changes on purpose: vLLM's config object becomes the group plus keywords.
RENAMED = {("MLADCPManager", "__init__"): {"vllm_config": "group"}}
MANAGER_KEYWORDS = [("max_num_tokens", REQUIRED), ("num_ubatches", 1), ("comm_backend", "a2a")]
#: Keyword-only parameters dcpkit adds after vLLM's (absent from vLLM).
EXTRA_KEYWORDS = {
    ("DirectDCPA2AWorkspace", "lse_reduce"): [
        ("return_lse", False),
        ("out", None),
        ("out_lse", None),
    ]
}


def _default(src):
    return REQUIRED if src is REQUIRED else eval(src, {"torch": torch})


def _params(cls_name, method):
    fn = getattr(getattr(dv, cls_name), method)
    params = list(inspect.signature(fn).parameters.values())
    assert params[0].name == "self"
    return params[1:]


@pytest.mark.parametrize("key", sorted(VLLM), ids=lambda k: ".".join(k))
def test_positional_parameters_match_vllm(key):
    rename = RENAMED.get(key, {})
    want = [(rename.get(n, n), _default(d)) for n, d in VLLM[key]]
    got = [p for p in _params(*key) if p.kind == P]
    assert [p.name for p in got] == [n for n, _ in want], key
    for p, (name, default) in zip(got, want, strict=True):
        if default is REQUIRED:
            assert p.default is REQUIRED, f"{key} {name}: expected no default, got {p.default!r}"
        else:
            assert p.default == default, f"{key} {name}: default {p.default!r} != {default!r}"
            assert repr(p.default) == repr(default), (key, name)


@pytest.mark.parametrize("key", sorted(VLLM), ids=lambda k: ".".join(k))
def test_only_documented_keyword_parameters_are_added(key):
    want = MANAGER_KEYWORDS if key == ("MLADCPManager", "__init__") else EXTRA_KEYWORDS.get(key, [])
    got = [(p.name, p.default) for p in _params(*key) if p.kind == K]
    assert got == want, key
    assert not [p for p in _params(*key) if p.kind not in (P, K)], "no *args / **kwargs"


def test_dtype_default_is_torch_bfloat16_without_importing_torch_at_import():
    default = inspect.signature(dv.DirectDCPKVGatherWorkspace).parameters["dtype"].default
    assert default == torch.bfloat16 and torch.bfloat16 == default
    assert default != torch.float16
    assert repr(default) == "torch.bfloat16"
    assert hash(default) == hash(dv.BFLOAT16)


# ----------------------------------------------------------------------------- the reference
def _reference_source():
    path = os.environ.get("DCPKIT_VLLM_REFERENCE")
    if not path:
        pytest.skip(
            "DCPKIT_VLLM_REFERENCE is not set: the stated table is not checked against "
            "a copy of vLLM's module source"
        )
    text = Path(path).read_text()
    start = text.find("class ")
    if start < 0:
        pytest.fail(f"{path} holds no class definition")
    end = text.find("\n=====", start)
    return text[start:] if end < 0 else text[start:end]


def test_stated_table_matches_the_reference():
    tree = ast.parse(_reference_source())
    found = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            a = fn.args
            names = [x.arg for x in a.args][1:]
            defaults = [REQUIRED] * (len(names) - len(a.defaults)) + [
                ast.unparse(d) for d in a.defaults
            ]
            found[(cls.name, fn.name)] = list(zip(names, defaults, strict=True))
    for key, want in VLLM.items():
        assert key in found, f"{key} not in the reference"
        assert found[key] == want, f"{key}: reference {found[key]} != stated {want}"
