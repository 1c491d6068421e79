// SPDX-License-Identifier: Apache-2.0
//! @file fp8.cuh  FP8 e4m3 Stage-2 weights on the device: the register conversions a GEMV inner loop
//! uses (L1), and the offline helpers, each next to its host twin where it has one: quantization,
//! the W_down transpose with its scales, INT4 proxies from FP8 weights, scale checks. The format,
//! the shared arithmetic and the other host helpers are in fp8_format.hpp.
//!
//! Conversion: e4m3 -> fp16 is exact (every e4m3 value is an fp16 value), so e4m3x2 -> f16x2 -> fp32
//! is exact too; bf16 activations use the same fp32 values (an e4m3 value is also exactly a bf16, but
//! PTX converts e4m3 pairs to f16x2 only: PTX ISA 9.0 has no bf16x2 form). sm_89 and newer (Ada, Hopper)
//! convert a pair in one instruction, cvt.rn.f16x2.e4m3x2 (SASS F2FP ... UNPACK_B), emitted by
//! cuda_fp8.h's __nv_cvt_fp8x2_to_halfraw2. Older devices (sm_80) run an emulation that gives the same
//! values (e4m3x2_to_half2_emulated).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/config.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"
#include "core/warp.cuh"
#include "fp8_format.hpp"
#include "int4.cuh"
#include "layout.cuh"

PROX_NAMESPACE_BEGIN

namespace fp8 {

namespace detail {
//! The checks the two W_down transposes share.
inline Status check_transpose_args(const std::uint8_t* q_down, const float* scales, int d_model, int d_ff,
                                   ScaleLayout layout, const std::uint8_t* q_down_t, const float* scales_t) {
  if (q_down == nullptr || scales == nullptr || q_down_t == nullptr || scales_t == nullptr)
    return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_matrix_shape(d_model, d_ff));
  if (!is_valid(layout)) return Status::kErrorInvalidArgument;
  // Not in place: the matrix is not square in general; block scales neither. Per-channel scales may stay put.
  if (q_down == q_down_t || (layout == ScaleLayout::kBlock128 && scales == scales_t))
    return Status::kErrorInvalidArgument;
  return Status::kSuccess;
}
}  // namespace detail

/**
 * @brief W_down^T and its scales from an FP8 nn.Linear W_down, on the host. Bit-identical to
 * transpose_down_device.
 *   - q: W_down [d_model][d_ff] (kOutIn) -> W_down^T [d_ff][d_model] (kInOut), codes unchanged.
 *   - kPerChannel: one scale per output d; they stay per column d of W_down^T, the same [d_model]
 *     array (copied unless scales_t == scales).
 *   - kBlock128: [ceil(d_model/128)][ceil(d_ff/128)] -> [ceil(d_ff/128)][ceil(d_model/128)], transposed.
 * @return kErrorNullPointer, kErrorInvalidShape (check_matrix_shape), kErrorInvalidArgument (layout,
 *         or q_down_t == q_down, or block scales in place).
 * @code
 * std::vector<std::uint8_t> qt(q.size());
 * std::vector<float> st(s.size());
 * PROX_CHECK(prox::fp8::transpose_down_host(q.data(), s.data(), d_model, d_ff, ScaleLayout::kBlock128,
 *                                           qt.data(), st.data()));
 * @endcode
 */
inline Status transpose_down_host(const std::uint8_t* q_down, const float* scales, int d_model, int d_ff,
                                  ScaleLayout layout, std::uint8_t* q_down_t, float* scales_t) {
  PROX_RETURN_IF_ERROR(detail::check_transpose_args(q_down, scales, d_model, d_ff, layout, q_down_t, scales_t));
  PROX_RETURN_IF_ERROR(transpose_host(q_down, d_model, d_ff, q_down_t));
  if (layout == ScaleLayout::kBlock128)
    return transpose_host(scales, scale_blocks(d_model), scale_blocks(d_ff), scales_t);
  if (scales_t != scales) std::memcpy(scales_t, scales, sizeof(float) * static_cast<std::size_t>(d_model));
  return Status::kSuccess;
}

