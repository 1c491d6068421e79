# SPDX-License-Identifier: Apache-2.0
"""Torch reimplementations of prox, on any device (CPU included):

- the INT4 proxy format of include/prox/int4_format.hpp (pack, unpack), bit for bit;
- Prox's two stages, batched over tokens (``prox_ffn``): the method as the kernels compute it, used
  where the CUDA op cannot run (CPU, calibration of many tokens at once) and as the tests' reference;
- the dense GLU FFN.

The kernels accumulate in fp32; ``prox_ffn`` computes in ``compute_dtype`` (float32 by default,
float64 for tests), so channels whose |s~| lies within rounding of tau_s may be selected differently.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = 7
BIAS = 8
CHANNELS_PER_WORD = 8
#: nibble position of channel c (0..7) inside its word: channels [0,2,4,6,1,3,5,7] in nibbles 0..7
NIBBLE_OF_CHANNEL = [(c >> 1) + 4 * (c & 1) for c in range(CHANNELS_PER_WORD)]


def activation(act: str):
    if act == "silu":
        return F.silu
    if act == "gelu_tanh":
        return lambda g: F.gelu(g, approximate="tanh")
    raise ValueError(f"prox: act must be 'silu' or 'gelu_tanh', got {act!r}")


# ---------------------------------------------------------------- INT4 format


def int4_scales(w: torch.Tensor) -> torch.Tensor:
    """scale[n] = max_k |W[n][k]| / 7 in float32 (IEEE division), [d_ff]."""
    wf = w.float()
    if not torch.isfinite(wf).all():
        raise ValueError("prox: pack_int4: the weight holds NaN or Inf")
    amax = wf.abs().amax(dim=1)
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal instead
    return amax / torch.full_like(amax, float(QMAX))


def int4_quantize(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Stored nibbles q + 8 in [1, 15] as int32 [d_ff, d_model]; an all-zero row (scale 0) stores 8."""
    wf = w.float()
    sc = scales.float()[:, None]
    q = torch.round(wf / torch.where(sc == 0, torch.ones_like(sc), sc))  # round half to even, like rintf
    q = q.clamp(-QMAX, QMAX).to(torch.int32) + BIAS
    return torch.where(sc == 0, torch.full_like(q, BIAS), q)


def pack_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of prox::int4::pack_host / pack_device: w [d_ff, d_model] (nn.Linear layout) ->
    (packed [d_model, d_ff/8] int32 holding the uint32 words, scales [d_ff] float32)."""
    if w.dim() != 2 or w.shape[0] % 32 != 0 or w.shape[0] < 32:
        raise ValueError(f"prox: pack_int4 needs a [d_ff, d_model] weight with d_ff a multiple of 32, "
                         f"got {tuple(w.shape)}")
    d_ff, d_model = w.shape
    scales = int4_scales(w)
    nib = int4_quantize(w, scales).t().reshape(d_model, d_ff // CHANNELS_PER_WORD, CHANNELS_PER_WORD).to(torch.int64)
    shifts = torch.tensor([4 * p for p in NIBBLE_OF_CHANNEL], dtype=torch.int64, device=w.device)
    words = (nib << shifts).sum(dim=-1)  # disjoint nibbles: the sum is the OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # uint32 bits as int32
    return words.to(torch.int32).contiguous(), scales


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Signed q in [-8, 7] as int8 [d_ff, d_model] (nn.Linear layout) from packed [d_model, d_ff/8]."""
    d_model, words = packed.shape
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor([4 * p for p in NIBBLE_OF_CHANNEL], dtype=torch.int64, device=packed.device)
    q = ((w[:, :, None] >> shifts) & 0xF) - BIAS  # [d_model, words, 8]: channel 8w + c
    return q.reshape(d_model, words * CHANNELS_PER_WORD).t().to(torch.int8).contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The proxy matrix W~ = q * scale, [d_ff, d_model]."""
    return (unpack_int4(packed).to(dtype) * scales.to(dtype)[:, None]).contiguous()


# ---------------------------------------------------------------- the FFN


def dense_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor, act: str,
              compute_dtype=torch.float32) -> torch.Tensor:
    """y = (u * act(g)) W_down for x [..., d_model]; w_down_t is W_down^T [d_ff, d_model]."""
    xc = x.to(compute_dtype)
    g = xc @ w_gate.to(compute_dtype).t()
    u = xc @ w_up.to(compute_dtype).t()
    return (u * activation(act)(g)) @ w_down_t.to(compute_dtype)


def input_mask(x: torch.Tensor, tau_x: float | torch.Tensor) -> torch.Tensor:
    """Stage 1's input mask |x_k| >= tau_x, compared in float32 as the kernels compare."""
    return x.float().abs() >= torch.as_tensor(tau_x, dtype=torch.float32, device=x.device)


