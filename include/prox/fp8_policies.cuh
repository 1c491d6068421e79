// SPDX-License-Identifier: Apache-2.0
//! @file fp8_policies.cuh  The candidate lists of the FP8 Stage-2 formats (fp8_weights.cuh), one
//! specialization per op family. Where a list is the native weights' (the same policy types), it shares their
//! name and their row of the tuning cache's policy table: the FP8 keys differ in their weights field only.
//! Batch 1 starts from the native lists with 16 weights per 16-byte piece (a GLU step then covers twice the
//! inputs, a down-GEMV thread 16 outputs); the fused lists were swept on the H100 (docs/benchmarks.md, "FP8
//! e4m3 Stage-2 weights"). Batched, the GLU runs on the tensor cores (glu_mma.cuh) but at capacity 2 on rows of
//! up to 4096 inputs; the batched down and fused lists are untuned starting points: one block of 256 threads per
//! SM (255 registers), since a thread holds twice the accumulators (down) of the native kernels, which run at 128
//! registers and 2 blocks.
#pragma once

#include "batched_down.cuh"
#include "batched_glu.cuh"
#include "batched_glu_down.cuh"
#include "core/config.hpp"
#include "core/policy.hpp"
#include "down_gemv.cuh"
#include "fp8_weights.cuh"
#include "glu_down_gemv.cuh"
#include "glu_gemv.cuh"
#include "glu_mma.cuh"
#include "proxy_gemv.cuh"

PROX_NAMESPACE_BEGIN

// ---------------------------------------------------------------- batch 1
//! GLU GEMV, both layouts: the native candidates (and their list's name). A block-scaled piece adds one
//! scale load and one multiply-add per 16 weights.
template <fp8::ScaleLayout L>
struct GluGemvPoliciesFor<Fp8Weights<L>> : GluGemvPoliciesFor<NativeWeights<__half>> {};

//! Down GEMV, per channel: the native candidates (256-column tiles of 16 threads x 16 columns).
template <>
struct DownGemvPoliciesFor<Fp8ChannelWeights> : DownGemvPoliciesFor<NativeWeights<__half>> {};
//! Down GEMV, 128 x 128 blocks: tiles of 128 columns (one column block, whose scale is folded into s_j), as
//! the native candidates 1 and 0 with the chunk of 2, and 64-column tiles (more blocks on small shapes).
using Fp8BlockDownGemvPolicies = PolicyList<DownGemvPolicy<256, 128, 512, 4, 3>, DownGemvPolicy<256, 128, 1024, 4, 3>,
                                            DownGemvPolicy<256, 64, 512, 4, 3>>;
template <>
struct DownGemvPoliciesFor<Fp8BlockWeights> {
  using type = Fp8BlockDownGemvPolicies;
  static constexpr const char* kName = "down_gemv_b128";
};

//! Fused Stage 2, per channel. With 16 weights a piece, a thread's GLU step holds twice the native x pieces:
//! the native candidates 1 and 2 (96 and 80 registers) spilled 8-24 bytes a thread (sm_90a, ptxas -v), so
//! these keep their shapes (320 threads: a 5120-wide row in one GLU step, a 4096-wide one too; 256: 4096)
//! with 2 down rows in flight where 4 spilled. No candidate spills or keeps a stack frame (ptxas -v, sm_90a).
//! Index 0 is what the plan picks on every Qwen3 shape (default_policy: the fewest GLU load slots, ties to
//! the lower index): measured on the H100 (prox_bench --prox_fp8_policies=0,1,2, docs/benchmarks.md), the
//! 320-thread candidate made the FFN fastest or within 1 % of it on Qwen3-8B, 14B and 32B at e = 40-70 %, and
//! 2-6 % faster than the 256-thread ones on 14B and 32B.
using Fp8ChannelGluDownGemvPolicies =
    PolicyList<GluDownGemvPolicy<320, 64, 2, 256, 1024, 2, 2>, GluDownGemvPolicy<256, 64, 4, 256, 1024, 4, 2>,
               GluDownGemvPolicy<256, 64, 2, 256, 1024, 2, 3>>;
template <>
struct GluDownGemvPoliciesFor<Fp8ChannelWeights> {
  using type = Fp8ChannelGluDownGemvPolicies;
  static constexpr const char* kName = "glu_down_gemv_fp8";
};
//! Fused Stage 2, 128 x 128 blocks: the per-channel shapes with 128-column down tasks (one column block,
//! whose scale is folded into s_j); none spills. The 320-thread candidate first, as per channel: on the H100
//! it made the FFN 3-8 % faster than the 256-thread ones on every Qwen3 shape at e = 40-70 %.
using Fp8BlockGluDownGemvPolicies =
    PolicyList<GluDownGemvPolicy<320, 64, 2, 128, 1024, 2, 2>, GluDownGemvPolicy<256, 64, 4, 128, 1024, 4, 2>,
               GluDownGemvPolicy<256, 64, 4, 128, 1024, 2, 2>>;
