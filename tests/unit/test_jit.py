"""dcpkit.jit on a machine without GPU: NVRTC compile of every kernel and template variant for
sm_90 (the target) and sm_80 / sm_70 (the minimum), CompileError contents, #include splicing,
argument checks, and the variant registry."""

import re
import shutil
from pathlib import Path

import pytest

import dcpkit
from dcpkit import jit
from dcpkit.errors import CompileError, DcpkitError, InvalidArgument, InvalidType


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


# Below sm_90 the multicast variants must still compile (their multimem stores become a trap):
# NVRTC compiles every variant of a file in one run, so one sm_90-only instruction would make the
# unicast variants unusable on A100 / L40S too. sm_70 is the documented minimum.
@pytest.mark.parametrize("arch", ["sm_80", "sm_70"])
@pytest.mark.parametrize("file", sorted(jit.VARIANTS))
def test_every_variant_compiles_below_sm90(file, arch):
    archs = jit.nvrtc_archs()
    if archs is not None and int(arch[3:]) not in archs:
        pytest.skip(
            f"this NVRTC ({jit.nvrtc_version()}) cannot target {arch} (CUDA 13 starts at sm_75)"
        )
    res = jit.compile_only([file], arch=arch)
    assert res[file]["variants"] == len(jit.VARIANTS[file])
    assert res[file]["cubin_bytes"] > 0


def test_unit_tests_compile_each_kernel_once(kernel_compile_memo):
    """The session's compile memo (tests/unit/conftest.py) serves a repeated compile of the same
    source and options, and a changed option compiles anew."""
    first = jit.compile_only(["ceilings.cu"])
    n = len(kernel_compile_memo)
    assert jit.compile_only(["ceilings.cu"]) == first
    assert len(kernel_compile_memo) == n
    jit.compile_only(["ceilings.cu"], options=["-lineinfo"])
    assert len(kernel_compile_memo) == n + 1


def test_multimem_helpers_are_guarded_for_sm90():
    """Every multimem instruction in the header sits under an sm_90 guard that traps below."""
    text = (jit.kernels_dir() / "dcpkit_ptx.cuh").read_text()
    lines = text.splitlines()
    uses = [i for i, l in enumerate(lines) if "multimem." in l and "asm" in l]
    assert len(uses) == 3, uses  # the payload store, the signal store, the share add
    for i in uses:
        before = "\n".join(lines[max(0, i - 3) : i])
        after = "\n".join(lines[i : i + 6])
        assert "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900" in before, before
        assert "__trap();" in after and "#endif" in after, after
    assert "sm_70" in jit.__doc__ and "sm_90" in jit.__doc__


def test_every_kernel_file_is_registered():
    on_disk = {p.name for p in jit.kernels_dir().glob("*.cu")}
    unregistered = sorted(on_disk - set(jit.VARIANTS))
    assert not unregistered, (
        f"kernels {unregistered} are not in jit.VARIANTS, so CI would never compile them"
    )


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
        "}\n}\n"
    )
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
    scratch_kernels(
        "broken.cu",
        "namespace t {\n__global__ void b(int* p) { p[0] = undefined_symbol_xyz; }\n}\n",
        ["t::b"],
    )
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
    scratch_kernels(
        "one.cu",
        "template <int N> __global__ void k(int* p) { p[0] = N; }\n",
        ["k<1>", "k_missing<2>"],
    )
    with pytest.raises(CompileError) as ei:
        jit.compile_only(["one.cu"])
    assert "k_missing" in ei.value.log


def test_include_splicing(scratch_kernels):
    scratch_kernels("a.cuh", '#pragma once\n#include "b.cuh"\n__device__ int a() { return b(); }\n')
    scratch_kernels("b.cuh", "#pragma once\n__device__ int b() { return 7; }\n")
    scratch_kernels(
        "main.cu",
        "// line 1\n"
        '#include "a.cuh"\n'
        '  #  include "b.cuh"\n'
        "#include <cuda/std/cstdint>\n"
        "__global__ void k(int* p) { p[0] = a(); }\n",
        ["k"],
    )
    src = jit.source("main.cu")
    assert src.count("__device__ int b()") == 1 and src.count("__device__ int a()") == 1
    assert '#include "' not in src  # every local include was spliced ...
    assert "#include <cuda/std/cstdint>" in src  # ... system includes were left alone
    assert "// kernels/b.cuh is spliced in above" in src
    # b.cuh is spliced inside a.cuh, before a() uses it
    assert src.index("__device__ int b()") < src.index("__device__ int a()")