def proxy_values(x: torch.Tensor, q_gate: torch.Tensor, scale_gate: torch.Tensor, q_up: torch.Tensor,
                 scale_up: torch.Tensor, tau_x: float | torch.Tensor, act: str,
                 compute_dtype=torch.float32) -> torch.Tensor:
    """Stage 1's s~ for x [..., d_model]: kept inputs |x| >= tau_x, g~ = scale_g (x_kept . q_g), likewise u~,
    s~ = u~ act(g~). q_* are the int8 [d_ff, d_model] values of unpack_int4 (or the packed words,
    int32 [d_model, d_ff/8], unpacked here)."""
    if q_gate.dtype == torch.int32:
        q_gate, q_up = unpack_int4(q_gate), unpack_int4(q_up)
    xk = torch.where(input_mask(x, tau_x), x.to(compute_dtype), torch.zeros((), dtype=compute_dtype, device=x.device))
    g = (xk @ q_gate.to(compute_dtype).t()) * scale_gate.to(compute_dtype)
    u = (xk @ q_up.to(compute_dtype).t()) * scale_up.to(compute_dtype)
    return u * activation(act)(g)


def stage2(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
           channel_mask: torch.Tensor, act: str, compute_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 on a given channel set (bool [..., d_ff]): s = u act(g) on the selected channels (0 elsewhere)
    and y = s W_down."""
    xc = x.to(compute_dtype)
    g = xc @ w_gate.to(compute_dtype).t()
    u = xc @ w_up.to(compute_dtype).t()
    s = torch.where(channel_mask, u * activation(act)(g), torch.zeros((), dtype=compute_dtype, device=x.device))
    return s, s @ w_down_t.to(compute_dtype)


def prox_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
             q_gate: torch.Tensor, scale_gate: torch.Tensor, q_up: torch.Tensor, scale_up: torch.Tensor,
             tau_x: float | torch.Tensor, tau_s: float | torch.Tensor, act: str, compute_dtype=torch.float32,
             return_all: bool = False):
    """Prox on every token of x [..., d_model] independently (each token as batch-1 decoding would run it).
    Returns y in x's dtype, or (y, s_proxy, mask, s) with return_all."""
    sp = proxy_values(x, q_gate, scale_gate, q_up, scale_up, tau_x, act, compute_dtype)
    mask = sp.float().abs() >= torch.as_tensor(tau_s, dtype=torch.float32, device=x.device)
    s, y = stage2(x, w_gate, w_up, w_down_t, mask, act, compute_dtype)
    if return_all:
        return y.to(x.dtype), sp, mask, s
    return y.to(x.dtype)


def mask_words_to_bool(words: torch.Tensor, d_ff: int) -> torch.Tensor:
    """The op's channel mask ([d_ff/32] int32 words, bit j%32 of word j/32) as bool [d_ff]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w[:, None] >> torch.arange(32, device=words.device)) & 1
    return bits.reshape(-1)[:d_ff].bool()
