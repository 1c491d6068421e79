// SPDX-License-Identifier: Apache-2.0
//! @file workspace.cuh  The workspace contract of every prox op and of SparseFfn: layout, sizes,
//! initialization, sharing, and what happens on a workspace that was never initialized.
//!
//! Layout of a workspace (an op's or a SparseFfn's): a header, then sync words, then scratch.
//!  - header   kHeaderCopies copies of {magic, tag}, one per 256 bytes (every block of a grid reads one,
//!             so that a few hundred blocks do not all queue on one L2 line), then a status word.
//!             initialize_workspace() writes every copy as {magic, kTagAny}; kernels read a copy after
//!             their PDL wait and OR a flag into `status` when the workspace is not ready.
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
#include <initializer_list>

#include "config.hpp"
#include "math.hpp"
#include "status.hpp"

PROX_NAMESPACE_BEGIN

namespace detail {

//! Alignment of every region of a workspace (and of the workspace itself: 16 bytes suffice for the
//! kernels; 256 keeps regions on separate L2 sectors).
constexpr std::size_t kWorkspaceAlign = 256;
//! Copies of {magic, tag} in the header, kHeaderStride bytes apart. One copy read by every block of a
//! 680-block Stage 1 cost it 0.3 us on the H100 (the requests queue on one L2 line); 16 copies on
//! separate lines spread them.
constexpr int kHeaderCopies = 16;
constexpr std::size_t kHeaderStride = 256;
//! Byte offset of the status word (after the copies, a line of its own).
constexpr std::size_t kHeaderStatusOffset = kHeaderCopies * kHeaderStride;
//! Bytes reserved for the header at the start of a workspace.
constexpr std::size_t kHeaderBytes = kHeaderStatusOffset + 256;
//! The magic word of a ready header copy, and the tag initialize_workspace() writes ("any layout"):
//! bytes 0x5a, so that one cudaMemsetAsync writes every copy (capturable, no kernel, no host buffer).
constexpr std::uint32_t kWorkspaceMagic = 0x5a5a5a5au;
constexpr std::uint32_t kTagAny = 0x5a5a5a5au;
//! Status bit: a kernel found the workspace not ready (no magic, or another layout's tag).
constexpr std::uint32_t kStatusDirty = 1u;

//! Word indices within a header copy.
enum HeaderWord : int { kHeaderMagic = 0, kHeaderTag = 1 };
//! Word index of a header's status word.
constexpr int kHeaderStatusWord = static_cast<int>(kHeaderStatusOffset / sizeof(std::uint32_t));

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

//! The layout tag of a SparseFfn shape (never kTagAny, which initialize_workspace() writes).
constexpr std::uint32_t layout_tag(int d_model, int d_ff) noexcept {
  std::uint64_t h = kFnv1aBasis;  // over the 4 little-endian bytes of d_model, then of d_ff
  for (const std::uint32_t x : {static_cast<std::uint32_t>(d_model), static_cast<std::uint32_t>(d_ff)})
    for (int b = 0; b < 4; ++b) h = fnv1a64_step(h, static_cast<unsigned char>(x >> (8 * b)));
  const std::uint32_t t = static_cast<std::uint32_t>(h ^ (h >> 32));
  return t == kTagAny ? kTagAny + 1u : t;
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
  //! Header to check after the PDL wait: ready iff the copy a block reads holds the magic and the tag
  //! kTagAny or `tag`. A kernel that finds it not ready ORs kStatusDirty into the header's status
  //! word and leaves the sync words alone.
  std::uint32_t* check = nullptr;
  std::uint32_t tag = 0;
  //! Sync words of the *next* kernel to zero when the check fails (SparseFfn's Stage 1 clears Stage 2's).
  std::uint32_t* reset = nullptr;
  int reset_words = 0;
  //! Header to stamp {magic, tag} (every copy) after the PDL wait (SparseFfn's Stage 2: Stage 1's sync
  //! words are clean).
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
//! checked with kTagAny (initialize_workspace()), nothing is reset or stamped.
inline OpWorkspace standalone_view(void* ws, const WorkspaceNeeds& n) noexcept {
  char* base = static_cast<char*>(ws);
  OpWorkspace v;
  v.sync = reinterpret_cast<std::uint32_t*>(base + kHeaderBytes);
  v.scratch = base + kHeaderBytes + round_up(n.sync, kWorkspaceAlign);
  v.guard.check = static_cast<std::uint32_t*>(ws);
  v.guard.tag = kTagAny;
  return v;
}

//! The caller's workspace for a launch that needs `need` bytes: non-null, large enough, 16-byte aligned.
inline Status check_workspace(const void* ws, std::size_t have, std::size_t need) noexcept {
  if (ws == nullptr) return Status::kErrorNullPointer;
  if (have < need) return Status::kErrorWorkspaceTooSmall;
  return is_aligned(ws, 16) ? Status::kSuccess : Status::kErrorMisalignedPointer;
}

#if defined(__CUDACC__)
//! The header words a kernel checks, loaded by workspace_header() and judged by workspace_ready().
struct HeaderWords {
  std::uint32_t magic = kWorkspaceMagic;  //!< defaults: a ready header (what a kernel with no check sees)
  std::uint32_t tag = kTagAny;
};

/**
 * @brief Issue the loads of one copy of WorkspaceGuard::check's header words (copy `copy` mod
 * kHeaderCopies; after pdl_wait()); without a header to check, the words of a ready one. Split from workspace_ready() so that a kernel issues the loads with
 * its first loads and judges them after its first barrier: judged inside the load's branch, the
 * compare made every thread wait for the header before it could issue its x loads, one more dependent
 * L2 round trip (Stage 1 was 0.8 us slower on every Qwen3 shape, H100).
 */
PROX_DEVICE PROX_FORCEINLINE HeaderWords workspace_header(const WorkspaceGuard& g, unsigned copy = 0) {
  HeaderWords h;
  if (g.check != nullptr) {
    const std::uint32_t* c = g.check + (copy % kHeaderCopies) * (kHeaderStride / sizeof(std::uint32_t));
    h.magic = __ldcg(c + kHeaderMagic);
    h.tag = __ldcg(c + kHeaderTag);
  }
  return h;
}

//! Kernel side of WorkspaceGuard::check: the workspace is ready (magic there, tag kTagAny or the guard's).
PROX_DEVICE PROX_FORCEINLINE bool workspace_ready(const HeaderWords& h, const WorkspaceGuard& g) {
  return h.magic == kWorkspaceMagic && (h.tag == kTagAny || h.tag == g.tag);
}

//! workspace_header() and workspace_ready() at once, where the latency does not matter (or no check).
PROX_DEVICE PROX_FORCEINLINE bool workspace_ready(const WorkspaceGuard& g) {
  return workspace_ready(workspace_header(g), g);
}

//! Flag a workspace that was not ready (any thread; idempotent).
PROX_DEVICE PROX_FORCEINLINE void flag_dirty(const WorkspaceGuard& g) {
  if (g.check != nullptr) atomicOr(g.check + kHeaderStatusWord, kStatusDirty);
}

//! Zero words [0, n) of w with every thread of the grid (1D or 2D grids), each word once.
PROX_DEVICE PROX_FORCEINLINE void grid_zero(std::uint32_t* w, int n) {
  if (w == nullptr) return;
  const long long blocks = static_cast<long long>(gridDim.x) * gridDim.y;
  const long long block = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  for (long long i = block * blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) w[i] = 0u;
}

//! Stamp {magic, tag} into every copy of a header (call from threads 0..kHeaderCopies-1 of one block).
PROX_DEVICE PROX_FORCEINLINE void stamp_header(const WorkspaceGuard& g, unsigned copy) {
  if (g.stamp == nullptr || copy >= static_cast<unsigned>(kHeaderCopies)) return;
  std::uint32_t* c = g.stamp + copy * (kHeaderStride / sizeof(std::uint32_t));
  c[kHeaderMagic] = kWorkspaceMagic;
  c[kHeaderTag] = g.tag;
}
#endif

}  // namespace detail

/**
 * @brief Initialize a workspace on `stream` before its first use: zero it and write the header's magic
 * (two cudaMemsetAsync; asynchronous and capturable). Also clears a flag read_workspace_status()
 * reports. A workspace once initialized serves every launch of an op at one shape with any of its
 * policies, and every SparseFfn of one (d_model, d_ff), fp16 and bf16 alike, any policies, fused
 * Stage 2 or not. Needs at least the header (detail::kHeaderBytes).
 */
inline Status initialize_workspace(void* workspace, std::size_t bytes, cudaStream_t stream) noexcept {
  PROX_RETURN_IF_ERROR(detail::check_workspace(workspace, bytes, detail::kHeaderBytes));
  // Everything zero, then every header copy {magic, kTagAny} (bytes 0x5a up to the status word).
  if (cudaMemsetAsync(workspace, 0, bytes, stream) != cudaSuccess ||
      cudaMemsetAsync(workspace, 0x5a, detail::kHeaderStatusOffset, stream) != cudaSuccess)
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
  std::uint32_t status = 0;
  if (cudaMemcpyAsync(&status, static_cast<const char*>(workspace) + detail::kHeaderStatusOffset, sizeof(status),
                      cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    return Status::kErrorCudaRuntime;
  *out = (status & detail::kStatusDirty) != 0u ? Status::kErrorDirtyWorkspace : Status::kSuccess;
  return Status::kSuccess;
}

PROX_NAMESPACE_END
