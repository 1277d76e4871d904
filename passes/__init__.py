"""fuselight graph passes (Relax), each a ``tvm.transform.Pass``."""
