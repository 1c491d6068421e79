// SPDX-License-Identifier: Apache-2.0
//! @file io_down.cuh  TuneIO of the sparse down GEMV (unfused Stage 2): rotated W_down^T, random s
//! and channel set at the density; y within its rounding bound plus the rounding of storing it as T.
#pragma once

#include <prox/down_gemv.cuh>

#include "bench.cuh"
#include "reference.cuh"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

//! y (output `i` of `got`, K elements of T) against the float64 expectation or policy 0's y.
template <class T>
std::string check_y(const Fetched& got, const Fetched* ref, std::size_t i, const std::vector<Bounded>& y_exact) {
  const Expected e = expected<T>(ref, i, y_exact);
  return verify::check_within("y", got.as_double<T>(i), e.want, y_exact, storage_of<T>(), e.against);
}

template <class T>
struct TuneIO<DownGemvOp<T>> {
  using Op = DownGemvOp<T>;
  static constexpr FfnView kView = FfnView::kStage2;  // no header read; the GLU kernel stamps in the FFN
  static typename Op::Options options() { return ffn_options<Op>(); }
  //! W_down^T [N][K], magnitudes per output column; the selected rows are read.
  static std::vector<WeightSpec> weights(Shape s) {
    return {{elem_of<T>(), static_cast<std::size_t>(s.d_ff), static_cast<std::size_t>(s.d_model), -0.05f, 0.05f,
             Spread::kCols, true}};
  }

  Status init(Shape s, Buffers& b, cudaStream_t) {
    K_ = s.d_model;
    N_ = s.d_ff;
    PROX_RETURN_IF_ERROR(b.alloc(&s_, static_cast<std::size_t>(N_)));
    PROX_RETURN_IF_ERROR(b.alloc(&mask_, static_cast<std::size_t>(N_ / 32)));
    return b.alloc(&y_, static_cast<std::size_t>(K_));
  }
  Status set_density(double d, std::mt19937_64& rng, const HostSet& w, cudaStream_t stream) {
    const std::vector<float> s = uniform_vector<float>(N_, -1.0f, 1.0f, rng);
    const std::vector<std::uint8_t> selected = pick_flags(N_, d, rng);
    std::vector<Bounded> sb(s.size());
    for (std::size_t j = 0; j < s.size(); ++j) sb[j] = Bounded{s[j], 0.0};  // given exactly
    y_exact_ = down_expected<T>(sb, w.as<T>(0), K_, N_, selected);
    PROX_RETURN_IF_ERROR(upload(mask_, verify::flags_to_mask(selected), stream));
    return upload(s_, s, stream);
  }
  typename Op::Args args(const DeviceSet& w, bool) const {
    typename Op::Args a;
    a.s = s_;
    a.channel_mask = mask_;
    a.w_down_t = w.as<T>(0);
    a.d_model = K_;
    a.d_ff = N_;
    a.y = y_;
    return a;
  }
  std::vector<Output> outputs() const { return {{y_, sizeof(T) * static_cast<std::size_t>(K_)}}; }
  std::string check(const Fetched& got, const Fetched* ref) const { return check_y<T>(got, ref, 0, y_exact_); }

 private:
  int K_ = 0, N_ = 0;
  float* s_ = nullptr;
  std::uint32_t* mask_ = nullptr;
  T* y_ = nullptr;
  std::vector<Bounded> y_exact_;
};

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