#if defined(__CUDACC__)

// ---------------------------------------------------------------- register conversions (L1)

/**
 * @brief Emulated e4m3 pair -> f16x2 for devices without the instruction (below sm_89); any
 * architecture may call it (the tests do, on sm_90). Same values as the instruction.
 * @param u  the two codes spread over the halves: code i in bits [8, 16) of half i, zeros below
 *           (`__byte_perm(w, 0, 0x1404)` spreads bytes 0, 1 of w; 0x3424 bytes 2, 3).
 *
 * Why it is exact: an e4m3 code's exponent and mantissa fields, moved into fp16's (sign to bit 15,
 * the 7 other bits to bits [7, 14)), read as an fp16 whose value is the e4m3 value times 2^-8
 * (biases 7 and 15), subnormals included; one HMUL2 by 2^8 is exact (Marlin's FP8 dequant does
 * the same). The NaN codes S.1111.111 come out of that as +-480: they become 0x7FFF, cuda_fp8.h's NaN.
 */
PROX_DEVICE PROX_FORCEINLINE __half2 e4m3x2_spread_to_half2_emulated(std::uint32_t u) {
  const std::uint32_t h = (u & 0x80008000u) | ((u >> 1) & 0x3F803F80u);
  const std::uint32_t r = pair_bits(__hmul2(as_pair<__half>(h), as_pair<__half>(0x5C005C00u)));  // x 256
  // Per half: bit 15 set iff the 7 low bits of the code are all ones (0x7F00 + 0x0100 = 0x8000).
  const std::uint32_t nan = ((u & 0x7F007F00u) + 0x01000100u) & 0x80008000u;
  const std::uint32_t mask = nan | (nan - (nan >> 15));  // 0xFFFF in each NaN half
  return as_pair<__half>((r & ~mask) | (0x7FFF7FFFu & mask));
}

/**
 * @brief Emulated conversion of two e4m3 codes (bits [0, 8): element 0, [8, 16): element 1; the
 * upper bits are ignored) to f16x2 (element 0 in the low half). Exact.
 */
PROX_DEVICE PROX_FORCEINLINE __half2 e4m3x2_to_half2_emulated(std::uint32_t pair) {
  return e4m3x2_spread_to_half2_emulated(__byte_perm(pair, 0u, 0x1404u));
}

/**
 * @brief Two e4m3 codes (bits [0, 8): element 0, [8, 16): element 1) to f16x2, exactly: one
 * cvt.rn.f16x2.e4m3x2 on sm_89+, e4m3x2_to_half2_emulated below. NaN codes give a NaN.
 * @code
 * const __half2 h = prox::fp8::e4m3x2_to_half2(word & 0xFFFFu);   // elements 0, 1 of a word
 * const float2 f = __half22float2(h);                              // exact
 * @endcode
 */
PROX_DEVICE PROX_FORCEINLINE __half2 e4m3x2_to_half2(std::uint32_t pair) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  return __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3));
#else
  return e4m3x2_to_half2_emulated(pair);
#endif
}

//! Two e4m3 codes (as e4m3x2_to_half2) to two exact floats.
PROX_DEVICE PROX_FORCEINLINE float2 e4m3x2_to_float2(std::uint32_t pair) {
  return __half22float2(e4m3x2_to_half2(pair));
}

//! Four e4m3 codes of one 32-bit word (byte i = element i) to f16x2 (elements 0, 1) and (2, 3), emulated.
PROX_DEVICE PROX_FORCEINLINE void e4m3x4_to_half2_emulated(std::uint32_t w, __half2& lo, __half2& hi) {
  lo = e4m3x2_spread_to_half2_emulated(__byte_perm(w, 0u, 0x1404u));
  hi = e4m3x2_spread_to_half2_emulated(__byte_perm(w, 0u, 0x3424u));
}

//! Four e4m3 codes of one 32-bit word (byte i = element i) to f16x2 (elements 0, 1) and (2, 3).
PROX_DEVICE PROX_FORCEINLINE void e4m3x4_to_half2(std::uint32_t w, __half2& lo, __half2& hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  lo = e4m3x2_to_half2(w & 0xFFFFu);
  hi = e4m3x2_to_half2(w >> 16);
#else
  e4m3x4_to_half2_emulated(w, lo, hi);
#endif
}

