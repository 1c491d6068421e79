// SPDX-License-Identifier: Apache-2.0
//! @file shape.hpp  The two FFN shape rules of prox and the batch's token capacities, in one place (ops, driver,
//! packer, tuner).
#pragma once

#include "config.hpp"
#include "status.hpp"

PROX_NAMESPACE_BEGIN

//! Largest d_model and d_ff prox accepts (32-bit indexing with room to spare).
constexpr int kMaxFfnDim = 1 << 20;

/**
 * @brief Stage-1 / INT4 proxy rule: 1 <= d_model <= 2^20; d_ff a multiple of 32 in [32, 2^20]
 * (the proxy GEMV reads whole 32-channel mask words and 16-channel INT4 pieces).
 */
constexpr Status check_proxy_shape(int d_model, int d_ff) noexcept {
  if (d_model < 1 || d_model > kMaxFfnDim || d_ff < 32 || d_ff > kMaxFfnDim || d_ff % 32 != 0)
    return Status::kErrorInvalidShape;
  return Status::kSuccess;
}

/**
 * @brief Stage-2 and full-FFN rule: the Stage-1 rule, and d_model a multiple of 8 (16-byte pieces
 * of fp16/bf16 rows of d_model elements).
 */
constexpr Status check_ffn_shape(int d_model, int d_ff) noexcept {
  if (d_model < 8 || d_model % 8 != 0) return Status::kErrorInvalidShape;
  return check_proxy_shape(d_model, d_ff);
}

//! Most tokens one batched call takes (SparseFfn::run_batch, the batched ops).
constexpr int kMaxBatchTokens = 8;

//! The compiled token capacity that serves `tokens` (2..8): 2, 4 or 8.
constexpr int batch_capacity(int tokens) noexcept { return tokens <= 2 ? 2 : tokens <= 4 ? 4 : 8; }

PROX_NAMESPACE_END
