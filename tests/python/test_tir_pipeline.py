"""fuselight's TIR pipelines: the programmatic-dependent-launch flag on exactly the kernels that wait,
or on every kernel after a wait at its entry.

On the GPU the decode kernels' numerics with the flag are the paged-attention suite's, and the
every-kernel pipeline's the end-to-end suite's (logits against float64, generation against
step-by-step decoding); here: which device kernels get the flag and the wait, where the flag goes
among the launch parameters, which targets take it, and that the code compiles with nvcc.
"""

import re

import pytest
from conftest import require_nvcc
import tvm
from fuselight import tir_pipeline
from fuselight.cuda_compile import compile_cuda
from fuselight.rules.flash.decode import flash_decode_paged, load_decode_config
from fuselight.target import resolve, to_tvm
from tvm.script import tirx as T

CUDA = to_tvm(resolve("cuda", "sm_90"))


def _device_launch_params(func: tvm.tirx.PrimFunc, every_kernel: bool = False) -> dict[str, list[str]]:
    """Launch parameters of each device kernel of ``func`` after fuselight's TIR pipeline."""
    pipeline, _, finalize_device = tvm.tirx.get_tir_pipeline(tir_pipeline.register(every_kernel))
    with CUDA:
        mod = pipeline(tvm.tirx.transform.BindTarget(CUDA)(tvm.IRModule({"main": func.with_attr("global_symbol", "main")})))
    device = tvm.IRModule({gv: f for gv, f in mod.functions.items() if "tirx.kernel_launch_params" in (f.attrs or {})})
    device = finalize_device()(device)
    return {gv.name_hint: [str(p) for p in f.attrs["tirx.kernel_launch_params"]] for gv, f in device.functions.items()}


def _two_kernels(wait_in_second: bool) -> tvm.tirx.PrimFunc:
    @T.prim_func(s_tir=True)
    def f(a: T.Buffer((1024,), "float32"), b: T.Buffer((1024,), "float32"), c: T.Buffer((1024,), "float32")):
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                with T.sblock("first"):
                    T.reads()
                    T.writes()
                    T.ptx.griddepcontrol.launch_dependents()
                    b[bx * 128 + tx] = a[bx * 128 + tx] * T.float32(2)
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                with T.sblock("second"):
                    T.reads()
                    T.writes()
                    if wait_in_second:
                        T.ptx.griddepcontrol.wait()
                    c[bx * 128 + tx] = b[1023 - bx * 128 - tx] + T.float32(1)

    return f


def test_only_the_kernel_that_waits_is_launched_early():
    params = _device_launch_params(_two_kernels(wait_in_second=True))
    assert sorted(params) == ["main_kernel", "main_kernel_1"]
    assert tir_pipeline.PDL_FLAG not in params["main_kernel"]  # it only lets the next one launch
    assert params["main_kernel_1"] == ["blockIdx.x", "threadIdx.x", tir_pipeline.PDL_FLAG]


def test_no_wait_no_flag():
    params = _device_launch_params(_two_kernels(wait_in_second=False))
    assert all(tir_pipeline.PDL_FLAG not in p for p in params.values())


def test_flag_goes_before_dynamic_shared_memory():
    dyn = "tirx.use_dyn_shared_memory"
    assert tir_pipeline.with_programmatic_launch(["blockIdx.x", "threadIdx.x", dyn]) == [
        "blockIdx.x", "threadIdx.x", tir_pipeline.PDL_FLAG, dyn]
    once = tir_pipeline.with_programmatic_launch(["blockIdx.x"])
    assert tir_pipeline.with_programmatic_launch(once) == once


def test_register_is_idempotent_and_the_names_resolve():
    assert tir_pipeline.register() == tir_pipeline.register() == tir_pipeline.NAME
    assert tir_pipeline.register(True) == tir_pipeline.register(True) == tir_pipeline.NAME_EVERY_KERNEL
    for name in (tir_pipeline.NAME, tir_pipeline.NAME_EVERY_KERNEL):
        assert len(tvm.tirx.get_tir_pipeline(name)) == 3