def test_include_line_numbers_point_at_the_original_file(scratch_kernels):
    scratch_kernels("h.cuh", "#pragma once\n// 2\n__device__ int h() { return bad_in_header; }\n")
    scratch_kernels(
        "m.cu",
        '// 1\n#include "h.cuh"\n// 3\n__global__ void k(int* p) { p[0] = bad_in_main; }\n',
        ["k"],
    )
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
    with pytest.raises(
        InvalidArgument, match=r"jit.get_kernel: name_expr must be a registered variant of kernels/"
    ):
        jit.get_kernel(file, "dcpkit::not_a_kernel<float>")
    with pytest.raises(InvalidArgument, match=re.escape(", ".join(jit.VARIANTS[file]))):
        jit.get_kernel(file, "dcpkit::not_a_kernel<float>")  # the choices are named
    with pytest.raises(
        InvalidArgument,
        match=r"jit.get_kernel: file must be one of the kernel "
        r"files registered in jit.VARIANTS \[.*q_gather.cu.*\] \(got 'nope.cu'\)",
    ):
        jit.get_kernel("nope.cu", "anything")
    with pytest.raises(InvalidType, match="jit.get_kernel: file must be a kernel file name"):
        jit.get_kernel(None, "anything")
    with pytest.raises(InvalidType, match="jit.get_kernel: name_expr must be a str"):
        jit.get_kernel(file, 3)


@pytest.mark.parametrize("options", [[1], ("-G", None), b"-G", 3.5])
def test_get_kernel_refuses_bad_options_before_cupy(options):
    file = "q_gather.cu"
    with pytest.raises(InvalidType, match="jit.get_kernel: options"):
        jit.get_kernel(file, jit.VARIANTS[file][0], options=options)


def test_compile_only_refuses_unregistered_files():
    with pytest.raises(
        InvalidArgument,
        match=r"jit.compile_only: file must be one of the kernel "
        r"files registered in jit.VARIANTS \[ceilings.cu, .*\] \(got 'nope.cu'\)",
    ):
        jit.compile_only(["nope.cu"])
    with pytest.raises(InvalidArgument, match=r"\(got 'nope.cu'\)"):
        jit.compile_only("nope.cu")
    with pytest.raises(
        InvalidType,
        match=r"jit.compile_only: files must be None, a kernel file "
        r"name or a sequence of them \(got int 3\)",
    ):
        jit.compile_only(3)
    with pytest.raises(InvalidType, match=r"file must be a kernel file name \(str\)"):
        jit.compile_only([None])


@pytest.mark.parametrize(
    "files", [b"lse_reduce.cu", bytearray(b"lse_reduce.cu"), memoryview(b"lse_reduce.cu")]
)
def test_compile_only_refuses_bytes_as_the_wrong_type(files):
    """Bytes are a sequence of ints, not of file names: refused by their own type."""
    name = type(files).__name__
    with pytest.raises(InvalidType) as ei:
        jit.compile_only(files)
    assert str(ei.value) == (
        f"jit.compile_only: files must be None, a kernel file name or a sequence of them "
        f"(got {name} {files!r})"
    )
    with pytest.raises(InvalidType, match=rf"options must be None, a str .*\(got {name} "):
        jit.compile_only("ceilings.cu", options=files)


def test_compile_only_takes_one_file_as_a_str():
    """A str is one file, not a sequence of one-character file names."""
    res = jit.compile_only("ceilings.cu")
    assert list(res) == ["ceilings.cu"]
    assert res["ceilings.cu"]["variants"] == len(jit.VARIANTS["ceilings.cu"])