/**
 * @brief Dequantize one 16-byte piece (16 e4m3 codes, element j in byte j of the little-endian
 * uint4, as one LDG.128 of a row returns it) into 8 f16 pairs (h[i] = elements 2i, 2i+1), exactly;
 * no scale applied. sm_90a SASS: 8 F2FP.F16.E4M3.UNPACK_B and 4 shifts (the high pair of each word).
 * @code
 * const uint4 v = prox::ld_stream_16(row + k);   // 16 weights of one row, k a multiple of 16
 * __half2 h[8];
 * prox::fp8::dequant16(v, h);
 * @endcode
 */
PROX_DEVICE PROX_FORCEINLINE void dequant16(uint4 v, __half2 (&h)[8]) {
  e4m3x4_to_half2(v.x, h[0], h[1]);
  e4m3x4_to_half2(v.y, h[2], h[3]);
  e4m3x4_to_half2(v.z, h[4], h[5]);
  e4m3x4_to_half2(v.w, h[6], h[7]);
}

/**
 * @brief Dequantize one 16-byte piece (as dequant16 above) into 16 exact floats, element order;
 * no scale applied (per-channel: scale each output once after the dot product; kBlock128: scale
 * each 128-wide partial sum).
 * @code
 * float w[16];
 * prox::fp8::dequant16(prox::ld_stream_16(row + k), w);
 * for (int j = 0; j < 16; ++j) acc = fmaf(x[k + j], w[j], acc);
 * @endcode
 */
PROX_DEVICE PROX_FORCEINLINE void dequant16(uint4 v, float (&out)[16]) {
  __half2 h[8];
  dequant16(v, h);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// ---------------------------------------------------------------- offline device helpers

namespace detail {

constexpr int kThreads = 256;

//! Per-channel scales: one warp per row; a non-finite weight makes the row's scale NaN.
template <class T>
PROX_KERNEL void fp8_row_scale_kernel(const T* __restrict__ w, int rows, int cols, float* __restrict__ scales) {
  const int r = static_cast<int>(blockIdx.x) * (kThreads / kWarpSize) + warp_id();
  if (r >= rows) return;
  const T* row = w + static_cast<std::size_t>(r) * static_cast<std::size_t>(cols);
  bool finite = true;
  const float amax = warp_abs_max([&](int c) { return source_float(row[c]); }, cols, finite);
  if (lane_id() == 0) scales[r] = finite ? scale_from_amax(amax) : __int_as_float(0x7fc00000);
}

//! Block scales: one thread block per 128 x 128 block (the last ones partial); NaN if a weight is not finite.
template <class T>
PROX_KERNEL void __launch_bounds__(kThreads)
    fp8_block_scale_kernel(const T* __restrict__ w, int rows, int cols, float* __restrict__ scales) {
  __shared__ float warp_amax[kThreads / kWarpSize];
  const int r0 = static_cast<int>(blockIdx.y) * kBlockSize;
  const int c0 = static_cast<int>(blockIdx.x) * kBlockSize;
  float amax = 0.0f;
  bool finite = true;
  for (int i = static_cast<int>(threadIdx.x); i < kBlockSize * kBlockSize; i += kThreads) {
    const int r = r0 + i / kBlockSize;
    const int c = c0 + i % kBlockSize;  // consecutive threads read consecutive columns
    if (r < rows && c < cols) {
      const float v = source_float(w[static_cast<std::size_t>(r) * static_cast<std::size_t>(cols) + c]);
      finite = finite && isfinite(v);
      amax = fmaxf(amax, fabsf(v));
    }
  }
  amax = warp_max(amax);
  if (lane_id() == 0) warp_amax[warp_id()] = amax;
  finite = __syncthreads_and(finite) != 0;  // also orders the warp_amax writes before the reads
  if (threadIdx.x == 0) {
    for (int i = 1; i < kThreads / kWarpSize; ++i) amax = fmaxf(amax, warp_amax[i]);
    scales[static_cast<std::size_t>(blockIdx.y) * gridDim.x + blockIdx.x] =
        finite ? scale_from_amax(amax) : __int_as_float(0x7fc00000);
  }
}

//! q = quantize_value(w, its scale), grid-stride over the elements.
template <class T>
PROX_KERNEL void fp8_quantize_kernel(const T* __restrict__ w, int rows, int cols, ScaleLayout layout,
                                     const float* __restrict__ scales, std::uint8_t* __restrict__ q) {
  const std::size_t total = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int r = static_cast<int>(i / static_cast<std::size_t>(cols));
    const int c = static_cast<int>(i % static_cast<std::size_t>(cols));
    q[i] = quantize_value(source_float(w[i]), scales[scale_index(layout, Orientation::kOutIn, cols, r, c)]);
  }
}

//! atomicMin of the index of every invalid scale: the first one survives, whatever the block order.
//! (A template, S = float, so that every translation unit may instantiate it: no duplicate symbol.)
template <class S>
PROX_KERNEL void fp8_scale_check_kernel(const S* __restrict__ scales, std::size_t count,
                                        unsigned long long* __restrict__ first_bad) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    if (!is_valid_scale(scales[i])) atomicMin(first_bad, static_cast<unsigned long long>(i));
}

