// SPDX-License-Identifier: Apache-2.0
//! @file io_proxy.cuh  TuneIO of Stage 1, the proxy GEMV (INT4 or fp16/bf16 proxies): rotated gate
//! and up proxies; the checked launch writes s~ (values mode) and the channel mask, the timed ones
//! the mask only, as SparseFfn runs it. tau_s is the median |s~|, so the mask sees both outcomes.
#pragma once

#include <algorithm>
#include <type_traits>

#include <prox/int4.cuh>
#include <prox/int4_format.hpp>
#include <prox/proxy_gemv.cuh>

#include "bench.cuh"
#include "reference.cuh"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

//! The element type of fp16/bf16 proxy weights (void for INT4).
template <class Fmt>
struct ProxyElement {
  using type = void;
};
template <class W>
struct ProxyElement<DenseWeights<W>> {
  using type = W;
};

template <class T, class Act, class Fmt>
struct TuneIO<ProxyGemvOp<T, Act, Fmt>> {
  using Op = ProxyGemvOp<T, Act, Fmt>;
  static constexpr bool kInt4 = std::is_same<Fmt, Int4Weights>::value;
  using W = typename ProxyElement<Fmt>::type;
  static_assert(!kInt4 || Int4Weights::kMaxStepRows == verify::kInt4StepRows, "verify.hpp's INT4 step model");

  static constexpr FfnView kView = FfnView::kChecked;  // the kernel reads the header
  static typename Op::Options options() { return ffn_options<Op>(); }
  //! gate and up: INT4 words [K][N/8] with per-channel scales (INT4 weights of magnitude ~0.02:
  //! amax / 7), or fp16/bf16 [K][N]; the kept rows are read.
  static std::vector<WeightSpec> weights(Shape s) {
    const std::size_t K = static_cast<std::size_t>(s.d_model), N = static_cast<std::size_t>(s.d_ff);
    if constexpr (kInt4) {
      const WeightSpec q{Elem::kBits32, K, N / int4::kChannelsPerWord, 0.0f, 0.0f, Spread::kNone, true};
      const WeightSpec sc{Elem::kF32, 1, N, 0.001f, 0.004f, Spread::kCols, false};
      return {q, q, sc, sc};
    } else {
      const WeightSpec w{elem_of<W>(), K, N, -1.0f, 1.0f, Spread::kCols, true};
      return {w, w};
    }
  }

  Status init(Shape s, Buffers& b, cudaStream_t) {
    K_ = s.d_model;
    N_ = s.d_ff;
    PROX_RETURN_IF_ERROR(b.alloc(&x_, static_cast<std::size_t>(K_)));
    PROX_RETURN_IF_ERROR(b.alloc(&mask_, static_cast<std::size_t>(N_ / 32)));
    return b.alloc(&s_, static_cast<std::size_t>(N_));
  }

  Status set_density(double d, std::mt19937_64& rng, const HostSet& w, cudaStream_t stream) {
    const std::vector<T> x = make_input<T>(K_, d, rng);
    std::vector<int> kept;
    for (int k = 0; k < K_; ++k)
      if (keep_magnitude(static_cast<float>(host_to_double(x[static_cast<std::size_t>(k)])), kInputTau))
        kept.push_back(k);
    const auto q = [&](int m, int k, std::size_t j) -> double {
      if constexpr (kInt4) {
        return int4::unpack_host(w.as<std::uint32_t>(m), N_, k, static_cast<int>(j));
      } else {
        return host_to_double(w.as<W>(static_cast<std::size_t>(m))[static_cast<std::size_t>(k) * N_ + j]);
      }
    };
    const auto scale = [&](int m, std::size_t j) -> double {
      return kInt4 ? static_cast<double>(w.as<float>(2 + m)[j]) : 1.0;
    };
    exact_ = stage1_expected<T, Act>(x, kept, N_, kInt4, q, scale);
    std::vector<double> mag(exact_.size());
    for (std::size_t j = 0; j < mag.size(); ++j) mag[j] = std::fabs(exact_[j].v);
    std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(mag.size() / 2), mag.end());
    tau_s_ = static_cast<float>(mag[mag.size() / 2]);
    std::vector<std::uint8_t> sel(exact_.size());
    for (std::size_t j = 0; j < sel.size(); ++j) sel[j] = std::fabs(exact_[j].v) >= static_cast<double>(tau_s_);
    want_mask_ = verify::flags_to_mask(sel);
    return upload(x_, x, stream);
  }

  typename Op::Args args(const DeviceSet& w, bool verify) const {
    typename Op::Args a;
    a.x = x_;
    a.d_model = K_;
    a.d_ff = N_;
    a.tau_x = kInputTau;
    a.tau_s = tau_s_;
    if constexpr (kInt4) {
      a.gate = {w.as<std::uint32_t>(0), w.as<float>(2)};
      a.up = {w.as<std::uint32_t>(1), w.as<float>(3)};
    } else {
      a.gate.w = w.as<W>(0);
      a.up.w = w.as<W>(1);
    }
    a.channel_mask = mask_;
    a.s_proxy = verify ? s_ : nullptr;
    return a;
  }
  std::vector<Output> outputs() const {
    return {{s_, sizeof(float) * static_cast<std::size_t>(N_)}, {mask_, sizeof(std::uint32_t) * (N_ / 32)}};
  }
  std::string check(const Fetched& got, const Fetched* ref) const {
    const Expected e = expected<float>(ref, 0, exact_);
    std::string why = verify::check_within("s~", got.as_double<float>(0), e.want, exact_, verify::Storage{}, e.against);
    if (why.empty())
      why = verify::check_mask(got.as<std::uint32_t>(1), ref == nullptr ? want_mask_ : ref->as<std::uint32_t>(1),
                               e.want, exact_, tau_s_, e.against);
    return why;
  }

 private:
  int K_ = 0, N_ = 0;
  float tau_s_ = 0.0f;
  T* x_ = nullptr;
  std::uint32_t* mask_ = nullptr;
  float* s_ = nullptr;
  std::vector<Bounded> exact_;
  std::vector<std::uint32_t> want_mask_;
};

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