//! FP8 fused Stage 2: the candidate with the fewest GLU steps per row of d_model inputs, ties to the lower
//! index (the native rule counts load slots, so it would take a 256-thread candidate on d_model 4096, where
//! the 320-thread one was as fast per channel and 3.5 % faster with block scales: fp8_policies' lists above).
template <class T, class Act, fp8::ScaleLayout L>
int default_policy(GluDownGemvOp<T, Act, Fp8Weights<L>>, const DeviceInfo&,
                   const GluDownGemvArgs<T, Fp8Weights<L>>& a) noexcept {
  return detail::fewest_load_slots<typename GluDownGemvOp<T, Act, Fp8Weights<L>>::Policies>([&](auto p) {
    return static_cast<long>(detail::GluRowsOf<typename decltype(p)::Glu, T, Fp8Weights<L>>::steps_per_row(a.d_model));
  });
}
template <>
struct GluDownGemvPoliciesFor<Fp8BlockWeights> {
  using type = Fp8BlockGluDownGemvPolicies;
  static constexpr const char* kName = "glu_down_gemv_b128";
};

// ---------------------------------------------------------------- Stage 1 over FP8 codes (prox_alpha)
//! The FP8 input-sparse GEMV (ProxyGemvOp<T, Act, Fp8ProxyWeights>): the fp16 proxies' candidates (16 threads of
//! 16 channels cover a 256-channel tile) and 128-channel tiles.
using Fp8ProxyGemvPolicies = PolicyList<ProxyGemvPolicy<256, 256, 256, 4, 2>, ProxyGemvPolicy<256, 128, 256, 4, 2>>;
template <>
struct ProxyGemvPoliciesFor<Fp8ProxyWeights> {
  using type = Fp8ProxyGemvPolicies;
  static constexpr const char* kName = "proxy_gemv_fp8";
};

// ---------------------------------------------------------------- batched (CUDA cores; not tuned)
//! Batched GLU GEMV: the native CUDA-core shape at one block per SM, and the rows on the tensor cores (glu_mma.cuh,
//! 2 blocks of 256 threads; 64 rows a round at capacity 8, where 128 would take 66 KB of static shared memory).
template <int Tokens, fp8::ScaleLayout L>
struct BatchedGluPoliciesFor<Tokens, Fp8Weights<L>> {
  using type = PolicyList<BatchedGluPolicy<Tokens, 256, 64, 1>, BatchedGluMmaPolicy<Tokens, 256, Tokens == 8 ? 64 : 128, 2>>;
};
//! FP8 batched GLU: the tensor-core candidate (BatchedGluMmaPolicy, glu_mma.cuh), except at capacity 2 on rows of
//! up to 4096 inputs, which keep the CUDA cores. Measured on the H200 (prox_batch_bench, bf16, e = 40-70 %, both
//! scale layouts; docs/history.md): the tensor cores made the FFN 14-16 % faster at B = 4 and 36-40 % at B = 8 on
//! Qwen3-8B, 27-32 % and 48-52 % on 14B and 32B, and at B = 2 6-13 % faster on 14B and 32B but 1-4.5 % slower on 8B.
template <class T, class Act, int B, fp8::ScaleLayout L>
int default_policy(BatchedGluGemvOp<T, Act, B, Fp8Weights<L>>, const DeviceInfo&,
                   const BatchedGluGemvArgs<T, Fp8Weights<L>>& a) noexcept {
  int tc = -1;
  int cuda_cores = -1;
  for_each_policy<typename BatchedGluGemvOp<T, Act, B, Fp8Weights<L>>::Policies>([&](auto p, int i) {
    int& slot = detail::IsTensorCoreRows<decltype(p)>::value ? tc : cuda_cores;
    if (slot < 0) slot = i;
  });
  const bool keep_cuda_cores = B == 2 && a.d_model <= 4096;
  if (tc >= 0 && !(keep_cuda_cores && cuda_cores >= 0)) return tc;
  return cuda_cores >= 0 ? cuda_cores : 0;
}
//! Batched down GEMV: 128-column tiles (one column block) at one block per SM: at 2 blocks (128 registers) the
//! native candidates spilled with FP8's 16 outputs per thread and token (sm_90a, before TileReducer's halving
//! was unrolled at 2+ steps: 128-336 bytes of stack at capacities 2 and 4); the native chunks, and 2 rows in
//! flight at capacity 8.
template <int Tokens, fp8::ScaleLayout L>
struct BatchedDownPoliciesFor<Tokens, Fp8Weights<L>> {
  using type = PolicyList<BatchedDownPolicy<Tokens, 256, Tokens == 2 ? 2048 : 1024, Tokens == 8 ? 2 : 4, 1>,
                          BatchedDownPolicy<Tokens, 256, 512, Tokens == 8 ? 2 : 4, 1>>;
};
//! Fused batched Stage 2 (capacities 2 and 4): the native shape at one block per SM, 2 down rows in flight.
template <int Tokens, fp8::ScaleLayout L>
struct BatchedGluDownPoliciesFor<Tokens, Fp8Weights<L>> {
  using type = PolicyList<BatchedGluDownPolicy<Tokens, 256, 64, 2048, 2, 1>>;
};

PROX_NAMESPACE_END
