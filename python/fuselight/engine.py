"""Run a compiled LLaMA step by step: one sequence, prefill then decode, over the TIR paged KV cache.

``decode`` is one synchronous step (logits back on the host's call). ``greedy``/``generate`` run a
greedy loop whose token never leaves the device and whose host prepares each step while the
previous one finishes, so less of the host's per-step work (embedding, KV-cache bookkeeping, ~300
kernel launches) leaves the GPU idle between steps.

Runtime only (``tvm.runtime`` + NumPy), so it works where the TVM compiler is not installed. The
VM functions are those ``fuselight.model.llama.export_module`` documents, except that in a library
built with whole-step capture (``passes.capture_whole_step``) ``decode`` and ``decode_attend`` take
token ids (int32 ``[1]``) in place of the input embedding: the engine then launches no ``embed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tvm
import tvm_ffi

from . import kv_hooks
from .config import ModelConfig
from .contracts import TOKEN_IDS_PARAM
from .errors import FuselightError
from .jsonfile import read_json_object
from .model.weights import param_names_and_shapes
from .paths import config_dir

_SEQ_ID = 0
# One sequence at a time; no sliding window.
_MAX_BATCH_SIZE = 1
_SLIDING_WINDOW = 0
# What greedy()/generate() call besides embed.
_GREEDY_FUNCTIONS = ("greedy", "decode_attend", "decode_greedy")
# DLPack device types: CUDA and its page-locked host memory.
_CUDA, _CUDA_HOST = 2, 3


def runtime_config() -> dict[str, int]:
    """KV-cache sizes the build and the engine agree on: ``configs/runtime.json``."""
    path = config_dir() / "runtime.json"
    return read_json_object(path, missing=f"runtime settings not found: {path}")


class Engine:
    """Drives ``embed``/``prefill``/``decode`` of a compiled model for one sequence (id 0)."""

    def __init__(
        self,
        vm: Any,
        params: list,
        config: ModelConfig,
        device: Any,
        *,
        max_total_seq_len: int | None = None,
        prefill_chunk_size: int | None = None,
        page_size: int | None = None,
        param_specs: Sequence[tuple] | None = None,
    ) -> None:
        """``vm``: a ``tvm.runtime.vm.VirtualMachine``; ``params``: tensors on ``device`` in
        ``param_specs`` order (``(name, shape)``, or ``(name, shape, dtype)`` for a list whose dtypes
        the config does not give; None: ``param_names_and_shapes(config)``, our model's). Of ``config``
        only ``name``, ``hidden_size``, ``vocab_size`` and ``dtype`` (and ``weight_dtype`` for 2-tuples:
        ``*.q_weight`` parameters are ``uint32``, as every 4-bit scheme stores them) are read,
        so another model with the same functions (MLC-LLM's) runs with its own parameter list.
        Unset sizes come from ``runtime_config()``; ``prefill_chunk_size`` must not exceed the one
        the library was built with."""
        kv_hooks.register()  # the cache of a library built with fuselight.passes.fuse_rope_append
        defaults = runtime_config()
        max_total_seq_len = max_total_seq_len or defaults["max_total_seq_len"]
        prefill_chunk_size = prefill_chunk_size or defaults["prefill_chunk_size"]
        page_size = page_size or defaults["page_size"]
        expected = list(param_specs) if param_specs is not None else param_names_and_shapes(config)
        if len(params) != len(expected):
            raise FuselightError(f"model {config.name!r} takes {len(expected)} parameters, got {len(params)}")
        for spec, p in zip(expected, params, strict=True):
            name, shape, dtype = (*spec, None)[:3]
            if tuple(p.shape) != tuple(shape):
                raise FuselightError(f"parameter {name!r} has shape {tuple(p.shape)}, expected {shape}")
            want = dtype or config.weight_dtype(name)  # packed words for *.q_weight, else the model dtype
            if str(p.dtype) != want:
                raise FuselightError(f"parameter {name!r} has dtype {p.dtype}, expected {want}")
        sizes = {
            "max_total_seq_len": max_total_seq_len,
            "prefill_chunk_size": prefill_chunk_size,
            "page_size": page_size,
        }
        for key, value in sizes.items():
            if value <= 0:
                raise FuselightError(f"{key} must be positive, got {value}")
        self.config = config
        self.device = device
        self.max_total_seq_len = max_total_seq_len
        self.prefill_chunk_size = prefill_chunk_size
        # Packed once: the VM functions take all weights as one tuple argument.
        self._params = tvm.runtime.convert(list(params))
        self._embed = vm["embed"]
        self._prefill = vm["prefill"]
        self._decode = vm["decode"]
        # Libraries built elsewhere (MLC-LLM's) lack these; only greedy() needs them.
        self._greedy, self._decode_attend, self._decode_greedy = (
            vm[name] if vm.module.implements_function(name) else None for name in _GREEDY_FUNCTIONS
        )
        # Where one CUDA graph holds the step (passes.capture_whole_step), the decode functions take
        # token ids and look the embedding up inside the graph: no embed launch of the host's.
        self._decode_takes_ids = _takes_token_ids(vm, "decode")
        self._attend_takes_ids = self._decode_attend is not None and _takes_token_ids(vm, "decode_attend")
        self._add_sequence = tvm.get_global_func("vm.builtin.kv_state_add_sequence")
        self._begin_forward = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
        self._end_forward = tvm.get_global_func("vm.builtin.kv_state_end_forward")
        # Uploads the step's KV-cache metadata (page tables, positions) that begin_forward prepared.
        # The cache would do it at the step's first attention call, but where one CUDA graph holds
        # the step (passes.capture_whole_step) no call runs on replay; for every library it is the
        # same upload, made before the step's kernels instead of inside its first layer.
        self._upload = tvm.get_global_func("vm.builtin.attention_kv_cache_get_query_positions")
        self._clear = tvm.get_global_func("vm.builtin.kv_state_clear")
        self._reshape = tvm.get_global_func("vm.builtin.reshape")
        shape = tvm.runtime.ShapeTuple
        self._kv_cache = vm["create_tir_paged_kv_cache"](
            shape([_MAX_BATCH_SIZE]),
            shape([max_total_seq_len]),
            shape([prefill_chunk_size]),
            shape([page_size]),
            shape([_SLIDING_WINDOW]),
        )
        self._length = 0
        self._add_sequence(self._kv_cache, _SEQ_ID)
        # Token ids go through one device buffer, allocated once, not a device allocation and free
        # (which synchronises) a step. Reuse is safe because every step ends with a device sync.
        self._ids = tvm.runtime.empty((prefill_chunk_size,), "int32", device)
        # On CUDA they are staged in page-locked host memory: the upload is then an asynchronous
        # copy on the stream, not a synchronous one that holds the host before the step's launches.
        self._ids_host = (
            tvm.runtime.empty((prefill_chunk_size,), "int32", tvm.runtime.Device(_CUDA_HOST, device.index))
            if device.dlpack_device_type() == _CUDA
            else None
        )

    @property
    def can_generate(self) -> bool:
        """Whether the library has the functions ``greedy``/``generate`` need."""
        return None not in (self._greedy, self._decode_attend, self._decode_greedy)

    def reset(self) -> None:
        """Start a fresh sequence: the KV cache is emptied."""
        self._clear(self._kv_cache)
        self._add_sequence(self._kv_cache, _SEQ_ID)
        self._length = 0

    def _step(self, fn: Any, token_ids: np.ndarray, takes_ids: bool = False) -> Any:
        n = int(token_ids.size)
        ids = self._ids._create_view((n,))
        host_ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        if self._ids_host is None:
            ids.copyfrom(host_ids)
        else:
            staged = self._ids_host._create_view((n,))
            staged.copyfrom(host_ids)
            staged.copyto(ids)
        step_input = ids if takes_ids else self._embed_ids(ids, n)
        self._begin_forward(self._kv_cache, tvm.runtime.ShapeTuple([_SEQ_ID]), tvm.runtime.ShapeTuple([n]))
        self._upload(self._kv_cache)
        logits, self._kv_cache = fn(step_input, self._kv_cache, self._params)
        self._end_forward(self._kv_cache)
        # begin_forward reuses host-side staging buffers; the next step must not overwrite them
        # while this one's copies are in flight.
        self.device.sync()
        self._length += n
        return logits

    def _embed_ids(self, ids: Any, n: int) -> Any:
        return self._reshape(self._embed(ids, self._params), tvm.runtime.ShapeTuple([1, n, self.config.hidden_size]))

    def _check_room(self, n: int) -> None:
        if self._length + n > self.max_total_seq_len:
            raise FuselightError(
                f"sequence of {self._length + n} tokens exceeds max_total_seq_len {self.max_total_seq_len}"
            )

    def _check_ids(self, ids: np.ndarray) -> None:
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise FuselightError(f"token id {int(ids[bad][0])} outside vocabulary [0, {self.config.vocab_size})")

    def prefill(self, token_ids: np.ndarray) -> Any:
        """Append ``token_ids`` (int [n]) in chunks of ``prefill_chunk_size``; float32 logits
        ``[1, 1, vocab]`` of the last position, on the device."""
        ids = np.asarray(token_ids).reshape(-1)
        if ids.size == 0:
            raise FuselightError("prefill needs at least one token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise FuselightError(f"token ids must be integers, got {ids.dtype}")
        self._check_ids(ids)
        self._check_room(ids.size)
        logits = None
        for start in range(0, ids.size, self.prefill_chunk_size):
            logits = self._step(self._prefill, ids[start : start + self.prefill_chunk_size])
        return logits

    def decode(self, token_id: int) -> Any:
        """Append one token; float32 logits ``[1, 1, vocab]`` on the device."""
        ids = np.array([int(token_id)])
        self._check_ids(ids)
        self._check_room(1)
        return self._step(self._decode, ids, self._decode_takes_ids)

    def greedy(self, logits: Any, max_new_tokens: int) -> np.ndarray:
        """Greedy continuation from ``logits`` (``prefill``'s or ``decode``'s): int32 tokens
        ``[max_new_tokens]``, the first ``argmax(logits)``; every token but the last is decoded.

        Tokens stay on the device: ``decode_greedy`` feeds ``embed`` (or ``decode_attend`` itself,
        where it takes token ids). The host waits for each
        step only until its ``decode_attend`` part is done, then enqueues the next step while the
        rest (last MLP, lm_head, argmax) runs. It may not run further ahead: TVM's KV cache uploads
        a step's page tables on its own stream at the step's first attention, with nothing that
        orders the upload after the previous step's attention kernels, which read them."""
        self._check_greedy(max_new_tokens, 0)
        tokens = tvm.runtime.empty((max_new_tokens,), "int32", self.device)
        pace = _StepPacer(self.device)
        token = self._greedy(logits)
        token.copyto(tokens._create_view((1,)))
        for i in range(1, max_new_tokens):
            step_input = token if self._attend_takes_ids else self._embed_ids(token, 1)
            self._begin_forward(self._kv_cache, tvm.runtime.ShapeTuple([_SEQ_ID]), tvm.runtime.ShapeTuple([1]))
            pace.wait()
            self._upload(self._kv_cache)  # after the wait: the last step's attention reads the old upload
            hidden, self._kv_cache = self._decode_attend(step_input, self._kv_cache, self._params)
            pace.mark()
            self._end_forward(self._kv_cache)
            self._length += 1
            token = self._decode_greedy(hidden, self._params)
            # Device to device: the host does not wait for it.
            token.copyto(tokens._create_view((1,), relative_byte_offset=4 * i))
        self.device.sync()
        return tokens.numpy()

    def generate(self, token_ids: np.ndarray, max_new_tokens: int) -> np.ndarray:
        """``prefill(token_ids)`` then ``greedy``: the ``max_new_tokens`` new tokens (int32)."""
        # Checked before the prefill, which would otherwise fill the cache and then fail.
        self._check_greedy(max_new_tokens, np.asarray(token_ids).size)
        return self.greedy(self.prefill(token_ids), max_new_tokens)

    def _check_greedy(self, max_new_tokens: int, prompt: int) -> None:
        if not self.can_generate:
            raise FuselightError(
                f"this library lacks {', '.join(_GREEDY_FUNCTIONS)}, which greedy decoding needs: "
                "build it with `fuselight compile`"
            )
        if max_new_tokens < 1:
            raise FuselightError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self._check_room(prompt + max_new_tokens - 1)


def _takes_token_ids(vm: Any, name: str) -> bool:
    """Whether the library's function ``name`` takes token ids (its first parameter ``TOKEN_IDS_PARAM``)
    rather than their embedding."""
    return str(vm.module["get_function_param_name"](name, 0)) == TOKEN_IDS_PARAM


class _StepPacer:
    """Lets the host wait for the device to reach a marked point of the compute stream while later
    work is already enqueued behind it: the mark is an event that a side stream waits on, and the
    host synchronises with that side stream. Without streams (CPU) both calls return at once."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self._stream = None
        if device.dlpack_device_type() == _CUDA:
            self._compute = tvm_ffi.get_raw_stream(device)
            self._stream = device.create_raw_stream()
        self._sync_from_to = tvm.get_global_func("runtime.Device_StreamSyncFromTo")

    def __del__(self) -> None:
        if self._stream is not None:
            self._device.free_raw_stream(self._stream)

    def mark(self) -> None:
        """The next ``wait`` returns once the device has done all work enqueued so far."""
        if self._stream is not None:
            self._sync_from_to(self._device, self._compute, self._stream)

    def wait(self) -> None:
        if self._stream is not None:
            self._device.sync(self._stream)
