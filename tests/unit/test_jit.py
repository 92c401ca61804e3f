"""dcpkit.jit on a machine without GPU: NVRTC compile of every kernel and template variant for
sm_90, CompileError contents, #include splicing, and the variant registry."""

import shutil
from pathlib import Path

import pytest

import dcpkit
from dcpkit import jit
from dcpkit.errors import CompileError, DcpkitError


@pytest.fixture(scope="module", autouse=True)
def _nvrtc(skip_or_fail):
    if jit.nvrtc_version() is None:
        skip_or_fail("NVRTC cannot be loaded: pip install 'dcpkit[cuda12]' (or cuda13)")


# A kernel file listed in VARIANTS that does not exist yet must FAIL here (FileNotFoundError),
# not skip: CI compiles every kernel dcpkit may launch.
@pytest.mark.parametrize("file", sorted(jit.VARIANTS))
def test_every_variant_compiles_for_sm90(file):
    res = jit.compile_only([file], arch="sm_90")
    assert res[file]["variants"] == len(jit.VARIANTS[file])
    assert res[file]["cubin_bytes"] > 0


def test_every_kernel_file_is_registered():
    on_disk = {p.name for p in jit.kernels_dir().glob("*.cu")}
    unregistered = sorted(on_disk - set(jit.VARIANTS))
    assert not unregistered, (f"kernels {unregistered} are not in jit.VARIANTS, so CI would "
                              "never compile them")


def test_multicast_variants_are_registered():
    mc = [e for exprs in jit.VARIANTS.values() for e in exprs if "Multicast" in e]
    assert mc, "no multicast variant in jit.VARIANTS: CI must compile them too"


def test_kernels_dir_of_this_install():
    pkg = Path(dcpkit.__file__).resolve().parent
    kd = jit.kernels_dir().resolve()
    if (pkg / "kernels" / "dcpkit_ptx.cuh").is_file():  # installed wheel: dcpkit/kernels
        assert kd == pkg / "kernels"
    else:  # source checkout: the top-level kernels/
        assert kd == pkg.parent / "kernels"
    assert (kd / "dcpkit_ptx.cuh").is_file()


def test_ptx_header_compiles_alone(tmp_path, monkeypatch):
    """The protocol header is a valid translation unit for sm_90 with no warning."""
    shutil.copy(jit.kernels_dir() / "dcpkit_ptx.cuh", tmp_path / "dcpkit_ptx.cuh")
    (tmp_path / "probe.cu").write_text(
        '#include "dcpkit_ptx.cuh"\n'
        "namespace probe {\n"
        "template <typename T> __global__ void k(const T* x, float* y) {\n"
        "  y[threadIdx.x] = dcpkit::to_float(x[threadIdx.x]);\n"
        "}\n}\n")
    monkeypatch.setattr(jit, "kernels_dir", lambda: tmp_path)
    exprs = ["probe::k<dcpkit::bf16_t>", "probe::k<dcpkit::fp16_t>", "probe::k<float>"]
    monkeypatch.setitem(jit.VARIANTS, "probe.cu", exprs)
    assert jit.compile_only(["probe.cu"])["probe.cu"]["variants"] == 3


@pytest.fixture
def scratch_kernels(tmp_path, monkeypatch):
    """A kernels folder of our own, registered in VARIANTS for the test only."""
    monkeypatch.setattr(jit, "kernels_dir", lambda: tmp_path)

    def add(name, text, exprs=None):
        (tmp_path / name).write_text(text)
        if exprs is not None:
            monkeypatch.setitem(jit.VARIANTS, name, list(exprs))

    return add


