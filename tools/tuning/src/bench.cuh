// SPDX-License-Identifier: Apache-2.0
//! @file bench.cuh  The one generic measurement, Bench<Op>, and tune_op<Op> over it. Every candidate
//! is planned and launched through prox::Operator<Op>, with the options SparseFfn::plan gives the op
//! (TuneIO::options()), so how an op is launched is known only by its own header.
//!
//! What an op contributes is a TuneIO<Op> specialization (io_*.cuh), which knows the op's data:
//!
//!   static Options options();                  the launch options: SparseFfn's PlanOptions defaults
//!   static std::vector<WeightSpec> weights(Shape);   the matrices of one rotation set
//!   Status init(Shape, Buffers&, cudaStream_t);      allocate the fixed inputs and outputs
//!   Status set_density(double, std::mt19937_64&, const HostSet& set0, cudaStream_t);
//!                                              the inputs at this density (uploaded), and from them
//!                                              and rotation set 0 the float64 expectation and bounds
//!   Args args(const DeviceSet& set, bool verify) const;  the arguments on a rotation set; `verify`:
//!                                              the checked launch (values outputs where an op has them)
//!   std::vector<Output> outputs() const;       what the checked launch writes (poisoned, fetched)
//!   static constexpr FfnView kView;            how SparseFfn hands the op its workspace (timed so)
//!   std::string check(const Fetched& got, const Fetched* policy0) const;
//!                                              "" if right: against the float64 expectation
//!                                              (policy0 == nullptr) or within twice the bound of
//!                                              policy 0's outputs; else why not
//!
//! Bench does the rest: rotation sets (allocated, filled, set 0 copied to the host), one workspace
//! (initialized once), planning every candidate, the checked launch of each, timing and the record.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <prox/core/workspace.cuh>
#include <prox/operator.cuh>
#include <prox/sparse_ffn.cuh>
#include <prox/tuning/choose.cuh>

#include "harness.hpp"
#include "tune_op.hpp"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

//! The options SparseFfn::plan gives its ops by default; TuneIO::options() reads them from here.
//! (PlanOptions does not depend on the layer type.)
using FfnDefaults = typename SparseFfn<__half>::PlanOptions;

//! The launch options SparseFfn::plan gives op Op under the default PlanOptions.
template <class Op>
typename Op::Options ffn_options() {
  return SparseFfn<__half>::template op_options<Op>(FfnDefaults{});
}

/**
 * @brief How SparseFfn hands an op its workspace, and so how Bench times its candidates (the checked
 * launch always goes through Operator::run). kChecked: Operator::run's view, whose kernel reads the
 * header (Stage 1 and the threshold op). kStage2 / kStage2Stamp: Operator::stage2_view, no header
 * read (in the FFN Stage 1 has checked it), the kernel stamping the header where the FFN's does.
 */
enum class FfnView { kChecked, kStage2, kStage2Stamp };

//! The per-op adapter of Bench (see the file comment); one specialization per op, in io_*.cuh.
template <class Op>
struct TuneIO;

template <class Op>
class Bench {
 public:
  using IO = TuneIO<Op>;
  using Args = typename Op::Args;
  static constexpr int kCandidates = Op::Policies::kSize;

  Status init(Shape shape, const TuneOptions& o, cudaStream_t stream) {
    // The key's ranges; each op's own rules are can_implement()'s, applied when it is planned.
    if (shape.d_model < 1 || shape.d_model > (1 << 24) || shape.d_ff < 0 || shape.d_ff > (1 << 24))
      return Status::kErrorInvalidShape;
    shape_ = shape;
    o_ = o;
    stream_ = stream;
    specs_ = IO::weights(shape);
    if (specs_.size() > kMaxWeightMatrices) return Status::kErrorInvalidArgument;
    set_bytes_ = 0;
    for (const WeightSpec& s : specs_) set_bytes_ += round_up(s.bytes(), kRegionAlign);
    return io_.init(shape, buffers_, stream);
  }

