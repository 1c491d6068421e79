// SPDX-License-Identifier: Apache-2.0
//! @file workspace.cuh  The workspace contract of every prox op and of SparseFfn: layout, sizes,
//! initialization, sharing, and what happens on a workspace that was never initialized.
//!
//! Layout of a workspace (an op's or a SparseFfn's): a 256-byte header, then sync words, then scratch.
//!  - header   {magic, tag, status}: initialize_workspace() writes magic and tag 0; kernels read it
//!             after their PDL wait and OR a flag into `status` when the workspace is not ready.
//!  - sync     split-K tile counters and grid-barrier words: zero before a launch, left zero after it.
//!             Sized so that every policy of an op finds its counters at the same place
//!             (tile_counter_bytes), so one workspace serves every policy of a shape.
//!  - scratch  split-K partials: written before read inside one launch; no initial value needed.
//!
//! A workspace that was never initialized, holds garbage, or was last used at another shape must not
//! hang the GPU or give a silently wrong result. The header says which: a kernel that finds no magic
//! (or, in SparseFfn, another layout's tag) does not use the sync words: SparseFfn's Stage 1 selects
//! every channel (its Stage 2 then computes the exact dense FFN, so y is right), resets the sync words
//! and flags the header; SparseFfn's Stage 2 stamps the header with its layout's tag, so the next run
//! is sparse again. Ops launched on their own write NaN outputs and flag it instead. The flag is read
//! with read_workspace_status() and cleared by initialize_workspace().
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "config.hpp"
#include "math.hpp"
#include "status.hpp"

PROX_NAMESPACE_BEGIN

