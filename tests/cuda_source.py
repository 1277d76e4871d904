"""Test helper: the kernels of generated CUDA source, by name."""

import re


def kernel_names(source: str) -> set[str]:
    """The ``__global__`` kernels ``source`` defines."""
    return set(re.findall(r"__global__ void __launch_bounds__\([^)]*\) (\w+)\(", source))


def kernel_body(source: str, name: str) -> str:
    """The definition of kernel ``name`` in ``source``, up to the next kernel."""
    body = source[re.search(rf"{name}\([^)]*\) \{{", source).end():]
    end = body.find("extern \"C\"")
    return body if end < 0 else body[:end]
