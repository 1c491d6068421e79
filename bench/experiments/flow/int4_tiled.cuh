// SPDX-License-Identifier: Apache-2.0
//! @file int4_tiled.cuh  (experiment, issue 46; not part of the library) The INT4 proxies in channel tiles (layout `prox-int4-tiled64-i8-v1`): the words of
//! layout v1 (int4_format.hpp: the same quantization, nibbles and words) rearranged so that the rows of one
//! tile of 64 channels are adjacent, and the host and device rearrangements from v1.
//!
//!   v1      packed [d_model][d_ff / 8]              row k: every channel of input k (d_ff / 2 bytes)
//!   tiled   packed [d_ff / 64][d_model][8]          tile t, row k: channels 64 t .. 64 t + 63 of input k (32 bytes)
//!           word (t, k, w) = v1 word (k, 8 t + w)
//!
//! Why: the one-kernel FFN (flow_ffn.cuh) has each block compute whole proxy dot products of a tile of 64
//! channels, so that no block waits on another to know its channels. In v1 a tile's piece of a kept row is 32
//! bytes d_ff / 2 bytes away from the next one, one DRAM sector each (a narrow-tile Stage 1 on v1 measured
//! 1.8x slower, docs/history.md); here a tile's rows are one contiguous 128-160 KB run, so at s1 = 0 it streams
//! like a copy and at s1 = 70 % each kept row is still one whole sector of gate and one of up.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <prox/core/config.hpp>
#include <prox/core/launch.cuh>
#include <prox/core/math.hpp>
#include <prox/core/status.hpp>
#include <prox/int4.cuh>
#include <prox/int4_format.hpp>

namespace prox_flow {
using namespace prox;


namespace tiled {

//! Layout tag of tiled proxies (store it next to them); the words are v1's (kLayoutVersion).
constexpr const char* kTiledLayoutTag = "prox-int4-tiled64-i8-v1";
//! Channels of one tile, and 32-bit words of one tile row (32 bytes: one DRAM sector).
constexpr int kTileChannels = 64;
constexpr int kTileWords = kTileChannels / prox::int4::kChannelsPerWord;

//! Shape rule of tiled proxies: the v1 rule (check_pack_shape) and d_ff a multiple of 64.
constexpr Status check_tiled_shape(int d_model, int d_ff) noexcept {
  const Status s = prox::int4::check_pack_shape(d_model, d_ff);
  return s != Status::kSuccess ? s : d_ff % kTileChannels != 0 ? Status::kErrorInvalidShape : Status::kSuccess;
}

//! Index of v1 word (k, w) in the tiled layout (the same number of words: prox::int4::packed_words()).
PROX_HOST_DEVICE constexpr std::size_t tiled_index(int d_model, int k, int w) noexcept {
  return (static_cast<std::size_t>(w / kTileWords) * static_cast<std::size_t>(d_model) + static_cast<std::size_t>(k)) *
             kTileWords +
         static_cast<std::size_t>(w % kTileWords);
}

/**
 * @brief Rearrange a v1 matrix (pack_host's output) into the tiled layout, on the host. `kmajor` and `tiled`
 * must not overlap.
 * @return kErrorNullPointer, or kErrorInvalidShape (check_tiled_shape).
 */
inline Status tile_host(const std::uint32_t* kmajor, int d_model, int d_ff, std::uint32_t* tiled) noexcept {
  if (kmajor == nullptr || tiled == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_tiled_shape(d_model, d_ff));
  const int words = d_ff / prox::int4::kChannelsPerWord;
  for (int k = 0; k < d_model; ++k)
    for (int w = 0; w < words; ++w)
      tiled[tiled_index(d_model, k, w)] = kmajor[static_cast<std::size_t>(k) * static_cast<std::size_t>(words) + w];
  return Status::kSuccess;
}

#if defined(__CUDACC__)
namespace tiled_detail {
//! One thread per word, reading v1 in order (coalesced) and writing 32-byte runs.
PROX_KERNEL void tile_kernel(const std::uint32_t* __restrict__ kmajor, int d_model, int d_ff,
                             std::uint32_t* __restrict__ tiled) {
  const int words = d_ff / prox::int4::kChannelsPerWord;
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::size_t>(d_model) * static_cast<std::size_t>(words)) return;
  tiled[tiled_index(d_model, static_cast<int>(i / words), static_cast<int>(i % words))] = kmajor[i];
}
}  // namespace tiled_detail

/**
 * @brief tile_host on the device (bit-identical), on `stream`; offline (not graph-safe by intent, but it
 * neither synchronizes nor allocates). Both pointers 4-byte aligned, not overlapping.
 */
inline Status tile_device(const std::uint32_t* kmajor, int d_model, int d_ff, std::uint32_t* tiled,
                          cudaStream_t stream) noexcept {
  if (kmajor == nullptr || tiled == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_tiled_shape(d_model, d_ff));
  if (!is_aligned(kmajor, 4) || !is_aligned(tiled, 4)) return Status::kErrorMisalignedPointer;
  constexpr int kThreads = 256;
  const std::size_t n = prox::int4::packed_words(d_model, d_ff);
  const LaunchConfig lc = plain_launch(dim3(static_cast<unsigned>((n + kThreads - 1) / kThreads)), dim3(kThreads));
  return prox::detail::launch_kernel(tiled_detail::tile_kernel, lc, stream, kmajor, d_model, d_ff, tiled);
}
#endif

}  // namespace tiled

/**
 * @brief INT4 proxies in the tiled layout, as the one-kernel FFN reads them: the same words, scales and
 * dequantization as Int4Weights (whose fma_step it uses), rows of a 64-channel tile adjacent.
 */
struct Int4TiledWeights {
  static constexpr const char* kName = "int4_tiled64";
  static constexpr const char* kKeyName = "int4t64v1";
  using Matrix = Int4Weights::Matrix;  //!< {packed (tiled layout), scales [d_ff]}
  static constexpr bool kNeedsScales = true;
  //! Bytes of one tile row (gate or up) and of one tile (d_model rows).
  static constexpr int kRowBytes = tiled::kTileWords * 4;
  PROX_HOST_DEVICE static constexpr std::size_t tile_bytes(int d_model) noexcept {
    return static_cast<std::size_t>(d_model) * kRowBytes;
  }
  PROX_HOST_DEVICE static const void* data(const Matrix& m) noexcept { return m.packed; }
};

}  // namespace prox_flow
