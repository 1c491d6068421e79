// SPDX-License-Identifier: Apache-2.0
//! @file io_glu_down.cuh  TuneIO of the fused Stage 2 (what SparseFfn runs by default): the GLU
//! GEMV's inputs and check of s (io_glu.cuh), plus W_down^T and y checked as the down GEMV's. Each
//! candidate runs cooperatively on the grid SparseFfn::plan gives it (GluDownGemvOp's default).
#pragma once

#include <prox/glu_down_gemv.cuh>

#include "io_down.cuh"
#include "io_glu.cuh"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

template <class T, class Act>
struct TuneIO<GluDownGemvOp<T, Act>> : TuneIO<GluGemvOp<T, Act>> {
  using Glu = TuneIO<GluGemvOp<T, Act>>;
  using Op = GluDownGemvOp<T, Act>;
  static constexpr FfnView kView = FfnView::kStage2Stamp;  // no header read; stamps the header
  static typename Op::Options options() { return ffn_options<Op>(); }  // grid_blocks 0: SMs x resident, as plan()
  //! W_gate, W_up (rotated together with) W_down^T [N][K], magnitudes per output column.
  static std::vector<WeightSpec> weights(Shape s) {
    std::vector<WeightSpec> w = Glu::weights(s);
    w.push_back(TuneIO<DownGemvOp<T>>::weights(s)[0]);
    return w;
  }

  Status init(Shape s, Buffers& b, cudaStream_t stream) {
    PROX_RETURN_IF_ERROR(Glu::init(s, b, stream));
    return b.alloc(&y_, static_cast<std::size_t>(s.d_model));
  }
  Status set_density(double d, std::mt19937_64& rng, const HostSet& w, cudaStream_t stream) {
    PROX_RETURN_IF_ERROR(Glu::set_density(d, rng, w, stream));
    y_exact_ = down_expected<T>(this->s_exact_, w.as<T>(2), this->K_, this->N_, this->selected_);
    return Status::kSuccess;
  }
  typename Op::Args args(const DeviceSet& w, bool verify) const {
    typename Op::Args a;
    static_cast<GluGemvArgs<T>&>(a) = Glu::args(w, verify);
    a.w_down_t = w.as<T>(2);
    a.y = y_;
    return a;
  }
  std::vector<Output> outputs() const {
    std::vector<Output> o = Glu::outputs();
    o.push_back({y_, sizeof(T) * static_cast<std::size_t>(this->K_)});
    return o;
  }
  std::string check(const Fetched& got, const Fetched* ref) const {
    const std::string why = this->check_s(got, ref, 0);
    return why.empty() ? check_y<T>(got, ref, 1, y_exact_) : why;
  }

 private:
  T* y_ = nullptr;
  std::vector<Bounded> y_exact_;
};

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
