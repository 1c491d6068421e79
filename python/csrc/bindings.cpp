// SPDX-License-Identifier: Apache-2.0
//! @file bindings.cpp  prox's torch custom ops (namespace `prox`): schemas, CUDA kernels and the
//! plan cache. The fake (meta) kernels live in Python (prox/_ops.py, torch.library.register_fake),
//! so torch.compile can trace the ops; every CUDA kernel here validates its inputs before launching
//! anything, allocates only its outputs (torch's caching allocator, graph-safe; a batch summing its
//! counters into a [4] tensor adds a [B+1, 4] temporary), never synchronizes and runs on the current
//! stream, so the FFN op can be captured in a CUDA graph.
//!
//! The workspace is declared mutable (Tensor(a!)): the kernels write its scratch regions (mask, s,
//! split-K partials) and stamp its header, though they leave its sync words as they found them.
//! torch.compile then orders the layers that share one workspace and keeps it in place.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <list>
#include <string>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ffn_api.h"
#include "layer_slots.h"

namespace prox_ext {
namespace {

// ---------------------------------------------------------------- checks

const char* status_name(prox::Status s) { return prox::to_string(s); }

void check_status(prox::Status s, const char* what) {
  TORCH_CHECK(s == prox::Status::kSuccess, "prox: ", what, " failed: ", status_name(s));
}

DType dtype_of(const at::Tensor& w, const char* name) {
  if (w.scalar_type() == at::kHalf) return DType::kHalf;
  if (w.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  TORCH_CHECK_TYPE(false, "prox: ", name, " must be float16 or bfloat16 (it is ", dtype_name(w.scalar_type()), ")");
  return DType::kHalf;
}

Act act_of(int64_t act) {
  TORCH_CHECK_VALUE(act == 0 || act == 1, "prox: act must be 0 (SiLU) or 1 (GeLU tanh), got ", act);
  return static_cast<Act>(act);
}

//! Bits the flags word may hold (one per PROX_EXT_PLAN_FLAGS entry).
constexpr int kPlanFlagCount = 0
#define PROX_EXT_COUNT(name, def) +1
    PROX_EXT_PLAN_FLAGS(PROX_EXT_COUNT)
#undef PROX_EXT_COUNT
    ;

//! options = [flags, proxy, glu, down, glu_down]; bit i of flags is PROX_EXT_PLAN_FLAGS's i-th entry
//! (ffn_api.h; prox/_ops.py encodes PlanOptions by the names plan_flag_names() reports).
PlanFlags flags_of(at::IntArrayRef o) {
  TORCH_CHECK_VALUE(o.size() == 5, "prox: options must have 5 entries [flags, proxy, glu, down, glu_down], got ",
                    o.size());
  TORCH_CHECK_VALUE(o[0] >= 0 && o[0] < (int64_t(1) << kPlanFlagCount), "prox: option flags out of range: ", o[0]);
  PlanFlags f;
  f.word = static_cast<unsigned>(o[0]);
  int bit = 0;
#define PROX_EXT_DECODE(name, def) f.name = ((o[0] >> bit++) & 1) != 0;
  PROX_EXT_PLAN_FLAGS(PROX_EXT_DECODE)
#undef PROX_EXT_DECODE
  // A fused Stage 2 waits at a grid-wide barrier: only a cooperative launch guarantees every block is
  // resident, so a non-cooperative one can hang the GPU (glu_down_gemv.cuh, batched_glu_down.cuh).
  TORCH_CHECK_VALUE(f.cooperative || !(f.fuse_stage2 || f.fuse_batch_stage2),
                    "prox: options: cooperative off needs fuse_stage2 and fuse_batch_stage2 off: a fused Stage 2's "
                    "grid barrier is safe only in a cooperative launch (it can hang otherwise)");
  for (int i = 1; i < 5; ++i) TORCH_CHECK_VALUE(o[i] >= -1 && o[i] < 64, "prox: policy index out of range: ", o[i]);
  f.proxy = static_cast<int>(o[1]);
  f.glu = static_cast<int>(o[2]);
  f.down = static_cast<int>(o[3]);
  f.glu_down = static_cast<int>(o[4]);
  return f;
}

std::vector<std::string> plan_flag_names_op() {
  return {
#define PROX_EXT_NAME(name, def) #name,
      PROX_EXT_PLAN_FLAGS(PROX_EXT_NAME)
#undef PROX_EXT_NAME
  };
}

std::vector<std::string> layer_slot_names_op() {
  return {
#define PROX_EXT_NAME(name) #name,
      PROX_EXT_LAYER_SLOTS(PROX_EXT_NAME)
#undef PROX_EXT_NAME
  };
}

std::vector<std::string> layer_format_names_op() {
  return {
#define PROX_EXT_FORMAT(name, code) #name,
#include "generated/formats.inc"
#undef PROX_EXT_FORMAT
  };
}

//! Validates a layer's tensors (each slot of its format by name: layer_slots.h; the thresholds) and its act,
//! options and activation type, and describes it. `want`: the activation type the call asks for.
FfnDesc describe(const LayerList& layer, int64_t format, const at::Tensor& thresholds, const ActType& want,
                 int64_t act, at::IntArrayRef options) {
  FfnDesc d;
  d.act = act_of(act);
  d.flags = flags_of(options);
  describe_layer(layer, format, thresholds, want, true, &d);
  return d;
}

//! The tokens x holds ([d_model]: 1, [tokens, d_model]: tokens). `one_call`: sparse_ffn's limit, one
//! run() or one run_batch() of at most kMaxTokens tokens.
int64_t check_x(const at::Tensor& x, const FfnDesc& d, const at::Device& dev, bool one_call) {
  check_tensor(x, "x", dev, d.dtype == DType::kHalf ? at::kHalf : at::kBFloat16, 16);
  TORCH_CHECK_VALUE((x.dim() == 1 || x.dim() == 2) && x.size(-1) == d.d_model,
                    "prox: x must be [d_model] or [tokens, d_model] with d_model = ", d.d_model, " (it is ",
                    x.sizes(), ")");
  const int64_t tokens = x.dim() == 1 ? 1 : x.size(0);
  if (one_call) {
    TORCH_CHECK_VALUE(tokens >= 1, "prox: x has no rows: sparse_ffn runs 1 to ", kMaxTokens, " tokens");
    TORCH_CHECK_VALUE(tokens <= kMaxTokens, "prox: sparse_ffn runs at most ", kMaxTokens,
                      " tokens per call (batched decoding, prox::kMaxBatchTokens); x has ", tokens,
                      " rows: run them in calls of at most ", kMaxTokens, " tokens");
  }
  return tokens;
}

void check_workspace(const at::Tensor& ws, const FfnDesc& d, const at::Device& dev) {
  check_tensor(ws, "workspace", dev, at::kByte, 16);
  const std::size_t need = workspace_bytes(d.d_model, d.d_ff);
  TORCH_CHECK_VALUE(static_cast<std::size_t>(ws.numel()) >= need, "prox: workspace has ", ws.numel(),
                    " bytes; this layer needs ", need, " (prox.workspace_bytes(", d.d_model, ", ", d.d_ff, "))");
}

//! The token capacity (Config::max_tokens) of the plan a batch of `tokens` runs: the most tokens the
//! workspace holds, not `tokens`, so that every batch size a workspace serves shares one plan (a plan
//! of capacity m runs any batch up to m, and needs workspace_bytes(d_model, d_ff, m)).
int plan_capacity(const at::Tensor& ws, const FfnDesc& d, const at::Device& dev, int64_t tokens) {
  check_tensor(ws, "workspace", dev, at::kByte, 16);
  const std::size_t have = static_cast<std::size_t>(ws.numel());
  for (int m = kMaxTokens; m >= tokens; --m) {
    if (workspace_bytes(d.d_model, d.d_ff, m) <= have) return m;
  }
  TORCH_CHECK_VALUE(false, "prox: workspace has ", have, " bytes; a call of ", tokens, " tokens needs ",
                    workspace_bytes(d.d_model, d.d_ff, static_cast<int>(tokens)), " (prox.workspace_bytes(",
                    d.d_model, ", ", d.d_ff, ", max_tokens=", tokens,
                    ")): size the workspace for the most tokens one call runs (max_tokens <= ", kMaxTokens, ")");
  return 0;  // unreachable
}

// ---------------------------------------------------------------- plan cache

//! A plan's status. kErrorInvalidScale (an FP8 layer's scale is NaN, infinite, zero or negative: plan() checks
//! them on the device) names the slot and the scale: each FP8 scale slot is checked again, on the host's side of
//! the offline check (fp8::check_scales_device, which synchronizes: plan time only, never during capture).
void check_plan_status(prox::Status st, const FfnDesc& d, cudaStream_t stream, const char* what) {
  if (st == prox::Status::kErrorInvalidScale) {
    for (Slot s : {Slot::w_gate_scale, Slot::w_up_scale, Slot::w_down_t_scale}) {
      const std::size_t n = fp8_scale_count(d.format, s, d.d_model, d.d_ff);
      const float* p = d.slot<float>(s);
      if (n == 0 || p == nullptr) continue;
      std::size_t bad = 0;
      if (fp8_check_scales(p, n, stream, &bad) == prox::Status::kErrorInvalidScale) {
        float v = 0.0f;
        static_cast<void>(cudaMemcpy(&v, p + bad, sizeof(v), cudaMemcpyDeviceToHost));
        TORCH_CHECK_VALUE(false, "prox: ", slot_name(s), " holds an invalid scale: element ", bad, " (flattened) is ", v,
                          "; FP8 scales must be finite and > 0 (prox.fp8.check_scales)");
      }
    }
    TORCH_CHECK_VALUE(false, "prox: an FP8 scale of this layer is NaN, infinite, zero or negative (", what, ": ",
                      status_name(st), ")");
  }
  check_status(st, what);
}

//! Everything plan() reads: device, type, shape, every slot's pointer, the thresholds pointer, options and token
//! capacity. A plan found under a key is valid for it whatever happened to the tensors since (it stores only
//! these pointers and values).
constexpr std::size_t kKeyFixed = 13;
using Key = std::array<std::uintptr_t, kKeyFixed + kSlotCount>;

Key key_of(const FfnDesc& d, int device) {
  const PlanFlags& f = d.flags;
  auto u = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  auto i = [](int v) { return static_cast<std::uintptr_t>(static_cast<std::intptr_t>(v)); };
  Key k{i(device), i(static_cast<int>(d.dtype)), i(static_cast<int>(d.act)), i(static_cast<int>(d.format)),
        i(d.d_model), i(d.d_ff), u(d.thresholds), f.word, i(f.proxy), i(f.glu), i(f.down), i(f.glu_down),
        i(d.max_tokens)};
  for (int s = 0; s < kSlotCount; ++s) k[kKeyFixed + s] = u(d.slots[s]);
  return k;
}

struct KeyHash {
  std::size_t operator()(const Key& k) const noexcept {
    std::uint64_t h = 1469598103934665603ull;
    for (std::uintptr_t v : k) {
      h ^= static_cast<std::uint64_t>(v);
      h *= 1099511628211ull;
      h ^= h >> 29;
    }
    return static_cast<std::size_t>(h);
  }
};

//! A bounded LRU of plans (a model holds one or two per layer; re-planned layers evict the oldest). Plans
//! are pinned, never evicted, while an owner holds a pin (plan_ffn(pin=True): PlannedFfn, SparseMLP.plan();
//! released by unpin()) and once a call used them during stream capture (a captured layer can always be
//! captured again, as torch.compile's CUDA graphs re-record). The capacity bounds the unpinned plans.
class PlanCache {
 public:
  static constexpr std::size_t kDefaultCapacity = 4096;

  //! The plan of `d`; with `pin`, also a pin on it (*handle, for unpin()).
  std::shared_ptr<const FfnPlan> get(const FfnDesc& d, int device, cudaStream_t stream, bool pin = false,
                                     std::int64_t* handle = nullptr) {
    const Key k = key_of(d, device);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    TORCH_CHECK(cudaStreamIsCapturing(stream, &cs) == cudaSuccess, "prox: cudaStreamIsCapturing failed");
    const bool capturing = cs != cudaStreamCaptureStatusNone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(k);
      if (it != map_.end()) {
        order_.splice(order_.begin(), order_, it->second.pos);
        mark(it->second, capturing, pin, k, handle);
        return it->second.plan;
      }
    }
    // plan() reads device attributes and sets kernel attributes: not while a graph is captured.
    TORCH_CHECK(!capturing, "prox: this layer has no plan yet (max_tokens ", d.max_tokens,
                ") and the stream is being captured; plan it before capture (prox.PlannedFfn plans at "
                "construction, SparseMLP.plan() plans, or run the call once eagerly)");
    std::unique_ptr<FfnPlan> p;
    check_plan_status(make_plan(d, &p), d, stream, "SparseFfn::plan");
    std::shared_ptr<const FfnPlan> sp(std::move(p));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(k);
    if (it == map_.end()) {
      order_.push_front(k);
      it = map_.emplace(k, Entry{sp, order_.begin()}).first;
    }  // else another thread planned it meanwhile
    mark(it->second, false, pin, k, handle);
    evict();
    return it->second.plan;
  }

  void unpin(std::int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto h = handles_.find(handle);
    if (h == handles_.end()) return;
    auto it = map_.find(h->second);
    handles_.erase(h);
    if (it == map_.end()) return;
    const bool was = pinned(it->second);
    --it->second.pins;
    if (was && !pinned(it->second)) --pinned_;
    evict();
  }

  void set_capacity(std::size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    capacity_ = n;
    evict();
  }
  std::size_t capacity() {
    std::lock_guard<std::mutex> lock(mu_);
    return capacity_;
  }
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.size();
  }
  std::size_t pinned_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return pinned_;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
    order_.clear();
    handles_.clear();
    pinned_ = 0;
  }

