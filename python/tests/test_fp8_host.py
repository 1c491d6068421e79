# SPDX-License-Identifier: Apache-2.0
"""FP8 e4m3 Stage-2 weights on the host (no GPU): the FP8 formats' slots and their checks (every error names the
slot), the offline helpers through the ops' CPU kernels (prox::fp8 quantize_host, transpose_down_host,
pack_int4_host, check_scales_host) against torch, the FP8 linears SparseMLP accepts (transformers' fine-grained
FP8Linear, prox.Fp8Linear, per-tensor and per-channel scales) and SparseMLP / sparsify on them through the torch
reference, the thresholds file's format field, the FP8 alpha, and the tools' FP8 flags."""
import json
import math

import pytest
import torch
import torch.nn as nn

import prox
from prox import fp8, reference
from conftest import requires_ext

LAYOUTS = ["channel", "block128"]


def _weights(rows, cols, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(dtype)


def _fp8_layer(d_model=64, d_ff=160, layout="block128", seed=0):
    """A LayerTensors of the FP8 format (CPU): the weights quantized, W_down^T and its scales, the proxies."""
    qg, sg = fp8.quantize(_weights(d_ff, d_model, seed), layout)
    qu, su = fp8.quantize(_weights(d_ff, d_model, seed + 1), layout)
    qd, sd = fp8.quantize(_weights(d_model, d_ff, seed + 2), layout)
    qdt, sdt = fp8.transpose_down(qd, sd, layout)
    pg, psg = fp8.pack_int4(qg, sg, layout)
    pu, psu = fp8.pack_int4(qu, su, layout)
    return prox.LayerTensors(w_gate=qg, w_up=qu, w_down_t=qdt, proxy_gate=pg, scale_gate=psg, proxy_up=pu,
                             scale_up=psu, w_gate_scale=sg, w_up_scale=su, w_down_t_scale=sdt,
                             format=prox.formats.fp8_format(layout).name)


# ---------------------------------------------------------------- formats, slots and their checks


@requires_ext
def test_fp8_formats_and_slots_come_from_the_extension():
    assert prox.FORMATS == ("native", "fp8_channel", "fp8_block128") == tuple(torch.ops.prox.layer_format_names())
    assert prox.LAYER_SLOTS[-3:] == ("w_gate_scale", "w_up_scale", "w_down_t_scale")
    assert prox._ops.fp8_layout() == fp8.LAYOUT_TAG
    for layout in LAYOUTS:
        t = _fp8_layer(layout=layout)
        assert t.format_code() == prox.FORMATS.index(prox.formats.fp8_format(layout).name)
        for dtype in (torch.float16, torch.bfloat16):
            assert prox.check_layer(t, torch.zeros(2), dtype=dtype) == (64, 160)


@requires_ext
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_slot_checks_name_the_slot(layout):
    t = _fp8_layer(layout=layout)
    th = torch.zeros(2)
    fmt = prox.formats.fp8_format(layout).name
    # The activation type: required, float16 or bfloat16.
    with pytest.raises(TypeError, match=f"the {fmt} format's weights are torch.float8_e4m3fn: give the activation "
                                        "dtype"):
        prox.check_layer(t, th)
    with pytest.raises(TypeError, match=f"dtype must be torch.float16 or torch.bfloat16 for the {fmt} format"):
        prox.check_layer(t, th, dtype=torch.float32)
    # Each slot given a wrong dtype is named by the op's own check.
    wrong = {"proxy_gate": torch.int64, "proxy_up": torch.int64}
    for i, name in enumerate(prox.LAYER_SLOTS):
        v = getattr(t, name)
        bad = v.to(wrong.get(name, torch.float64 if v.dtype == torch.float32 else torch.bfloat16))
        layer = t.tensors()
        layer[i] = bad
        with pytest.raises(TypeError, match=rf"prox: {name} must be torch\."):
            torch.ops.prox.check_layer(layer, t.format_code(), th, torch.float16)
        layer[i] = None
        with pytest.raises(ValueError, match=rf"prox: {name} is missing \(None\): the {fmt} format needs it"):
            torch.ops.prox.check_layer(layer, t.format_code(), th, torch.float16)
    blocks = (2, 1)  # [ceil(160/128), ceil(64/128)]
    shape = (lambda n: rf"\({n},\)") if layout == "channel" else (lambda n: r"\(2, 1\)")
    buf = torch.zeros(160 * 64 + 1, dtype=torch.uint8).view(fp8.E4M3)
    cases = [
        (dict(w_up=t.w_up[:, :48]), ValueError, r"w_up must have shape \(160, 64\)"),
        (dict(w_down_t=buf[1:].view(160, 64)), ValueError, "w_down_t must be 16-byte aligned"),
        (dict(w_gate_scale=t.w_gate_scale[:1]), ValueError, "w_gate_scale must have shape " + shape(160)),
        (dict(w_down_t_scale=torch.ones(160 if layout == "channel" else blocks[::-1])), ValueError,
         "w_down_t_scale must have shape " + shape(64)),
        (dict(w_up_scale=t.w_up_scale.double()), TypeError, r"w_up_scale must be torch.float32"),
        (dict(w_gate=t.w_gate.view(torch.uint8)), TypeError, r"w_gate must be torch.float8_e4m3fn"),
        (dict(w_up=t.w_up.t().contiguous().t()), ValueError, "w_up must be contiguous"),
    ]
    for over, exc, text in cases:
        with pytest.raises(exc, match=text):
            prox.check_layer(t._replace(**over), th, dtype=torch.bfloat16)
    # d_model a multiple of 16 (a 16-byte piece holds 16 codes).
    t8 = _fp8_layer(d_model=72, layout=layout)
    with pytest.raises(ValueError, match=f"d_model must be a multiple of 16 for the {fmt} format"):
        prox.check_layer(t8, th, dtype=torch.float16)
    # The native format refuses FP8 weights and names the FP8 formats; the FP8 formats refuse a missing scale.
    with pytest.raises(TypeError, match="FP8 weights are the fp8_channel or fp8_block128 format"):
        prox.check_layer(t._replace(format="native", w_gate_scale=None, w_up_scale=None, w_down_t_scale=None), th)
    with pytest.raises(ValueError, match="w_gate_scale is given, but the native format has no such tensor"):
        native = reference.pack_int4(torch.randn(160, 64).half())
        w16 = torch.randn(160, 64).half()
        prox.check_layer(prox.LayerTensors(w16, w16, w16, native[0], native[1], native[0], native[1],
                                           w_gate_scale=torch.ones(160)), th)


@requires_ext
def test_fp8_fake_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        w = torch.empty(300, 200)
        q, s = torch.ops.prox.fp8_quantize(w, 1)
        assert q.shape == (300, 200) and q.dtype == fp8.E4M3 and s.shape == (3, 2)
        q, s = torch.ops.prox.fp8_quantize(w, 0)
        assert s.shape == (300,)
        qt, st = torch.ops.prox.fp8_transpose_down(torch.empty(300, 200, dtype=fp8.E4M3), torch.empty(3, 2), 1)
        assert qt.shape == (200, 300) and st.shape == (2, 3)
        p, s4 = torch.ops.prox.fp8_pack_int4(torch.empty(320, 200, dtype=fp8.E4M3), torch.empty(320), 0)
        assert p.shape == (200, 40) and p.dtype == torch.int32 and s4.shape == (320,)
        x = torch.empty(1, 64, dtype=torch.bfloat16)
        layer = [torch.empty(160, 64, dtype=fp8.E4M3)] + [None] * (len(prox.LAYER_SLOTS) - 1)
        assert torch.ops.prox.dense_ffn(x, layer, 2, torch.empty(2), 0, prox.PlanOptions().encode()).shape == (1, 64)


# ---------------------------------------------------------------- the offline helpers through the ops (host)


@requires_ext
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (160, 64), (300, 200)])
def test_host_quantize_matches_torch(shape, dtype, layout):
    w = (_weights(*shape, seed=3) * 40).to(dtype)  # codes up to +-448 and subnormals both
    w[0, 0] = 0
    if shape[0] > 2:
        w[2] = 0  # an all-zero row: scale FLT_MIN
    q, s = torch.ops.prox.fp8_quantize(w, fp8.layout_code(layout))
    q_ref, s_ref = fp8.quantize_reference(w, layout)
    assert q.dtype == fp8.E4M3 and s.shape == fp8.scale_shape(layout, *shape)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert (s > 0).all() and torch.isfinite(s).all()
    # dequantized: within half a code step of the weight (e4m3 has 3 mantissa bits), exact in float64
    deq = fp8.dequantize(q, s, layout, torch.float64)
    assert torch.equal(deq, q.double() * fp8._expanded(s, layout, *shape, False).double())
    # round to nearest: half a step, 2^-4 of a normal value, 2^-10 of the scale for a subnormal one
    tol = w.double().abs() * 2.0 ** -4 + fp8._expanded(s, layout, *shape, False).double() * 2.0 ** -10
    assert ((deq - w.double()).abs() <= tol * (1 + 2.0 ** -20)).all()
    with pytest.raises(ValueError, match="NaN or Inf"):
        bad = w.clone()
        bad.view(-1)[-1] = float("nan")
        torch.ops.prox.fp8_quantize(bad, fp8.layout_code(layout))