//! Grid of a grid-stride loop over n items: enough blocks to fill any device, no more than needed.
inline dim3 stride_grid(std::size_t n) {
  const std::size_t blocks = (n + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(blocks < 4096 ? blocks : 4096));
}

//! kErrorCapturing if `stream` captures (or cannot tell): the synchronizing helpers refuse capture.
inline Status refuse_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone)
    return Status::kErrorCapturing;
  return Status::kSuccess;
}

}  // namespace detail

/**
 * @brief Check that every scale is finite and > 0 (is_valid_scale), on the device; the same verdict
 * and first_bad as check_scales_host. Offline, not for the hot path: it allocates 8 bytes
 * (cudaMallocAsync on `stream`), launches one kernel, copies 8 bytes back and synchronizes `stream`.
 * @param scales     device pointer to `count` floats, 4-byte aligned
 * @param first_bad  optional host out: index of the first invalid scale (left alone on success)
 * @return kErrorInvalidScale; before any launch kErrorNullPointer, kErrorInvalidShape (count 0),
 *         kErrorMisalignedPointer, kErrorCapturing (stream capturing); kErrorCudaRuntime.
 * @code
 * std::size_t bad = 0;
 * const auto st = prox::fp8::check_scales_device(d_scale_inv, n_scales, stream, &bad);
 * if (st == prox::Status::kErrorInvalidScale) report("weight_scale_inv", bad);
 * @endcode
 */
inline Status check_scales_device(const float* scales, std::size_t count, cudaStream_t stream,
                                  std::size_t* first_bad = nullptr) {
  if (scales == nullptr) return Status::kErrorNullPointer;
  if (count == 0) return Status::kErrorInvalidShape;
  if (!is_aligned(scales, alignof(float))) return Status::kErrorMisalignedPointer;
  PROX_RETURN_IF_ERROR(detail::refuse_capture(stream));
  unsigned long long* d_bad = nullptr;
  if (cudaMallocAsync(reinterpret_cast<void**>(&d_bad), sizeof(*d_bad), stream) != cudaSuccess)
    return Status::kErrorCudaRuntime;
  unsigned long long bad = ~0ull;
  Status st = cudaMemsetAsync(d_bad, 0xFF, sizeof(*d_bad), stream) == cudaSuccess ? Status::kSuccess
                                                                                  : Status::kErrorCudaRuntime;
  if (ok(st)) {
    st = prox::detail::launch_kernel(detail::fp8_scale_check_kernel<float>,
                                     plain_launch(detail::stride_grid(count), dim3(detail::kThreads)), stream, scales,
                                     count, d_bad);
  }
  if (ok(st) && cudaMemcpyAsync(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream) != cudaSuccess)
    st = Status::kErrorCudaRuntime;
  const bool freed = cudaFreeAsync(d_bad, stream) == cudaSuccess;
  if (cudaStreamSynchronize(stream) != cudaSuccess || !freed) st = Status::kErrorCudaRuntime;
  PROX_RETURN_IF_ERROR(st);
  if (bad == ~0ull) return Status::kSuccess;
  if (first_bad != nullptr) *first_bad = static_cast<std::size_t>(bad);
  return Status::kErrorInvalidScale;
}