 private:
  struct Entry {
    std::shared_ptr<const FfnPlan> plan;
    std::list<Key>::iterator pos;
    int pins = 0;           //!< owners' pins (plan_ffn(pin=True) not yet unpinned)
    bool captured = false;  //!< used by a call during stream capture: kept until clear()
  };
  static bool pinned(const Entry& e) { return e.pins > 0 || e.captured; }

  // Under mu_.
  void mark(Entry& e, bool capturing, bool pin, const Key& k, std::int64_t* handle) {
    const bool was = pinned(e);
    if (capturing) e.captured = true;
    if (pin) {
      ++e.pins;
      const std::int64_t h = next_handle_++;
      handles_.emplace(h, k);
      if (handle != nullptr) *handle = h;
    }
    if (!was && pinned(e)) ++pinned_;
  }
  // Under mu_: drop the least recently used unpinned plans beyond the capacity.
  void evict() {
    auto it = order_.end();
    while (map_.size() - pinned_ > capacity_ && it != order_.begin()) {
      --it;
      auto e = map_.find(*it);
      if (pinned(e->second)) continue;
      map_.erase(e);
      it = order_.erase(it);
    }
  }

  std::mutex mu_;
  std::size_t capacity_ = kDefaultCapacity;
  std::size_t pinned_ = 0;
  std::int64_t next_handle_ = 1;
  std::list<Key> order_;
  std::unordered_map<Key, Entry, KeyHash> map_;
  std::unordered_map<std::int64_t, Key> handles_;
};