@requires_ext
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(16, 32), (64, 160), (200, 300), (129, 257)])
def test_host_transpose_down(shape, layout):
    d_model, d_ff = shape
    q, s = fp8.quantize(_weights(d_model, d_ff, 4), layout)
    qt, st = torch.ops.prox.fp8_transpose_down(q, s, fp8.layout_code(layout))
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t().contiguous())
    assert torch.equal(st, s.t().contiguous() if layout == "block128" else s)
    # the transposed matrix dequantizes to W_down^T exactly
    assert torch.equal(fp8.dequantize(qt, st, layout, torch.float64, transposed=True),
                       fp8.dequantize(q, s, layout, torch.float64).t())
    with pytest.raises(ValueError, match=r"w_down_scale must have shape"):
        torch.ops.prox.fp8_transpose_down(q, torch.ones(s.shape[0] + 1, *s.shape[1:]), fp8.layout_code(layout))


@requires_ext
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(32, 16), (160, 64), (1536, 576)])
def test_host_pack_int4_from_fp8(shape, layout):
    """The proxies of FP8 weights are int4-packed from the float32 dequantized weights, bit for bit."""
    q, s = fp8.quantize(_weights(*shape, 5), layout)
    p, ps = torch.ops.prox.fp8_pack_int4(q, s, fp8.layout_code(layout))
    p_ref, ps_ref = reference.pack_int4(fp8.dequantize(q, s, layout))
    assert torch.equal(p, p_ref) and torch.equal(ps, ps_ref)
    assert fp8.pack_int4(q, s)[0].equal(p)  # the wrapper infers the layout from the scales' shape


