"""The C++ operators (`fms_paged/csrc/ops/`) and the native package that builds and loads them
(`fms_paged.native`): from an AOT-compiled graph (`torch.export` keeps `fms_paged::linear` and
`fms_paged::paged_attention` as calls, AOTInductor compiles the graph into a package whose C++ calls
them through the dispatcher, and the loaded package gives what eager mode gives); the background
builds of a first start; the page geometry of the C++ held to `kv/geometry.py`; the opt-in kernel
clock; and what importing the package leaves alone."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fms_paged import native
from fms_paged.kv import geometry
from fms_paged.modules import linear as L
from tests.kv.test_cpu_kernel import make_pool

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")


class Block(torch.nn.Module):
    """A projection, then paged attention of its output over a pool (one sequence, one chunk)."""

    def __init__(self, k, v, table, chunks, H, D):
        super().__init__()
        self.proj = L.Linear(H * D, H * D, bias=True).requires_grad_(False)
        self.k, self.v, self.table, self.chunks, self.H, self.D = k, v, table, chunks, H, D

    def forward(self, x):  # x: [T, H * D]
        q = self.proj(x).view(1, -1, self.H, self.D).transpose(1, 2)  # [1, H, T, D]
        scale = self.D**-0.5
        out = torch.ops.fms_paged.paged_attention(q, self.k, self.v, self.table, self.chunks, 16, scale)
        return F.relu(out).flatten(2)



def fresh_interpreter(code: str) -> list[str]:
    """Run `code` in a new Python process (nothing of this one imported) -> the words it printed."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()

def test_aot_compiled_graph_calls_the_operators(tmp_path):
    H, Hkv, D, T = 4, 2, 16, 20
    k, v, table, _ = make_pool([T], H, Hkv, D, 16)
    assert native.load_attention(D, torch.float32) is None and native.load_gemv(torch.float32) is None
    block = Block(k, v, table, torch.tensor([(0, 0, T, 0)]), H, D).eval()
    x = torch.randn(T, H * D)
    ep = torch.export.export(block, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"fms_paged.linear.default", "fms_paged.paged_attention.default"} <= targets
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp_path, "block.pt2"))
    got = torch._inductor.aoti_load_package(pkg)(x)
    torch.testing.assert_close(got, block(x), rtol=1e-5, atol=1e-5)


def test_builds_start_after_setuptools_is_imported_on_the_calling_thread():
    """A build thread must not be the one to import setuptools (through torch.utils.cpp_extension):
    its import adds a finder to `sys.meta_path` and removes it again, which can make an import
    running meanwhile on the caller's thread miss its module. In a fresh interpreter, setuptools is
    imported by the time `prebuild_model` has handed its builds over (a recorder in place of the
    build threads: nothing runs on them)."""
    code = (
        "import sys, torch\n"
        "from fms_paged import native\n"
        "assert 'setuptools' not in sys.modules\n"
        "class Recorder:\n"
        "    def submit(self, fn, *args, **kwargs): pass\n"
        "native._BUILDS = Recorder()\n"
        "native.prebuild_model(torch.device('cpu'), torch.bfloat16, 64, 'paged')\n"
        "print('setuptools' in sys.modules)\n"
    )
    assert fresh_interpreter(code)[-1] == "True"


def test_a_paged_cpu_model_starts_its_builds_while_it_loads(monkeypatch):
    """`get_model` of a paged CPU model hands the builds its first forward needs to the background
    (the operators, unless loaded; its dtype's GEMV and rows kernels, and GEMM kernel where the
    projections take it; attention for its head dim)
    before it reads the checkpoint (a variant: before its init); the dense attention starts none."""
    from fms_paged.models import get_model

    kernels, submitted = [], []

    class Recorder:
        def submit(self, fn, *args):
            submitted.append(fn)

    monkeypatch.setattr(native, "_building",
                        lambda source, dtype, **defines: kernels.append((source.stem, dtype, defines)))
    monkeypatch.setattr(native, "_BUILDS", Recorder())
    monkeypatch.setattr(native, "_OPS", [])  # as in a process that has not loaded them
    model = get_model(attn_impl="paged", device="cpu", dtype=torch.bfloat16)
    D = model.config.head_dim
    assert submitted == [native.ops]
    own = [("gemm", torch.bfloat16, {})] if native.gemm.GEMM == "own" else []  # its GEMM kernel too
    want = [("gemv", torch.bfloat16, {}), ("rows", torch.bfloat16, {}),
            ("attention", torch.bfloat16, {"HEAD_DIM": D}), *own]
    assert sorted(kernels, key=str) == sorted(want, key=str)
    kernels.clear(), submitted.clear()
    get_model(attn_impl="sdpa", device="cpu", dtype=torch.bfloat16)
    get_model(variant="micro", attn_impl="sdpa", device="cpu")
    assert kernels == submitted == []
    get_model(variant="micro", attn_impl="paged", device="cpu")  # a variant: fp32
    assert {dt for _, dt, _ in kernels} == {torch.float32} and len(kernels) == 3 + len(own)


