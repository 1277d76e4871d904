"""Gemv: schedule linear layers of a few static rows (decode, low batch) with fuselight's GEMV template.

``analyze`` is the Matmul rule's (``rules.gemm.analysis``): a matmul with its fused elementwise
epilogue, here only with a static M. ``schedule`` takes the functions the Matmul rule leaves to the
next rule (static M below the dispatch config's ``min_static_m``) and writes the GEMV template's
body (``rules.gemm.gemv``, the config bucket of ``configs/gemm/gemv.json`` for that M) over the
function's own buffers: the signature, the parameters and the epilogue stay, the intermediates
vanish (a paired ``silu(gate) * up`` epilogue included: decode's gate+up projection writes
``[M, I]`` directly). Unlike the Matmul rule it also takes an RMSNorm prologue
(``passes.fuse_norm_gemv``: the template norms the token rows in every block). Other weights
layouts, M without a bucket and targets without a config go on to the next rule (DLight's GEMV).
``symbolic_m_buckets`` gives the Matmul rule the buckets it branches a symbolic M of a few rows into.

Dequantized 4-bit weights (``rules.gemm.dequant``; ``configs/gemm/gemv_q4.json``) are this rule's
for any M: the Matmul rule's templates do not dequantize. A static M takes its bucket (M = 1 the
row-streaming or the mma template, 2..16 the mma template); a symbolic M (MLC-LLM's batch decode)
branches on the host into every bucket up to the largest and, above it, into DLight's Matmul
schedule of the same function (what MLC-LLM's LowBatchGemvSpecialize runs there), so the function
leaves this rule scheduled and LowBatchGemvSpecialize, which runs after fuselight's rules, skips it.
Those in the KN layout (MLC-LLM's ``q4f16_0``) take the KN template (``rules.gemm.gemv_kn``,
``configs/gemm/gemv_q4_kn.json``) at a static M of its buckets, with the norm prologue and the
paired epilogue as the NK templates (N may be symbolic: MLC-LLM's LM head); any other KN function
(a symbolic M: prefill, batch decode) goes on to the next rule. AutoAWQ's words along N (``q4f16_autoawq``,
layout ``KN_N``) take the column template (``rules.gemm.gemv_cols``) at M = 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..device import require_device
from ..errors import FuselightError
from ..target import arch_of
from .base import AnalyzeScheduleRule, built_once, host_branch, with_kernels
from .gemm.analysis import MatmulDesc, analyze_matmul
from .gemm.estimate import load_dispatch
from .gemm.gemv import (
    body_config,
    check_gemv,
    config_for,
    gemv_body,
    grid_blocks,
    load_gemv_configs,
)
from .gemm.gemv_cols import ColsConfig, cols_body, cols_config
from .gemm.gemv_common import PIECE_WORDS, GemvConfig, static_m
from .gemm.gemv_kn import KnGemvConfig, check_kn, kn_body, kn_config_for, kn_vec, load_kn_configs
from .gemm.operands import GemmOperands


_Bucket = TypeVar("_Bucket", GemvConfig, KnGemvConfig)


def _for_tokens(cfg: _Bucket, ops: GemmOperands) -> _Bucket:
    """``cfg`` without ``half_sums`` where the tokens are not fp16: bf16 keeps the float32 dot."""
    return dataclasses.replace(cfg, half_sums=False) if cfg.half_sums and ops.dtype != "float16" else cfg


def gemv_config(ops: GemmOperands, m: int, target: Target) -> GemvConfig | None:
    """The GEMV bucket that computes ``ops`` for up to ``m`` token rows on ``target`` (``ops.m`` may
    be symbolic), or None: no config for the arch, no bucket for ``m``, or operands the template
    does not take (NN weights, K not a multiple of 32, too much shared memory)."""
    try:
        arch = arch_of(target)
        cfg = config_for(load_gemv_configs(arch, ops.dequant is not None), m, grid_blocks(ops), ops.k, ops.dtype)
        if cfg is None:
            return None
        cfg = _for_tokens(cfg, ops)
        # The kernel's shared memory is static: the device's static limit.
        check_gemv(ops, cfg, require_device(arch).smem_per_block)
    except FuselightError:
        return None
    return cfg


def gemv_kernel(ops: GemmOperands, cfg: GemvConfig, target: Target) -> tirx.Stmt:
    """The GEMV template's kernel for ``ops`` with the bucket ``cfg`` on ``target`` (whose SM count
    sizes a looping grid, ``grid_blocks_per_sm``)."""
    return gemv_body(ops, cfg, require_device(arch_of(target)).sms)


def kn_gemv_config(ops: GemmOperands, target: Target) -> KnGemvConfig | None:
    """The KN template's bucket computing ``ops`` (4-bit weights in the KN layout, static M) on
    ``target``, or None: no config for the arch, no bucket for M, or operands it does not take."""
    try:
        arch = arch_of(target)
        cfg = kn_config_for(load_kn_configs(arch), static_m(ops) or 0)
        if cfg is None:
            return None
        cfg = _for_tokens(cfg, ops)
        # The kernel's shared memory is static: the device's static limit.
        check_kn(ops, cfg, require_device(arch).smem_per_block)
    except FuselightError:
        return None
    return cfg


def symbolic_m_buckets(ops: GemmOperands, target: Target) -> list[tuple[int, GemvConfig]]:
    """``(largest M, bucket)`` in increasing M for a matmul whose M is symbolic: each bucket of the
    arch's GEMV config that takes ``ops``, so the caller can branch on M into the template (which
    needs no static M) below the GEMM plans. Neighbouring buckets whose kernels for ``ops`` are the
    same (``body_config``: the mma template's buckets of one token tile) are one range, so a
    function lowers and compiles that kernel once."""
    try:
        tops = sorted({c.max_m for c in load_gemv_configs(arch_of(target), ops.dequant is not None)})
    except FuselightError:
        return []
    buckets: list[tuple[int, GemvConfig]] = []
    for top in tops:
        cfg = gemv_config(ops, top, target)
        if cfg is None:
            break  # no gaps: a bucket that does not take ops ends the GEMV range
        if buckets and body_config(ops, buckets[-1][1]) == body_config(ops, cfg):
            buckets[-1] = (top, cfg)
        else:
            buckets.append((top, cfg))
    return buckets


class Gemv(AnalyzeScheduleRule):
    """Swap static few-row matmul functions for the GEMV template (see the module docstring)."""

    family = "gemv"

    @staticmethod
    def analyze(func: tirx.PrimFunc) -> MatmulDesc | None:
        """The GEMV and fused epilogue ``func`` computes (a matmul with static M, or any M with
        dequantized weights), or None."""
        # The template computes a norm prologue, and dequantizes 4-bit weights as it loads them.
        desc = analyze_matmul(func, prologue=True, dequant=True)
        if desc is None or (desc.m_static is None and desc.operands.dequant is None):
            return None  # a symbolic M of float weights is the Matmul rule's
        return desc

    @classmethod
    def supports(cls, desc: MatmulDesc, target: Target) -> bool:
        """Whether ``schedule`` builds ``desc`` on ``target``: M below the Matmul rule's and a GEMV
        bucket that takes the operands; a symbolic M (dequantized weights), buckets that take them
        and an epilogue DLight's schedule above them takes (not a paired one: its Matmul rule fails
        an assertion on that)."""
        if _layout(desc) in _LAYOUT_KERNELS:
            return _layout_template(desc, target) is not None
        try:
            min_static_m = load_dispatch(arch_of(target)).min_static_m
        except FuselightError:
            return False
        if desc.m_static is None:
            return not desc.operands.paired and bool(symbolic_m_buckets(desc.operands, target))
        return desc.m_static < min_static_m and gemv_config(desc.operands, desc.m_static, target) is not None

    def schedule(self, func: tirx.PrimFunc, desc: MatmulDesc, target: Target) -> tirx.PrimFunc | None:
        """``func`` with its body replaced by the GEMV kernel for ``desc`` on ``target``, or None where
        the template does not serve it (M left to the Matmul rule, no config for the arch)."""
        if _layout(desc) in _LAYOUT_KERNELS:
            template = _layout_template(desc, target)
            return None if template is None else with_kernels(func, template[0](desc.operands, template[1]))
        try:
            min_static_m = load_dispatch(arch_of(target)).min_static_m
        except FuselightError:
            return None  # no GEMM config for this arch
        if desc.m_static is None:
            return _symbolic_m(func, desc, target)
        if desc.m_static >= min_static_m and desc.operands.dequant is None:
            return None  # the Matmul rule's
        cfg = gemv_config(desc.operands, desc.m_static, target)
        return None if cfg is None else with_kernels(func, gemv_kernel(desc.operands, cfg, target))


def _kn_kernels(ops: GemmOperands, cfg: KnGemvConfig) -> tirx.Stmt:
    """The KN template's kernel for ``ops``: its loads as wide as a static N allows (paired: the
    output's N, the offset of the up columns); for a symbolic N (MLC-LLM's vocabulary), 16 bytes
    where N is a multiple of 4 at run time, else a word at a time."""
    if isinstance(ops.out_n, int):
        return kn_body(ops, cfg, kn_vec(ops.out_n))
    aligned = tirx.EQ(tirx.floormod(ops.n, PIECE_WORDS), tirx.IntImm(ops.n.ty.dtype, 0))
    return host_branch(aligned, kn_body(ops, cfg, PIECE_WORDS), kn_body(ops, cfg, 1))


def _cols_config(desc: MatmulDesc, target: Target) -> ColsConfig | None:
    """The column template's bucket for ``desc`` (M = 1 only; a symbolic M is DLight's), or None."""
    if desc.m_static != 1:
        return None
    try:
        return cols_config(desc.operands, arch_of(target))
    except FuselightError:
        return None


def _layout(desc: MatmulDesc) -> str | None:
    return None if desc.operands.dequant is None else desc.operands.dequant.layout


# Dequantized layouts with a template of their own: (its bucket for the function, or None; its kernel).
# KN: MLC-LLM's q4f16_0 (words along K, transposed); KN_N: AutoAWQ's words along N.
_LAYOUT_KERNELS = {
    "KN": (lambda desc, target: kn_gemv_config(desc.operands, target), _kn_kernels),
    "KN_N": (_cols_config, cols_body),
}


def _layout_template(desc: MatmulDesc, target: Target) -> tuple[Callable, Any] | None:
    """For a layout of ``_LAYOUT_KERNELS``: its kernel builder and its bucket for ``desc``, or None
    where the template has no bucket for it."""
    config_of, kernel = _LAYOUT_KERNELS[_layout(desc)]
    cfg = config_of(desc, target)
    return None if cfg is None else (kernel, cfg)


def _symbolic_m(func: tirx.PrimFunc, desc: MatmulDesc, target: Target) -> tirx.PrimFunc | None:
    """``func`` (dequantized weights, symbolic M) as the GEMV buckets' kernels behind host branches on
    M, DLight's schedule above the largest (see the module docstring); None where no bucket serves
    it or DLight schedules no rest."""
    ops = desc.operands
    buckets = symbolic_m_buckets(ops, target)
    if not buckets:
        return None
    rest = _dlight_rest(func, target)
    if rest is None:
        return None
    body, bucket = rest.body, built_once(lambda cfg: gemv_kernel(ops, cfg, target))
    for upper, cfg in reversed(buckets):
        body = host_branch(ops.m <= upper, bucket(body_config(ops, cfg)), body)
    return with_kernels(func, host_branch(ops.m > 0, body))  # no empty grids


def _dlight_rest(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc | None:
    """``func`` scheduled by DLight's Matmul (MLC-LLM's choice past its low-batch buckets) or, where
    that rule fails (its tensor-core path asserts on a ``[batch, 1, k]`` token operand with a cast
    epilogue), by its LowBatchGEMV, GEMV or Fallback rule (a symbolic vocabulary too: the batch LM
    head), the first that applies; None where none does."""
    for rule in (dl.gpu.Matmul(), dl.gpu.LowBatchGEMV(4), dl.gpu.GEMV(), dl.gpu.Fallback()):
        try:
            with target:
                scheduled = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({"main": func}))["main"]
        except Exception:  # noqa: BLE001 - a rule that fails serves nothing
            continue
        if not tvm_ffi.structural_equal(scheduled, func):
            return scheduled
    return None
