"""Test helper: a one-function Relax module built with the BlockBuilder."""

from tvm import relax


def single_function(params, make):
    """Module with ``main(*params)`` whose dataflow block returns ``make(bb, *params)``."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(bb, *params))
        bb.emit_func_output(out)
    return bb.get()