/**
 * @brief Quantize an nn.Linear weight matrix to e4m3 on the device; bit-identical to quantize_host.
 * Offline, not for the hot path: one scale kernel, then check_scales_device (which synchronizes
 * `stream`) to find non-finite weights, then one quantization kernel, left running on `stream`.
 * @tparam T      float, `__half` or `__nv_bfloat16`
 * @param w       device [rows][cols] row-major ([out][in]), element-aligned
 * @param q       device out: [rows][cols] e4m3 codes
 * @param scales  device out: scale_count(layout, kOutIn, rows, cols) floats, 4-byte aligned
 * @return kErrorNonFiniteWeight if a weight is NaN or infinite (q not written; the scales of the
 *         offending rows or blocks are NaN); before any launch kErrorNullPointer, kErrorInvalidShape,
 *         kErrorInvalidArgument (layout), kErrorMisalignedPointer, kErrorCapturing.
 * @code
 * DeviceArray<std::uint8_t> q(size_t(N) * K);
 * DeviceArray<float> s(prox::fp8::scale_count(ScaleLayout::kPerChannel, Orientation::kOutIn, N, K));
 * PROX_CHECK(prox::fp8::quantize_device(d_w, N, K, ScaleLayout::kPerChannel, q.get(), s.get(), stream));
 * @endcode
 */
template <class T>
Status quantize_device(const T* w, int rows, int cols, ScaleLayout layout, std::uint8_t* q, float* scales,
                       cudaStream_t stream) {
  if (w == nullptr || q == nullptr || scales == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_matrix_shape(rows, cols));
  if (!is_valid(layout)) return Status::kErrorInvalidArgument;
  if (!is_aligned(w, alignof(T)) || !is_aligned(scales, alignof(float))) return Status::kErrorMisalignedPointer;
  if (layout == ScaleLayout::kBlock128 && scale_blocks(rows) > 65535) return Status::kErrorInvalidShape;  // grid.y
  PROX_RETURN_IF_ERROR(detail::refuse_capture(stream));
  if (layout == ScaleLayout::kPerChannel) {
    const LaunchConfig lc =
        plain_launch(dim3(static_cast<unsigned>(ceil_div(rows, detail::kThreads / kWarpSize))), dim3(detail::kThreads));
    PROX_RETURN_IF_ERROR(
        prox::detail::launch_kernel(detail::fp8_row_scale_kernel<T>, lc, stream, w, rows, cols, scales));
  } else {
    const LaunchConfig lc =
        plain_launch(dim3(static_cast<unsigned>(scale_blocks(cols)), static_cast<unsigned>(scale_blocks(rows))),
                     dim3(detail::kThreads));
    PROX_RETURN_IF_ERROR(
        prox::detail::launch_kernel(detail::fp8_block_scale_kernel<T>, lc, stream, w, rows, cols, scales));
  }
  const Status st = check_scales_device(scales, scale_count(layout, Orientation::kOutIn, rows, cols), stream);
  if (st == Status::kErrorInvalidScale) return Status::kErrorNonFiniteWeight;  // only a NaN can be invalid here
  PROX_RETURN_IF_ERROR(st);
  const std::size_t total = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  return prox::detail::launch_kernel(detail::fp8_quantize_kernel<T>,
                                     plain_launch(detail::stride_grid(total), dim3(detail::kThreads)), stream, w, rows,
                                     cols, layout, static_cast<const float*>(scales), q);
}