PlanCache& cache() {
  static PlanCache* c = new PlanCache();  // never destroyed: no CUDA calls at exit
  return *c;
}

//! The dense Stage-2 plans (dense_ffn), under the same key as the plan cache's: never evicted (a benchmark's
//! baseline; each holds a little device memory of its own: DensePlan, ffn_api.h), dropped by clear_plan_cache().
class DenseCache {
 public:
  std::shared_ptr<const DensePlan> get(const FfnDesc& d, int device, cudaStream_t stream) {
    const Key k = key_of(d, device);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(k);
      if (it != map_.end()) return it->second;
    }
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    TORCH_CHECK(cudaStreamIsCapturing(stream, &cs) == cudaSuccess, "prox: cudaStreamIsCapturing failed");
    TORCH_CHECK(cs == cudaStreamCaptureStatusNone, "prox: dense_ffn: this layer has no dense plan yet and the stream "
                "is being captured; run it once eagerly before capture");
    std::unique_ptr<DensePlan> p;
    check_plan_status(make_dense_plan(d, &p), d, stream, "the dense Stage 2's plan");
    std::shared_ptr<const DensePlan> sp(std::move(p));
    std::lock_guard<std::mutex> lock(mu_);
    return map_.emplace(k, sp).first->second;  // another thread's plan if it won the race
  }
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.size();
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
  }

 private:
  std::mutex mu_;
  std::unordered_map<Key, std::shared_ptr<const DensePlan>, KeyHash> map_;
};

DenseCache& dense_cache() {
  static DenseCache* c = new DenseCache();  // never destroyed: no CUDA calls at exit
  return *c;
}

// ---------------------------------------------------------------- ops

std::tuple<at::Tensor, at::Tensor> pack_int4_impl(const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2, "prox: pack_int4 takes a 2-D [d_ff, d_model] weight (nn.Linear layout), got ",
                    w.sizes());
  const DType t = dtype_of(w, "w");
  check_tensor(w, "w", w.device(), w.scalar_type(), 2);
  const int64_t d_ff = w.size(0), d_model = w.size(1);
  TORCH_CHECK_VALUE(d_ff >= 32 && d_ff % 32 == 0 && d_ff <= (1 << 20),
                    "prox: pack_int4 needs d_ff (rows) a multiple of 32 in [32, 2^20], got ", d_ff);
  TORCH_CHECK_VALUE(d_model >= 1 && d_model <= (1 << 20), "prox: pack_int4 needs d_model (columns) in [1, 2^20], got ",
                    d_model);
  at::Tensor packed = at::empty({d_model, d_ff / 8}, w.options().dtype(at::kInt));
  at::Tensor scales = at::empty({d_ff}, w.options().dtype(at::kFloat));
  auto* qp = static_cast<std::uint32_t*>(packed.data_ptr());
  prox::Status st;
  if (w.is_cuda()) {
    const c10::cuda::CUDAGuard guard(w.device());
    st = pack_int4(t, w.data_ptr(), static_cast<int>(d_model), static_cast<int>(d_ff), qp, scales.data_ptr<float>(),
                   at::cuda::getCurrentCUDAStream(w.device().index()));
  } else {
    st = pack_int4_host(t, w.data_ptr(), static_cast<int>(d_model), static_cast<int>(d_ff), qp,
                        scales.data_ptr<float>());
  }
  TORCH_CHECK_VALUE(st != prox::Status::kErrorNonFiniteWeight, "prox: pack_int4: the weight holds NaN or Inf");
  check_status(st, "int4::pack_device");
  return {packed, scales};
}

