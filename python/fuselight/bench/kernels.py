"""The kernel suite: LLaMA's operators one at a time, MLC baseline vs fuselight vs PyTorch.

A case is one operator at one static shape (a GEMM's weight, a norm's width, an attention's head
layout) with one dimension left symbolic and swept at run time: a GEMM's M, a norm's or softmax's
rows, attention's sequence or context length. So each case builds one library per pipeline.
Cases come from ``kernel_suites`` in ``configs/bench.json`` (``full``: LLaMA-3-8B shapes;
``small``: tiny shapes for CPU tests).

This module only defines cases and their costs (no TVM, no PyTorch). ``kernels_build`` compiles
(build host); ``kernels_run`` loads, checks and times (GPU host, runtime-only TVM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..compile import PIPELINES
from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..quantization import SCHEMES
from . import bench_config

MANIFEST_FORMAT = 1
MANIFEST_NAME = "manifest.json"
SUITE = "kernels"
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How one operator is named, swept and costed."""

    sweep_var: str  # the symbolic dimension
    dims: tuple[str, ...]  # static integer dimensions, in name order
    metric: str  # how results are shown: "tflops" (compute-bound) or "gbps" (memory-bound)
    # (static dims, sweep value) -> (elements read + written, flops); bytes = elements * itemsize
    cost: Callable[[dict[str, int], int], tuple[int, int]]


def _gemm_cost(d: dict[str, int], m: int) -> tuple[int, int]:
    n, k = d["n"], d["k"]
    return m * k + n * k + m * n, 2 * m * n * k


def _gemm_residual_cost(d: dict[str, int], m: int) -> tuple[int, int]:
    elements, flops = _gemm_cost(d, m)
    return elements + m * d["n"], flops + m * d["n"]  # the residual read, one add an output


def _gemm_gate_up_silu_cost(d: dict[str, int], m: int) -> tuple[int, int]:
    n, k = d["n"], d["k"]
    # silu(gate) * up: the output is half the GEMM's width; sigmoid, two multiplies an output
    return m * k + n * k + m * n // 2, 2 * m * n * k + 3 * m * n // 2


def _gemm_q4_cost(d: dict[str, int], m: int) -> tuple[int, int]:
    n, k = d["n"], d["k"]
    # 4-bit weights and a scale per 32 of them, counted in 2-byte elements
    return m * k + n * k // 4 + n * k // 32 + m * n, 2 * m * n * k


def _norm_gemm_cost(d: dict[str, int], m: int, weight_elements: int) -> tuple[int, int]:
    n, k = d["n"], d["k"]
    # x and the residual read, their sum written, the norm weight; the GEMM's weight and output
    return 3 * m * k + k + weight_elements + m * n, 5 * m * k + 2 * m * n * k


def _add_rmsnorm_cost(d: dict[str, int], m: int) -> tuple[int, int]:
    h = d["hidden"]
    # two rows read, the sum and the normed row written; the add, then the norm's four operations
    return 4 * m * h + h, 5 * m * h


def _rmsnorm_cost(d: dict[str, int], m: int) -> tuple[int, int]:
    h = d["hidden"]
    # square, sum, scale, weight: four operations an element
    return 2 * m * h + h, 4 * m * h


def _softmax_cost(d: dict[str, int], rows: int) -> tuple[int, int]:
    n = rows * d["cols"]
    # max, subtract+exp, sum, divide
    return 2 * n, 4 * n


def _attention_elements(d: dict[str, int], q_len: int, kv_len: int) -> int:
    return 2 * q_len * d["q_heads"] * d["head_dim"] + 2 * kv_len * d["kv_heads"] * d["head_dim"]


def _prefill_cost(d: dict[str, int], seq: int) -> tuple[int, int]:
    # QK^T and PV, 2 flops a multiply-add each, half of the square under the causal mask
    return _attention_elements(d, seq, seq), 2 * seq * seq * d["head_dim"] * d["q_heads"]


def _decode_cost(d: dict[str, int], context: int) -> tuple[int, int]:
    return _attention_elements(d, 1, context), 4 * context * d["head_dim"] * d["q_heads"]