/**
 * @brief W_down^T and its scales on the device (asynchronous on `stream`); bit-identical to
 * transpose_down_host, which documents the layouts.
 * @param q_down    device W_down [d_model][d_ff] e4m3;  q_down_t: device out [d_ff][d_model]
 * @param scales    device scales of W_down in `layout`; scales_t: device out, the scales of W_down^T
 *                  (kPerChannel: the same [d_model] array, copied unless scales_t == scales)
 * @return kErrorNullPointer, kErrorInvalidShape, kErrorInvalidArgument, kErrorMisalignedPointer
 *         (scales not 4-byte aligned) before any launch; kErrorCudaRuntime.
 * @code
 * PROX_CHECK(prox::fp8::transpose_down_device(down_q, down_s, d_model, d_ff, ScaleLayout::kBlock128,
 *                                             down_t_q, down_t_s, stream));
 * @endcode
 */
inline Status transpose_down_device(const std::uint8_t* q_down, const float* scales, int d_model, int d_ff,
                                    ScaleLayout layout, std::uint8_t* q_down_t, float* scales_t, cudaStream_t stream) {
  PROX_RETURN_IF_ERROR(detail::check_transpose_args(q_down, scales, d_model, d_ff, layout, q_down_t, scales_t));
  if (!is_aligned(scales, alignof(float)) || !is_aligned(scales_t, alignof(float)))
    return Status::kErrorMisalignedPointer;
  PROX_RETURN_IF_ERROR(transpose_device(q_down, d_model, d_ff, q_down_t, stream));
  if (layout == ScaleLayout::kBlock128)
    return transpose_device(scales, scale_blocks(d_model), scale_blocks(d_ff), scales_t, stream);
  if (scales_t == scales) return Status::kSuccess;
  return cudaMemcpyAsync(scales_t, scales, sizeof(float) * static_cast<std::size_t>(d_model), cudaMemcpyDeviceToDevice,
                         stream) == cudaSuccess
             ? Status::kSuccess
             : Status::kErrorCudaRuntime;
}

/**
 * @brief INT4 proxy (int4 layout v1) of an FP8 W_gate or W_up on the device; bit-identical to
 * pack_int4_host (the int4 packer's kernels over DequantSource). Offline, not for the hot path: it
 * synchronizes `stream` twice (check_scales_device, then int4's non-finite check).
 * @param q            device [d_ff][d_model] e4m3 (nn.Linear layout)
 * @param scales       device scales in `layout` (Orientation::kOutIn), 4-byte aligned
 * @param packed       device out: [d_model][d_ff/8] uint32
 * @param int4_scales  device out: [d_ff] float32
 * @return kErrorInvalidScale (nothing written), kErrorNonFiniteWeight (packed not written); before any
 *         launch kErrorNullPointer, kErrorInvalidShape (int4::check_pack_shape), kErrorInvalidArgument,
 *         kErrorMisalignedPointer, kErrorCapturing.
 * @code
 * PROX_CHECK(prox::fp8::pack_int4_device(gate_q, gate_s, ScaleLayout::kBlock128, d_model, d_ff,
 *                                        proxy_gate.get(), proxy_gate_scales.get(), stream));
 * @endcode
 */
inline Status pack_int4_device(const std::uint8_t* q, const float* scales, ScaleLayout layout, int d_model, int d_ff,
                               std::uint32_t* packed, float* int4_scales, cudaStream_t stream) {
  if (q == nullptr || scales == nullptr || packed == nullptr || int4_scales == nullptr)
    return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(int4::check_pack_shape(d_model, d_ff));
  if (!is_valid(layout)) return Status::kErrorInvalidArgument;
  if (!is_aligned(scales, 4) || !is_aligned(packed, 4) || !is_aligned(int4_scales, 4))
    return Status::kErrorMisalignedPointer;
  PROX_RETURN_IF_ERROR(detail::refuse_capture(stream));
  PROX_RETURN_IF_ERROR(check_scales_device(scales, scale_count(layout, Orientation::kOutIn, d_ff, d_model), stream));
  return int4::detail::pack_device_from(DequantSource{q, scales, layout, d_model}, d_model, d_ff, packed, int4_scales,
                                        stream, nullptr);
}

#endif  // __CUDACC__

}  // namespace fp8

PROX_NAMESPACE_END
