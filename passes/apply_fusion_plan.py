"""Lower the fusion plan: outline each planned group into a ``Primitive`` Relax function.

Runs at the start of phase 2, before LegalizeOps: ``plan_fusion`` groups the bindings of each Relax
function by their operator classes (the plan ``fuselight explain`` reports), and each group of two or
more becomes a private function with the ``Primitive`` attribute, as FuseOps writes them, called
where the group's last member was. LegalizeOps then lowers the ops inside it, FuseOps leaves it
alone (it fuses only what the plan left as singletons, treating calls of outlined groups as opaque),
and FuseTIR merges it into one PrimFunc: a transpose or reshape in a group becomes indexing in its
consumer, not a copy.

Rewritten: bindings of dataflow blocks that are Relax op calls, ``call_tir`` calls, or fields taken
out of their tuple results, of one planned group. Left alone, and reported in ``skipped`` with the
reason: a group spanning blocks or holding anything else (a packed call), a group whose outlined
function would use a symbolic dim its inputs do not define, a group whose result is read before its
last member (outlining would reorder), and a group TVM cannot build: an op LegalizeOps cannot lower,
or a function FuseTIR cannot merge (both tried on the group alone). Functions that are ``Primitive``
already (another pipeline's fusion) are not planned; kernels TVM's pattern analysis calls opaque
(hand-written, scheduled) are never grouped (``fusion_plan``).

Yellow edges are decided by ``plan_fusion``'s analytic cost with the symbolic dims at ``dims``
(default: each function's ``tir_var_upper_bound``; a dim without a value leaves its yellow edges
unfused), or by ``decide_yellow``, the hook measured decisions fill.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import mutator

from ..relax_rewrite import FunctionRewriter, module_with_unique_binding_names, visit_nodes
from .fusion_plan import Group, YellowHook, plan_fusion

PRIMITIVE_ATTR = "Primitive"


@dataclasses.dataclass
class Outlined:
    """A group as lowered: its function, members and classes, and the Relax function it called from
    (``fused``: its name in the module), or why it was left alone (``reason``)."""

    function: str
    members: list[str]
    classes: list[str]
    fused: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@tvm.transform.module_pass(opt_level=0, name="ApplyFusionPlan")
class ApplyFusionPlan:
    """Outline every planned group of op bindings into a ``Primitive`` function; ``applied``
    and ``skipped`` list the groups of two or more bindings (``Outlined``)."""

    def __init__(
        self, dims: Mapping[str, int] | None = None, arch: str | None = None, decide_yellow: YellowHook | None = None
    ) -> None:
        self.dims = dict(dims) if dims is not None else None
        self.arch = arch
        self.decide_yellow = decide_yellow
        self.applied: list[Outlined] = []
        self.skipped: list[Outlined] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        dims = self.dims if self.dims is not None else _upper_bounds(mod)
        # The plan names bindings by their vars. Only a function's own repeats are renamed: the
        # groups reported name every other function's bindings as the caller's module does.
        mod = module_with_unique_binding_names(mod)
        plan = plan_fusion(mod, dims, self.arch, self.decide_yellow)
        self.applied, self.skipped = [], []
        return _Outliner(mod, plan, self.applied, self.skipped).transform()


def _upper_bounds(mod: tvm.IRModule) -> dict[str, int]:
    bounds: dict[str, int] = {}
    for _gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and func.attrs is not None and "tir_var_upper_bound" in func.attrs:
            bounds.update({str(k): int(v) for k, v in func.attrs["tir_var_upper_bound"].items()})
    return bounds


@dataclasses.dataclass
class _Site:
    """Where an outlined group is called: its function, the external inputs, the member vars read
    after the group (its outputs), its members (their bindings dropped) and the last of them."""

    gv: tvm.ir.GlobalVar
    inputs: list[relax.Expr]  # vars and constants
    outputs: list[relax.Var]
    members: set[relax.Var]
    last: relax.Var  # where the call goes


@mutator
class _Outliner(FunctionRewriter):
    prune_unused = False  # everything but the outlined groups stays as it was

    def __init__(self, mod, plan: dict[str, list[Group]], applied: list[Outlined], skipped: list[Outlined]) -> None:
        super().__init__(mod)
        self.sites: dict[relax.Var, _Site] = {}  # keyed by each group's last member
        self.dropped: set[relax.Var] = set()
        checked = _BuildCheck(mod)
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or gv.name_hint not in plan:
                continue
            if func.attrs is not None and PRIMITIVE_ATTR in func.attrs:
                continue  # already a kernel (another pipeline's FuseOps)
            index = _Bindings(func)
            for group in plan[gv.name_hint]:
                if len(group.members) < 2 or all(c == "reorganize" for c in group.classes):
                    continue  # a view alone, or views of one tensor: no kernel
                record = Outlined(gv.name_hint, group.members, group.classes)
                site = _outline(self.builder_, checked, index, group, record)
                if site is None:
                    skipped.append(record)
                    continue
                applied.append(record)
                self.sites[site.last] = site
                self.dropped |= site.members - {site.last}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        site = self.sites.get(binding.var)
        if site is None:
            if binding.var not in self.dropped:
                super().visit_var_binding_(binding)
            return
        call = self.builder_.normalize(relax.Call(site.gv, [self.visit_expr(v) for v in site.inputs]))
        if len(site.outputs) == 1:
            self.builder_.emit_normalized(relax.VarBinding(site.outputs[0], call))
            return
        results = self.builder_.emit(call, name_hint=f"{site.gv.name_hint}_out")
        for i, var in enumerate(site.outputs):
            self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(relax.TupleGetItem(results, i))))


class _Bindings:
    """Where each binding of a function sits, what it reads and who reads it: indexed once, so that
    outlining a group costs its own size, not the function's (1600 groups in a 32-layer LLaMA)."""

    def __init__(self, func: relax.Function) -> None:
        self.blocks = list(func.body.blocks)
        self.where: dict[str, tuple[int, int, relax.Binding]] = {}  # name -> (block, position, binding)
        self.reads: dict[relax.Var, list[relax.Var]] = {}  # binding var -> the vars its value reads
        self.readers: dict[relax.Var, list[tuple[int, int, relax.Var]]] = {}  # var -> (block, position, reader)
        for i, block in enumerate(self.blocks):
            for j, b in enumerate(block.bindings):
                self.where[b.var.name] = (i, j, b)
                self.reads[b.var] = list(relax.analysis.free_vars(b.value))
                for v in self.reads[b.var]:
                    self.readers.setdefault(v, []).append((i, j, b.var))
        self.result_reads = set(relax.analysis.free_vars(func.body.body))