at::Tensor transpose_impl(const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 2, "prox: transpose takes a 2-D tensor, got ", w.sizes());
  const DType t = dtype_of(w, "w");
  check_tensor(w, "w", w.device(), w.scalar_type(), 2);
  TORCH_CHECK_VALUE(w.size(0) >= 1 && w.size(1) >= 1 && w.size(0) < (int64_t(1) << 31) &&
                        w.size(1) < (int64_t(1) << 31),
                    "prox: transpose: bad shape ", w.sizes());
  at::Tensor out = at::empty({w.size(1), w.size(0)}, w.options());
  const int rows = static_cast<int>(w.size(0)), cols = static_cast<int>(w.size(1));
  if (w.is_cuda()) {
    const c10::cuda::CUDAGuard guard(w.device());
    check_status(transpose(t, w.data_ptr(), rows, cols, out.data_ptr(),
                           at::cuda::getCurrentCUDAStream(w.device().index())),
                 "transpose_device");
  } else {
    check_status(transpose_host(t, w.data_ptr(), rows, cols, out.data_ptr()), "transpose_host");
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_ffn_cuda(
    const at::Tensor& x, const LayerList& layer, int64_t format, const at::Tensor& thresholds,
    const at::Tensor& workspace, int64_t act, at::IntArrayRef options, bool return_mask, bool return_s_proxy,
    bool return_s, const std::optional<at::Tensor>& counters) {
  FfnDesc d = describe(layer, format, thresholds, ActType{x.scalar_type(), "x"}, act, options);
  const at::Device dev = thresholds.device();  // the layer's (describe() checked)
  // One token ([d_model] or [1, d_model]) runs run() with its batch-1 shapes; 2..kMaxTokens tokens run
  // run_batch(), and every output gains a leading token dimension.
  const int64_t tokens = check_x(x, d, dev, true);
  const bool batched = tokens > 1;
  if (batched) {
    d.max_tokens = plan_capacity(workspace, d, dev, tokens);
  } else {
    check_workspace(workspace, d, dev);
  }
  // A batch takes counters [4] (each token counted as a call, as batch 1 would: the per-token entries
  // run_batch() writes, summed into it) or [tokens + 1, 4] (run_batch()'s entries as they are: each
  // token's, then their union's).
  bool sum_counters = false;
  if (counters.has_value()) {
    check_tensor(*counters, "counters", dev, at::kLong, 8);
    if (!batched) {
      check_shape(*counters, "counters", {4});
    } else {
      const at::Tensor& c = *counters;
      sum_counters = c.dim() == 1 && c.size(0) == 4;
      TORCH_CHECK_VALUE(sum_counters || (c.dim() == 2 && c.size(0) == tokens + 1 && c.size(1) == 4),
                        "prox: counters must have shape [4] (summed over the tokens) or [", tokens + 1,
                        ", 4] (each token's, then their union's) for ", tokens, " tokens (it has ", c.sizes(), ")");
    }
  }
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev.index());
  const std::shared_ptr<const FfnPlan> plan = cache().get(d, dev.index(), stream);
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  const auto shape = [&](bool wanted, int64_t n) {
    if (!wanted) return std::vector<int64_t>{0};
    return batched ? std::vector<int64_t>{tokens, n} : std::vector<int64_t>{n};
  };
  at::Tensor y = at::empty_like(x);
  at::Tensor mask = at::empty(shape(return_mask, d.d_ff / 32), x.options().dtype(at::kInt));
  at::Tensor s_proxy = at::empty(shape(return_s_proxy, d.d_ff), f32);
  at::Tensor s = at::empty(shape(return_s, d.d_ff), f32);
  FfnOutputs out;
  out.mask = return_mask ? static_cast<std::uint32_t*>(mask.data_ptr()) : nullptr;
  out.s_proxy = return_s_proxy ? s_proxy.data_ptr<float>() : nullptr;
  out.s = return_s ? s.data_ptr<float>() : nullptr;
  const std::size_t bytes = static_cast<std::size_t>(workspace.numel());
  if (!batched) {
    out.counters = counters.has_value() ? counters->data_ptr() : nullptr;
    check_status(plan->run(x.data_ptr(), y.data_ptr(), workspace.data_ptr(), bytes, stream, out), "SparseFfn::run");
    return {y, mask, s_proxy, s};
  }
  at::Tensor entries;  // run_batch()'s tokens + 1 counters
  if (sum_counters) {
    entries = at::zeros({tokens + 1, 4}, counters->options());
  } else if (counters.has_value()) {
    entries = *counters;
  }
  out.counters = entries.defined() ? entries.data_ptr() : nullptr;
  check_status(plan->run_batch(x.data_ptr(), y.data_ptr(), static_cast<int>(tokens), workspace.data_ptr(), bytes,
                               stream, out),
               "SparseFfn::run_batch");
  if (sum_counters) counters->add_(entries.narrow(0, 0, tokens).sum(0));
  return {y, mask, s_proxy, s};
}

at::Tensor proxy_values_cuda(const at::Tensor& x, const LayerList& layer, int64_t format, const at::Tensor& thresholds,
                             const at::Tensor& workspace, int64_t act, at::IntArrayRef options) {
  const FfnDesc d = describe(layer, format, thresholds, ActType{x.scalar_type(), "x"}, act, options);
  const at::Device dev = thresholds.device();  // the layer's (describe() checked)
  check_x(x, d, dev, false);
  check_workspace(workspace, d, dev);
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev.index());
  const std::shared_ptr<const FfnPlan> plan = cache().get(d, dev.index(), stream);
  const int64_t tokens = x.dim() == 1 ? 1 : x.size(0);
  std::vector<int64_t> shape = x.dim() == 1 ? std::vector<int64_t>{d.d_ff} : std::vector<int64_t>{tokens, d.d_ff};
  at::Tensor s = at::empty(shape, x.options().dtype(at::kFloat));
  const std::size_t row = static_cast<std::size_t>(d.d_model) * x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    check_status(plan->run_proxy_values(xp + t * row, s.data_ptr<float>() + t * d.d_ff, workspace.data_ptr(),
                                        static_cast<std::size_t>(workspace.numel()), stream),
                 "SparseFfn::run_proxy_values");
  }
  return s;
}