namespace detail {

//! Alignment of every region of a workspace (and of the workspace itself: 16 bytes suffice for the
//! kernels; 256 keeps regions on separate L2 sectors).
constexpr std::size_t kWorkspaceAlign = 256;
//! Bytes reserved for the header at the start of a workspace.
constexpr std::size_t kHeaderBytes = 256;
//! header[0] of an initialized workspace: bytes 0x5a, so that initialize_workspace() can write it
//! with cudaMemsetAsync (capturable, no kernel, no host buffer).
constexpr std::uint32_t kWorkspaceMagic = 0x5a5a5a5au;
//! header[2] bit: a kernel found the workspace not ready (no magic, or another layout's tag).
constexpr std::uint32_t kStatusDirty = 1u;

//! Word indices of the header.
enum HeaderWord : int { kHeaderMagic = 0, kHeaderTag = 1, kHeaderStatus = 2 };

//! Narrowest column tile any split-K policy may have (one 16-byte piece of 8 fp16/bf16 values).
constexpr int kMinTileWidth = 8;

/**
 * @brief Bytes of an op's split-K tile-counter region over `columns` output columns: a counter for every
 * kMinTileWidth columns, the finest tiling any policy can use, whatever the launching policy's tile.
 * Every policy of the op then finds its counters at the start of the same region and the partials
 * elsewhere, so one workspace serves every policy of an op and shape, each of which leaves its
 * counters zero. kTileWidth, the launching policy's tile, only checks that it is a multiple of
 * kMinTileWidth.
 */
template <int kTileWidth>
PROX_HOST_DEVICE constexpr std::size_t tile_counter_bytes(int columns) noexcept {
  static_assert(kTileWidth > 0 && kTileWidth % kMinTileWidth == 0, "tile narrower than the counter region allows");
  return round_up<std::size_t>(sizeof(unsigned) * static_cast<std::size_t>(ceil_div(columns, kMinTileWidth)),
                               kWorkspaceAlign);
}

//! The layout tag of a SparseFfn shape (never 0, which initialize_workspace() writes: "any layout").
constexpr std::uint32_t layout_tag(int d_model, int d_ff) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  const std::uint64_t v[2] = {static_cast<std::uint64_t>(static_cast<std::uint32_t>(d_model)),
                              static_cast<std::uint64_t>(static_cast<std::uint32_t>(d_ff))};
  for (std::uint64_t x : v) {
    for (int b = 0; b < 4; ++b) {
      h ^= (x >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  const std::uint32_t t = static_cast<std::uint32_t>(h ^ (h >> 32));
  return t == 0u ? 1u : t;
}

}  // namespace detail

//! What an op needs of a workspace, the same for every one of its policies.
struct WorkspaceNeeds {
  std::size_t sync = 0;     //!< counters and barrier words: zero before the first launch, left zero
  std::size_t scratch = 0;  //!< split-K partials: no initial value
};

/**
 * @brief How a kernel treats the workspace header (set by the planned op or SparseFfn, not by users).
 * Every pointer is into the caller's workspace; null disables that part.
 */
struct WorkspaceGuard {
  //! Header to check after the PDL wait: ready iff magic is there and the tag is 0 or `tag`. A kernel
  //! that finds it not ready ORs kStatusDirty into its status word and leaves the sync words alone.
  std::uint32_t* check = nullptr;
  std::uint32_t tag = 0;
  //! Sync words of the *next* kernel to zero when the check fails (SparseFfn's Stage 1 clears Stage 2's).
  std::uint32_t* reset = nullptr;
  int reset_words = 0;
  //! Header to stamp {magic, tag} after the PDL wait (SparseFfn's Stage 2: Stage 1's sync words are clean).
  std::uint32_t* stamp = nullptr;
};

//! An op's view of a workspace for one launch.
struct OpWorkspace {
  std::uint32_t* sync = nullptr;  //!< WorkspaceNeeds::sync bytes, 256-byte aligned
  void* scratch = nullptr;        //!< WorkspaceNeeds::scratch bytes, 256-byte aligned
  WorkspaceGuard guard{};
};

namespace detail {

//! Bytes of a workspace holding one op alone: header, sync words, scratch; 0 for an op that needs none.
constexpr std::size_t standalone_workspace_bytes(const WorkspaceNeeds& n) noexcept {
  if (n.sync == 0 && n.scratch == 0) return 0;
  return kHeaderBytes + round_up(n.sync, kWorkspaceAlign) + round_up(n.scratch, kWorkspaceAlign);
}

//! The view of an op's own workspace (standalone_workspace_bytes() bytes at `ws`): the header is
//! checked with tag 0 (initialize_workspace()), nothing is reset or stamped.
inline OpWorkspace standalone_view(void* ws, const WorkspaceNeeds& n) noexcept {
  char* base = static_cast<char*>(ws);
  OpWorkspace v;
  v.sync = reinterpret_cast<std::uint32_t*>(base + kHeaderBytes);
  v.scratch = base + kHeaderBytes + round_up(n.sync, kWorkspaceAlign);
  v.guard.check = static_cast<std::uint32_t*>(ws);
  return v;
}

#if defined(__CUDACC__)
//! Kernel side of WorkspaceGuard::check: true when the workspace is ready (read after pdl_wait()).
PROX_DEVICE PROX_FORCEINLINE bool workspace_ready(const WorkspaceGuard& g) {
  if (g.check == nullptr) return true;
  const std::uint32_t magic = __ldcg(g.check + kHeaderMagic);
  const std::uint32_t tag = __ldcg(g.check + kHeaderTag);
  return magic == kWorkspaceMagic && (tag == 0u || tag == g.tag);
}

//! Flag a workspace that was not ready (any thread; idempotent).
PROX_DEVICE PROX_FORCEINLINE void flag_dirty(const WorkspaceGuard& g) {
  if (g.check != nullptr) atomicOr(g.check + kHeaderStatus, kStatusDirty);
}

//! Zero words [0, n) of w with every thread of the grid (1D or 2D grids), each word once.
PROX_DEVICE PROX_FORCEINLINE void grid_zero(std::uint32_t* w, int n) {
  if (w == nullptr) return;
  const long long blocks = static_cast<long long>(gridDim.x) * gridDim.y;
  const long long block = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  for (long long i = block * blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) w[i] = 0u;
}

//! Stamp {magic, tag} into a header (one thread).
PROX_DEVICE PROX_FORCEINLINE void stamp_header(const WorkspaceGuard& g) {
  if (g.stamp == nullptr) return;
  g.stamp[kHeaderMagic] = kWorkspaceMagic;
  g.stamp[kHeaderTag] = g.tag;
}
#endif

}  // namespace detail

/**
 * @brief Initialize a workspace on `stream` before its first use: zero it and write the header's magic
 * (two cudaMemsetAsync; asynchronous and capturable). Also clears a flag read_workspace_status()
 * reports. A workspace once initialized serves every launch of an op at one shape with any of its
 * policies, and every SparseFfn of one (d_model, d_ff), fp16 and bf16 alike, any policies, fused
 * Stage 2 or not. Needs at least the 256-byte header.
 */
inline Status initialize_workspace(void* workspace, std::size_t bytes, cudaStream_t stream) noexcept {
  if (workspace == nullptr) return Status::kErrorNullPointer;
  if (bytes < detail::kHeaderBytes) return Status::kErrorWorkspaceTooSmall;
  if (!is_aligned(workspace, 16)) return Status::kErrorMisalignedPointer;
  if (cudaMemsetAsync(workspace, 0, bytes, stream) != cudaSuccess ||
      cudaMemsetAsync(workspace, 0x5a, sizeof(std::uint32_t), stream) != cudaSuccess)
    return Status::kErrorCudaRuntime;
  return Status::kSuccess;
}

/**
 * @brief Whether a kernel found this workspace not ready since its last initialize_workspace():
 * kErrorDirtyWorkspace if so (the run(s) flagged were exact-dense in SparseFfn, NaN in standalone
 * ops), else kSuccess. Not for the hot path: copies 16 bytes to the host and synchronizes `stream`.
 */
inline Status read_workspace_status(const void* workspace, cudaStream_t stream, Status* out) noexcept {
  if (workspace == nullptr || out == nullptr) return Status::kErrorNullPointer;
  std::uint32_t h[4] = {0, 0, 0, 0};
  if (cudaMemcpyAsync(h, workspace, sizeof(h), cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    return Status::kErrorCudaRuntime;
  *out = (h[detail::kHeaderStatus] & detail::kStatusDirty) != 0u ? Status::kErrorDirtyWorkspace : Status::kSuccess;
  return Status::kSuccess;
}

PROX_NAMESPACE_END