def _outline(builder, checked: _BuildCheck, index: _Bindings, group: Group, record: Outlined) -> _Site | None:
    """The group as a ``Primitive`` function added to ``builder``'s module, or None (``record.reason`` set)."""
    found = [index.where[name] for name in group.members if name in index.where]
    if len(found) != len(group.members) or len({i for i, _, _ in found}) != 1:
        record.reason = "members are not bindings of one block"
        return None
    at = found[0][0]
    block = index.blocks[at]
    if not isinstance(block, relax.DataflowBlock):
        record.reason = "not in a dataflow block"
        return None
    members = [b for _, _, b in sorted(found, key=lambda f: f[1])]
    for b in members:
        if isinstance(b, relax.MatchCast) or not (_is_op_call(b.value) or isinstance(b.value, relax.TupleGetItem)):
            record.reason = f"{b.var.name} is not an op call"
            return None
    member_vars = {b.var for b in members}
    # Inputs: vars from outside the group, in the order the group's op calls read them (a field of
    # a tuple taken by a member counts where a call reads it, as FuseOps orders them: so a matmul's
    # operands come first, where MLC-LLM's FuseDequantizeMatmulEwise looks for them), and constants
    # (FuseTIR takes none inside a Primitive function: passed in as parameters, as FuseOps lifts them).
    fields = {b.var for b in members if isinstance(b.value, relax.TupleGetItem)}
    inputs: dict[relax.Expr, None] = {}

    def read(var: relax.Var) -> None:
        if var in fields:
            for v in index.reads[var]:
                read(v)
        elif var not in member_vars:
            inputs[var] = None

    for b in [b for b in members if b.var not in fields] + [b for b in members if b.var in fields]:
        for v in index.reads[b.var]:
            read(v)
        for leaf in _leaves(b.value):
            if isinstance(leaf, relax.Constant):
                inputs[leaf] = None
    # Outputs: members read by any binding outside the group or by the function's result; a read
    # from an earlier block counts as before the group, from a later one as after it.
    last = members[-1].var
    end = len(block.bindings)
    readers: dict[relax.Var, list[int]] = {}
    for v in member_vars:
        for i, j, reader in index.readers.get(v, []):
            if reader not in member_vars:
                readers.setdefault(v, []).append(j if i == at else (end if i > at else -1))
        if v in index.result_reads or not isinstance(v, relax.DataflowVar):
            readers.setdefault(v, []).append(end)  # the function's result, or a block output
    position = index.where[last.name][1]
    if any(j < position for js in readers.values() for j in js):
        record.reason = "a result is read before the group's last member"
        return None
    outputs = [b.var for b in members if b.var in readers]
    if not outputs:
        record.reason = "its result is unused"
        return None
    sub = _function(members, list(inputs), outputs)
    if relax.analysis.free_symbolic_vars(sub):
        record.reason = "uses a symbolic dim its inputs do not define"
        return None
    record.reason = checked(sub)
    if record.reason is not None:
        return None
    names = [_op_name(b.value) for b in members if isinstance(b.value, relax.Call)]
    gv = builder.add_func(sub, "fused_" + "_".join(names)[:80])
    record.fused = gv.name_hint
    return _Site(gv, list(inputs), outputs, member_vars, last)