@requires_ext
@pytest.mark.parametrize("bad", [float("nan"), 0.0, -0.0, -1.0, float("inf"), float("-inf")])
def test_check_scales_refuses_and_names(bad):
    s = torch.rand(3, 5) + 0.5
    fp8.check_scales(s, "w_up's scales")
    assert int(torch.ops.prox.fp8_check_scales(s)) == -1
    s[1, 2] = bad
    assert int(torch.ops.prox.fp8_check_scales(s)) == 7
    with pytest.raises(ValueError, match=r"w_up's scales holds an invalid scale: element 7 \(flattened\)"):
        fp8.check_scales(s, "w_up's scales")
    q = torch.zeros(160, 64).to(fp8.E4M3)
    with pytest.raises(ValueError, match="gate's scales holds an invalid scale"):
        fp8.pack_int4(q, torch.ones(160).index_fill_(0, torch.tensor([9]), bad), "channel", name="gate")
    with pytest.raises(ValueError, match="scales holds an invalid scale: element 9"):
        torch.ops.prox.fp8_pack_int4(q, torch.ones(160).index_fill_(0, torch.tensor([9]), bad), 0)


@requires_ext
def test_offline_helpers_refuse_bad_input():
    q = torch.zeros(64, 32).to(fp8.E4M3)
    with pytest.raises(ValueError, match="scale layout is 0"):
        torch.ops.prox.fp8_quantize(torch.zeros(4, 4), 2)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        torch.ops.prox.fp8_quantize(torch.zeros(4, 4, dtype=torch.float64), 0)
    with pytest.raises(TypeError, match="w must be torch.float8_e4m3fn"):
        torch.ops.prox.fp8_pack_int4(q.view(torch.uint8), torch.ones(64), 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        torch.ops.prox.fp8_pack_int4(torch.zeros(40, 16).to(fp8.E4M3), torch.ones(40), 0)
    with pytest.raises(ValueError, match="w_down must be contiguous"):
        torch.ops.prox.fp8_transpose_down(q.t(), torch.ones(32), 0)
    with pytest.raises(ValueError, match="runs on CUDA tensors only"):
        t = _fp8_layer()
        torch.ops.prox.dense_ffn(torch.zeros(64, dtype=torch.bfloat16), t.tensors(), t.format_code(), torch.zeros(2),
                                 0, prox.PlanOptions().encode())


def test_torch_fallbacks_match_the_ops():
    """The pure-torch helpers (no extension) are the ops' rules: quantize_reference bit for bit (checked against
    the op above), the transposes, and the proxies from the dequantized weights."""
    w = _weights(160, 64, 6)
    for layout in LAYOUTS:
        q, s = fp8.quantize_reference(w, layout)
        qt, st = q.t().contiguous(), (s.t().contiguous() if layout == "block128" else s)
        assert torch.equal(fp8.dequantize(qt, st, layout, torch.float64, transposed=True),
                           fp8.dequantize(q, s, layout, torch.float64).t())
    assert fp8.infer_layout(torch.ones(160, 1), 160, 64) == "channel"
    assert fp8.infer_layout(torch.ones(2, 1), 160, 64) == "block128"
    with pytest.raises(ValueError, match=r"FP8 scales are \[160\]"):
        fp8.infer_layout(torch.ones(1, 2), 160, 64, name="weight_scale_inv")


# ---------------------------------------------------------------- FP8 linears


def _linear(rows, cols, seed):
    lin = nn.Linear(cols, rows, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_weights(rows, cols, seed))
    return lin


def test_fine_grained_fp8_linear_is_detected():
    pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import FP8Linear
    m = fp8.quantize_linear(_linear(160, 64, 7), "block128", module="transformers")
    assert isinstance(m, FP8Linear) and m.weight.dtype == fp8.E4M3 and tuple(m.block_size) == (128, 128)
    info = fp8.linear_info(m, "gate_proj")
    assert info.layout == "block128" and info.scale_name == "weight_scale_inv" and info.scales.shape == (2, 1)
    # per tensor (block_size None: one weight_scale_inv): either layout, expanded
    with torch.device("meta"):
        pt = FP8Linear(64, 160, block_size=None)
    pt.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)
    pt.weight_scale_inv = nn.Parameter(torch.tensor(0.01), requires_grad=False)
    info = fp8.linear_info(pt)
    assert info.layout is None and torch.equal(info.normalized("block128"), torch.full((2, 1), 0.01))
    assert torch.equal(info.normalized("channel"), torch.full((160,), 0.01))
    with torch.device("meta"):
        odd = FP8Linear(64, 160, block_size=(64, 64))
    odd.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)
    odd.weight_scale_inv = nn.Parameter(torch.ones(3, 1), requires_grad=False)
    with pytest.raises(ValueError, match=r"up_proj has block_size \(64, 64\)"):
        fp8.linear_info(odd, "up_proj")
    odd.block_size = (128, 128)
    odd.weight_scale_inv = nn.Parameter(torch.ones(2, 1, dtype=torch.float16), requires_grad=False)
    with pytest.raises(ValueError, match="weight_scale_inv is torch.float16: prox reads float32 scales"):
        fp8.linear_info(odd, "lin")
    assert fp8.linear_info(_linear(32, 16, 0)) is None  # not FP8
    bare = nn.Module()
    bare.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)
    with pytest.raises(ValueError, match="no float32 weight_scale_inv or weight_scale"):
        fp8.linear_info(bare, "down_proj")


