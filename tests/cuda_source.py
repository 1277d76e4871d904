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


def main_loops(body: str) -> list[str]:
    """The K-slice loops (``for (int kt...``) of CUDA source, each up to its closing brace."""
    loops = []
    for match in re.finditer(r"for \(int kt\w* = 0;", body):
        depth, i = 0, body.index("{", match.start())
        for j in range(i, len(body)):
            depth += {"{": 1, "}": -1}.get(body[j], 0)
            if depth == 0:
                loops.append(body[match.start(): j + 1])
                break
    return loops