//! dense_ffn: the layer's dense FFN through its own fused Stage-2 kernel, every channel selected, no Stage 1
//! (DensePlan): a benchmark's dense baseline. One token; the thresholds are checked as every op checks them and
//! not read. Allocates only y; graph-capturable once planned (its first eager call plans).
at::Tensor dense_ffn_cuda(const at::Tensor& x, const LayerList& layer, int64_t format, const at::Tensor& thresholds,
                          int64_t act, at::IntArrayRef options) {
  const FfnDesc d = describe(layer, format, thresholds, ActType{x.scalar_type(), "x"}, act, options);
  const at::Device dev = thresholds.device();
  const int64_t tokens = check_x(x, d, dev, true);
  TORCH_CHECK_VALUE(tokens == 1, "prox: dense_ffn runs one token ([d_model] or [1, d_model]); x has ", tokens,
                    " rows");
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev.index());
  const std::shared_ptr<const DensePlan> plan = dense_cache().get(d, dev.index(), stream);
  at::Tensor y = at::empty_like(x);
  check_status(plan->run(x.data_ptr(), y.data_ptr(), stream), "the dense Stage 2");
  return y;
}

// ---------------------------------------------------------------- FP8 e4m3 offline helpers

//! An FP8 scale layout (prox::fp8::ScaleLayout's value): 0 one scale per output channel, 1 128 x 128 blocks.
constexpr int64_t kFp8Channel = 0, kFp8Block128 = 1;
int fp8_layout_of(int64_t layout) {
  TORCH_CHECK_VALUE(layout == kFp8Channel || layout == kFp8Block128, "prox: an FP8 scale layout is 0 (one scale per "
                    "output channel) or 1 (128 x 128 blocks), got ", layout);
  return static_cast<int>(layout);
}

//! The scales' shape of a stored matrix [rows][cols] (fp8::scale_shape): per channel, one per output channel
//! (`out`: rows for nn.Linear's layout, cols for W_down^T's); blocks, [ceil(rows/128), ceil(cols/128)].
std::vector<int64_t> fp8_scale_shape(int layout, int64_t rows, int64_t cols, int64_t out) {
  if (layout == kFp8Block128) return {(rows + 127) / 128, (cols + 127) / 128};
  return {out};
}

//! An FP8 matrix an offline helper reads: torch.float8_e4m3fn, 2-D, contiguous, on `dev`, rows and cols in
//! [1, 2^20]; its scales float32 of `shape`, contiguous, 4-byte aligned, on the same device.
void check_fp8_matrix(const at::Tensor& q, const char* what, const at::Device& dev) {
  check_placement(q, what, dev, at::kFloat8_e4m3fn);
  TORCH_CHECK_VALUE(q.dim() == 2, "prox: ", what, " must be a 2-D matrix (it has shape ", shape_name(q.sizes()), ")");
  TORCH_CHECK_VALUE(q.is_contiguous(), "prox: ", what, " must be contiguous");
  TORCH_CHECK_VALUE(q.size(0) >= 1 && q.size(1) >= 1 && q.size(0) <= (1 << 20) && q.size(1) <= (1 << 20),
                    "prox: ", what, " must have 1 to 2^20 rows and columns (it has shape ", shape_name(q.sizes()), ")");
}
void check_fp8_scales(const at::Tensor& s, const char* what, const at::Device& dev, at::IntArrayRef shape) {
  check_tensor(s, what, dev, at::kFloat, 4);
  check_shape(s, what, shape);
}

//! The first invalid scale (NaN, +-inf, +-0, negative) of float32 `s` on its device: its flat index, or -1.
int64_t fp8_first_bad_scale(const at::Tensor& s) {
  if (s.numel() == 0) return -1;
  std::size_t bad = 0;
  prox::Status st;
  if (s.is_cuda()) {
    const c10::cuda::CUDAGuard guard(s.device());
    st = fp8_check_scales(s.data_ptr<float>(), static_cast<std::size_t>(s.numel()),
                          at::cuda::getCurrentCUDAStream(s.device().index()), &bad);
  } else {
    st = fp8_check_scales_host(s.data_ptr<float>(), static_cast<std::size_t>(s.numel()), &bad);
  }
  if (st == prox::Status::kErrorInvalidScale) return static_cast<int64_t>(bad);
  check_status(st, "fp8::check_scales");
  return -1;
}

//! fp8_check_scales(scales) -> int: the flat index of the first scale that is NaN, infinite, zero or negative, -1
//! when every one is finite and > 0 (fp8::check_scales_device, which synchronizes, or check_scales_host).
int64_t fp8_check_scales_op(const at::Tensor& scales) {
  check_tensor(scales, "scales", scales.device(), at::kFloat, 4);
  TORCH_CHECK_VALUE(scales.numel() >= 1, "prox: fp8_check_scales: scales is empty");
  return fp8_first_bad_scale(scales);
}

//! Raises ValueError naming `what` and its first invalid scale.
void require_valid_scales(const at::Tensor& s, const char* what) {
  const int64_t bad = fp8_first_bad_scale(s);
  if (bad < 0) return;
  const float v = s.reshape(-1)[bad].item<float>();
  TORCH_CHECK_VALUE(false, "prox: ", what, " holds an invalid scale: element ", bad, " (flattened) is ", v,
                    "; FP8 scales must be finite and > 0");
}

SrcType src_type_of(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return SrcType::kFloat;
    case at::kHalf: return SrcType::kHalf;
    case at::kBFloat16: return SrcType::kBFloat16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "prox: fp8_quantize takes a float32, float16 or bfloat16 weight (it is ",
                   dtype_name(w.scalar_type()), ")");
  return SrcType::kFloat;
}