def test_the_cpp_page_geometry_is_kv_geometry():
    """The C++ rules of page geometry (`csrc/kernels/geometry.h`: what the attention kernel and
    `decode_greedy` walk the page table with) equal `kv/geometry.py`'s over a grid of page sizes,
    positions (either side of every page edge) and physical pages."""
    assert native.ops() is None
    for P in (1, 2, 3, 7, 8, 16, 64, 256):
        pos = torch.arange(0, 5 * P + 3, dtype=torch.int64)
        pages = (pos * 7919 + 13) % 1000  # any physical page, the null page 0 among them
        page_of, slot, pages_for = torch.ops.fms_paged._geometry(pages, pos, P)
        assert torch.equal(page_of, pos // P)
        assert torch.equal(slot, geometry.slot(pages, pos, P))
        assert torch.equal(pages_for, geometry.pages_for(pos, P))
    with pytest.raises(ValueError, match=r"page_size=0; expected >= 1"):
        torch.ops.fms_paged._geometry(pages, pos, 0)
    with pytest.raises(ValueError, match=r"position -1 on page 3; expected both >= 0"):
        torch.ops.fms_paged._geometry(torch.tensor([3]), torch.tensor([-1]), 16)


def test_the_kernel_clock_counts_only_inside_and_restores_itself():
    """`native.kernel_clock()` turns the operators' kernel clock on (off by default: no clock read
    around a kernel call) and yields the nanoseconds spent in the kernels since entering; leaving
    it turns the clock back to what it was, nested or not."""
    assert native.ops() is None and native.load_gemv(torch.float32) is None
    x, w = torch.randn(2, 256), [torch.randn(512, 256)]
    assert torch.ops.fms_paged._kernel_clock(False) is False  # off by default
    before = torch.ops.fms_paged._kernel_ns()
    torch.ops.fms_paged.gemv(x, w)
    assert torch.ops.fms_paged._kernel_ns() == before  # off: nothing counted
    with native.kernel_clock() as elapsed_ns:
        assert elapsed_ns() == 0
        torch.ops.fms_paged.gemv(x, w)
        first = elapsed_ns()
        assert first > 0
        with native.kernel_clock() as inner:
            torch.ops.fms_paged.gemv(x, w)
            assert 0 < inner() <= elapsed_ns() - first
        assert torch.ops.fms_paged._kernel_clock(True) is True  # still on after the inner one
    assert torch.ops.fms_paged._kernel_clock(False) is False  # off again after the outer one


def test_importing_the_package_changes_nothing_global():
    """Importing fms_paged (and making a model) runs no oneDNN probe GEMM and registers no
    process-wide module hooks: the packed dtypes are probed when the operators are first
    configured, the hooks registered when the first decoder stack is made. In a fresh interpreter."""
    code = (
        "import torch\n"
        "from torch.nn.modules import module\n"
        "def hooks():\n"
        "    return (len(module._global_module_registration_hooks),\n"
        "            len(module._global_parameter_registration_hooks))\n"
        "before = hooks()\n"
        "import fms_paged\n"
        "from fms_paged.native import gemm\n"
        "from fms_paged.modules import linear\n"
        "m = fms_paged.get_model(variant='micro', attn_impl='sdpa', device='cpu', linear_impl='torch')\n"
        "print(hooks() == before, dict(gemm.PACK_DTYPES) == {})\n"
    )
    assert fresh_interpreter(code)[-2:] == ["True", "True"]