def test_prox_fp8_linear_per_channel():
    lin = _linear(160, 64, 8)
    f = prox.Fp8Linear.from_linear(lin, "channel")
    assert f.layout == "channel" and f.weight_scale.shape == (160,) and f.bias is None
    x = torch.randn(3, 64)
    with torch.no_grad():  # e4m3 keeps 3 mantissa bits: a few % of error
        assert (f(x) - lin(x)).norm() < 0.05 * lin(x).norm()
    assert torch.equal(f(x), x @ fp8.dequantize(f.weight, f.weight_scale).t())
    info = fp8.linear_info(f)
    assert info.layout == "channel" and info.scale_name == "weight_scale"
    ct = nn.Module()  # a compressed-tensors style per-channel linear: weight_scale [N, 1]
    ct.weight = nn.Parameter(f.weight.detach().clone(), requires_grad=False)
    ct.weight_scale = nn.Parameter(f.weight_scale.detach().clone()[:, None], requires_grad=False)
    assert fp8.linear_info(ct).layout == "channel" and fp8.linear_info(ct).normalized().shape == (160,)
    fb = prox.Fp8Linear.from_linear(lin, "block128")
    assert fb.layout == "block128" and fb.weight_scale.shape == (2, 1)


# ---------------------------------------------------------------- SparseMLP and sparsify on FP8 models (CPU)