//! fp8_quantize(w, layout) -> (q, scales): an nn.Linear weight [rows, cols] quantized to e4m3 with one scale per
//! row or per 128 x 128 block (fp8::quantize_device / quantize_host, bit-identical). Offline: synchronizes.
std::tuple<at::Tensor, at::Tensor> fp8_quantize_impl(const at::Tensor& w, int64_t layout) {
  const int l = fp8_layout_of(layout);
  const SrcType t = src_type_of(w);
  check_tensor(w, "w", w.device(), w.scalar_type(), w.element_size());
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(0) >= 1 && w.size(1) >= 1 && w.size(0) <= (1 << 20) &&
                        w.size(1) <= (1 << 20),
                    "prox: fp8_quantize takes a 2-D [rows, cols] weight with 1 to 2^20 rows and columns, got ",
                    shape_name(w.sizes()));
  at::Tensor q = at::empty(w.sizes(), w.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor s = at::empty(fp8_scale_shape(l, w.size(0), w.size(1), w.size(0)), w.options().dtype(at::kFloat));
  auto* qp = static_cast<std::uint8_t*>(q.data_ptr());
  const int rows = static_cast<int>(w.size(0)), cols = static_cast<int>(w.size(1));
  prox::Status st;
  if (w.is_cuda()) {
    const c10::cuda::CUDAGuard guard(w.device());
    st = fp8_quantize(t, w.data_ptr(), rows, cols, l, qp, s.data_ptr<float>(),
                      at::cuda::getCurrentCUDAStream(w.device().index()));
  } else {
    st = fp8_quantize_host(t, w.data_ptr(), rows, cols, l, qp, s.data_ptr<float>());
  }
  TORCH_CHECK_VALUE(st != prox::Status::kErrorNonFiniteWeight, "prox: fp8_quantize: the weight holds NaN or Inf");
  check_status(st, "fp8::quantize");
  return {q, s};
}

//! fp8_transpose_down(q, scales, layout) -> (q_t, scales_t): W_down [d_model, d_ff] e4m3 and its scales
//! ([d_model] per channel, [ceil(d_model/128), ceil(d_ff/128)] blocks) -> W_down^T [d_ff, d_model] and its
//! scales ([d_model], the same values; [ceil(d_ff/128), ceil(d_model/128)], transposed).
std::tuple<at::Tensor, at::Tensor> fp8_transpose_down_impl(const at::Tensor& q, const at::Tensor& scales,
                                                           int64_t layout) {
  const int l = fp8_layout_of(layout);
  check_fp8_matrix(q, "w_down", q.device());
  const int64_t d_model = q.size(0), d_ff = q.size(1);
  check_fp8_scales(scales, "w_down_scale", q.device(), fp8_scale_shape(l, d_model, d_ff, d_model));
  at::Tensor qt = at::empty({d_ff, d_model}, q.options());
  at::Tensor st_ = at::empty(fp8_scale_shape(l, d_ff, d_model, d_model), scales.options());
  const auto* qp = static_cast<const std::uint8_t*>(q.data_ptr());
  auto* qtp = static_cast<std::uint8_t*>(qt.data_ptr());
  prox::Status st;
  if (q.is_cuda()) {
    const c10::cuda::CUDAGuard guard(q.device());
    st = fp8_transpose_down(qp, scales.data_ptr<float>(), static_cast<int>(d_model), static_cast<int>(d_ff), l, qtp,
                            st_.data_ptr<float>(), at::cuda::getCurrentCUDAStream(q.device().index()));
  } else {
    st = fp8_transpose_down_host(qp, scales.data_ptr<float>(), static_cast<int>(d_model), static_cast<int>(d_ff), l,
                                 qtp, st_.data_ptr<float>());
  }
  check_status(st, "fp8::transpose_down");
  return {qt, st_};
}

//! fp8_pack_int4(q, scales, layout) -> (packed, int4_scales): the INT4 proxy (layout v1) of an FP8 W_gate or W_up
//! [d_ff, d_model], packed from its dequantized weights (fp8::pack_int4_device / _host, bit-identical). Offline:
//! synchronizes. Refuses invalid scales (naming the first) and a NaN code or an overflowing q * scale.
std::tuple<at::Tensor, at::Tensor> fp8_pack_int4_impl(const at::Tensor& q, const at::Tensor& scales, int64_t layout) {
  const int l = fp8_layout_of(layout);
  check_fp8_matrix(q, "w", q.device());
  const int64_t d_ff = q.size(0), d_model = q.size(1);
  TORCH_CHECK_VALUE(d_ff >= 32 && d_ff % 32 == 0, "prox: fp8_pack_int4 needs d_ff (rows) a multiple of 32, got ",
                    d_ff);
  check_fp8_scales(scales, "scales", q.device(), fp8_scale_shape(l, d_ff, d_model, d_ff));
  require_valid_scales(scales, "scales");
  at::Tensor packed = at::empty({d_model, d_ff / 8}, q.options().dtype(at::kInt));
  at::Tensor s4 = at::empty({d_ff}, q.options().dtype(at::kFloat));
  const auto* qp = static_cast<const std::uint8_t*>(q.data_ptr());
  auto* pp = static_cast<std::uint32_t*>(packed.data_ptr());
  prox::Status st;
  if (q.is_cuda()) {
    const c10::cuda::CUDAGuard guard(q.device());
    st = fp8_pack_int4(qp, scales.data_ptr<float>(), l, static_cast<int>(d_model), static_cast<int>(d_ff), pp,
                       s4.data_ptr<float>(), at::cuda::getCurrentCUDAStream(q.device().index()));
  } else {
    st = fp8_pack_int4_host(qp, scales.data_ptr<float>(), l, static_cast<int>(d_model), static_cast<int>(d_ff), pp,
                            s4.data_ptr<float>());
  }
  TORCH_CHECK_VALUE(st != prox::Status::kErrorNonFiniteWeight, "prox: fp8_pack_int4: the dequantized weight holds "
                    "NaN or Inf (a NaN code, or q * scale overflowing float32)");
  check_status(st, "fp8::pack_int4");
  return {packed, s4};
}

std::string fp8_layout_op() { return fp8_layout_tag(); }

int check_max_tokens(int64_t max_tokens) {
  TORCH_CHECK_VALUE(max_tokens >= 1 && max_tokens <= kMaxTokens, "prox: max_tokens must be in [1, ", kMaxTokens,
                    "] (prox::kMaxBatchTokens), got ", max_tokens);
  return static_cast<int>(max_tokens);
}

//! max_tokens: the plan's token capacity. A batched sparse_ffn call uses the capacity its workspace
//! holds (plan_capacity()), so plan that one before capturing batched calls.
//! pin: keep the plan until unpin_plan(handle) (the handle is a fifth entry of the result).
//! dtype: the activation type (x, y); the native format's is its weights' (None means that).
std::vector<int64_t> plan_ffn_cuda(const LayerList& layer, int64_t format, const at::Tensor& thresholds, int64_t act,
                                   at::IntArrayRef options, int64_t max_tokens, bool pin,
                                   std::optional<at::ScalarType> dtype) {
  FfnDesc d = describe(layer, format, thresholds, ActType{dtype, "dtype"}, act, options);
  d.max_tokens = check_max_tokens(max_tokens);
  const at::Device dev = thresholds.device();  // the layer's (describe() checked)
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev.index());
  std::int64_t handle = 0;
  const std::shared_ptr<const FfnPlan> plan = cache().get(d, dev.index(), stream, pin, &handle);
  int p[4];
  plan->policies(p);
  if (pin) return {p[0], p[1], p[2], p[3], handle};
  return {p[0], p[1], p[2], p[3]};
}