def test_broken_kernel_raises_compile_error(scratch_kernels):
    scratch_kernels("broken.cu",
                    "namespace t {\n__global__ void b(int* p) { p[0] = undefined_symbol_xyz; }\n}\n",
                    ["t::b"])
    with pytest.raises(CompileError) as ei:
        jit.compile_only(["broken.cu"], options=["-lineinfo"])
    e = ei.value
    assert isinstance(e, DcpkitError)
    assert e.kernel == "broken.cu"
    assert "-arch=sm_90" in e.options and "-std=c++17" in e.options and "-lineinfo" in e.options
    assert 'broken.cu(2): error: identifier "undefined_symbol_xyz" is undefined' in e.log, e.log
    assert "kernels/broken.cu" in str(e) and "undefined_symbol_xyz" in str(e)


def test_warning_is_a_compile_error(scratch_kernels):
    scratch_kernels("warns.cu", "__global__ void w(int* p) { int unused = 3; p[0] = 1; }\n", ["w"])
    with pytest.raises(CompileError, match="warnings are errors") as ei:
        jit.compile_only(["warns.cu"])
    assert '"unused" was declared but never referenced' in ei.value.log


def test_unknown_name_expression_is_a_compile_error(scratch_kernels):
    scratch_kernels("one.cu", "template <int N> __global__ void k(int* p) { p[0] = N; }\n",
                    ["k<1>", "k_missing<2>"])
    with pytest.raises(CompileError) as ei:
        jit.compile_only(["one.cu"])
    assert "k_missing" in ei.value.log


def test_include_splicing(scratch_kernels):
    scratch_kernels("a.cuh", "#pragma once\n#include \"b.cuh\"\n__device__ int a() { return b(); }\n")
    scratch_kernels("b.cuh", "#pragma once\n__device__ int b() { return 7; }\n")
    scratch_kernels("main.cu",
                    "// line 1\n"
                    '#include "a.cuh"\n'
                    '  #  include "b.cuh"\n'
                    "#include <cuda/std/cstdint>\n"
                    "__global__ void k(int* p) { p[0] = a(); }\n",
                    ["k"])
    src = jit.source("main.cu")
    assert src.count("__device__ int b()") == 1 and src.count("__device__ int a()") == 1
    assert '#include "' not in src  # every local include was spliced ...
    assert "#include <cuda/std/cstdint>" in src  # ... system includes were left alone
    assert "// kernels/b.cuh is spliced in above" in src
    # b.cuh is spliced inside a.cuh, before a() uses it
    assert src.index("__device__ int b()") < src.index("__device__ int a()")


def test_include_line_numbers_point_at_the_original_file(scratch_kernels):
    scratch_kernels("h.cuh", "#pragma once\n// 2\n__device__ int h() { return bad_in_header; }\n")
    scratch_kernels("m.cu", '// 1\n#include "h.cuh"\n// 3\n__global__ void k(int* p) { p[0] = bad_in_main; }\n',
                    ["k"])
    with pytest.raises(CompileError) as ei:
        jit.compile_only(["m.cu"])
    assert 'h.cuh(3): error: identifier "bad_in_header"' in ei.value.log, ei.value.log
    assert 'm.cu(4): error: identifier "bad_in_main"' in ei.value.log, ei.value.log


def test_missing_include_names_the_file(scratch_kernels):
    scratch_kernels("x.cu", '#include "nope.cuh"\n', ["k"])
    with pytest.raises(FileNotFoundError, match=r"kernels/nope.cuh does not exist"):
        jit.source("x.cu")


def test_get_kernel_refuses_unregistered_variants():
    file = next(iter(jit.VARIANTS))
    with pytest.raises(KeyError, match="is not a registered variant of kernels/"):
        jit.get_kernel(file, "dcpkit::not_a_kernel<float>")
    with pytest.raises(KeyError, match="is not a registered variant of kernels/nope.cu"):
        jit.get_kernel("nope.cu", "anything")


def test_compile_only_refuses_unregistered_files():
    with pytest.raises(KeyError, match="kernels/nope.cu is not registered in VARIANTS"):
        jit.compile_only(["nope.cu"])


def test_nvrtc_version():
    major, minor = jit.nvrtc_version()
    assert major >= 12 and minor >= 0