def _tiny_llama(layers=2, act="silu", hidden=64, inter=160, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128,
                                   hidden_act="silu" if act == "silu" else "gelu_pytorch_tanh")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("layout,module", [("channel", "prox"), ("block128", "transformers"), ("block128", "prox")])
def test_sparse_mlp_on_fp8_linears_cpu(layout, module):
    if module == "transformers":
        pytest.importorskip("transformers")
    m = _tiny_llama(1)
    prox.quantize_mlps(m, layout, module)
    mlp = m.model.layers[0].mlp
    assert prox.nn.is_gated_mlp(mlp) and prox.formats.of_module(mlp) is prox.formats.fp8_format(layout)
    qs = {p: fp8.linear_info(getattr(mlp, p)) for p in ("gate_proj", "up_proj", "down_proj")}
    wg, wu = (fp8.dequantize(qs[p].q, qs[p].normalized(layout)) for p in ("gate_proj", "up_proj"))
    wd = fp8.dequantize(qs["down_proj"].q, qs["down_proj"].normalized(layout))
    sp = prox.SparseMLP.from_mlp(mlp, dtype=torch.float32, track_sparsity=True)
    assert sp.format == prox.formats.fp8_format(layout).name and sp.layout == layout and sp.act_dtype == torch.float32
    assert sp.alpha == prox.FP8_ALPHA and sp.backend_in_use() == "torch" and "format=fp8_" in repr(sp)
    # the proxies are packed from the dequantized weights; W_down^T and its scales transposed
    assert torch.equal(sp.proxy_gate, reference.pack_int4(wg)[0]) and torch.equal(sp.scale_up, reference.pack_int4(wu)[1])
    assert torch.equal(sp.down_t.view(torch.uint8), qs["down_proj"].q.view(torch.uint8).t())
    g, u, dt = sp.exact_weights()
    assert torch.equal(g, wg) and torch.equal(u, wu) and torch.equal(dt, wd.t())
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        dense = sp(x)  # prefill: the dense FFN on the dequantized weights in float32
        want = (torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())) @ wd.t()
        assert torch.allclose(dense, want, rtol=1e-5, atol=1e-6)
        sp.set_thresholds(0.5, 0.01)
        one = sp(x[:, :1])  # decode: Prox through the reference, on the dequantized weights
        ref = reference.prox_ffn(x[0, :1], wg, wu, wd.t(), sp.proxy_gate, sp.scale_gate, sp.proxy_up, sp.scale_up,
                                 0.5, 0.01, "silu")
        assert torch.allclose(one[0], ref, rtol=1e-6, atol=1e-7)
    assert sp.sparsity_report()["calls"] == 1
    r = sp.memory_bytes()
    assert r["dense_mlp"] == 3 * 160 * 64 + 4 * (sp.w_gate_scale.numel() * 2 + sp.w_down_t_scale.numel())


def test_sparse_mlp_fp8_state_dict_roundtrip_and_dtype_changes():
    m = _tiny_llama(1)
    prox.quantize_mlps(m, "block128", "prox")
    mlp = m.model.layers[0].mlp
    sd_dense = {k: v.clone() for k, v in mlp.state_dict().items()}
    sp = prox.SparseMLP.from_mlp(mlp, dtype=torch.float32)  # keep_down=False: W_down lives as W_down^T
    sd = sp.state_dict()
    assert set(sd) == set(sd_dense)
    for k in sd:
        assert torch.equal(sd[k].view(torch.uint8) if sd[k].dtype == fp8.E4M3 else sd[k],
                           sd_dense[k].view(torch.uint8) if sd_dense[k].dtype == fp8.E4M3 else sd_dense[k]), k
    m2 = _tiny_llama(1, seed=1)
    prox.quantize_mlps(m2, "block128", "prox")
    sp2 = prox.SparseMLP.from_mlp(m2.model.layers[0].mlp, dtype=torch.float32)
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        assert not torch.equal(sp2(x), sp(x))
        sp2.load_state_dict(sd)
        assert torch.equal(sp2(x), sp(x))  # W_down^T, its scales and the proxies re-derived
        assert torch.equal(sp2.w_down_t_scale, sp.w_down_t_scale)
    # model.half(): the FP8 codes and scales stay, the activation dtype follows
    sp.half()
    assert sp.gate_proj.weight.dtype == fp8.E4M3 and sp.down_t.dtype == fp8.E4M3
    assert sp.w_gate_scale.dtype == torch.float32 and sp.act_dtype == torch.float16
    with torch.no_grad():
        assert sp(x.half()).dtype == torch.float16
    # an in-place change of a scale is seen (the layer refuses to run until refresh())
    with torch.no_grad():
        sp.gate_proj.weight_scale.mul_(2)
    with pytest.raises(RuntimeError, match="refresh"):
        sp(x.half())
    sp.refresh()
    assert torch.equal(sp.w_gate_scale, sp.gate_proj.weight_scale.reshape(sp.w_gate_scale.shape))