void initialize_workspace_cuda(const at::Tensor& ws) {
  check_tensor(ws, "workspace", ws.device(), at::kByte, 16);
  const c10::cuda::CUDAGuard guard(ws.device());
  check_status(initialize_workspace(ws.data_ptr(), static_cast<std::size_t>(ws.numel()),
                                    at::cuda::getCurrentCUDAStream(ws.device().index())),
               "initialize_workspace");
}

//! The status word lies at the end of the header (prox::detail::kHeaderStatusOffset): a workspace must
//! hold the whole header to be read.
void check_header(const at::Tensor& ws) {
  const std::size_t need = workspace_header_bytes();
  TORCH_CHECK_VALUE(static_cast<std::size_t>(ws.numel()) >= need, "prox: workspace has ", ws.numel(),
                    " bytes; a workspace holds at least its ", need, "-byte header");
}

bool workspace_dirty_cuda(const at::Tensor& ws) {
  check_tensor(ws, "workspace", ws.device(), at::kByte, 16);
  check_header(ws);
  const c10::cuda::CUDAGuard guard(ws.device());
  bool dirty = false;
  check_status(workspace_dirty(ws.data_ptr(), at::cuda::getCurrentCUDAStream(ws.device().index()), &dirty),
               "read_workspace_status");
  return dirty;
}

//! The CPU kernels of the CUDA-only ops: a clear error instead of the dispatcher's "no CPU kernel".
[[noreturn]] void needs_cuda(const char* op) {
  TORCH_CHECK_VALUE(false, "prox: ", op, " runs on CUDA tensors only (the layer's tensors are on the CPU)");
  throw;  // unreachable
}
//! They validate what needs no device first (act, options, format, the list's length), so a bad option is the
//! same error everywhere.
void check_no_device(const LayerList& layer, int64_t format, int64_t act, at::IntArrayRef options) {
  act_of(act);
  flags_of(options);
  format_of(format);
  static_cast<void>(LayerSlots(layer));  // the list's length
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_ffn_cpu(
    const at::Tensor&, const LayerList& layer, int64_t format, const at::Tensor&, const at::Tensor&, int64_t act,
    at::IntArrayRef options, bool, bool, bool, const std::optional<at::Tensor>&) {
  check_no_device(layer, format, act, options);
  needs_cuda("sparse_ffn");
}
at::Tensor proxy_values_cpu(const at::Tensor&, const LayerList& layer, int64_t format, const at::Tensor&,
                            const at::Tensor&, int64_t act, at::IntArrayRef options) {
  check_no_device(layer, format, act, options);
  needs_cuda("proxy_values");
}
std::vector<int64_t> plan_ffn_cpu(const LayerList& layer, int64_t format, const at::Tensor&, int64_t act,
                                  at::IntArrayRef options, int64_t max_tokens, bool, std::optional<at::ScalarType>) {
  check_no_device(layer, format, act, options);
  check_max_tokens(max_tokens);
  needs_cuda("plan_ffn");
}
at::Tensor dense_ffn_cpu(const at::Tensor&, const LayerList& layer, int64_t format, const at::Tensor&, int64_t act,
                         at::IntArrayRef options) {
  check_no_device(layer, format, act, options);
  needs_cuda("dense_ffn");
}
void initialize_workspace_cpu(const at::Tensor&) { needs_cuda("initialize_workspace"); }
bool workspace_dirty_cpu(const at::Tensor& ws) {
  check_header(ws);
  needs_cuda("workspace_dirty");
}

//! The layer checks of every op call, on tensors of any device (no CUDA needed): prox.check_layer runs them where
//! a layer is built, so a bad tensor is named there. Returns [d_model, d_ff].
std::vector<int64_t> check_layer_op(const LayerList& layer, int64_t format, const at::Tensor& thresholds,
                                    std::optional<at::ScalarType> dtype) {
  FfnDesc d;
  describe_layer(layer, format, thresholds, ActType{dtype, "dtype"}, false, &d);
  return {d.d_model, d.d_ff};
}

int64_t workspace_bytes_op(int64_t d_model, int64_t d_ff, int64_t max_tokens) {
  TORCH_CHECK_VALUE(d_model >= 8 && d_model % 8 == 0 && d_model <= (1 << 20),
                    "prox: d_model must be a multiple of 8 in [8, 2^20], got ", d_model);
  TORCH_CHECK_VALUE(d_ff >= 32 && d_ff % 32 == 0 && d_ff <= (1 << 20),
                    "prox: d_ff must be a multiple of 32 in [32, 2^20], got ", d_ff);
  return static_cast<int64_t>(
      workspace_bytes(static_cast<int>(d_model), static_cast<int>(d_ff), check_max_tokens(max_tokens)));
}

std::tuple<double, double> allocate_sparsity_op(double e) {
  double s1 = 0.0, s2 = 0.0;
  const prox::Status st = allocate_sparsity(e, &s1, &s2);
  TORCH_CHECK_VALUE(st == prox::Status::kSuccess, "prox: allocate_sparsity(", e, "): ", status_name(st));
  return {s1, s2};
}

std::string int4_layout_op() { return int4_layout_tag(); }

int64_t workspace_header_bytes_op() { return static_cast<int64_t>(workspace_header_bytes()); }
int64_t plan_cache_size_op() { return static_cast<int64_t>(cache().size()); }
int64_t plan_cache_capacity_op() { return static_cast<int64_t>(cache().capacity()); }
int64_t plan_cache_pinned_op() { return static_cast<int64_t>(cache().pinned_count()); }
void set_plan_cache_capacity_op(int64_t n) {
  TORCH_CHECK_VALUE(n >= 1, "prox: the plan cache capacity must be >= 1, got ", n);
  cache().set_capacity(static_cast<std::size_t>(n));
}
void unpin_plan_op(int64_t handle) { cache().unpin(handle); }
void clear_plan_cache_op() {
  cache().clear();
  dense_cache().clear();
}

}  // namespace
}  // namespace prox_ext