_ATTENTION_DIMS = ("q_heads", "kv_heads", "head_dim")
OPS: dict[str, OpSpec] = {
    "gemm": OpSpec("m", ("n", "k"), "tflops", _gemm_cost),
    # A linear layer whose output adds the residual stream: the epilogue a fused GEMM keeps on chip.
    "gemm_residual": OpSpec("m", ("n", "k"), "tflops", _gemm_residual_cost),
    # The gated MLP's gate+up projection (gate rows, then up rows) with silu(gate) * up applied.
    "gemm_gate_up_silu": OpSpec("m", ("n", "k"), "tflops", _gemm_gate_up_silu_cost),
    # A linear layer over 4-bit weights (q4f16_1 / q4bf16_1 by the dtype): the dequantize in the kernel.
    "gemm_q4": OpSpec("m", ("n", "k"), "tflops", _gemm_q4_cost),
    # The residual add, RMSNorm and the linear layer after it (a decode step's QKV and gate+up): the
    # norm a prologue of the GEMV. Outputs: the GEMM's and the sum. Float weights, or 4-bit ones.
    "norm_gemm": OpSpec("m", ("n", "k"), "tflops", lambda d, m: _norm_gemm_cost(d, m, d["n"] * d["k"])),
    "norm_gemm_q4": OpSpec("m", ("n", "k"), "tflops",
                           lambda d, m: _norm_gemm_cost(d, m, d["n"] * d["k"] // 4 + d["n"] * d["k"] // 32)),
    "rmsnorm": OpSpec("m", ("hidden",), "gbps", _rmsnorm_cost),
    # The residual add and the next norm: both the sum and the normed row are outputs.
    "add_rmsnorm": OpSpec("m", ("hidden",), "gbps", _add_rmsnorm_cost),
    "softmax": OpSpec("rows", ("cols",), "gbps", _softmax_cost),
    "attention_prefill": OpSpec("seq", _ATTENTION_DIMS, "tflops", _prefill_cost),
    "attention_decode": OpSpec("context", _ATTENTION_DIMS, "gbps", _decode_cost),
}
# Float attributes some ops take besides their dimensions.
_FLOAT_ATTRS = {"rmsnorm": ("eps",), "add_rmsnorm": ("eps",), "norm_gemm": ("eps",), "norm_gemm_q4": ("eps",)}
# The 4-bit scheme of a quantized case's dtype, and the ops that take 4-bit weights.
Q4_SCHEMES = {"float16": "q4f16_1", "bfloat16": "q4bf16_1"}
Q4_OPS = ("gemm_q4", "norm_gemm_q4")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str
    dtype: str
    dims: dict[str, int]
    sweep: tuple[int, ...]
    attrs: dict[str, float] = dataclasses.field(default_factory=dict)
    # The swept dimension compiled as a constant (a decode shape): the sweep then has one value.
    static: bool = False
    # A 4-bit case's scheme where not its dtype's default (``Q4_SCHEMES``): ``q4f16_0``, the KN layout.
    scheme: str | None = None

    @property
    def spec(self) -> OpSpec:
        return OPS[self.op]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def quantization(self) -> str | None:
        """The 4-bit scheme of a quantized case (``Q4_OPS``), else None."""
        if self.op not in Q4_OPS:
            return None
        return self.scheme or Q4_SCHEMES[self.dtype]

    def shape(self, n: int) -> dict[str, int | str]:
        """A record's ``shape`` at sweep value ``n``; a quantized case's names its scheme."""
        scheme = {"quantization": self.quantization} if self.quantization else {}
        return {**self.dims, self.spec.sweep_var: n, **scheme}

    def cost(self, n: int) -> tuple[int, int]:
        """(bytes, flops) of one call at sweep value ``n``: the minimum traffic and the math."""
        elements, flops = self.spec.cost(self.dims, n)
        return elements * self.itemsize, flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "dtype": self.dtype,
            "dims": self.dims,
            "sweep": list(self.sweep),
            "attrs": self.attrs,
            **({"static": True} if self.static else {}),
            **({"quantization": self.scheme} if self.scheme else {}),
        }


def _default_name(op: str, dtype: str, dims: dict[str, int]) -> str:
    name = op.replace("_", "-") + "-" + "x".join(str(dims[d]) for d in OPS[op].dims)
    return name if dtype == "float16" else f"{name}-{dtype}"


def case_from_dict(raw: Any, sweeps: dict[str, list[int]] | None = None, where: str = "case") -> Case:
    """A case from its config or manifest entry; ``sweep`` may name a list in ``sweeps``."""
    if not isinstance(raw, dict):
        raise FuselightError(f"{where}: must be an object")
    op = raw.get("op")
    if op not in OPS:
        raise FuselightError(f"{where}: field 'op' {op!r} is not one of {', '.join(OPS)}")
    dtype = raw.get("dtype")
    if dtype not in _ITEMSIZE:
        raise FuselightError(f"{where}: field 'dtype' {dtype!r} is not one of {', '.join(_ITEMSIZE)}")
    source = raw.get("dims", raw)
    dims = {}
    for d in OPS[op].dims:
        v = source.get(d)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise FuselightError(f"{where}: field {d!r} must be a positive integer, got {v!r}")
        dims[d] = v
    if op in Q4_OPS and (dtype not in Q4_SCHEMES or dims["k"] % 32):
        raise FuselightError(f"{where}: a {op} case needs dtype float16 or bfloat16 and k a multiple of 32")
    scheme = raw.get("quantization")
    if scheme is not None and (op not in Q4_OPS or scheme not in SCHEMES or SCHEMES[scheme].model_dtype != dtype):
        raise FuselightError(f"{where}: field 'quantization' {scheme!r} must name a 4-bit scheme computing in "
                             f"{dtype} ({', '.join(n for n, s in SCHEMES.items() if s.model_dtype == dtype)}), "
                             f"on a {' or '.join(Q4_OPS)} case")
    if op.startswith("attention") and dims["q_heads"] % dims["kv_heads"]:
        raise FuselightError(f"{where}: kv_heads ({dims['kv_heads']}) must divide q_heads ({dims['q_heads']})")
    attr_source = raw.get("attrs", raw)
    attrs = {}
    for a in _FLOAT_ATTRS.get(op, ()):
        v = attr_source.get(a)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise FuselightError(f"{where}: field {a!r} must be a positive number, got {v!r}")
        attrs[a] = float(v)
    sweep = raw.get("sweep")
    if isinstance(sweep, str):
        if sweeps is None or sweep not in sweeps:
            raise FuselightError(f"{where}: field 'sweep' names unknown sweep {sweep!r}")
        sweep = sweeps[sweep]
    if (
        not isinstance(sweep, list)
        or not sweep
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sweep)
    ):
        raise FuselightError(f"{where}: field 'sweep' must be a non-empty list of positive integers")
    static = raw.get("static", False)
    if not isinstance(static, bool) or (static and len(sweep) != 1):
        raise FuselightError(f"{where}: field 'static' must be a boolean, true only with a one-value sweep")
    name = raw.get("name") or (_default_name(op, dtype, dims) + (f"-{scheme}" if scheme else "")
                               + (f"-{OPS[op].sweep_var}{sweep[0]}" if static else ""))
    return Case(name=name, op=op, dtype=dtype, dims=dims, sweep=tuple(sweep), attrs=attrs, static=static, scheme=scheme)