def test_sparse_mlp_fp8_refusals():
    m = _tiny_llama(1)
    mlp = m.model.layers[0].mlp
    mlp.gate_proj = prox.Fp8Linear.from_linear(mlp.gate_proj, "channel")
    with pytest.raises(ValueError, match="gate_proj is fp8_channel, up_proj is native, down_proj is native: an MLP's "
                                         "three projections must share one weight format"):
        prox.SparseMLP.from_mlp(mlp)
    mlp.up_proj = prox.Fp8Linear.from_linear(mlp.up_proj, "block128")
    mlp.down_proj = prox.Fp8Linear.from_linear(mlp.down_proj, "block128")
    with pytest.raises(ValueError, match="gate_proj is fp8_channel, up_proj is fp8_block128, down_proj is "
                                         "fp8_block128: an MLP's three projections must share one weight format"):
        prox.SparseMLP.from_mlp(mlp)
    mlp.gate_proj = prox.Fp8Linear.from_linear(_linear(160, 64, 1), "block128")
    with pytest.raises(TypeError, match="dtype must be torch.float16, torch.bfloat16 or torch.float32"):
        prox.SparseMLP.from_mlp(mlp, dtype=torch.float64)
    with torch.no_grad():
        mlp.up_proj.weight_scale[0, 0] = float("nan")
    with pytest.raises(ValueError, match="up_proj's scales holds an invalid scale: element 0"):
        prox.SparseMLP.from_mlp(mlp)
    native = _tiny_llama(1).model.layers[0].mlp
    with pytest.raises(TypeError, match="dtype= is for FP8 projections"):
        prox.SparseMLP.from_mlp(native, dtype=torch.float16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sparsify_fp8_model_records_format_and_alpha(tmp_path, layout):
    m = _tiny_llama(2)
    prox.quantize_mlps(m, layout, "prox")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    cfg = prox.sparsify(m, 0.6, ids, track_sparsity=True, model_name="tiny-fp8")
    want = prox.allocate_sparsity(0.6, prox.FP8_ALPHA)
    assert cfg.alpha == prox.FP8_ALPHA and want != prox.allocate_sparsity(0.6)
    for r in cfg.layers:
        assert r.format == prox.formats.fp8_format(layout).name and (r.s1, r.s2) == pytest.approx((want.s1, want.s2))
        assert r.realized_s2 == pytest.approx(want.s2, abs=0.03) and r.fingerprint["dtype"] == "float8_e4m3fn"
    for _, sp in prox.nn.sparse_mlps(m):
        assert sp.format == prox.formats.fp8_format(layout).name and sp.act_dtype == torch.float32
    with torch.no_grad():
        prox.set_mode(m, prefill="sparse")
        logits = m(ids).logits
    rep = prox.sparsity_report(m)
    assert rep["effective"] == pytest.approx(prox.effective_sparsity(rep["s1"], rep["s2"], prox.FP8_ALPHA))
    path = tmp_path / "th.json"
    prox.save_thresholds(path, cfg)
    d = json.loads(path.read_text())
    assert d["version"] == 4 and d["configs"][0]["alpha"] == prox.FP8_ALPHA
    assert {r["format"] for r in d["configs"][0]["layers"]} == {prox.formats.fp8_format(layout).name}
    m2 = _tiny_llama(2)
    prox.quantize_mlps(m2, layout, "prox")
    prox.sparsify(m2, 0.6, thresholds=path, prefill="sparse", model_name="tiny-fp8")
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, logits)
    # thresholds of FP8 weights do not apply to the unquantized model, nor the reverse
    with pytest.raises(ValueError, match="calibrated on 'fp8_"):
        prox.sparsify(_tiny_llama(2), 0.6, thresholds=path)
    other = tmp_path / "native.json"
    prox.save_thresholds(other, prox.sparsify(_tiny_llama(2), 0.6, ids))
    m3 = _tiny_llama(2)
    prox.quantize_mlps(m3, layout, "prox")
    with pytest.raises(ValueError, match="calibrated on 'native' weights"):
        prox.sparsify(m3, 0.6, thresholds=other)


