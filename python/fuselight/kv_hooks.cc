// The KV cache's kernel wrappers of fuselight.kv_hooks (its docstring says what they do), in C++.
//
// Linked into every library built with fuselight.passes.fuse_rope_append (fuselight.library), so
// the cache's three calls a decode layer cost a C++ call each, as TVM's own kernels do, not a trip
// into Python (GIL, argument conversion): 90 of them a SmolLM2 step. Loading the library registers
// the factories under the names the library calls, replacing the Python ones (same behaviour;
// tests/passes/test_kv_hooks_native.py drives both with the same calls).

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace {

namespace ffi = tvm::ffi;
using Args = std::vector<ffi::Any>;

// Whether two tensors view the same memory with the same shape (the cache passes new views).
bool SameBuffer(ffi::AnyView a, ffi::AnyView b) {
  std::optional<DLTensor*> x = a.try_cast<DLTensor*>(), y = b.try_cast<DLTensor*>();
  if (!x || !y) return false;
  const DLTensor *s = *x, *t = *y;
  if (static_cast<const char*>(s->data) + s->byte_offset != static_cast<const char*>(t->data) + t->byte_offset ||
      s->ndim != t->ndim) {
    return false;
  }
  for (int i = 0; i < s->ndim; ++i) {
    if (s->shape[i] != t->shape[i]) return false;
  }
  return true;
}

void Call(const ffi::Function& f, const Args& args, ffi::Any* rv) {
  std::vector<ffi::AnyView> views(args.begin(), args.end());
  f.CallPacked(views.data(), static_cast<int32_t>(views.size()), rv);
}

Args Concat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

bool SameDevice(DLDevice a, DLDevice b) { return a.device_type == b.device_type && a.device_id == b.device_id; }

// The split partials AttentionWithFusedQKV was given, while its call into the cache runs.
thread_local std::optional<Args> decode_workspace;

class RopeAppendHooks {
 public:
  RopeAppendHooks(ffi::Function fused, ffi::Function split_rotary, ffi::Function append,
                  std::optional<ffi::Function> fused_decode, std::optional<ffi::Function> decode)
      : fused_(std::move(fused)), split_rotary_(std::move(split_rotary)), append_(std::move(append)),
        fused_decode_(std::move(fused_decode)), decode_(std::move(decode)) {}

  void RecordSplit(ffi::PackedArgs args) {
    Flush();  // two splits in a row: the first still runs, in order
    pending_ = Args(args.data(), args.data() + args.size());
  }

  void RunAppend(ffi::PackedArgs args, ffi::Any* rv) {  // pages, k, v, positions
    if (pending_ && !pending_append_ && pending_->size() >= 5 && SameBuffer((*pending_)[3], args[1]) &&
        SameBuffer((*pending_)[4], args[2])) {
      Args pages_positions{args[0], args[3]};
      if (fused_decode_) {
        // A decode batch has a page per sequence: counters for every page x KV head serve any batch
        // of this cache, allocated here, where no graph is being captured yet (prefill appends first).
        const DLTensor* pages = args[0].cast<DLTensor*>();
        Counters(pages->device, pages->shape[0] * pages->shape[2]);
        pending_append_ = std::move(pages_positions);  // the decode attention may take both
        return;
      }
      Args split = Take(pending_);
      Call(fused_, Concat(std::move(split), pages_positions), rv);
      return;
    }
    Flush();
    append_.CallPacked(args, rv);
  }

  void RunDecode(ffi::PackedArgs args, ffi::Any* rv) {  // q, pages, then the attention's own
    if (pending_ && pending_append_ && pending_->size() >= 3 && SameBuffer((*pending_)[2], args[0]) &&
        SameBuffer((*pending_append_)[0], args[1])) {
      const DLTensor *q = args[0].cast<DLTensor*>(), *pages = args[1].cast<DLTensor*>();
      ffi::Tensor counters = Counters(q->device, q->shape[0] * pages->shape[2]);  // [batch, KV heads]
      Args split = Take(pending_), append = Take(pending_append_);
      Args rest(args.data() + 2, args.data() + args.size());
      if (decode_workspace) rest = Concat(std::move(rest), *decode_workspace);
      rest.push_back(counters);
      Call(*fused_decode_, Concat(Concat(std::move(split), append), rest), rv);
      return;
    }
    Flush();
    decode_->CallPacked(args, rv);
  }

  void Flush() {
    if (!pending_) {
      pending_append_.reset();
      return;
    }
    Args split = Take(pending_);
    ffi::Any rv;
    if (pending_append_) {
      Call(fused_, Concat(std::move(split), Take(pending_append_)), &rv);
    } else {
      Call(split_rotary_, split, &rv);
    }
  }

 private:
  // The fused decode kernel's counters (its last argument): int32, zero between its calls (its last
  // block of each sequence x KV head sets its counter back), at least `count` of them on `device`.
  // Allocated and zeroed once; a larger batch gets new ones, and the old stay allocated as long as
  // the cache: a captured CUDA graph may still replay their address.
  ffi::Tensor Counters(DLDevice device, int64_t count) {
    if (!counters_.empty() && SameDevice(counters_.back().device(), device) && counters_.back().size(0) >= count) {
      return counters_.back();
    }
    static const ffi::Function alloc = ffi::Function::GetGlobalRequired("runtime.TVMTensorAllocWithScope");
    static const ffi::Function copy_from_bytes = ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyFromBytes");
    count = std::max<int64_t>(count, 1);
    ffi::Tensor counters = alloc(ffi::Shape({count}), DLDataType{kDLInt, 32, 1}, device, ffi::Optional<ffi::String>())
                               .cast<ffi::Tensor>();
    std::vector<int32_t> zeros(static_cast<size_t>(count), 0);
    copy_from_bytes(counters, static_cast<void*>(zeros.data()), static_cast<int64_t>(zeros.size() * sizeof(int32_t)));
    counters_.push_back(counters);
    return counters;
  }

  static Args Take(std::optional<Args>& slot) {
    Args out = std::move(*slot);
    slot.reset();
    return out;
  }

  ffi::Function fused_, split_rotary_, append_;
  std::optional<ffi::Function> fused_decode_, decode_;
  std::optional<Args> pending_;          // split-rotary's arguments
  std::optional<Args> pending_append_;   // (pages, append positions), only with fused_decode
  std::vector<ffi::Tensor> counters_;    // the fused decode kernel's, the newest last
};

// [split-rotary wrapper, append wrapper, (decode wrapper,) then one wrapper per other kernel].
ffi::Array<ffi::Function> Wrappers(std::shared_ptr<RopeAppendHooks> hooks, bool with_decode, ffi::PackedArgs kernels) {
  ffi::Array<ffi::Function> out;
  out.push_back(ffi::Function::FromPacked([hooks](ffi::PackedArgs args, ffi::Any*) { hooks->RecordSplit(args); }));
  out.push_back(ffi::Function::FromPacked([hooks](ffi::PackedArgs args, ffi::Any* rv) { hooks->RunAppend(args, rv); }));
  if (with_decode) {
    out.push_back(ffi::Function::FromPacked([hooks](ffi::PackedArgs args, ffi::Any* rv) { hooks->RunDecode(args, rv); }));
  }
  for (int i = 0; i < kernels.size(); ++i) {
    ffi::Function kernel = kernels[i].cast<ffi::Function>();
    out.push_back(ffi::Function::FromPacked([hooks, kernel](ffi::PackedArgs args, ffi::Any* rv) {
      hooks->Flush();
      kernel.CallPacked(args, rv);
    }));
  }
  return out;
}

// fuse_rope_append(fused, split_rotary, append, *kernels)
void MakeWrappers(ffi::PackedArgs args, ffi::Any* rv) {
  auto hooks = std::make_shared<RopeAppendHooks>(args[0].cast<ffi::Function>(), args[1].cast<ffi::Function>(),
                                                 args[2].cast<ffi::Function>(), std::nullopt, std::nullopt);
  *rv = Wrappers(hooks, false, args.Slice(3));
}

// fuse_rope_append_decode(fused, fused_decode, split_rotary, append, decode, *kernels)
void MakeDecodeWrappers(ffi::PackedArgs args, ffi::Any* rv) {
  auto hooks = std::make_shared<RopeAppendHooks>(args[0].cast<ffi::Function>(), args[2].cast<ffi::Function>(),
                                                 args[3].cast<ffi::Function>(), args[1].cast<ffi::Function>(),
                                                 args[4].cast<ffi::Function>());
  *rv = Wrappers(hooks, true, args.Slice(5));
}

// TVM's attention builtin under a name outside ``vm.builtin``, which RewriteCUDAGraph never captures:
// passes/capture_whole_step.py points a decode step's attention calls here so one graph holds the
// step. Arguments (cache, layer, sm_scale, qkv, out, o_part, lse_part): the builtin's, then the split
// partials of the by-position decode kernel, which RunDecode passes it (the cache calls the kernel
// with TVM's arguments only) while the builtin runs, before the counters.
void AttentionWithFusedQKV(ffi::PackedArgs args, ffi::Any* rv) {
  static const ffi::Function builtin =
      ffi::Function::GetGlobalRequired("vm.builtin.attention_kv_cache_attention_with_fused_qkv");
  constexpr int kBuiltinArgs = 5;
  TVM_FFI_ICHECK_EQ(args.size(), kBuiltinArgs + 2) << "attention_with_fused_qkv: expected 7 arguments";
  decode_workspace = Args(args.data() + kBuiltinArgs, args.data() + args.size());
  struct Reset {
    ~Reset() { decode_workspace.reset(); }
  } reset;
  builtin.CallPacked(args.Slice(0, kBuiltinArgs), rv);
}

}  // namespace

// The names are fuselight.contracts.HOOKS_FUNC, HOOKS_DECODE_FUNC (replacing the Python ones) and
// ATTENTION_FORWARD_FUNC.
TVM_FFI_STATIC_INIT_BLOCK() {
  tvm::ffi::Function::SetGlobal("fuselight.kv_cache.fuse_rope_append", tvm::ffi::Function::FromPacked(MakeWrappers), true);
  tvm::ffi::Function::SetGlobal("fuselight.kv_cache.fuse_rope_append_decode",
                                tvm::ffi::Function::FromPacked(MakeDecodeWrappers), true);
  tvm::ffi::Function::SetGlobal("fuselight.kv_cache.attention_with_fused_qkv",
                                tvm::ffi::Function::FromPacked(AttentionWithFusedQKV), true);
}