@pytest.mark.parametrize("wait_in_second", [False, True])
def test_every_kernel_waits_at_entry_and_is_flagged(wait_in_second):
    params = _device_launch_params(_two_kernels(wait_in_second), every_kernel=True)
    assert sorted(params) == ["main_kernel", "main_kernel_1"]
    assert all(p == ["blockIdx.x", "threadIdx.x", tir_pipeline.PDL_FLAG] for p in params.values())
    exe = tvm.compile(tvm.IRModule({"main": _two_kernels(wait_in_second)}), target=CUDA,
                      tir_pipeline=tir_pipeline.register(True))
    src = exe.mod.imports[0].inspect_source("cuda")
    bodies = re.findall(r"__global__ void [^{;]*\{(.*?)\n\}", src, re.DOTALL)
    assert len(bodies) == 2
    for body in bodies:
        # the kernel's first statement, before any load, and only once where the kernel waited already
        assert body.strip().startswith("tvm_builtin_ptx_griddepcontrol_wait();")
        assert body.count("griddepcontrol_wait") == 1
    require_nvcc()
    compile_cuda(src, arch="sm_90")


@pytest.mark.parametrize(
    "kind,arch,ok", [("cuda", "sm_90", True), ("cuda", "sm_90a", True), ("cuda", "sm_100", False),
                     ("cuda", "sm_100f", False), ("cuda", "sm_80", False), ("cuda", None, False), ("cuda", "gfx90a", False),
                     ("llvm", None, False)]
)
def test_programmatic_launch_needs_sm90(kind, arch, ok):
    """Only where the device model says griddepcontrol: sm_90; sm_100 has no description (yet)."""
    assert tir_pipeline.programmatic_launch_supported(kind, arch) is ok


@pytest.mark.parametrize("d,h_kv", [(128, 8), (64, 32)])
def test_decode_merge_kernel_is_launched_early_and_compiles(d, h_kv):
    func = flash_decode_paged(h_kv, 32, d, "float16", 16, load_decode_config("sm_90"))
    params = _device_launch_params(func)
    flagged = [name for name, p in params.items() if tir_pipeline.PDL_FLAG in p]
    assert len(params) == 2 and flagged == [max(params)]  # the merge (second) kernel only
    exe = tvm.compile(tvm.IRModule({"main": func}), target=CUDA, tir_pipeline=tir_pipeline.register())
    src = exe.mod.imports[0].inspect_source("cuda")
    assert "griddepcontrol.wait" in src and "griddepcontrol.launch_dependents" in src
    # The merge lets the next kernel (o_proj) launch once it has waited for the split kernel.
    merge = src[re.search(r"void __launch_bounds__\([^)]*\) \w+_kernel_1\([^)]*\) \{", src).start():]
    assert merge.index("griddepcontrol_wait();") < merge.index("griddepcontrol_launch_dependents();")
    require_nvcc()
    compile_cuda(src, arch="sm_90")


@pytest.mark.parametrize("programmatic_launch,arch,waits", [(True, "sm_90", True), (False, "sm_90", False), (True, "sm_80", False)])
def test_lower_waits_at_every_kernel_entry_only_where_asked_and_supported(programmatic_launch, arch, waits):
    """``compile.lower`` (the fuselight pipeline asks, the baseline does not; sm_80 has no griddepcontrol)."""
    from fuselight.compile import lower
    from fuselight.pipeline import baseline_pipeline
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((256, 512), "float16"))
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(relax.op.add(relax.op.exp(x), x)))
    target = to_tvm(resolve("cuda", arch))
    _, exe = lower(bb.get(), target, baseline_pipeline(target, use_mlc=False), programmatic_launch=programmatic_launch)
    def cuda_sources(mod):
        own = [mod.inspect_source("cuda")] if mod.kind == "cuda" else []
        return own + [src for sub in mod.imports for src in cuda_sources(sub)]

    (src,) = cuda_sources(exe.mod)
    kernels = len(re.findall(r"__global__ void [^{;]*\{", src))
    assert kernels >= 1 and src.count("griddepcontrol_wait();") == (kernels if waits else 0)