TORCH_LIBRARY(prox, m) {
  // The fake kernels (register_fake) are in this module; torch imports it when it needs them.
  m.set_python_module("prox._ops");
  m.def("pack_int4(Tensor w) -> (Tensor packed, Tensor scales)");
  m.def("transpose(Tensor w) -> Tensor");
  // `layer`: one entry per slot (layer_slot_names(), PROX_EXT_LAYER_SLOTS), None where the format has no such
  // tensor; `format`: its Stage-2 weight format, a position in layer_format_names().
  m.def(
      "sparse_ffn(Tensor x, Tensor?[] layer, int format, Tensor thresholds, Tensor(a!) workspace, int act, "
      "int[] options, bool return_mask=False, bool return_s_proxy=False, bool return_s=False, "
      "Tensor(b!)? counters=None) -> (Tensor y, Tensor mask, Tensor s_proxy, Tensor s)");
  m.def(
      "proxy_values(Tensor x, Tensor?[] layer, int format, Tensor thresholds, Tensor(a!) workspace, int act, "
      "int[] options) -> Tensor");
  m.def(
      "plan_ffn(Tensor?[] layer, int format, Tensor thresholds, int act, int[] options, int max_tokens=1, "
      "bool pin=False, ScalarType? dtype=None) -> int[]");
  m.def("dense_ffn(Tensor x, Tensor?[] layer, int format, Tensor thresholds, int act, int[] options) -> Tensor");
  // FP8 e4m3 offline helpers (layout: 0 per output channel, 1 128 x 128 blocks; docs/fp8-format.md).
  m.def("fp8_quantize(Tensor w, int layout) -> (Tensor q, Tensor scales)");
  m.def("fp8_transpose_down(Tensor q, Tensor scales, int layout) -> (Tensor q_t, Tensor scales_t)");
  m.def("fp8_pack_int4(Tensor q, Tensor scales, int layout) -> (Tensor packed, Tensor scales)");
  m.def("fp8_check_scales(Tensor scales) -> int");
  m.def("fp8_layout() -> str", &prox_ext::fp8_layout_op);
  m.def("check_layer(Tensor?[] layer, int format, Tensor thresholds, ScalarType? dtype=None) -> int[]",
        &prox_ext::check_layer_op);
  m.def("layer_slot_names() -> str[]", &prox_ext::layer_slot_names_op);
  m.def("layer_format_names() -> str[]", &prox_ext::layer_format_names_op);
  m.def("initialize_workspace(Tensor(a!) workspace) -> ()");
  m.def("workspace_dirty(Tensor workspace) -> bool");
  m.def("workspace_bytes(int d_model, int d_ff, int max_tokens=1) -> int", &prox_ext::workspace_bytes_op);
  m.def("allocate_sparsity(float e) -> (float, float)", &prox_ext::allocate_sparsity_op);
  m.def("int4_layout() -> str", &prox_ext::int4_layout_op);
  m.def("workspace_header_bytes() -> int", &prox_ext::workspace_header_bytes_op);
  m.def("plan_flag_names() -> str[]", &prox_ext::plan_flag_names_op);
  m.def("plan_cache_size() -> int", &prox_ext::plan_cache_size_op);
  m.def("plan_cache_capacity() -> int", &prox_ext::plan_cache_capacity_op);
  m.def("set_plan_cache_capacity(int capacity) -> ()", &prox_ext::set_plan_cache_capacity_op);
  m.def("plan_cache_pinned() -> int", &prox_ext::plan_cache_pinned_op);
  m.def("unpin_plan(int handle) -> ()", &prox_ext::unpin_plan_op);
  m.def("clear_plan_cache() -> ()", &prox_ext::clear_plan_cache_op);
}

TORCH_LIBRARY_IMPL(prox, CUDA, m) {
  m.impl("pack_int4", &prox_ext::pack_int4_impl);
  m.impl("transpose", &prox_ext::transpose_impl);
  m.impl("sparse_ffn", &prox_ext::sparse_ffn_cuda);
  m.impl("dense_ffn", &prox_ext::dense_ffn_cuda);
  m.impl("fp8_quantize", &prox_ext::fp8_quantize_impl);
  m.impl("fp8_transpose_down", &prox_ext::fp8_transpose_down_impl);
  m.impl("fp8_pack_int4", &prox_ext::fp8_pack_int4_impl);
  m.impl("fp8_check_scales", &prox_ext::fp8_check_scales_op);
  m.impl("proxy_values", &prox_ext::proxy_values_cuda);
  m.impl("plan_ffn", &prox_ext::plan_ffn_cuda);
  m.impl("initialize_workspace", &prox_ext::initialize_workspace_cuda);
  m.impl("workspace_dirty", &prox_ext::workspace_dirty_cuda);
}

// CPU: the host packer, transpose and FP8 helpers (bit-identical to the device ones), and clear errors for the rest.
TORCH_LIBRARY_IMPL(prox, CPU, m) {
  m.impl("pack_int4", &prox_ext::pack_int4_impl);
  m.impl("transpose", &prox_ext::transpose_impl);
  m.impl("sparse_ffn", &prox_ext::sparse_ffn_cpu);
  m.impl("dense_ffn", &prox_ext::dense_ffn_cpu);
  m.impl("fp8_quantize", &prox_ext::fp8_quantize_impl);
  m.impl("fp8_transpose_down", &prox_ext::fp8_transpose_down_impl);
  m.impl("fp8_pack_int4", &prox_ext::fp8_pack_int4_impl);
  m.impl("fp8_check_scales", &prox_ext::fp8_check_scales_op);
  m.impl("proxy_values", &prox_ext::proxy_values_cpu);
  m.impl("plan_ffn", &prox_ext::plan_ffn_cpu);
  m.impl("initialize_workspace", &prox_ext::initialize_workspace_cpu);
  m.impl("workspace_dirty", &prox_ext::workspace_dirty_cpu);
}

// A Python module with no functions: `import prox._C` loads this library, whose static initializers
// register the ops above (torch's recommended pattern for op-only extensions).
PyMODINIT_FUNC PyInit__C(void) {  // default visibility (the rest of the module is hidden)
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "prox's torch custom ops (torch.ops.prox)",
                                          -1, nullptr};
  return PyModule_Create(&module_def);
}