def test_compile_only_options_forms(scratch_kernels):
    scratch_kernels(
        "opt.cu",
        "namespace t {\n__global__ void b(int* p) { p[0] = undefined_xyz; }\n}\n",
        ["t::b"],
    )
    for options, expected in (
        ("-lineinfo", ["-lineinfo"]),
        (None, []),
        ((), []),
        (["-lineinfo", "-G"], ["-lineinfo", "-G"]),
    ):
        with pytest.raises(CompileError) as ei:
            jit.compile_only("opt.cu", options=options)
        # a str is one option (not one option per character); None is no option
        assert list(ei.value.options) == ["-std=c++17", "-arch=sm_90"] + expected, options
    for bad in ([1], ["-G", None], b"-G", 7):
        with pytest.raises(InvalidType, match="jit.compile_only: options"):
            jit.compile_only("opt.cu", options=bad)


def test_compile_only_arch_checks():
    for bad in ("90", "sm90", "compute_90", "sm_9x", "", "sm_\u0669\u0660", "sm_90\n"):
        with pytest.raises(
            InvalidArgument,
            match=r"jit.compile_only: arch must be a real target "
            r"such as 'sm_90'",
        ):
            jit.compile_only("ceilings.cu", arch=bad)
    with pytest.raises(InvalidType, match="jit.compile_only: arch must be a str"):
        jit.compile_only("ceilings.cu", arch=90)
    with pytest.raises(
        InvalidArgument,
        match=r"arch must be a target this NVRTC supports \["
        r".*sm_90.*\] \(got 'sm_1'\)",
    ):
        jit.compile_only("ceilings.cu", arch="sm_1")


def test_compile_only_refuses_targets_below_sm_70():
    """A target NVRTC knows but the kernels do not support is refused before compiling (it was
    a long ptxas error)."""
    old = [a for a in jit.nvrtc_archs() if a < jit.MIN_ARCH]
    if not old:
        pytest.skip("this NVRTC knows no target below sm_70")
    with pytest.raises(
        InvalidArgument,
        match=rf"jit.compile_only: arch must be sm_70 or newer: .* \(got 'sm_{old[-1]}'\)",
    ):
        jit.compile_only("ceilings.cu", arch=f"sm_{old[-1]}")


def test_nvrtc_archs():
    archs = jit.nvrtc_archs()
    assert archs and 90 in archs and 80 in archs


def test_nvrtc_version():
    major, minor = jit.nvrtc_version()
    assert major >= 12 and minor >= 0


def test_a_clean_compile_leaves_the_interpreters_bytes_intact(run_python):
    """NVRTC's log of a clean compile is one NUL byte. The log buffer was ``b" " * n``, which for
    n = 1 is CPython's shared one-byte object b" ": NVRTC wrote the NUL into it, and from then
    on every b" " of the process (``os.fsencode(" ")``, an environment value of one space handed
    to a child process) was b"\\x00". Checked in a fresh process, where nothing else ran."""
    r = run_python(
        "import os\n"
        "from dcpkit import jit\n"
        "jit.compile_only(['fallback.cu'])\n"
        "print(b' '[0], os.fsencode(' ')[0], bytes([32])[0], ' '.encode()[0])\n"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["32"] * 4, r.stdout + r.stderr


def test_the_log_buffer_handed_to_nvrtc_is_writable(monkeypatch):
    """Whatever the log's size, NVRTC writes into a buffer of its own, never into an immutable
    (and possibly shared) bytes object."""
    seen = []

    class Nvrtc:
        def nvrtcCreateProgram(self, code, name, n, a, b):
            return 0, object()

        def nvrtcAddNameExpression(self, prog, e):
            return (0,)

        def nvrtcCompileProgram(self, prog, n, opts):
            return (0,)

        def nvrtcGetProgramLogSize(self, prog):
            return 0, self.size

        def nvrtcGetProgramLog(self, prog, buf):
            view = memoryview(buf)
            seen.append(view.readonly)
            if not view.readonly:
                view[-1] = 0
            return (0,)

        def nvrtcGetLoweredName(self, prog, e):
            return 0, b"k"

        def nvrtcGetCUBINSize(self, prog):
            return 0, 8

        def nvrtcDestroyProgram(self, prog):
            return (0,)

    for size in (1, 2, 64):
        fake = Nvrtc()
        fake.size = size
        # a name expression of its own per size: the session's compile memo keys on it
        jit._compile_one(fake, "fallback.cu", [f"fake_kernel_{size}"], [])
    assert seen == [False, False, False]