def test_sparsify_runs_without_the_checkpoints_fp8_kernels():
    """transformers' FP8Linear forward needs its Triton kernel (the `kernels` package, missing on the GPU machine):
    sparsify's dense passes go through SparseMLP's dense path (the dequantized weights), never that forward."""
    pytest.importorskip("transformers")
    m = _tiny_llama(2)
    prox.quantize_mlps(m, "block128", "transformers")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    cfg = prox.sparsify(m, 0.5, ids)
    want = prox.allocate_sparsity(0.5, prox.FP8_ALPHA)
    assert [r.format for r in cfg.layers] == ["fp8_block128"] * 2
    for r in cfg.layers:
        assert r.realized_s2 == pytest.approx(want.s2, abs=0.03)


def test_thresholds_version2_file_is_native(tmp_path):
    m = _tiny_llama(1)
    cfg = prox.sparsify(m, 0.5, torch.randint(0, 128, (1, 16)))
    path = tmp_path / "th.json"
    prox.save_thresholds(path, cfg)
    d = json.loads(path.read_text())
    d["version"] = 2
    for c in d["configs"]:
        for r in c["layers"]:
            del r["format"]
    path.write_text(json.dumps(d))
    assert all(r.format == "native" for r in prox.load_thresholds(path)[0].layers)
    prox.sparsify(_tiny_llama(1), 0.5, thresholds=path)


def test_fp8_alpha_allocation():
    assert prox.alpha_for("fp8_block128") == prox.alpha_for("fp8_channel") == prox.FP8_ALPHA
    assert prox.alpha_for("native") == prox.ALPHA
    st = prox.allocate_sparsity(0.7, prox.FP8_ALPHA)
    assert prox.effective_sparsity(st.s1, st.s2, prox.FP8_ALPHA) == pytest.approx(0.7)
    assert prox.max_effective_sparsity(prox.FP8_ALPHA) < prox.max_effective_sparsity()


# ---------------------------------------------------------------- the tools' FP8 flags


def test_eval_ppl_fp8_flag_and_quantization():
    from prox import eval_ppl
    with pytest.raises(SystemExit):
        eval_ppl.main(["--fp8", "int4"])  # argparse: choices channel, block128
    m = _tiny_llama(1)
    names = eval_ppl.quantize_for_eval(m, "channel")
    assert names == ["model.layers.0.mlp"] and isinstance(m.model.layers[0].mlp.gate_proj, prox.Fp8Linear)


def test_bench_decode_fp8_cpu_smoke(tmp_path):
    """bench_decode --fp8 on CPU is a smoke test: the tiny Qwen3 shape with block-128 FP8 MLPs (prox's host
    quantizer), the lean step dense (the dequantized FFN) and Prox (the torch reference) run; nothing is timed."""
    pytest.importorskip("transformers")
    from prox import bench_decode
    out = tmp_path / "decode.json"
    rc = bench_decode.main(["--device", "cpu", "--models", "tiny", "--fp8", "block128", "--contexts", "16",
                            "--e", "0.5,0.7", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["backend_used"] == "torch" and res["fp8"] == "block128"
    assert res["alpha"] == prox.FP8_ALPHA and res["non_mlp"] == "bf16"
    assert sorted(res["cells"]) == ["tiny-fp8/bf16/16/lean"]
    cell = res["cells"]["tiny-fp8/bf16/16/lean"]
    assert "error" not in cell, cell.get("error")
    for e, v in cell["prox"].items():
        assert v["target"]["s2"] == pytest.approx(prox.allocate_sparsity(float(e), prox.FP8_ALPHA).s2)
    with pytest.raises(SystemExit):
        bench_decode.main(["--device", "cpu", "--models", "tiny", "--fp8", "block128", "--steps", "hf"])
