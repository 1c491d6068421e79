// SPDX-License-Identifier: Apache-2.0
//! @file io_glu.cuh  TuneIO of the masked GLU GEMV (unfused Stage 2): rotated W_gate and W_up, a
//! random channel set at the density; s of the selected channels within its rounding bound, the
//! others exactly +0. The fused Stage 2's TuneIO (io_glu_down.cuh) builds on it.
#pragma once

#include <prox/glu_gemv.cuh>

#include "bench.cuh"
#include "reference.cuh"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

template <class T, class Act>
struct TuneIO<GluGemvOp<T, Act>> {
  using Op = GluGemvOp<T, Act>;
  static constexpr FfnView kView = FfnView::kStage2Stamp;  // no header read; stamps the header
  static typename Op::Options options() { return ffn_options<Op>(); }  // grid_blocks 0: one wave, as plan()
  //! W_gate and W_up [N][K], magnitudes per output channel; the selected rows are read.
  static std::vector<WeightSpec> weights(Shape s) {
    const WeightSpec w{elem_of<T>(),
                       static_cast<std::size_t>(s.d_ff),
                       static_cast<std::size_t>(s.d_model),
                       -0.05f,
                       0.05f,
                       Spread::kRows,
                       true};
    return {w, w};
  }

  Status init(Shape s, Buffers& b, cudaStream_t) {
    K_ = s.d_model;
    N_ = s.d_ff;
    PROX_RETURN_IF_ERROR(b.alloc(&x_, static_cast<std::size_t>(K_)));
    PROX_RETURN_IF_ERROR(b.alloc(&mask_, static_cast<std::size_t>(N_ / 32)));
    return b.alloc(&s_, static_cast<std::size_t>(N_));
  }
  Status set_density(double d, std::mt19937_64& rng, const HostSet& w, cudaStream_t stream) {
    const std::vector<T> x = uniform_vector<T>(K_, -1.0f, 1.0f, rng);
    selected_ = pick_flags(N_, d, rng);
    s_exact_ = glu_expected<T, Act>(x, w.as<T>(0), w.as<T>(1), K_, N_, selected_);
    PROX_RETURN_IF_ERROR(upload(mask_, verify::flags_to_mask(selected_), stream));
    return upload(x_, x, stream);
  }
  typename Op::Args args(const DeviceSet& w, bool) const {
    typename Op::Args a;
    a.x = x_;
    a.d_model = K_;
    a.d_ff = N_;
    a.w_gate = w.as<T>(0);
    a.w_up = w.as<T>(1);
    a.channel_mask = mask_;
    a.s = s_;
    return a;
  }
  std::vector<Output> outputs() const { return {{s_, sizeof(float) * static_cast<std::size_t>(N_)}}; }
  std::string check(const Fetched& got, const Fetched* ref) const { return check_s(got, ref, 0); }

 protected:
  //! Output `i` is s: selected channels within the bound, the others +0.
  std::string check_s(const Fetched& got, const Fetched* ref, std::size_t i) const {
    const std::string why = check_unselected_zero(got.as<float>(i), selected_);
    if (!why.empty()) return why;
    const Expected e = expected<float>(ref, i, s_exact_);
    return verify::check_within("s", got.as_double<float>(i), e.want, s_exact_, verify::Storage{}, e.against,
                                &selected_);
  }

  int K_ = 0, N_ = 0;
  T* x_ = nullptr;
  std::uint32_t* mask_ = nullptr;
  float* s_ = nullptr;
  std::vector<std::uint8_t> selected_;
  std::vector<Bounded> s_exact_;
};

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