  Status measure(Cache& cache, double density, TuneResult* out) {
    const Key key = op_key<Op>(shape_.d_model, shape_.d_ff, density);
    const double d = bucket_density(key.density16);
    std::mt19937_64 rng = key_rng(o_.seed, key);
    std::size_t touched = 0;
    for (const WeightSpec& s : specs_)
      touched += static_cast<std::size_t>(static_cast<double>(round_up(s.bytes(), kRegionAlign)) *
                                          (s.rows_by_density ? d : 1.0));
    const int nsets = set_bytes_ == 0 ? 1 : rotation_sets(set_bytes_, touched, o_);
    PROX_RETURN_IF_ERROR(ensure_sets(nsets));
    PROX_RETURN_IF_ERROR(plan());  // validates the shape before the inputs are made for it
    PROX_RETURN_IF_ERROR(io_.set_density(d, rng, host0_, stream_));

    std::vector<CandidateResult> res(kCandidates);
    const std::vector<std::string> names = policy_names<typename Op::Policies>();
    for (int c = 0; c < kCandidates; ++c) res[static_cast<std::size_t>(c)].policy = names[static_cast<std::size_t>(c)];
    Fetched reference;
    for (int c = 0; c < kCandidates; ++c) {
      CandidateResult& r = res[static_cast<std::size_t>(c)];
      r.status = planned_[static_cast<std::size_t>(c)];
      if (r.status != Status::kSuccess) {
        r.failure = std::string("cannot be planned: ") + to_string(r.status);
      } else if (!o_.verify) {
        r.verified = true;
      } else {
        Fetched got;
        PROX_RETURN_IF_ERROR(checked_launch(c, &r, &got));
        if (r.failure.empty()) r.failure = io_.check(got, c == 0 ? nullptr : &reference);
        r.verified = r.failure.empty();
        if (c == 0) reference = std::move(got);
      }
      if (c == 0 && !r.verified) return finish(cache, key, res, o_, out);  // nothing to verify against
    }
    PROX_RETURN_IF_ERROR(time_candidates(res, nsets, o_, stream_, [&](int c, int set) {
      return timed_launch(c, io_.args(device_set(set), false));
    }));
    if (out != nullptr) {
      out->rotation_sets = nsets;
      out->rotation_bytes = static_cast<std::size_t>(nsets) * set_bytes_;
    }
    return finish(cache, key, res, o_, out);
  }

 private:
  //! A timed launch of candidate c, on the workspace view SparseFfn gives the op (IO::kView).
  Status timed_launch(int c, const Args& a) const {
    const Operator<Op>& op = ops_[static_cast<std::size_t>(c)];
    if constexpr (IO::kView == FfnView::kChecked) {
      return op.run(a, ws_.get(), ws_.bytes(), stream_);
    } else {
      return op.launch(a, Operator<Op>::stage2_view(ws_.get(), a, IO::kView == FfnView::kStage2Stamp), stream_);
    }
  }

  //! Launch candidate c once on set 0 with its outputs poisoned, and fetch them.
  Status checked_launch(int c, CandidateResult* r, Fetched* got) {
    const std::vector<Output> outs = io_.outputs();
    for (const Output& o : outs) PROX_RETURN_IF_ERROR(cuda_ok(cudaMemsetAsync(o.ptr, 0xFF, o.bytes, stream_)));
    r->status = ops_[static_cast<std::size_t>(c)].run(io_.args(device_set(0), true), ws_.get(), ws_.bytes(), stream_);
    if (r->status != Status::kSuccess) {
      r->failure = std::string("launch failed: ") + to_string(r->status);
      return Status::kSuccess;
    }
    got->out.assign(outs.size(), {});
    for (std::size_t i = 0; i < outs.size(); ++i) {
      got->out[i].resize(outs[i].bytes);
      PROX_RETURN_IF_ERROR(
          cuda_ok(cudaMemcpyAsync(got->out[i].data(), outs[i].ptr, outs[i].bytes, cudaMemcpyDeviceToHost, stream_)));
    }
    return cuda_ok(cudaStreamSynchronize(stream_));  // a fault here is the whole process's: stop
  }

  DeviceSet device_set(int set) const {
    DeviceSet s;
    const char* base = sets_.as<const char>(static_cast<std::size_t>(set) * set_bytes_);
    for (std::size_t m = 0; m < specs_.size(); ++m) {
      s.m[m] = base;
      base += round_up(specs_[m].bytes(), kRegionAlign);
    }
    return s;
  }

