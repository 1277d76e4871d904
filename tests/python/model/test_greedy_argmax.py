"""The model's two-stage greedy argmax (chunks of GREEDY_CHUNK logits, then the chunks' winners) equals
numpy's argmax, the first index on ties, on random and adversarial logits (CPU, llvm)."""

import numpy as np
import pytest
import tvm
from fuselight.model import llama
from tvm import te

VOCAB = 509  # prime: the last chunk is partial


def _greedy_fn(chunk: int, monkeypatch):
    """The two stages for ``VOCAB`` logits and chunks of ``chunk``, compiled once for llvm."""
    monkeypatch.setattr(llama, "GREEDY_CHUNK", chunk)
    x = te.placeholder((1, 1, VOCAB), "float32", name="logits")
    chunks = llama._argmax_chunks(x, "int32")
    lib = tvm.compile(te.create_prim_func([x, llama._argmax_int32(x, chunks)]), target="llvm")

    def greedy(logits: np.ndarray) -> int:
        out = tvm.runtime.empty((1,), "int32", tvm.cpu())
        lib(tvm.runtime.tensor(logits.reshape(1, 1, -1), tvm.cpu()), out)
        return int(out.numpy()[0])

    return greedy


def _cases() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(7)

    def base() -> np.ndarray:
        return rng.uniform(-3.0, -1.0, VOCAB).astype("float32")

    cases = [("random", rng.standard_normal(VOCAB).astype("float32"))]
    x = base()
    x[[40, 130, 500]] = 2.0  # tied maxima in three chunks: the first wins
    cases.append(("ties across chunks", x))
    x = base()
    x[[70, 66]] = 2.0  # tied within one chunk, the later listed first
    cases.append(("ties in a chunk", x))
    x = base()
    x[VOCAB - 1] = 5.0  # in the partial last chunk
    cases.append(("last", x))
    x = base()
    x[0] = 5.0
    cases.append(("first", x))
    cases.append(("all equal", np.full(VOCAB, -0.5, "float32")))
    return cases


@pytest.mark.parametrize("chunk", [64, 100, 509, 1024])
def test_two_stage_argmax_is_numpy_argmax(chunk, monkeypatch):
    greedy = _greedy_fn(chunk, monkeypatch)
    for name, logits in _cases():
        assert greedy(logits) == int(np.argmax(logits)), name
