// SPDX-License-Identifier: Apache-2.0
//! @file io_threshold.cuh  TuneIO of the threshold op: no weights (nothing to rotate); mask, count
//! and indices are exact, so every candidate must equal the host's result bit for bit.
#pragma once

#include <prox/threshold.cuh>

#include "bench.cuh"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

template <class T>
struct TuneIO<ThresholdOp<T>> {
  using Op = ThresholdOp<T>;
  static constexpr FfnView kView = FfnView::kChecked;  // the kernel reads the header
  static typename Op::Options options() {
    typename Op::Options o;
    o.pdl = FfnDefaults{}.pdl;
    return o;
  }
  static std::vector<WeightSpec> weights(Shape) { return {}; }

  Status init(Shape s, Buffers& b, cudaStream_t) {
    n_ = s.d_model;
    PROX_RETURN_IF_ERROR(b.alloc(&x_, static_cast<std::size_t>(n_)));
    PROX_RETURN_IF_ERROR(b.alloc(&mask_, words()));
    PROX_RETURN_IF_ERROR(b.alloc(&idx_, static_cast<std::size_t>(n_)));
    return b.alloc(&count_, 1);
  }
  Status set_density(double d, std::mt19937_64& rng, const HostSet&, cudaStream_t stream) {
    const std::vector<T> x = make_input<T>(n_, d, rng);
    want_mask_.assign(words(), 0u);
    want_idx_.clear();
    for (int i = 0; i < n_; ++i) {
      if (!keep_magnitude(static_cast<float>(host_to_double(x[static_cast<std::size_t>(i)])), kInputTau)) continue;
      want_mask_[static_cast<std::size_t>(i / 32)] |= 1u << (i % 32);
      want_idx_.push_back(i);
    }
    return upload(x_, x, stream);
  }
  typename Op::Args args(const DeviceSet&, bool) const {
    typename Op::Args a;
    a.x = x_;
    a.n = n_;
    a.tau = kInputTau;
    a.mask = mask_;
    a.indices = idx_;
    a.count = count_;
    return a;
  }
  std::vector<Output> outputs() const {
    return {{mask_, sizeof(std::uint32_t) * words()},
            {count_, sizeof(int)},
            {idx_, sizeof(int) * static_cast<std::size_t>(n_)}};
  }
  //! Exact results: policy 0 and every other candidate must give the host's.
  std::string check(const Fetched& got, const Fetched*) const {
    const std::vector<int> counts = got.as<int>(1);
    const int count = counts.empty() ? -1 : counts.front();
    std::vector<int> idx = got.as<int>(2);
    if (count != static_cast<int>(want_idx_.size()))
      return "count " + std::to_string(count) + ", exact " + std::to_string(want_idx_.size());
    if (got.as<std::uint32_t>(0) != want_mask_) return "mask differs from the exact one";
    idx.resize(static_cast<std::size_t>(count));
    return idx == want_idx_ ? std::string() : "indices differ from the exact ones";
  }

 private:
  std::size_t words() const { return static_cast<std::size_t>((n_ + 31) / 32); }
  int n_ = 0;
  T* x_ = nullptr;
  std::uint32_t* mask_ = nullptr;
  int* idx_ = nullptr;
  int* count_ = nullptr;
  std::vector<std::uint32_t> want_mask_;
  std::vector<int> want_idx_;
};

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