  //! At least n rotation sets, filled (a function of the seed, the set and the matrix, so set 0 is
  //! the same whatever n); the host copy of set 0 is made once.
  Status ensure_sets(int n) {
    if (n <= nsets_) return Status::kSuccess;
    nsets_ = 0;
    PROX_RETURN_IF_ERROR(allocate(sets_, static_cast<std::size_t>(n) * set_bytes_));
    // Each (op, set, matrix) its own stream of values.
    const std::uint64_t op_seed = ::prox::detail::splitmix64(o_.seed ^ fnv1a64(Op::kName));
    for (int set = 0; set < n; ++set) {
      const DeviceSet s = device_set(set);
      for (std::size_t m = 0; m < specs_.size(); ++m) {
        const std::uint64_t seed =
            ::prox::detail::splitmix64(op_seed + kMaxWeightMatrices * static_cast<std::uint64_t>(set) + m);
        PROX_RETURN_IF_ERROR(fill_weights(const_cast<char*>(s.m[m]), specs_[m], seed, stream_));
      }
    }
    if (host0_.m.size() != specs_.size()) {
      const DeviceSet s = device_set(0);
      host0_.m.assign(specs_.size(), {});
      for (std::size_t m = 0; m < specs_.size(); ++m) {
        host0_.m[m].resize(specs_[m].bytes());
        PROX_RETURN_IF_ERROR(
            cuda_ok(cudaMemcpyAsync(host0_.m[m].data(), s.m[m], specs_[m].bytes(), cudaMemcpyDeviceToHost, stream_)));
      }
    }
    PROX_RETURN_IF_ERROR(cuda_ok(cudaStreamSynchronize(stream_)));
    nsets_ = n;
    return Status::kSuccess;
  }

  //! Plan every candidate once (the shape is fixed; run() takes each launch's pointers) and make the
  //! op's workspace, the same for every policy, initialized once: each launch leaves it ready.
  //! A candidate that cannot be planned keeps its Status; policy 0 failing stops the bench.
  Status plan() {
    if (is_planned_) return Status::kSuccess;
    const Args a = io_.args(device_set(0), false);
    for (int c = 0; c < kCandidates; ++c)
      planned_[static_cast<std::size_t>(c)] = ops_[static_cast<std::size_t>(c)].initialize(a, IO::options(), c);
    PROX_RETURN_IF_ERROR(planned_[0]);
    const std::size_t bytes = Operator<Op>::workspace_bytes(a);
    PROX_RETURN_IF_ERROR(allocate(ws_, bytes));
    if (bytes > 0) PROX_RETURN_IF_ERROR(initialize_workspace(ws_.get(), bytes, stream_));
    PROX_RETURN_IF_ERROR(cuda_ok(cudaStreamSynchronize(stream_)));
    is_planned_ = true;
    return Status::kSuccess;
  }

  IO io_;
  Buffers buffers_;
  Shape shape_;
  TuneOptions o_;
  cudaStream_t stream_ = nullptr;
  std::vector<WeightSpec> specs_;
  std::size_t set_bytes_ = 0;
  DeviceBuffer sets_;
  int nsets_ = 0;
  HostSet host0_;
  std::array<Operator<Op>, kCandidates> ops_{};
  std::array<Status, kCandidates> planned_{};
  bool is_planned_ = false;
  DeviceBuffer ws_;
};

template <class Op>
Status tune_op(Cache& cache, Shape shape, const std::vector<double>& densities, cudaStream_t stream,
               const TuneOptions& options, std::vector<TuneResult>* results, Lock lock) noexcept {
  PROX_RETURN_IF_ERROR(check_not_capturing(stream));
  try {
    std::unique_lock<std::mutex> guard(cache.tuning_mutex(), std::defer_lock);
    if (lock == Lock::kTake) guard.lock();
    Bench<Op> bench;
    PROX_RETURN_IF_ERROR(bench.init(shape, options, stream));
    std::vector<int> done;
    for (double d : densities) {
      const int b = density_bucket(d);
      if (std::find(done.begin(), done.end(), b) != done.end()) continue;
      done.push_back(b);
      TuneResult r;
      const Status st = bench.measure(cache, bucket_density(b), &r);
      if (results != nullptr && !r.key.op.empty()) results->push_back(std::move(r));
      PROX_RETURN_IF_ERROR(st);
    }
    return Status::kSuccess;
  } catch (...) {
    return Status::kErrorCudaRuntime;  // host allocation, or the mutex
  }
}

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