def select(cases: list[Case], names: list[str] | None) -> list[Case]:
    """``cases`` restricted to ``names`` (all when None), in suite order."""
    if not names:
        return cases
    known = {c.name for c in cases}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise FuselightError(f"unknown kernel case {unknown[0]!r}: available {', '.join(sorted(known))}")
    return [c for c in cases if c.name in names]


def load_suite(suite: str = "full", cases: list[str] | None = None) -> list[Case]:
    """The cases of ``kernel_suites[suite]`` in ``configs/bench.json``."""
    cfg = bench_config()
    suites = cfg["kernel_suites"]
    if suite not in suites:
        raise FuselightError(f"unknown kernel suite {suite!r}: available {', '.join(suites)}")
    loaded = [case_from_dict(raw, cfg["sweeps"], f"kernel_suites.{suite}[{i}]") for i, raw in enumerate(suites[suite])]
    names = [c.name for c in loaded]
    if len(set(names)) != len(names):
        raise FuselightError(f"kernel suite {suite!r} has two cases of the same name")
    return select(loaded, cases)


def library_name(case: Case, pipeline: str) -> str:
    return f"{case.name}-{pipeline}.so"


def read_manifest(path: Path) -> tuple[dict[str, Any], list[Case]]:
    """The manifest ``build_suite`` wrote, and its cases."""
    path = Path(path)
    raw = read_json_object(path, missing=f"kernel-suite manifest not found: {path}")
    if raw.get("format") != MANIFEST_FORMAT:
        raise FuselightError(f"{path}: not a kernel-suite manifest (format {MANIFEST_FORMAT} expected)")
    if not isinstance(raw.get("cases"), list):
        raise FuselightError(f"{path}: field 'cases' must be a list")
    cases = []
    for i, entry in enumerate(raw["cases"]):
        where = f"{path}: cases[{i}]"
        case = case_from_dict(entry, where=where)
        libs = entry.get("libraries")
        if not isinstance(libs, dict) or not libs or any(p not in PIPELINES for p in libs):
            raise FuselightError(f"{where}: field 'libraries' must map {' / '.join(PIPELINES)} to files")
        cases.append(case)
    return raw, cases
