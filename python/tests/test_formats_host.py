# SPDX-License-Identifier: Apache-2.0
"""The weight formats registry (prox.formats) on the host: one object per Stage-2 format, what each recognizes,
its alpha and op code, an unknown format refused; the FP8 prefill (dense path) against the float64 reference, one
matrix dequantized at a time in the activation dtype; FP8 dequantization in row chunks bit for bit; tensor-parallel
cuts of each format's linears (block scales on block boundaries only, refused by name elsewhere)."""
import math

import pytest
import torch
import torch.nn as nn

import prox
from prox import formats, fp8
from conftest import requires_ext

LAYOUTS = ["channel", "block128"]


def _weights(rows, cols, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(dtype)


def _linear(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


class GatedMLP(nn.Module):
    def __init__(self, d_model=64, d_ff=256, seed=0, layout=None):
        super().__init__()
        self.gate_proj = _linear(_weights(d_ff, d_model, seed))
        self.up_proj = _linear(_weights(d_ff, d_model, seed + 1))
        self.down_proj = _linear(_weights(d_model, d_ff, seed + 2))
        self.act_fn = nn.SiLU()
        if layout is not None:
            for p in ("gate_proj", "up_proj", "down_proj"):
                setattr(self, p, prox.Fp8Linear.from_linear(getattr(self, p), layout))


# ---------------------------------------------------------------- the registry


def test_one_object_per_format_with_its_code_and_alpha():
    assert tuple(f.name for f in formats.REGISTRY) == prox.FORMATS
    assert formats.NATIVE.alpha == prox.ALPHA and formats.FP8_CHANNEL.alpha == formats.FP8_BLOCK128.alpha == 0.5
    assert prox.alpha_for("native") == prox.ALPHA and prox.alpha_for(formats.FP8_BLOCK128) == prox.FP8_ALPHA
    assert [formats.fp8_format(l).layout for l in LAYOUTS] == LAYOUTS
    if prox.ops_available():
        assert [f.code for f in formats.REGISTRY] == [0, 1, 2]


@pytest.mark.parametrize("name", ["fp4", "int4_group128", "fp8", ""])
def test_an_unknown_format_is_refused_by_name(name):
    """No format falls back to another's alpha (alpha_for once gave any name starting with "fp8" FP8's, any other
    the paper's): an unknown name raises, naming it and the formats prox has."""
    with pytest.raises(ValueError, match=rf"unknown weight format {name!r} \(prox knows native, fp8_channel, "
                                         r"fp8_block128\)"):
        prox.alpha_for(name)
    with pytest.raises(ValueError, match="unknown weight format"):
        formats.get(name)
    with pytest.raises(ValueError, match="an FP8 scale layout is one of"):
        formats.fp8_format("block64")


@pytest.mark.parametrize("layout", [None, "channel", "block128"])
def test_the_format_of_an_mlp(layout):
    mlp = GatedMLP(layout=layout)
    fmt = formats.of_module(mlp)
    assert fmt is (formats.NATIVE if layout is None else formats.fp8_format(layout))
    assert formats.is_gated_mlp(mlp) and fmt.weights_set_dtype == (layout is None)
    assert formats.holds_codes(mlp.gate_proj.weight) == (layout is not None)


def test_per_tensor_scales_run_per_channel_and_mixed_formats_are_refused():
    mlp = GatedMLP(layout="channel")
    for p in ("gate_proj", "up_proj", "down_proj"):  # one scale each: both FP8 formats read them
        lin = getattr(mlp, p)
        lin.weight_scale = nn.Parameter(lin.weight_scale.max().reshape(1), requires_grad=False)
    assert formats.of_module(mlp) is formats.FP8_CHANNEL
    mlp.up_proj = _linear(_weights(256, 64, 9))
    with pytest.raises(ValueError, match="gate_proj is fp8_channel or fp8_block128, up_proj is native, down_proj is "
                                         "fp8_channel or fp8_block128: an MLP's three projections must share one "
                                         "weight format"):
        formats.of_module(mlp)


# ---------------------------------------------------------------- dequantization and the FP8 prefill


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("transposed", [False, True])
def test_dequantize_in_row_chunks_is_the_whole_product(layout, transposed):
    """fp8.dequantize computes DEQUANT_ROWS rows at a time (no float32 temporary of the whole matrix): the result is
    bit for bit the one-shot float32 product, across chunk boundaries and a partial last block."""
    rows, cols = fp8.DEQUANT_ROWS + 200, 144
    q, s = fp8.quantize(_weights(rows, cols, 3), layout)
    if transposed:  # W_down^T [d_ff, d_model] with its transposed scales
        q, s = fp8.transpose_down(fp8.quantize(_weights(cols, rows, 4), layout)[0],
                                  fp8.quantize(_weights(cols, rows, 4), layout)[1], layout)
    full = q.to(torch.float32) * fp8._expanded(s, layout, rows, cols, transposed)
    assert torch.equal(fp8.dequantize(q, s, layout, transposed=transposed), full)
    assert torch.equal(fp8.dequantize(q, s, layout, torch.bfloat16, transposed=transposed), full.to(torch.bfloat16))
    exact = q.to(torch.float64) * fp8._expanded(s, layout, rows, cols, transposed).to(torch.float64)
    assert torch.equal(fp8.dequantize(q, s, layout, torch.float64, transposed=transposed), exact)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keep_down", [False, True])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_fp8_prefill_against_the_float64_reference(layout, keep_down, dtype, bound):
    """The dense path of several tokens (prefill) of an FP8 layer: in the activation dtype, each weight dequantized
    to it when its GEMM runs (on the CPU: no FP8 GEMM, "auto" is "dequantized"), within the dtype's rounding of the
    float64 dense FFN on the exactly dequantized weights."""
    sp = prox.SparseMLP.from_mlp(GatedMLP(layout=layout), dtype=dtype, keep_down=keep_down, tau_x=0.3, tau_s=0.01)
    x = torch.randn(1, 37, 64).to(dtype)
    wg, wu, wdt = sp.exact_weights(torch.float64)
    want = (torch.nn.functional.silu(x.double() @ wg.t()) * (x.double() @ wu.t())) @ wdt
    with torch.no_grad():
        y = sp(x)  # 37 tokens, prefill="dense": whatever the thresholds, the dense FFN
        assert y.dtype == dtype and y.shape == x.shape
        err = (y.double() - want).norm() / want.norm()
        assert err < bound, err
        sp.prefill_gemm = "dequantized"
        assert torch.equal(sp(x), y)
    assert sp.fmt.scaled_mm_ok(x[0], 256, 64) is False  # the CPU has no row-wise / blockwise _scaled_mm


def test_native_prefill_is_the_modules_own():
    mlp = GatedMLP()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        for keep_down in (False, True):
            sp = prox.SparseMLP.from_mlp(GatedMLP(), keep_down=keep_down, tau_x=0.5, tau_s=0.05)
            assert torch.allclose(sp(x), want, rtol=1e-5, atol=1e-6)


def test_prefill_gemm_is_checked():
    with pytest.raises(ValueError, match="prefill_gemm must be 'auto' or 'dequantized', got 'float32'"):
        prox.SparseMLP.from_mlp(GatedMLP(), prefill_gemm="float32")
    with pytest.raises(ValueError, match="prefill_gemm must be"):
        prox.set_mode(nn.ModuleList([prox.SparseMLP.from_mlp(GatedMLP())]), prefill_gemm="fp8")


# ---------------------------------------------------------------- tensor-parallel cuts


@pytest.mark.parametrize("layout", [None] + LAYOUTS)
def test_cuts_are_the_full_matrix_rows_and_columns(layout):
    """A format's cut of rows (W_gate, W_up) or columns (W_down) dequantizes to exactly those rows / columns of the
    full matrix: block scales cut on block boundaries, per-channel scales with their rows."""
    mlp = GatedMLP(d_ff=512, layout=layout)
    fmt, lins = formats.of_mlp({n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})

    def dense(m):
        info = fmt.linear(m, "m")
        return info.weight.double() if info.scales is None else \
            fp8.dequantize(info.weight, fmt.normalized_scale(info.scales, *info.weight.shape, "s"), layout,
                           torch.float64)
    for lo, hi in ((0, 256), (256, 512), (128, 384)):
        g = fmt.cut(lins["gate_proj"], "gate_proj", rows=(lo, hi))
        d = fmt.cut(lins["down_proj"], "down_proj", cols=(lo, hi))
        assert torch.equal(dense(g), dense(mlp.gate_proj)[lo:hi])
        assert torch.equal(dense(d), dense(mlp.down_proj)[:, lo:hi])
        assert g.weight.data_ptr() != mlp.gate_proj.weight.data_ptr()  # a copy: the whole can be freed


def test_a_block_scale_cut_off_a_block_boundary_is_refused_by_name():
    mlp = GatedMLP(d_ff=320, layout="block128")
    fmt, lins = formats.of_mlp({n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})
    with pytest.raises(ValueError, match=r"prox: gate_proj \[320, 64\] has 128 x 128 block scales: its rows \[0, 160\) "
                                         r"do not start and end on a block boundary \(multiples of 128\), so the shard "
                                         r"cannot be cut"):
        fmt.cut(lins["gate_proj"], "gate_proj", rows=(0, 160))
    with pytest.raises(ValueError, match=r"down_proj \[64, 320\] has 128 x 128 block scales: its columns \[160, 320\)"):
        fmt.cut(lins["down_proj"], "down_proj", cols=(160, 320))
    assert fmt.cut(lins["gate_proj"], "gate_proj", rows=(256, 320)).weight.shape == (64, 64)  # the last, partial block
    channel = formats.of_mlp({"gate_proj": GatedMLP(d_ff=320, layout="channel").gate_proj})
    assert channel[0].cut(channel[1]["gate_proj"], "gate_proj", rows=(0, 160)).weight.shape == (160, 64)


@requires_ext
def test_every_format_of_the_extension_has_an_object():
    """The extension's formats (setup.py's list) and the registry are the same list: a C++ format without its
    Python object (or the reverse) fails here."""
    assert tuple(torch.ops.prox.layer_format_names()) == tuple(f.name for f in formats.REGISTRY)