_PACKED = ("relax.call_dps_packed", "relax.call_pure_packed", "relax.call_packed", "relax.call_tir_inplace")


def _is_op_call(value: relax.Expr) -> bool:
    """A Relax op or a ``call_tir``: what LegalizeOps leaves as ``call_tir`` for FuseTIR to merge."""
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name not in _PACKED


def _op_name(call: relax.Call) -> str:
    if call.op.name == "relax.call_tir":
        return call.args[0].name_hint
    return call.op.name.removeprefix("relax.").replace(".", "_")


def _function(members: list[relax.Binding], inputs: list[relax.Expr], outputs: list[relax.Var]) -> relax.Function:
    params = [relax.Var(v.name if isinstance(v, relax.Var) else f"const{i}", v.ty) for i, v in enumerate(inputs)]
    vmap: dict[relax.Expr, relax.Expr] = dict(zip(inputs, params))
    bb = relax.BlockBuilder()
    with bb.function("group", params, attrs={PRIMITIVE_ATTR: True}, private=True):
        with bb.dataflow():
            for b in members:
                vmap[b.var] = bb.emit(_substitute(b.value, vmap), name_hint=b.var.name)
            result = vmap[outputs[0]] if len(outputs) == 1 else relax.Tuple([vmap[v] for v in outputs])
            out = bb.emit_output(result)
        bb.emit_func_output(out)
    return bb.get()["group"]


def _leaves(expr: relax.Expr) -> list[relax.Expr]:
    if isinstance(expr, relax.Call):
        return [leaf for a in expr.args for leaf in _leaves(a)]
    if isinstance(expr, relax.Tuple):
        return [leaf for f in expr.fields for leaf in _leaves(f)]
    return [expr]


def _substitute(expr: relax.Expr, vmap: Mapping[relax.Expr, relax.Expr]) -> relax.Expr:
    """``expr`` (a binding's value in normal form: leaves and tuples of them) with vars and constants replaced."""
    if isinstance(expr, (relax.Var, relax.Constant)):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(_substitute(expr.tuple_value, vmap), expr.index)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_substitute(a, vmap) for a in expr.args], expr.attrs, expr.ty_args)
    return expr


class _BuildCheck:
    """Whether TVM builds a group: LegalizeOps and FuseTIR on the group alone, once per distinct group."""

    def __init__(self, mod: tvm.IRModule) -> None:
        self.mod = mod
        self.seen: dict[int, str | None] = {}

    def __call__(self, sub: relax.Function) -> str | None:
        """None if it builds, else why not."""
        key = tvm_ffi.structural_hash(sub, map_free_vars=True)
        if key not in self.seen:
            self.seen[key] = self._check(sub)
        return self.seen[key]

    def _check(self, sub: relax.Function) -> str | None:
        prims = {}
        visit_nodes(
            sub.body,
            lambda e: prims.setdefault(e.args[0], self.mod[e.args[0]])
            if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir" else None,
        )
        bb = relax.BlockBuilder(tvm.IRModule(prims))
        group = bb.add_func(sub, "group")
        params = [relax.Var(p.name, p.ty) for p in sub.params]
        with bb.function("main", params):
            out = bb.emit(relax.Call(group, params))
            bb.emit_func_output(out)
        try:
            legal = relax.transform.LegalizeOps()(bb.get())
            for b in legal["group"].body.blocks[0].bindings:
                if isinstance(b.value, relax.Call) and b.value.op.name != "relax.call_tir":
                    return f"LegalizeOps cannot lower {b.value.op.name}"
            relax.transform.FuseTIR()(legal)
        except RuntimeError as err:  # TVM's InternalError: FuseTIR cannot build the group
            return f"FuseTIR cannot merge it: {str(err).strip().splitlines()[-1][:200]}"
        return None
