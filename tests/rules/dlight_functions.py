# Licensed to the Apache Software Foundation (ASF) under one or more contributor license agreements.
# The functions below are the PrimFuncs that TVM's DLight GPU tests schedule (their "before"
# functions), copied from apache/tvm, tests/python/s_tir/dlight/test_gpu_*.py at commit
# d536d413e66cfd018d45f5400301b0d747e87b81 (the file each comes from is named above it), under the
# Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0); each is renamed after
# its test and otherwise unchanged.
"""TVM's DLight test functions: PrimFuncs nobody on this project wrote, to see what our rules claim
of them on each arch (tests/rules/test_dlight_functions.py). ``FUNCTIONS``: name -> PrimFunc."""
# ruff: noqa: E501
# fmt: off

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

# --- test_gpu_gemv.py -----------------------------------------------------------------------------
# test_gemv_basic
@T.prim_func(private=True, s_tir=True)
def gemv_basic(lv1637: T.Buffer((1, 32, 1, 128), "float16"), p_lv1638: T.handle, p_lv1614: T.handle, p_output0: T.handle):
    T.func_attr({"tirx.noalias": True})
    n = T.int32()
    lv1638 = T.match_buffer(p_lv1638, (1, 32, n, 128), "float16")
    lv1614 = T.match_buffer(p_lv1614, (1, 1, 1, n), "float16")
    var_compute_intermediate = T.match_buffer(p_output0, (1, 32, 1, n))
    # with T.sblock("root"):
    var_NT_matmul_intermediate = T.sblock_alloc_buffer((1, 32, 1, n), "float16")
    var_T_divide_intermediate = T.sblock_alloc_buffer((1, 32, 1, n), "float16")
    var_T_maximum_intermediate = T.sblock_alloc_buffer((1, 32, 1, n), "float16")
    var_T_minimum_intermediate = T.sblock_alloc_buffer((1, 32, 1, n), "float16")
    for i0, i1, i2, i3, k in T.grid(1, 32, 1, n, 128):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_i3, v_k = T.axis.remap("SSSSR", [i0, i1, i2, i3, k])
            T.reads(lv1637[v_i0, v_i1, v_i2, v_k], lv1638[v_i0, v_i1, v_i3, v_k])
            T.writes(var_NT_matmul_intermediate[v_i0, v_i1, v_i2, v_i3])
            with T.init():
                var_NT_matmul_intermediate[v_i0, v_i1, v_i2, v_i3] = T.float16(0)
            var_NT_matmul_intermediate[v_i0, v_i1, v_i2, v_i3] = var_NT_matmul_intermediate[v_i0, v_i1, v_i2, v_i3] + lv1637[v_i0, v_i1, v_i2, v_k] * lv1638[v_i0, v_i1, v_i3, v_k]
    for ax0, ax1, ax2, ax3 in T.grid(1, 32, 1, n):
        with T.sblock("T_divide"):
            v_ax0, v_ax1, v_ax2, v_ax3 = T.axis.remap("SSSS", [ax0, ax1, ax2, ax3])
            T.reads(var_NT_matmul_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
            T.writes(var_T_divide_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
            var_T_divide_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] = var_NT_matmul_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] * T.float16(0.088397790055248615)
    for ax0, ax1, ax2, ax3 in T.grid(1, 32, 1, n):
        with T.sblock("T_maximum"):
            v_ax0, v_ax1, v_ax2, v_ax3 = T.axis.remap("SSSS", [ax0, ax1, ax2, ax3])
            T.reads(var_T_divide_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
            T.writes(var_T_maximum_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
            var_T_maximum_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] = T.max(var_T_divide_intermediate[v_ax0, v_ax1, v_ax2, v_ax3], T.float16(-65504))
    for ax0, ax1, ax2, ax3 in T.grid(1, 32, 1, n):
        with T.sblock("T_minimum"):
            v_ax0, v_ax1, v_ax2, v_ax3 = T.axis.remap("SSSS", [ax0, ax1, ax2, ax3])
            T.reads(var_T_maximum_intermediate[v_ax0, v_ax1, v_ax2, v_ax3], lv1614[v_ax0, 0, v_ax2, v_ax3])
            T.writes(var_T_minimum_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
            var_T_minimum_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] = T.min(var_T_maximum_intermediate[v_ax0, v_ax1, v_ax2, v_ax3], lv1614[v_ax0, 0, v_ax2, v_ax3])
    for i0, i1, i2, i3 in T.grid(1, 32, 1, n):
        with T.sblock("compute"):
            v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
            T.reads(var_T_minimum_intermediate[v_i0, v_i1, v_i2, v_i3])
            T.writes(var_compute_intermediate[v_i0, v_i1, v_i2, v_i3])
            var_compute_intermediate[v_i0, v_i1, v_i2, v_i3] = T.Cast("float32", var_T_minimum_intermediate[v_i0, v_i1, v_i2, v_i3])

# test_decode_gemv1
@T.prim_func(private=True, s_tir=True)
def decode_gemv1(lv571: T.Buffer((22016, 512), "uint32"), lv572: T.Buffer((22016, 128), "float16"), lv1654: T.Buffer((1, 1, 4096), "float16"), var_NT_matmul_intermediate: T.Buffer((1, 1, 22016), "float16")):
    T.func_attr({"tirx.noalias": True})
    # with T.sblock("root"):
    p_output0_intermediate = T.sblock_alloc_buffer((22016, 4096), "float16")
    for i, j in T.grid(22016, 4096):
        with T.sblock("decode"):
            v_i, v_j = T.axis.remap("SS", [i, j])
            T.reads(lv571[v_i, v_j // 8], lv572[v_i, v_j // 32])
            T.writes(p_output0_intermediate[v_i, v_j])
            p_output0_intermediate[v_i, v_j] = (T.Cast("float16", T.bitwise_and(T.shift_right(lv571[v_i, v_j // 8], T.Cast("uint32", v_j % 8) * T.uint32(4)), T.uint32(15))) - T.float16(7)) * lv572[v_i, v_j // 32]
    for i0, i1, i2, k in T.grid(1, 1, 22016, 4096):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(lv1654[v_i0, v_i1, v_k], p_output0_intermediate[v_i2, v_k])
            T.writes(var_NT_matmul_intermediate[v_i0, v_i1, v_i2])
            with T.init():
                var_NT_matmul_intermediate[v_i0, v_i1, v_i2] = T.float16(0)
            var_NT_matmul_intermediate[v_i0, v_i1, v_i2] = var_NT_matmul_intermediate[v_i0, v_i1, v_i2] + lv1654[v_i0, v_i1, v_k] * p_output0_intermediate[v_i2, v_k]

# test_gemv_cuda_target_without_max_shared_memory_per_block
@T.prim_func(private=True, s_tir=True)
def gemv_cuda_target_without_max_shared_memory_per_block(
    A: T.Buffer((1, 1, 1, 128), "float16"),
    B: T.Buffer((1, 1, 64, 128), "float16"),
    C: T.Buffer((1, 1, 1, 64), "float16"),
):
    T.func_attr({"tirx.noalias": True})
    for i0, i1, i2, i3, k in T.grid(1, 1, 1, 64, 128):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_i3, v_k = T.axis.remap("SSSSR", [i0, i1, i2, i3, k])
            T.reads(A[v_i0, v_i1, v_i2, v_k], B[v_i0, v_i1, v_i3, v_k])
            T.writes(C[v_i0, v_i1, v_i2, v_i3])
            with T.init():
                C[v_i0, v_i1, v_i2, v_i3] = T.float16(0)
            C[v_i0, v_i1, v_i2, v_i3] = C[v_i0, v_i1, v_i2, v_i3] + A[
                v_i0, v_i1, v_i2, v_k
            ] * B[v_i0, v_i1, v_i3, v_k]

# test_gemv_broadcast_epilogue
@T.prim_func(private=True, s_tir=True)
def gemv_broadcast_epilogue(
    A: T.Buffer((1, 32, 1, 128), "float16"),
    p_B: T.handle,
    p_C: T.handle,
):
    T.func_attr({"tirx.noalias": True})
    n = T.int32()
    B = T.match_buffer(p_B, (1, 32, n, 128), "float16")
    C = T.match_buffer(p_C, (1, 32, 2, 3, n), "float32")
    C_temp = T.sblock_alloc_buffer((1, 32, 1, n), "float16")
    for i0, i1, i2, i3, k in T.grid(1, 32, 1, n, 128):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_i3, v_k = T.axis.remap("SSSSR", [i0, i1, i2, i3, k])
            T.reads(A[v_i0, v_i1, v_i2, v_k], B[v_i0, v_i1, v_i3, v_k])
            T.writes(C_temp[v_i0, v_i1, v_i2, v_i3])
            with T.init():
                C_temp[v_i0, v_i1, v_i2, v_i3] = T.float16(0)
            C_temp[v_i0, v_i1, v_i2, v_i3] = C_temp[
                v_i0, v_i1, v_i2, v_i3
            ] + A[v_i0, v_i1, v_i2, v_k] * B[v_i0, v_i1, v_i3, v_k]
    for i0, i1, i2, i3, i4 in T.grid(1, 32, 2, 3, n):
        with T.sblock("broadcast_epilogue"):
            v_i0, v_i1, v_i2, v_i3, v_i4 = T.axis.remap(
                "SSSSS", [i0, i1, i2, i3, i4]
            )
            T.reads(C_temp[v_i0, v_i1, 0, v_i4])
            T.writes(C[v_i0, v_i1, v_i2, v_i3, v_i4])
            C[v_i0, v_i1, v_i2, v_i3, v_i4] = T.Cast(
                "float32", C_temp[v_i0, v_i1, 0, v_i4]
            )

# --- test_gpu_general_reduction.py ----------------------------------------------------------------
# test_softmax_1
@T.prim_func(s_tir=True)
def softmax_1(p_lv44: T.handle, p_output0: T.handle):
    T.func_attr({"tirx.noalias": True})
    n, m = T.int64(), T.int64()
    lv44 = T.match_buffer(p_lv44, (T.int64(1), T.int64(32), n, m))
    var_compute_intermediate = T.match_buffer(p_output0, (T.int64(1), T.int64(32), n, m), "float16")
    # with T.sblock("root"):
    T_softmax_maxelem = T.sblock_alloc_buffer((T.int64(1), T.int64(32), n))
    T_softmax_exp = T.sblock_alloc_buffer((T.int64(1), T.int64(32), n, m))
    T_softmax_expsum = T.sblock_alloc_buffer((T.int64(1), T.int64(32), n))
    var_T_softmax_norm_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(32), n, m))
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(32), n, m):
        with T.sblock("T_softmax_maxelem"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(lv44[v_i0, v_i1, v_i2, v_k])
            T.writes(T_softmax_maxelem[v_i0, v_i1, v_i2])
            with T.init():
                T_softmax_maxelem[v_i0, v_i1, v_i2] = T.float32(-3.4028234663852886e+38)
            T_softmax_maxelem[v_i0, v_i1, v_i2] = T.max(T_softmax_maxelem[v_i0, v_i1, v_i2], lv44[v_i0, v_i1, v_i2, v_k])
    for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(32), n, m):
        with T.sblock("T_softmax_exp"):
            v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
            T.reads(lv44[v_i0, v_i1, v_i2, v_i3], T_softmax_maxelem[v_i0, v_i1, v_i2])
            T.writes(T_softmax_exp[v_i0, v_i1, v_i2, v_i3])
            T_softmax_exp[v_i0, v_i1, v_i2, v_i3] = T.exp(lv44[v_i0, v_i1, v_i2, v_i3] - T_softmax_maxelem[v_i0, v_i1, v_i2])
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(32), n, m):
        with T.sblock("T_softmax_expsum"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(T_softmax_exp[v_i0, v_i1, v_i2, v_k])
            T.writes(T_softmax_expsum[v_i0, v_i1, v_i2])
            with T.init():
                T_softmax_expsum[v_i0, v_i1, v_i2] = T.float32(0)
            T_softmax_expsum[v_i0, v_i1, v_i2] = T_softmax_expsum[v_i0, v_i1, v_i2] + T_softmax_exp[v_i0, v_i1, v_i2, v_k]
    for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(32), n, m):
        with T.sblock("T_softmax_norm"):
            v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
            T.reads(T_softmax_exp[v_i0, v_i1, v_i2, v_i3], T_softmax_expsum[v_i0, v_i1, v_i2])
            T.writes(var_T_softmax_norm_intermediate[v_i0, v_i1, v_i2, v_i3])
            T.sblock_attr({"axis": 3})
            var_T_softmax_norm_intermediate[v_i0, v_i1, v_i2, v_i3] = T_softmax_exp[v_i0, v_i1, v_i2, v_i3] / T_softmax_expsum[v_i0, v_i1, v_i2]
    for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(32), n, m):
        with T.sblock("compute"):
            v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
            T.reads(var_T_softmax_norm_intermediate[v_i0, v_i1, v_i2, v_i3])
            T.writes(var_compute_intermediate[v_i0, v_i1, v_i2, v_i3])
            var_compute_intermediate[v_i0, v_i1, v_i2, v_i3] = T.Cast("float16", var_T_softmax_norm_intermediate[v_i0, v_i1, v_i2, v_i3])

# test_softmax_2
@T.prim_func(s_tir=True)
def softmax_2(A: T.Buffer((T.int64(1), T.int64(1), T.int64(32000)), "float32"), T_softmax_norm: T.Buffer((T.int64(1), T.int64(1), T.int64(32000)), "float32")):
    # with T.sblock("root"):
    T_softmax_maxelem = T.sblock_alloc_buffer((T.int64(1), T.int64(1)))
    T_softmax_exp = T.sblock_alloc_buffer((T.int64(1), T.int64(1), T.int64(32000)))
    T_softmax_expsum = T.sblock_alloc_buffer((T.int64(1), T.int64(1)))
    for i0, i1, k in T.grid(T.int64(1), T.int64(1), T.int64(32000)):
        with T.sblock("T_softmax_maxelem"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            T.reads(A[v_i0, v_i1, v_k])
            T.writes(T_softmax_maxelem[v_i0, v_i1])
            with T.init():
                T_softmax_maxelem[v_i0, v_i1] = T.float32(-3.4028234663852886e+38)
            T_softmax_maxelem[v_i0, v_i1] = T.max(T_softmax_maxelem[v_i0, v_i1], A[v_i0, v_i1, v_k])
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(1), T.int64(32000)):
        with T.sblock("T_softmax_exp"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(A[v_i0, v_i1, v_i2], T_softmax_maxelem[v_i0, v_i1])
            T.writes(T_softmax_exp[v_i0, v_i1, v_i2])
            T_softmax_exp[v_i0, v_i1, v_i2] = T.exp(A[v_i0, v_i1, v_i2] - T_softmax_maxelem[v_i0, v_i1])
    for i0, i1, k in T.grid(T.int64(1), T.int64(1), T.int64(32000)):
        with T.sblock("T_softmax_expsum"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            T.reads(T_softmax_exp[v_i0, v_i1, v_k])
            T.writes(T_softmax_expsum[v_i0, v_i1])
            with T.init():
                T_softmax_expsum[v_i0, v_i1] = T.float32(0)
            T_softmax_expsum[v_i0, v_i1] = T_softmax_expsum[v_i0, v_i1] + T_softmax_exp[v_i0, v_i1, v_k]
    for i0, i1, i2 in T.grid(T.int64(1), T.int64(1), T.int64(32000)):
        with T.sblock("T_softmax_norm"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(T_softmax_exp[v_i0, v_i1, v_i2], T_softmax_expsum[v_i0, v_i1])
            T.writes(T_softmax_norm[v_i0, v_i1, v_i2])
            T.sblock_attr({"axis": 2})
            T_softmax_norm[v_i0, v_i1, v_i2] = T_softmax_exp[v_i0, v_i1, v_i2] / T_softmax_expsum[v_i0, v_i1]

# test_softmax_3
@T.prim_func(s_tir=True)
def softmax_3(input: T.Buffer((T.int64(1), T.int64(4), T.int64(32), T.int64(8192)), "float32"), T_softmax_norm: T.Buffer((T.int64(1), T.int64(4), T.int64(32), T.int64(8192)), "float32")):
    # with T.sblock("root"):
    T_softmax_maxelem = T.sblock_alloc_buffer((T.int64(1), T.int64(4), T.int64(8192)))
    T_softmax_exp = T.sblock_alloc_buffer((T.int64(1), T.int64(4), T.int64(32), T.int64(8192)))
    T_softmax_expsum = T.sblock_alloc_buffer((T.int64(1), T.int64(4), T.int64(8192)))
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(4), T.int64(8192), T.int64(32)):
        with T.sblock("T_softmax_maxelem"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(input[v_i0, v_i1, v_k, v_i2])
            T.writes(T_softmax_maxelem[v_i0, v_i1, v_i2])
            with T.init():
                T_softmax_maxelem[v_i0, v_i1, v_i2] = T.float32(-340282346638528859811704183484516925440.0)
            T_softmax_maxelem[v_i0, v_i1, v_i2] = T.max(T_softmax_maxelem[v_i0, v_i1, v_i2], input[v_i0, v_i1, v_k, v_i2])
    for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(4), T.int64(32), T.int64(8192)):
        with T.sblock("T_softmax_exp"):
            v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
            T.reads(input[v_i0, v_i1, v_i2, v_i3], T_softmax_maxelem[v_i0, v_i1, v_i3])
            T.writes(T_softmax_exp[v_i0, v_i1, v_i2, v_i3])
            T_softmax_exp[v_i0, v_i1, v_i2, v_i3] = T.exp(input[v_i0, v_i1, v_i2, v_i3] - T_softmax_maxelem[v_i0, v_i1, v_i3])
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(4), T.int64(8192), T.int64(32)):
        with T.sblock("T_softmax_expsum"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(T_softmax_exp[v_i0, v_i1, v_k, v_i2])
            T.writes(T_softmax_expsum[v_i0, v_i1, v_i2])
            with T.init():
                T_softmax_expsum[v_i0, v_i1, v_i2] = T.float32(0.0)
            T_softmax_expsum[v_i0, v_i1, v_i2] = T_softmax_expsum[v_i0, v_i1, v_i2] + T_softmax_exp[v_i0, v_i1, v_k, v_i2]
    for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(4), T.int64(32), T.int64(8192)):
        with T.sblock("T_softmax_norm"):
            v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
            T.reads(T_softmax_exp[v_i0, v_i1, v_i2, v_i3], T_softmax_expsum[v_i0, v_i1, v_i3])
            T.writes(T_softmax_norm[v_i0, v_i1, v_i2, v_i3])
            T.sblock_attr({"axis": 2})
            T_softmax_norm[v_i0, v_i1, v_i2, v_i3] = T_softmax_exp[v_i0, v_i1, v_i2, v_i3] / T_softmax_expsum[v_i0, v_i1, v_i3]

# test_layer_norm
@T.prim_func(s_tir=True)
def layer_norm(p_lv6: T.handle, weight1: T.Buffer((T.int64(2560),), "float32"), bias: T.Buffer((T.int64(2560),), "float32"), p_output0: T.handle):
    T.func_attr({"tirx.noalias": True})
    n = T.int64()
    lv6 = T.match_buffer(p_lv6, (T.int64(1), n, T.int64(2560)))
    var_compute_intermediate = T.match_buffer(p_output0, (T.int64(1), n, T.int64(2560)), "float16")
    # with T.sblock("root"):
    A_red_temp_v0 = T.sblock_alloc_buffer((T.int64(1), n))
    A_red_temp_v1 = T.sblock_alloc_buffer((T.int64(1), n))
    var_T_layer_norm_intermediate = T.sblock_alloc_buffer((T.int64(1), n, T.int64(2560)))
    for ax0, ax1, k2 in T.grid(T.int64(1), n, T.int64(2560)):
        with T.sblock("A_red_temp"):
            v_ax0, v_ax1, v_k2 = T.axis.remap("SSR", [ax0, ax1, k2])
            T.reads(lv6[v_ax0, v_ax1, v_k2])
            T.writes(A_red_temp_v0[v_ax0, v_ax1], A_red_temp_v1[v_ax0, v_ax1])
            with T.init():
                A_red_temp_v0[v_ax0, v_ax1] = T.float32(0)
                A_red_temp_v1[v_ax0, v_ax1] = T.float32(0)
            v_A_red_temp_v0: T.let[T.float32] = A_red_temp_v0[v_ax0, v_ax1] + lv6[v_ax0, v_ax1, v_k2]
            v_A_red_temp_v1: T.let[T.float32] = A_red_temp_v1[v_ax0, v_ax1] + lv6[v_ax0, v_ax1, v_k2] * lv6[v_ax0, v_ax1, v_k2]
            A_red_temp_v0[v_ax0, v_ax1] = v_A_red_temp_v0
            A_red_temp_v1[v_ax0, v_ax1] = v_A_red_temp_v1
    for ax0, ax1, ax2 in T.grid(T.int64(1), n, T.int64(2560)):
        with T.sblock("T_layer_norm"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(lv6[v_ax0, v_ax1, v_ax2], A_red_temp_v0[v_ax0, v_ax1], A_red_temp_v1[v_ax0, v_ax1], weight1[v_ax2], bias[v_ax2])
            T.writes(var_T_layer_norm_intermediate[v_ax0, v_ax1, v_ax2])
            var_T_layer_norm_intermediate[v_ax0, v_ax1, v_ax2] = (lv6[v_ax0, v_ax1, v_ax2] - A_red_temp_v0[v_ax0, v_ax1] * T.float32(0.00039062500000000002)) * T.rsqrt(A_red_temp_v1[v_ax0, v_ax1] * T.float32(0.00039062500000000002) - A_red_temp_v0[v_ax0, v_ax1] * T.float32(0.00039062500000000002) * (A_red_temp_v0[v_ax0, v_ax1] * T.float32(0.00039062500000000002)) + T.float32(1.0000000000000001e-05)) * weight1[v_ax2] + bias[v_ax2]
    for i0, i1, i2 in T.grid(T.int64(1), n, T.int64(2560)):
        with T.sblock("compute"):
            v_i0, v_i1, v_i2 = T.axis.remap("SSS", [i0, i1, i2])
            T.reads(var_T_layer_norm_intermediate[v_i0, v_i1, v_i2])
            T.writes(var_compute_intermediate[v_i0, v_i1, v_i2])
            var_compute_intermediate[v_i0, v_i1, v_i2] = T.Cast("float16", var_T_layer_norm_intermediate[v_i0, v_i1, v_i2])

# test_rms_norm
@T.prim_func(s_tir=True)
def rms_norm(var_A: T.handle, B: T.Buffer((T.int64(4096),), "float16"), var_rms_norm: T.handle):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    n = T.int64()
    A = T.match_buffer(var_A, (T.int64(1), n, T.int64(4096)), "float16")
    rms_norm_1 = T.match_buffer(var_rms_norm, (T.int64(1), n, T.int64(4096)), "float16")
    # with T.sblock("root"):
    Ared_temp = T.sblock_alloc_buffer((T.int64(1), n))
    for bsz, i, k in T.grid(T.int64(1), n, T.int64(4096)):
        with T.sblock("Ared_temp"):
            v_bsz, v_i, v_k = T.axis.remap("SSR", [bsz, i, k])
            T.reads(A[v_bsz, v_i, v_k])
            T.writes(Ared_temp[v_bsz, v_i])
            with T.init():
                Ared_temp[v_bsz, v_i] = T.float32(0)
            Ared_temp[v_bsz, v_i] = Ared_temp[v_bsz, v_i] + T.Cast("float32", A[v_bsz, v_i, v_k]) * T.Cast("float32", A[v_bsz, v_i, v_k])
    for bsz, i, k in T.grid(T.int64(1), n, T.int64(4096)):
        with T.sblock("rms_norm"):
            v_bsz, v_i, v_k = T.axis.remap("SSS", [bsz, i, k])
            T.reads(B[v_k], A[v_bsz, v_i, v_k], Ared_temp[v_bsz, v_i])
            T.writes(rms_norm_1[v_bsz, v_i, v_k])
            rms_norm_1[v_bsz, v_i, v_k] = T.Cast("float16", T.Cast("float32", B[v_k]) * (T.Cast("float32", A[v_bsz, v_i, v_k]) / T.sqrt(Ared_temp[v_bsz, v_i] * T.float32(0.000244140625) + T.float32(9.9999999999999995e-07))))

# test_logsumexp
@T.prim_func(s_tir=True)
def logsumexp(var_A: T.handle, var_blocked_lse: T.handle):
    T.func_attr({"tirx.noalias": True})
    batch_size = T.int64()
    vocab_size = T.int64()
    num_chunks = T.int64()
    A = T.match_buffer(var_A, (batch_size, vocab_size), dtype="float32")
    blocked_lse = T.match_buffer(var_blocked_lse, (batch_size, num_chunks), dtype="float32")
    A_pad = T.sblock_alloc_buffer((batch_size, num_chunks, T.int64(4096)), dtype="float32")
    temp_max = T.sblock_alloc_buffer((batch_size, num_chunks), dtype="float32")
    temp_sum = T.sblock_alloc_buffer((batch_size, num_chunks), dtype="float32")

    for l0, l1, l2 in T.grid(batch_size, num_chunks, T.int64(4096)):
        with T.sblock("pad"):
            v0, v1, v2 = T.axis.remap("SSS", [l0, l1, l2])
            A_pad[v0, v1, v2] = T.if_then_else(
                v1 * T.int64(4096) + v2 < vocab_size,
                A[v0, v1 * T.int64(4096) + v2],
                T.min_value("float32"),
            )

    for l0, l1, l2 in T.grid(batch_size, num_chunks, T.int64(4096)):
        with T.sblock("max"):
            v0, v1, v2 = T.axis.remap("SSR", [l0, l1, l2])
            with T.init():
                temp_max[v0, v1] = T.min_value("float32")
            temp_max[v0, v1] = T.max(temp_max[v0, v1], A_pad[v0, v1, v2])

    for l0, l1, l2 in T.grid(batch_size, num_chunks, T.int64(4096)):
        with T.sblock("sum_exp"):
            v0, v1, v2 = T.axis.remap("SSR", [l0, l1, l2])
            with T.init():
                temp_sum[v0, v1] = T.float32(0)
            temp_sum[v0, v1] += T.if_then_else(
                v1 * T.int64(4096) + v2 < vocab_size,
                T.exp(A_pad[v0, v1, v2] - temp_max[v0, v1]),
                T.float32(0),
            )

    for l0, l1, l2 in T.grid(batch_size, num_chunks, T.int64(1)):
        with T.sblock("log"):
            v0, v1, v2 = T.axis.remap("SSS", [l0, l1, l2])
            blocked_lse[v0, v1] = T.log(temp_sum[v0, v1]) + temp_max[v0, v1]

# --- test_gpu_low_batch_gemv.py -------------------------------------------------------------------
# test_batch_decode_gemv
@T.prim_func(private=True, s_tir=True)
def batch_decode_gemv(lv429: T.Buffer((T.int64(4096), T.int64(3584)), "uint32"), lv430: T.Buffer((T.int64(4096), T.int64(896)), "float16"), p_lv807: T.handle, p_output0: T.handle):
    T.func_attr({"tirx.noalias": True, "tirx.HoistIfThenElseExprWithBlock": 1})
    batch_size = T.int64()
    lv807 = T.match_buffer(p_lv807, (batch_size, T.int64(1), T.int64(28672)), "float16")
    NT_matmul_intermediate = T.match_buffer(p_output0, (batch_size, T.int64(1), T.int64(4096)), "float16")
    # with T.sblock("root"):
    compute = T.sblock_alloc_buffer((T.int64(4096), T.int64(28672)), "float16")
    dequantize_intermediate_intermediate = T.sblock_alloc_buffer((T.int64(4096), T.int64(28672)), "float16")
    for i0, i1 in T.grid(T.int64(4096), T.int64(28672)):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(lv429[v_i0, v_i1 // T.int64(8)])
            T.writes(compute[v_i0, v_i1])
            compute[v_i0, v_i1] = T.Cast("float16", T.bitwise_and(T.shift_right(lv429[v_i0, v_i1 // T.int64(8)], T.Cast("uint32", v_i1 % T.int64(8) * T.int64(4))), T.uint32(15)))
    for i0, i1 in T.grid(T.int64(4096), T.int64(28672)):
        with T.sblock("dequantize"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(compute[v_i0, v_i1], lv430[v_i0, v_i1 // T.int64(32)])
            T.writes(dequantize_intermediate_intermediate[v_i0, v_i1])
            dequantize_intermediate_intermediate[v_i0, v_i1] = (compute[v_i0, v_i1] - T.float16(7)) * lv430[v_i0, v_i1 // T.int64(32)]
    for i0, i1, i2, k in T.grid(batch_size, T.int64(1), T.int64(4096), T.int64(28672)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(lv807[v_i0, v_i1, v_k], dequantize_intermediate_intermediate[v_i2, v_k])
            T.writes(NT_matmul_intermediate[v_i0, v_i1, v_i2])
            with T.init():
                NT_matmul_intermediate[v_i0, v_i1, v_i2] = T.float16(0)
            NT_matmul_intermediate[v_i0, v_i1, v_i2] = NT_matmul_intermediate[v_i0, v_i1, v_i2] + lv807[v_i0, v_i1, v_k] * dequantize_intermediate_intermediate[v_i2, v_k]

# test_outer_reduction
@T.prim_func(private=True, s_tir=True)
def outer_reduction(
    B0: T.Buffer((512, 6144), "uint32"),
    B1: T.Buffer((128, 6144), "float16"),
    var_A: T.handle,
    var_C: T.handle
):
    batch_size = T.int32()
    A = T.match_buffer(var_A, (batch_size, 1, 4096), "float16")
    C = T.match_buffer(var_C, (batch_size, 1, 6144), "float16")
    compute = T.sblock_alloc_buffer((4096, 6144), "float16")
    B = T.sblock_alloc_buffer((4096, 6144), "float16")
    for i0, i1 in T.grid(4096, 6144):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            compute[v_i0, v_i1] = T.Cast("float16", T.bitwise_and(T.shift_right(B0[v_i0 // 8, v_i1], T.Cast("uint32", v_i0 % 8 * 4)), T.uint32(15)))
    for i0, i1 in T.grid(4096, 6144):
        with T.sblock("dequantize"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            B[v_i0, v_i1] = (compute[v_i0, v_i1] - T.float16(7)) * B1[v_i0 // 32, v_i1]
    for i0, i1, i2, k in T.grid(batch_size, 1, 6144, 4096):
        with T.sblock("matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                C[v_i0, v_i1, v_i2] = T.float16(0)
            C[v_i0, v_i1, v_i2] = C[v_i0, v_i1, v_i2] + A[v_i0, v_i1, v_k] * B[v_k, v_i2]

# test_low_batch_gemv_cuda_target_without_max_shared_memory_per_block
@T.prim_func(private=True, s_tir=True)
def low_batch_gemv_cuda_target_without_max_shared_memory_per_block(var_A: T.handle, B: T.Buffer((T.int64(128), T.int64(128)), "float16"), var_C: T.handle):
    T.func_attr({"tir.noalias": True})
    batch_size = T.int64()
    A = T.match_buffer(var_A, (batch_size, T.int64(1), T.int64(128)), "float16")
    C = T.match_buffer(var_C, (batch_size, T.int64(1), T.int64(128)), "float16")
    for i0, i1, i2, k in T.grid(batch_size, T.int64(1), T.int64(128), T.int64(128)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(A[v_i0, v_i1, v_k], B[v_i2, v_k])
            T.writes(C[v_i0, v_i1, v_i2])
            with T.init():
                C[v_i0, v_i1, v_i2] = T.float16(0)
            C[v_i0, v_i1, v_i2] = C[v_i0, v_i1, v_i2] + A[v_i0, v_i1, v_k] * B[v_i2, v_k]

# --- test_gpu_matmul.py ---------------------------------------------------------------------------
# test_matmul
@T.prim_func(private=True, s_tir=True)
def matmul(var_inp0: T.handle, inp1: T.Buffer((T.int64(4096), T.int64(4096)), "float32"), var_matmul: T.handle):
    m = T.int64()
    inp0 = T.match_buffer(var_inp0, (T.int64(1), m, T.int64(4096)))
    matmul = T.match_buffer(var_matmul, (T.int64(1), m, T.int64(4096)))
    for i0, i1, i2, k in T.grid(T.int64(1), m, T.int64(4096), T.int64(4096)):
        with T.sblock("matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                matmul[v_i0, v_i1, v_i2] = T.float32(0)
            matmul[v_i0, v_i1, v_i2] = matmul[v_i0, v_i1, v_i2] + inp0[v_i0, v_i1, v_k] * inp1[v_k, v_i2]

# test_fused_matmul
@T.prim_func(private=True, s_tir=True)
def fused_matmul(W: T.Buffer((T.int64(512), T.int64(4096)), "uint32"), S: T.Buffer((T.int64(128), T.int64(4096)), "uint32"), A: T.Buffer((T.int64(1), T.int64(32), T.int64(4096)), "float32"), C: T.Buffer((T.int64(1), T.int64(32), T.int64(4096)), "float32"), Out: T.Buffer((T.int64(1), T.int64(32), T.int64(4096)), "float32")):
    var_decode_intermediate = T.sblock_alloc_buffer((T.int64(4096), T.int64(4096)))
    var_matmul_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(32), T.int64(4096)))
    for i, j in T.grid(T.int64(4096), T.int64(4096)):
        with T.sblock("decode"):
            v_i, v_j = T.axis.remap("SS", [i, j])
            T.reads(W[v_i // T.int64(8), v_j], S[v_i // T.int64(32), v_j])
            T.writes(var_decode_intermediate[v_i, v_j])
            var_decode_intermediate[v_i, v_j] = T.Cast("float32", T.bitwise_and(T.shift_right(W[v_i // T.int64(8), v_j], T.Cast("uint32", v_i % T.int64(8) * T.int64(4))), T.uint32(15))) * T.reinterpret("float32", T.shift_left(T.bitwise_and(S[v_i // T.int64(32), v_j], T.uint32(65535)), T.uint32(16))) + T.reinterpret("float32", T.shift_left(T.bitwise_and(T.shift_right(S[v_i // T.int64(32), v_j], T.uint32(16)), T.uint32(65535)), T.uint32(16)))
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(32), T.int64(4096), T.int64(4096)):
        with T.sblock("matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(A[v_i0, v_i1, v_k], var_decode_intermediate[v_k, v_i2])
            T.writes(var_matmul_intermediate[v_i0, v_i1, v_i2])
            with T.init():
                var_matmul_intermediate[v_i0, v_i1, v_i2] = T.float32(0)
            var_matmul_intermediate[v_i0, v_i1, v_i2] = var_matmul_intermediate[v_i0, v_i1, v_i2] + A[v_i0, v_i1, v_k] * var_decode_intermediate[v_k, v_i2]
    for ax0, ax1, ax2 in T.grid(T.int64(1), T.int64(32), T.int64(4096)):
        with T.sblock("T_add"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(C[v_ax0, v_ax1, v_ax2], var_matmul_intermediate[v_ax0, v_ax1, v_ax2])
            T.writes(Out[v_ax0, v_ax1, v_ax2])
            Out[v_ax0, v_ax1, v_ax2] = C[v_ax0, v_ax1, v_ax2] + var_matmul_intermediate[v_ax0, v_ax1, v_ax2]

# --- test_gpu_matmul_tensorize.py -----------------------------------------------------------------
# test_matmul_tensorize
@T.prim_func(private=True, s_tir=True)
def matmul_tensorize(X: T.Buffer((256, 256), "float16"), W: T.Buffer((256, 256), "float16"), compute: T.Buffer((256, 256), "float16")):
    T.func_attr({"tirx.noalias": True})
    # with T.sblock("root"):
    for i, j, k in T.grid(256, 256, 256):
        with T.sblock("compute"):
            v_i, v_j, v_k = T.axis.remap("SSR", [i, j, k])
            T.reads(X[v_i, v_k], W[v_j, v_k])
            T.writes(compute[v_i, v_j])
            with T.init():
                compute[v_i, v_j] = T.float16(0)
            compute[v_i, v_j] = compute[v_i, v_j] + X[v_i, v_k] * W[v_j, v_k]

# test_matmul_tensorize_epilogue
@T.prim_func(private=True, s_tir=True)
def matmul_tensorize_epilogue(lv686: T.Buffer((T.int32(4096), T.int32(256)), "uint32"), lv687: T.Buffer((T.int32(4096), T.int32(64)), "float16"), p_lv42: T.handle, p_lv3: T.handle, p_output0: T.handle):
    T.func_attr({"tirx.noalias": True})
    n = T.int32()
    lv42 = T.match_buffer(p_lv42, (T.int32(1), n, T.int32(2048)), "float16")
    lv3 = T.match_buffer(p_lv3, (T.int32(1), n, T.int32(4096)), "float16")
    p_output0_intermediate = T.match_buffer(p_output0, (T.int32(1), n, T.int32(4096)), "float16")
    # with T.sblock("root"):
    p_output0_intermediate_1 = T.sblock_alloc_buffer((T.int32(4096), T.int32(2048)), "float16")
    var_NT_matmul_intermediate = T.sblock_alloc_buffer((T.int32(1), n, T.int32(4096)), "float16")
    var_T_divide_intermediate = T.sblock_alloc_buffer((T.int32(1), n, T.int32(4096)), "float16")
    for i, j in T.grid(T.int32(4096), T.int32(2048)):
        with T.sblock("decode"):
            v_i, v_j = T.axis.remap("SS", [i, j])
            T.reads(lv686[v_i, v_j // T.int32(8)], lv687[v_i, v_j // T.int32(32)])
            T.writes(p_output0_intermediate_1[v_i, v_j])
            p_output0_intermediate_1[v_i, v_j] = (T.Cast("float16", T.bitwise_and(T.shift_right(lv686[v_i, v_j // T.int32(8)], T.Cast("uint32", v_j % T.int32(8)) * T.uint32(4)), T.uint32(15))) - T.float16(7)) * lv687[v_i, v_j // T.int32(32)]
    for i0, i1, i2, k in T.grid(T.int32(1), n, T.int32(4096), T.int32(2048)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(lv42[v_i0, v_i1, v_k], p_output0_intermediate_1[v_i2, v_k])
            T.writes(var_NT_matmul_intermediate[v_i0, v_i1, v_i2])
            with T.init():
                var_NT_matmul_intermediate[v_i0, v_i1, v_i2] = T.float16(0)
            var_NT_matmul_intermediate[v_i0, v_i1, v_i2] = var_NT_matmul_intermediate[v_i0, v_i1, v_i2] + lv42[v_i0, v_i1, v_k] * p_output0_intermediate_1[v_i2, v_k]
    for ax0, ax1, ax2 in T.grid(T.int32(1), n, T.int32(4096)):
        with T.sblock("T_divide"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(lv3[v_ax0, v_ax1, v_ax2])
            T.writes(var_T_divide_intermediate[v_ax0, v_ax1, v_ax2])
            var_T_divide_intermediate[v_ax0, v_ax1, v_ax2] = lv3[v_ax0, v_ax1, v_ax2] * T.float16(0.5)
    for ax0, ax1, ax2 in T.grid(T.int32(1), n, T.int32(4096)):
        with T.sblock("T_add"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(var_T_divide_intermediate[v_ax0, v_ax1, v_ax2], var_NT_matmul_intermediate[v_ax0, v_ax1, v_ax2])
            T.writes(p_output0_intermediate[v_ax0, v_ax1, v_ax2])
            p_output0_intermediate[v_ax0, v_ax1, v_ax2] = var_T_divide_intermediate[v_ax0, v_ax1, v_ax2] + var_NT_matmul_intermediate[v_ax0, v_ax1, v_ax2]

# test_matmul_int8_tensorize
@T.prim_func(private=True, s_tir=True)
def matmul_int8_tensorize(X: T.Buffer((256, 256), "int8"), W: T.Buffer((256, 256), "int8"), compute: T.Buffer((256, 256), "int32")):
    T.func_attr({"tirx.noalias": True})
    # with T.sblock("root"):
    for i, j, r in T.grid(256, 256, 256):
        with T.sblock("compute"):
            v_i, v_j, v_k = T.axis.remap("SSR", [i, j, r])
            T.reads(X[v_i, v_k], W[v_j, v_k])
            T.writes(compute[v_i, v_j])
            with T.init():
                compute[v_i, v_j] = 0
            compute[v_i, v_j] = compute[v_i, v_j] + T.Cast("int32", X[v_i, v_k]) * T.Cast("int32", W[v_j, v_k])

# test_matmul_metal
@T.prim_func(private=True, s_tir=True)
def matmul_metal(
    var_A: T.handle,
    B: T.Buffer((28672, 4096), "float16"),
    var_C: T.handle,
):
    batch_size = T.int32()
    A = T.match_buffer(var_A, (batch_size, 1, 4096), "float16")
    C = T.match_buffer(var_C, (batch_size, 1, 28672), "float16")
    for i0, i1, i2, k in T.grid(batch_size, 1, 28672, 4096):
        with T.sblock("C"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.writes(C[v_i0, v_i1, v_i2])
            with T.init():
                C[v_i0, v_i1, v_i2] = T.float16(0)
            C[v_i0, v_i1, v_i2] += A[v_i0, v_i1, v_k] * B[v_i2, v_k]

# test_matmul_metal_int4_quant
@T.prim_func(private=True, s_tir=True)
def matmul_metal_int4_quant(
    B0: T.Buffer((28672, 512), "uint32"),
    B1: T.Buffer((28672, 128), "float16"),
    var_A: T.handle,
    var_C: T.handle
):
    batch_size = T.int32()
    A = T.match_buffer(var_A, (batch_size, 1, 4096), "float16")
    C = T.match_buffer(var_C, (batch_size, 1, 28672), "float16")
    compute = T.sblock_alloc_buffer((28672, 4096), "float16")
    B = T.sblock_alloc_buffer((28672, 4096), "float16")
    for i0, i1 in T.grid(28672, 4096):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            compute[v_i0, v_i1] = T.Cast("float16", T.bitwise_and(T.shift_right(B0[v_i0, v_i1 // 8], T.Cast("uint32", v_i1 % 8 * 4)), T.uint32(15)))
    for i0, i1 in T.grid(28672, 4096):
        with T.sblock("dequantize"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            B[v_i0, v_i1] = (compute[v_i0, v_i1] - T.float16(7)) * B1[v_i0, v_i1 // 32]
    for i0, i1, i2, k in T.grid(batch_size, 1, 28672, 4096):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                C[v_i0, v_i1, v_i2] = T.float16(0)
            C[v_i0, v_i1, v_i2] = C[v_i0, v_i1, v_i2] + A[v_i0, v_i1, v_k] * B[v_i2, v_k]

# --- test_gpu_reduction.py ------------------------------------------------------------------------
# test_decode_gemv_1
@T.prim_func(s_tir=True)
def decode_gemv_1(W: T.Buffer((4096, 512), "uint32"), S: T.Buffer((4096, 128), "float16"), V: T.Buffer((1, 1, 4096), "float16"), C: T.Buffer((1, 1, 4096), "float16")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    # with T.sblock("root"):
    B = T.sblock_alloc_buffer((4096, 4096), "float16")
    for i, j in T.grid(4096, 4096):
        with T.sblock("decode"):
            v_i, v_j = T.axis.remap("SS", [i, j])
            T.reads(W[v_i, v_j // 8], S[v_i, v_j // 32])
            T.writes(B[v_i, v_j])
            B[v_i, v_j] = (T.Cast("float16", T.bitwise_and(T.shift_right(W[v_i, v_j // 8], T.Cast("uint32", v_j % 8) * T.uint32(4)), T.uint32(15))) - T.float16(7)) * S[v_i, v_j // 32]
    for i0, i1, i2, k in T.grid(1, 1, 4096, 4096):
        with T.sblock("matmul"):
            v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
            T.reads(V[v_i0, v_i1, v_k], B[v_i2, v_k])
            T.writes(C[v_i0, v_i1, v_i2])
            with T.init():
                C[v_i0, v_i1, v_i2] = T.float16(0)
            C[v_i0, v_i1, v_i2] = C[v_i0, v_i1, v_i2] + V[v_i0, v_i1, v_k] * B[v_i2, v_k]

# test_repeat_transpose_gemv
@T.prim_func(private=True, s_tir=True)
def repeat_transpose_gemv(p_lv716: T.handle, p_astype66: T.handle, var_matmul_intermediate: T.Buffer((T.int64(1), T.int64(32), T.int64(1), T.int64(128)), "float16")):
    T.func_attr({"tirx.noalias": True})
    kv_seq_len = T.int64()
    lv716 = T.match_buffer(p_lv716, (T.int64(1), kv_seq_len, T.int64(8), T.int64(128)), "float16")
    astype66 = T.match_buffer(p_astype66, (T.int64(1), T.int64(32), T.int64(1), kv_seq_len), "float16")
    # with T.sblock("root"):
    var_T_repeat_intermediate = T.sblock_alloc_buffer((T.int64(1), kv_seq_len, T.int64(32), T.int64(128)), "float16")
    var_T_transpose_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(32), kv_seq_len, T.int64(128)), "float16")
    for ax0, ax1, ax2, ax3 in T.grid(T.int64(1), kv_seq_len, T.int64(32), T.int64(128)):
        with T.sblock("T_repeat"):
            v_ax0, v_ax1, v_ax2, v_ax3 = T.axis.remap("SSSS", [ax0, ax1, ax2, ax3])
            T.reads(lv716[v_ax0, v_ax1, v_ax2 // T.int64(4), v_ax3])
            T.writes(var_T_repeat_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
            var_T_repeat_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] = lv716[v_ax0, v_ax1, v_ax2 // T.int64(4), v_ax3]
    for ax0, ax1, ax2, ax3 in T.grid(T.int64(1), T.int64(32), kv_seq_len, T.int64(128)):
        with T.sblock("T_transpose"):
            v_ax0, v_ax1, v_ax2, v_ax3 = T.axis.remap("SSSS", [ax0, ax1, ax2, ax3])
            T.reads(var_T_repeat_intermediate[v_ax0, v_ax2, v_ax1, v_ax3])
            T.writes(var_T_transpose_intermediate[v_ax0, v_ax1, v_ax2, v_ax3])
            var_T_transpose_intermediate[v_ax0, v_ax1, v_ax2, v_ax3] = var_T_repeat_intermediate[v_ax0, v_ax2, v_ax1, v_ax3]
    for i0, i1, i2, i3, k in T.grid(T.int64(1), T.int64(32), T.int64(1), T.int64(128), kv_seq_len):
        with T.sblock("matmul"):
            v_i0, v_i1, v_i2, v_i3, v_k = T.axis.remap("SSSSR", [i0, i1, i2, i3, k])
            T.reads(astype66[v_i0, v_i1, v_i2, v_k], var_T_transpose_intermediate[v_i0, v_i1, v_k, v_i3])
            T.writes(var_matmul_intermediate[v_i0, v_i1, v_i2, v_i3])
            with T.init():
                var_matmul_intermediate[v_i0, v_i1, v_i2, v_i3] = T.float16(0)
            var_matmul_intermediate[v_i0, v_i1, v_i2, v_i3] = var_matmul_intermediate[v_i0, v_i1, v_i2, v_i3] + astype66[v_i0, v_i1, v_i2, v_k] * var_T_transpose_intermediate[v_i0, v_i1, v_k, v_i3]

# test_gemv_output_one_element
@T.prim_func(private=True, s_tir=True)
def gemv_output_one_element(A: T.Buffer((T.int64(1), T.int64(2048)), "float16"), weight: T.Buffer((T.int64(1), T.int64(2048)), "float16"), out: T.Buffer((T.int64(1), T.int64(1)), "float16")):
    T.func_attr({"tirx.noalias": True})
    NT_matmul_intermediate = T.sblock_alloc_buffer((T.int64(1), T.int64(1)), "float16")
    for i0, i1, k in T.grid(T.int64(1), T.int64(1), T.int64(2048)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            with T.init():
                NT_matmul_intermediate[v_i0, v_i1] = T.float16(0)
            NT_matmul_intermediate[v_i0, v_i1] = NT_matmul_intermediate[v_i0, v_i1] + A[v_i0, v_k] * weight[v_i1, v_k]
    for i0, i1 in T.grid(T.int64(1), T.int64(1)):
        with T.sblock("compute"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            out[v_i0, v_i1] = T.sigmoid(NT_matmul_intermediate[v_i0, v_i1])

# --- test_gpu_rmsnorm.py --------------------------------------------------------------------------
# test_rms_norm_with_casting
@T.prim_func(s_tir=True)
def rms_norm_with_casting(var_data: T.handle, weight: T.Buffer((4096,), "float16"), var_T_cast: T.handle):
    T.func_attr({"tirx.noalias": True})
    n = T.int32()
    data = T.match_buffer(var_data, (1, n, 4096), "float16")
    T_cast = T.match_buffer(var_T_cast, (1, n, 4096), "float16")
    # with T.sblock("root"):
    T_cast_1 = T.sblock_alloc_buffer((1, n, 4096))
    T_multiply = T.sblock_alloc_buffer((1, n, 4096))
    T_multiply_red = T.sblock_alloc_buffer((1, n))
    rsqrt = T.sblock_alloc_buffer((1, n))
    T_cast_2 = T.sblock_alloc_buffer((4096,))
    T_rms_norm = T.sblock_alloc_buffer((1, n, 4096))
    for ax0, ax1, ax2 in T.grid(1, n, 4096):
        with T.sblock("T_cast"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(data[v_ax0, v_ax1, v_ax2])
            T.writes(T_cast_1[v_ax0, v_ax1, v_ax2])
            T_cast_1[v_ax0, v_ax1, v_ax2] = T.Cast("float32", data[v_ax0, v_ax1, v_ax2])
    for ax0, ax1, ax2 in T.grid(1, n, 4096):
        with T.sblock("T_multiply"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_cast_1[v_ax0, v_ax1, v_ax2])
            T.writes(T_multiply[v_ax0, v_ax1, v_ax2])
            T_multiply[v_ax0, v_ax1, v_ax2] = T_cast_1[v_ax0, v_ax1, v_ax2] * T_cast_1[v_ax0, v_ax1, v_ax2]
    for ax0, ax1, k2 in T.grid(1, n, 4096):
        with T.sblock("T_multiply_red"):
            v_ax0, v_ax1, v_k2 = T.axis.remap("SSR", [ax0, ax1, k2])
            T.reads(T_multiply[v_ax0, v_ax1, v_k2])
            T.writes(T_multiply_red[v_ax0, v_ax1])
            with T.init():
                T_multiply_red[v_ax0, v_ax1] = T.float32(0)
            T_multiply_red[v_ax0, v_ax1] = T_multiply_red[v_ax0, v_ax1] + T_multiply[v_ax0, v_ax1, v_k2]
    for ax0, ax1 in T.grid(1, n):
        with T.sblock("rsqrt"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_multiply_red[v_ax0, v_ax1])
            T.writes(rsqrt[v_ax0, v_ax1])
            rsqrt[v_ax0, v_ax1] = T.rsqrt(T_multiply_red[v_ax0, v_ax1] * T.float32(0.000244140625) + T.float32(9.9999999999999995e-07))
    for ax0 in range(4096):
        with T.sblock("T_cast_1"):
            v_ax0 = T.axis.spatial(4096, ax0)
            T.reads(weight[v_ax0])
            T.writes(T_cast_2[v_ax0])
            T_cast_2[v_ax0] = T.Cast("float32", weight[v_ax0])
    for ax0, ax1, ax2 in T.grid(1, n, 4096):
        with T.sblock("T_rms_norm"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(rsqrt[v_ax0, v_ax1], T_cast_1[v_ax0, v_ax1, v_ax2], T_cast_2[v_ax2])
            T.writes(T_rms_norm[v_ax0, v_ax1, v_ax2])
            T_rms_norm[v_ax0, v_ax1, v_ax2] = rsqrt[v_ax0, v_ax1] * T_cast_1[v_ax0, v_ax1, v_ax2] * T_cast_2[v_ax2]
    for ax0, ax1, ax2 in T.grid(1, n, 4096):
        with T.sblock("T_cast_2"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_rms_norm[v_ax0, v_ax1, v_ax2])
            T.writes(T_cast[v_ax0, v_ax1, v_ax2])
            T_cast[v_ax0, v_ax1, v_ax2] = T.Cast("float16", T_rms_norm[v_ax0, v_ax1, v_ax2])

# test_rms_norm_without_casting
@T.prim_func(s_tir=True)
def rms_norm_without_casting(var_data: T.handle, weight: T.Buffer((4096,), "float32"), var_T_cast: T.handle):
    T.func_attr({"tirx.noalias": True})
    n = T.int32()
    data = T.match_buffer(var_data, (1, n, 4096))
    T_cast = T.match_buffer(var_T_cast, (1, n, 4096))
    # with T.sblock("root"):
    T_multiply = T.sblock_alloc_buffer((1, n, 4096))
    T_multiply_red = T.sblock_alloc_buffer((1, n))
    rsqrt = T.sblock_alloc_buffer((1, n))
    T_rms_norm = T.sblock_alloc_buffer((1, n, 4096))
    for ax0, ax1, ax2 in T.grid(1, n, 4096):
        with T.sblock("T_multiply"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(data[v_ax0, v_ax1, v_ax2])
            T.writes(T_multiply[v_ax0, v_ax1, v_ax2])
            T_multiply[v_ax0, v_ax1, v_ax2] = data[v_ax0, v_ax1, v_ax2] * data[v_ax0, v_ax1, v_ax2]
    for ax0, ax1, k2 in T.grid(1, n, 4096):
        with T.sblock("T_multiply_red"):
            v_ax0, v_ax1, v_k2 = T.axis.remap("SSR", [ax0, ax1, k2])
            T.reads(T_multiply[v_ax0, v_ax1, v_k2])
            T.writes(T_multiply_red[v_ax0, v_ax1])
            with T.init():
                T_multiply_red[v_ax0, v_ax1] = T.float32(0)
            T_multiply_red[v_ax0, v_ax1] = T_multiply_red[v_ax0, v_ax1] + T_multiply[v_ax0, v_ax1, v_k2]
    for ax0, ax1 in T.grid(1, n):
        with T.sblock("rsqrt"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T.reads(T_multiply_red[v_ax0, v_ax1])
            T.writes(rsqrt[v_ax0, v_ax1])
            rsqrt[v_ax0, v_ax1] = T.rsqrt(T_multiply_red[v_ax0, v_ax1] * T.float32(0.000244140625) + T.float32(9.9999999999999995e-07))
    for ax0, ax1, ax2 in T.grid(1, n, 4096):
        with T.sblock("T_rms_norm"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(rsqrt[v_ax0, v_ax1], data[v_ax0, v_ax1, v_ax2], weight[v_ax2])
            T.writes(T_rms_norm[v_ax0, v_ax1, v_ax2])
            T_rms_norm[v_ax0, v_ax1, v_ax2] = rsqrt[v_ax0, v_ax1] * data[v_ax0, v_ax1, v_ax2] * weight[v_ax2]
    for ax0, ax1, ax2 in T.grid(1, n, 4096):
        with T.sblock("T_cast_2"):
            v_ax0, v_ax1, v_ax2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            T.reads(T_rms_norm[v_ax0, v_ax1, v_ax2])
            T.writes(T_cast[v_ax0, v_ax1, v_ax2])
            T_cast[v_ax0, v_ax1, v_ax2] = T_rms_norm[v_ax0, v_ax1, v_ax2]

# --- test_gpu_transpose.py ------------------------------------------------------------------------
# test_transpose
@T.prim_func(s_tir=True)
def transpose(rxplaceholder: T.Buffer((T.int64(512), T.int64(4096)), "float32"), T_transpose: T.Buffer((T.int64(4096), T.int64(512)), "float32")):
    T.func_attr({"tirx.noalias": True})
    for ax0, ax1 in T.grid(T.int64(4096), T.int64(512)):
        with T.sblock("T_transpose"):
            v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
            T_transpose[v_ax0, v_ax1] = rxplaceholder[v_ax1, v_ax0]


FUNCTIONS: dict[str, tirx.PrimFunc] = {
    'gemv_basic': gemv_basic,
    'decode_gemv1': decode_gemv1,
    'gemv_cuda_target_without_max_shared_memory_per_block': gemv_cuda_target_without_max_shared_memory_per_block,
    'gemv_broadcast_epilogue': gemv_broadcast_epilogue,
    'softmax_1': softmax_1,
    'softmax_2': softmax_2,
    'softmax_3': softmax_3,
    'layer_norm': layer_norm,
    'rms_norm': rms_norm,
    'logsumexp': logsumexp,
    'batch_decode_gemv': batch_decode_gemv,
    'outer_reduction': outer_reduction,
    'low_batch_gemv_cuda_target_without_max_shared_memory_per_block': low_batch_gemv_cuda_target_without_max_shared_memory_per_block,
    'matmul': matmul,
    'fused_matmul': fused_matmul,
    'matmul_tensorize': matmul_tensorize,
    'matmul_tensorize_epilogue': matmul_tensorize_epilogue,
    'matmul_int8_tensorize': matmul_int8_tensorize,
    'matmul_metal': matmul_metal,
    'matmul_metal_int4_quant': matmul_metal_int4_quant,
    'decode_gemv_1': decode_gemv_1,
    'repeat_transpose_gemv': repeat_transpose_gemv,
    'gemv_output_one_element': gemv_output_one_element,
    'rms_norm_with_casting': rms_norm_with_casting,
    'rms_norm_without_casting': rms_norm_without_casting,
    'transpose': transpose,
}
