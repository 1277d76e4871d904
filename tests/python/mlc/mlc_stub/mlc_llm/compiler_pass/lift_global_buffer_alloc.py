"""The module fuselight's TVM shims patch (MLC's helper is replaced by fuselight's 0.26 version)."""


def remove_global_buf_alloc(*args):
    raise AssertionError("replaced by fuselight.mlc.shims")
