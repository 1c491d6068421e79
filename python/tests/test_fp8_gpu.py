# SPDX-License-Identifier: Apache-2.0
"""FP8 e4m3 Stage-2 weights on the GPU: the device helpers bit for bit against the host ones; the FP8 op (both
scale layouts, fp16/bf16 activations, both activations, odd shapes) against the float64 reference of the
dequantized weights on the device's own channel mask, batch 1 and batched; the dense FP8 Stage 2 (dense_ffn);
SparseMLP on transformers' fine-grained FP8Linear and prox.Fp8Linear (op vs reference, decode vs sparse prefill,
a batch); torch.compile and CUDA-graph capture; bad input (invalid scales, misaligned FP8 weights, block-scale
shapes) refused with a clear error and nothing launched."""
import math

import pytest
import torch

import prox
import refs
from conftest import Decoder, assert_replays_follow_thresholds, requires_cuda
from prox import fp8, reference

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]
ACTS = ["silu", "gelu_tanh"]
LAYOUTS = ["channel", "block128"]
# (d_model, d_ff): the smallest FP8 d_model (16), odd multiples (partial 128-blocks both ways), SmolLM2-135M, a
# Qwen3-1.7B-sized layer
SHAPES = [(16, 32), (208, 96), (1040, 2016), (576, 1536), (2048, 6144)]


def fp8_weights(d_model, d_ff, layout, seed=0):
    """(q_gate, s_gate, q_up, s_up, q_down, s_down) on the GPU: random weights quantized with prox's rule."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = 1.0 / math.sqrt(d_model)
    out = []
    for shape, sigma in (((d_ff, d_model), s), ((d_ff, d_model), s), ((d_model, d_ff), 1.0 / math.sqrt(d_ff))):
        out += fp8.quantize(torch.randn(shape, device="cuda", generator=g) * sigma, layout)
    return out


def planned(shape, layout, dtype, act="silu", seed=0, **kw):
    qg, sg, qu, su, qd, sd = fp8_weights(*shape, layout, seed)
    return prox.PlannedFfn(qg, qu, qd, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd, dtype=dtype, act=act, **kw)


def thresholds_for(x, ffn, act, s1, s2):
    a = x.float().abs().reshape(-1).sort().values
    tau_x = float(a[min(int(s1 * a.numel()), a.numel() - 1)])
    sp, _ = refs.stage1(x, ffn.proxy_gate, ffn.scale_gate, ffn.proxy_up, ffn.scale_up, tau_x, act)
    b = sp.abs().sort().values
    return tau_x, float(b[min(int(s2 * b.numel()), b.numel() - 1)])


def check_token(out_y, out_mask, out_sp, out_s, x, ffn, act, tau_x, tau_s, dtype):
    """One token's outputs against the float64 reference of the dequantized weights: s~ within its bound (the
    proxies are packed from the dequantized weights), the mask exactly |s~| >= tau_s on the device's s~, s and y
    within the fp32 bounds doubled for the scales' roundings (one per channel sum, or per 16-weight piece with
    block scales: tests/fp8_fixture.hpp's widen_for_scales) plus the output rounding."""
    d_ff = ffn.d_ff
    mask = reference.mask_words_to_bool(out_mask, d_ff)
    sp_ref, sp_err = refs.stage1(x, ffn.proxy_gate, ffn.scale_gate, ffn.proxy_up, ffn.scale_up, tau_x, act)
    assert ((out_sp.double() - sp_ref).abs() <= sp_err + 1e-30).all()
    assert torch.equal(mask, out_sp.abs() >= tau_s)
    clear = (sp_ref.abs() - tau_s).abs() > sp_err
    assert torch.equal(mask[clear], (sp_ref.abs() >= tau_s)[clear])
    wg, wu, wdt = ffn.exact_weights(torch.float64)
    s_ref, s_err, y_ref, y_err = refs.stage2(x, wg, wu, wdt, mask, act)
    assert ((out_s.double() - s_ref).abs() <= 2 * s_err + 1e-30).all()
    assert (out_s[~mask] == 0).all()
    tol = 2 * y_err + refs.store_rel(dtype) * y_ref.abs() + 1e-30
    assert ((out_y.double().reshape(-1) - y_ref).abs() <= tol).all(), \
        float(((out_y.double().reshape(-1) - y_ref).abs() - tol).max())
    return mask, clear


# ---------------------------------------------------------------- offline helpers on the device


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (1536, 576), (4096, 12288)])
def test_device_helpers_match_host(shape, layout):
    w = torch.randn(shape, device="cuda") * 0.05
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, s = fp8.quantize(w.to(dtype), layout)
        qh, sh = fp8.quantize(w.to(dtype).cpu(), layout)
        assert torch.equal(q.view(torch.uint8).cpu(), qh.view(torch.uint8)) and torch.equal(s.cpu(), sh)
    qt, st = fp8.transpose_down(q, s, layout)
    qth, sth = fp8.transpose_down(qh, sh, layout)
    assert torch.equal(qt.view(torch.uint8).cpu(), qth.view(torch.uint8)) and torch.equal(st.cpu(), sth)
    if shape[0] % 32 == 0:
        p, ps = fp8.pack_int4(q, s, layout)
        ph, psh = fp8.pack_int4(qh, sh, layout)
        assert torch.equal(p.cpu(), ph) and torch.equal(ps.cpu(), psh)
        pr, psr = reference.pack_int4(fp8.dequantize(q, s, layout))
        assert torch.equal(p, pr) and torch.equal(ps, psr)


def test_device_check_scales_names_the_first_bad():
    s = torch.rand(40, 33, device="cuda") + 0.1
    fp8.check_scales(s, "w")
    s[3, 7] = -2.0
    s[9, 1] = float("nan")
    with pytest.raises(ValueError, match=r"w_down_t_scale holds an invalid scale: element 106 \(flattened\) is -2.0"):
        fp8.check_scales(s, "w_down_t_scale")


# ---------------------------------------------------------------- the FP8 op against the float64 reference


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("target", [(0.1, 0.7), (0.7, 0.77)])
def test_fp8_ffn_matches_float64_reference(shape, dtype, act, layout, target):
    ffn = planned(shape, layout, dtype, act)
    assert ffn.layer_tensors().format == prox.formats.fp8_format(layout).name
    torch.manual_seed(1)
    for _ in range(2):
        x = torch.randn(shape[0], device="cuda").to(dtype)
        tau_x, tau_s = thresholds_for(x, ffn, act, *target)
        ffn.set_thresholds(tau_x, tau_s)
        out = ffn.run(x, return_mask=True, return_s_proxy=True, return_s=True)
        assert out.y.shape == x.shape and out.y.dtype == dtype
        check_token(out.y, out.mask, out.s_proxy, out.s, x, ffn, act, tau_x, tau_s, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(208, 96), (1040, 2016), (2048, 6144)])
@pytest.mark.parametrize("tokens", [2, 3, 8])
def test_fp8_batch_matches_float64_reference(tokens, shape, dtype, layout):
    act = "gelu_tanh" if tokens == 3 else "silu"
    ffn = planned(shape, layout, dtype, act, seed=11, max_tokens=prox.MAX_TOKENS)
    torch.manual_seed(12)
    x = torch.randn(tokens, shape[0], device="cuda").to(dtype)
    tau_x, tau_s = thresholds_for(x[0], ffn, act, 0.55, 0.7)
    ffn.set_thresholds(tau_x, tau_s)
    out = ffn.run(x, return_mask=True, return_s_proxy=True, return_s=True)
    assert out.y.shape == x.shape and out.mask.shape == (tokens, shape[1] // 32)
    for b in range(tokens):
        mask, clear = check_token(out.y[b], out.mask[b], out.s_proxy[b], out.s[b], x[b], ffn, act, tau_x, tau_s, dtype)
        alone = reference.mask_words_to_bool(ffn.run(x[b], return_mask=True).mask, shape[1])
        assert torch.equal(alone[clear], mask[clear])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_boundaries_and_dense_kernel(layout, dtype):
    """Everything kept: the dense FP8 FFN; nothing kept: y = 0; dense_ffn (prox's own FP8 Stage 2 on every channel,
    no Stage 1) within the dense bound of the float64 reference, and capturable once planned."""
    shape = (1040, 2016)
    ffn = planned(shape, layout, dtype, seed=3)
    x = torch.randn(1, shape[0], device="cuda").to(dtype)
    wg, wu, wdt = ffn.exact_weights(torch.float64)
    dense = refs.dense(x, wg, wu, wdt, "silu")
    _, _, _, y_err = refs.stage2(x, wg, wu, wdt, torch.ones(shape[1], dtype=torch.bool, device="cuda"), "silu")
    tol = 2 * y_err + refs.store_rel(dtype) * dense.abs() + 1e-30
    ffn.set_thresholds(0.0, 0.0)
    out = ffn.run(x, return_mask=True)
    assert bool((out.mask == -1).all()) and ((out.y.double().reshape(-1) - dense).abs() <= tol).all()
    ffn.set_thresholds(0.0, math.inf)
    assert torch.count_nonzero(ffn.run(x)) == 0
    yd = ffn.dense(x)
    assert yd.shape == x.shape and ((yd.double().reshape(-1) - dense).abs() <= tol).all()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = ffn.dense(x)
    g.replay()
    assert torch.equal(yg, yd)


def test_fp8_invalid_scale_at_plan_names_the_slot():
    """A layer handed to the op with an invalid scale: plan() checks the scales on the device, and the error names
    the slot and the element (nothing runs)."""
    ffn = planned((208, 96), "block128", torch.bfloat16, seed=4)
    lt = ffn.layer_tensors()
    bad = lt.w_down_t_scale.clone()
    bad[0, 1] = 0.0
    lt = lt._replace(w_down_t_scale=bad)
    with pytest.raises(ValueError, match=r"w_down_t_scale holds an invalid scale: element 1 \(flattened\)"):
        torch.ops.prox.plan_ffn(lt.tensors(), lt.format_code(), ffn.thresholds, 0, ffn._options, 1, False,
                                torch.bfloat16)
    c = prox.new_counters()
    with pytest.raises(ValueError, match="w_down_t_scale holds an invalid scale"):
        torch.ops.prox.sparse_ffn(torch.zeros(208, device="cuda", dtype=torch.bfloat16), lt.tensors(),
                                  lt.format_code(), ffn.thresholds, ffn.workspace, 0, ffn._options, counters=c)
    assert int(c[0]) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_plan_cache_key_covers_every_slot(layout):
    """An FP8 layer with any one of its ten slots (its weight scales included) moved to a copy gets a plan of its
    own and runs as the original does."""
    ffn = planned((208, 96), layout, torch.bfloat16, seed=12, tau_x=0.3, tau_s=0.01)
    lt = ffn.layer_tensors()
    x = torch.randn(208, device="cuda").bfloat16()
    y = ffn.run(x)
    for i, name in enumerate(prox.LAYER_SLOTS):
        moved = lt._replace(**{name: getattr(lt, name).clone()})
        n = prox.plan_cache_size()
        torch.ops.prox.plan_ffn(moved.tensors(), moved.format_code(), ffn.thresholds, 0, ffn._options, 1, False,
                                torch.bfloat16)
        assert prox.plan_cache_size() == n + 1, f"{name}: a copy of it found the original's plan"
        got = torch.ops.prox.sparse_ffn(x, moved.tensors(), moved.format_code(), ffn.thresholds, ffn.workspace, 0,
                                        ffn._options)[0]
        assert torch.equal(got, y), name


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_fp8_bad_input_raises_before_launch(bad):
    shape = (208, 96)
    qg, sg, qu, su, qd, sd = fp8_weights(*shape, "block128", seed=5)
    s = sg.clone()  # [1, 2] blocks
    s.view(-1)[1] = bad
    with pytest.raises(ValueError, match=r"w_gate_scale holds an invalid scale: element 1"):
        prox.PlannedFfn(qg, qu, qd, w_gate_scale=s, w_up_scale=su, w_down_scale=sd, dtype=torch.float16)
    s = sd.clone()
    s.view(-1)[0] = bad
    with pytest.raises(ValueError, match="w_down_scale holds an invalid scale: element 0"):
        prox.PlannedFfn(qg, qu, qd, w_gate_scale=sg, w_up_scale=su, w_down_scale=s, dtype=torch.float16)
    ffn = prox.PlannedFfn(qg, qu, qd, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd, dtype=torch.float16)
    x = torch.randn(208, device="cuda").half()
    c = prox.new_counters()
    buf = torch.zeros(96 * 208 + 16, dtype=torch.uint8, device="cuda").view(fp8.E4M3)
    lt = ffn.layer_tensors()
    cases = [
        (lt._replace(w_up=buf[1:1 + 96 * 208].view(96, 208)), ValueError, "w_up must be 16-byte aligned"),
        (lt._replace(w_gate_scale=lt.w_gate_scale.t().contiguous()), ValueError, r"w_gate_scale must have shape \(1, 2\)"),
        (lt._replace(w_down_t_scale=None), ValueError, "w_down_t_scale is missing"),
        (lt._replace(w_up=lt.w_up.view(torch.uint8)), TypeError, "w_up must be torch.float8_e4m3fn"),
    ]
    for layer, exc, text in cases:
        with pytest.raises(exc, match=text):
            torch.ops.prox.sparse_ffn(x, layer.tensors(), layer.format_code(), ffn.thresholds, ffn.workspace, 0,
                                      ffn._options, counters=c)
    with pytest.raises(TypeError, match="x must be torch.float16 or torch.bfloat16 for the fp8_block128 format"):
        ffn.run(x.float())
    with pytest.raises(TypeError, match="FP8 weights need dtype"):
        prox.PlannedFfn(qg, qu, qd, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd)
    with pytest.raises(ValueError, match="w_down_scale has shape"):
        prox.PlannedFfn(qg, qu, qd, w_gate_scale=sg, w_up_scale=su, w_down_scale=sd.t().contiguous(),
                        dtype=torch.float16)
    assert int(c[0]) == 0  # no kernel ran


# ---------------------------------------------------------------- SparseMLP on FP8 linears


def tiny_fp8(layout, module, dtype=torch.bfloat16, layers=2, seed=0):
    transformers = pytest.importorskip("transformers")  # here: the op tests above run without it
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()
    prox.quantize_mlps(m, layout, module)
    return m


@pytest.mark.parametrize("layout,module", [("channel", "prox"), ("block128", "transformers")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mlp_fp8_op_vs_reference_and_prefill(layout, module, dtype):
    m = tiny_fp8(layout, module, dtype)
    mlp = m.model.layers[0].mlp
    x = torch.randn(1, 12, 256, device="cuda", dtype=dtype)
    with torch.no_grad():
        sp = prox.SparseMLP.from_mlp(mlp, dtype=dtype, keep_down=True)
        assert sp.format == prox.formats.fp8_format(layout).name and sp.backend_in_use() == "op"
        wg, wu, wdt = sp.exact_weights(torch.float64)
        want = ((torch.nn.functional.silu(x.double() @ wg.t()) * (x.double() @ wu.t())) @ wdt)
        sp.prefill_gemm = "dequantized"  # weight-only: the weights dequantized to x's dtype (test_fp8_prefill_gemm)
        assert torch.allclose(sp(x).double(), want, rtol=2e-2, atol=2e-3)  # prefill: dense FP8 in x's dtype
        sp.prefill_gemm = "auto"
        sp.set_thresholds(0.5, 0.01)
        one = sp(x[:, :1])  # decode: the FP8 op
        sp.backend = "torch"
        ref = sp(x[:, :1])
        sp.backend = "auto"
        assert (one.float() - ref.float()).norm() / ref.float().norm() < 2e-2
        sp.prefill = "sparse"
        rows = sp(x)
        for t in range(12):
            assert torch.equal(rows[:, t:t + 1], sp(x[:, t:t + 1]))
        three = sp(x[:, :3])  # a batch: one batched op call
        for t in range(3):
            assert (three[:, t].float() - rows[:, t].float()).norm() <= 2e-2 * rows[:, t].float().norm()
        assert sp.plan() is not None


def test_sparsify_fp8_model_on_gpu(tmp_path):
    m = tiny_fp8("block128", "transformers", torch.bfloat16)
    ids = torch.randint(0, 512, (2, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    cfg = prox.sparsify(m, 0.5, ids, track_sparsity=True)
    want = prox.allocate_sparsity(0.5, prox.FP8_ALPHA)
    assert cfg.alpha == prox.FP8_ALPHA and all(r.format == "fp8_block128" for r in cfg.layers)
    for r in cfg.layers:
        assert r.realized_s1 == pytest.approx(want.s1, abs=0.02) and r.realized_s2 == pytest.approx(want.s2, abs=0.03)
    assert {sp.backend_in_use() for _, sp in prox.nn.sparse_mlps(m)} == {"op"}
    with torch.no_grad():
        prox.set_mode(m, prefill="sparse")
        m(ids)
    rep = prox.sparsity_report(m)
    assert rep["s2"] == pytest.approx(want.s2, abs=0.04)
    path = tmp_path / "th.json"
    prox.save_thresholds(path, cfg)
    m2 = tiny_fp8("block128", "transformers", torch.bfloat16)
    prox.sparsify(m2, 0.5, thresholds=path)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_torch_compile_fullgraph(mode, layout):
    torch._dynamo.reset()
    m = tiny_fp8(layout, "prox", torch.bfloat16, layers=1)
    mod = Decoder(prox.SparseMLP.from_mlp(m.model.layers[0].mlp, dtype=torch.bfloat16, tau_x=0.3, tau_s=0.02))
    h = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = mod(h)
        comp = torch.compile(mod, fullgraph=True, mode=mode)
        for _ in range(3):
            got = comp(h)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    mod.mlp.set_thresholds(0.6, 0.05)
    with torch.no_grad():
        assert torch.equal(comp(h), mod(h))


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp8_graph_capture_with_changing_thresholds(tokens):
    m = tiny_fp8("block128", "transformers", torch.float16, layers=1)
    mlp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp, dtype=torch.float16, tau_x=0.3, tau_s=0.02)
    x = torch.randn(1, tokens, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        mlp.plan()
    assert_replays_follow_thresholds(mlp, x)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().reshape(-1).view(torch.uint8)


def _opcheck_fp8(op, args, test_utils):
    """torch.library.opcheck where an argument holds FP8 e4m3 tensors: its test_schema cannot run there (torch's
    SchemaCheckMode compares the inputs before and after with ops FP8 lacks: '"mul_cuda" not implemented for
    'Float8_e4m3fn'', torch 2.11 on the H100), so what it checks is checked here instead: every tensor of an argument
    the schema does not mark as written keeps its bytes through a call. The other utils run as asked."""
    torch.library.opcheck(op, args, test_utils=tuple(u for u in test_utils if u != "test_schema"))
    if "test_schema" not in test_utils:
        return
    read_only = []
    for a, arg in zip(op._schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write:
            continue
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        read_only += [(a.name, t) for t in items if isinstance(t, torch.Tensor)]
    before = [_bytes(t) for _, t in read_only]
    op(*args)
    torch.cuda.synchronize()
    for (name, t), b in zip(read_only, before):
        assert torch.equal(_bytes(t), b), f"{op}: read-only argument {name} was written"


def test_fp8_opcheck():
    ffn = planned((208, 96), "channel", torch.float16, seed=10, tau_x=0.3, tau_s=0.01)
    x = torch.randn(1, 208, device="cuda").half()
    lt = ffn.layer_tensors()
    args = (x, lt.tensors(), lt.format_code(), ffn.thresholds, ffn.workspace, 0, ffn._options, True, True, True,
            prox.new_counters())
    _opcheck_fp8(torch.ops.prox.sparse_ffn.default, args,
                 test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    _opcheck_fp8(torch.ops.prox.dense_ffn.default,
                 (x, lt.tensors(), lt.format_code(), ffn.thresholds, 0, ffn._options),
                 test_utils=("test_schema", "test_faketensor"))
    w = torch.randn(96, 208, device="cuda")
    torch.library.opcheck(torch.ops.prox.fp8_quantize.default, (w, 1), test_utils=("test_schema", "test_faketensor"))
    q, s = fp8.quantize(w, "block128")
    _opcheck_fp8(torch.ops.prox.fp8_transpose_down.default, (q, s, 1), test_utils=("test_schema", "test_faketensor"))
    _opcheck_fp8(torch.ops.prox.fp8_pack_int4.default, (q, s, 1), test_utils=("test_schema", "test_faketensor"))


def _w8a8_reference(x, sp, keep_down):
    """The dense FFN as the FP8 GEMM path computes it (per-channel scales), in float64: the activations quantized to
    e4m3 per token by the same function, the weights dequantized exactly; g and u rounded to x's dtype where
    _scaled_mm rounds them; h quantized too where W_down goes through _scaled_mm (kept), else h as it is (W_down^T
    dequantized)."""
    wg, wu, wdt = sp.exact_weights(torch.float64)

    def deq(a):
        q, s = fp8.quantize_rows(a)
        return q.double() * s.double()
    x2 = x.reshape(-1, x.shape[-1])
    xq = deq(x2)
    g, u = (xq @ wg.t()).to(x.dtype), (xq @ wu.t()).to(x.dtype)
    h = torch.nn.functional.silu(g) * u
    return ((deq(h) if keep_down else h.double()) @ wdt).reshape(x.shape)


@pytest.mark.parametrize("layout,module", [("channel", "prox"), ("block128", "transformers"), ("block128", "prox")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep_down", [False, True])
def test_fp8_prefill_gemm(layout, module, dtype, keep_down, monkeypatch):
    """FP8 prefill (512 tokens): "auto" runs gate and up (and W_down, kept) through torch._scaled_mm for per-channel
    scales (bfloat16 on sm_89+), within rounding of the W8A8 float64 reference; "dequantized" (and "auto" elsewhere:
    fp16, block scales) the weights one matrix at a time in x's dtype, within its rounding of the float64 dense
    FFN. Neither makes a float32 copy of the weights."""
    m = tiny_fp8(layout, module, dtype)
    sp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp, dtype=dtype, keep_down=keep_down, tau_x=0.5, tau_s=0.01)
    x = torch.randn(1, 512, 256, device="cuda", dtype=dtype)
    wg, wu, wdt = sp.exact_weights(torch.float64)
    exact = (torch.nn.functional.silu(x.double() @ wg.t()) * (x.double() @ wu.t())) @ wdt
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (calls.append(a[1].shape), real(*a, **k))[1])
    with torch.no_grad():
        sp.prefill_gemm = "dequantized"
        y = sp(x)
        assert not calls and y.dtype == dtype
        assert (y.double() - exact).norm() / exact.norm() < 1e-2
        sp.prefill_gemm = "auto"
        y = sp(x)
    fp8_gemm = sp.fmt.scaled_mm_ok(x[0], 768, 256)
    assert fp8_gemm == (layout == "channel" and dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 9))
    if fp8_gemm:
        assert len(calls) == (3 if keep_down else 2)
        want = _w8a8_reference(x, sp, keep_down)
        assert (y.double() - want).norm() / want.norm() < 2e-2
        assert (y.double() - exact).norm() / exact.norm() < 1e-1  # the activations' e4m3 rounding
    else:
        assert not calls and (y.double() - exact).norm() / exact.norm() < 1e-2


def test_fp8_prefill_peak_memory():
    """The dense FP8 prefill of a 4096 x 12288 layer (Qwen3-8B's MLP shape, block scales) holds at most one weight
    matrix in bfloat16 at a time (about 100 MB), never the three in float32 (about 600 MB)."""
    mlp = torch.nn.Module()
    for name, (o, i) in (("gate_proj", (12288, 4096)), ("up_proj", (12288, 4096)), ("down_proj", (4096, 12288))):
        q, s = fp8.quantize(torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / 64, "block128")
        setattr(mlp, name, prox.Fp8Linear(q, s))
    mlp.act_fn = torch.nn.SiLU()
    sp = prox.SparseMLP.from_mlp(mlp, dtype=torch.bfloat16, prefill_gemm="dequantized")
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        sp(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sp(x)
        peak = torch.cuda.max_memory_allocated() - base
    one_bf16 = 12288 * 4096 * 2
    # One matrix in bfloat16 (96 MiB), the dequantization's float32 chunk (2048 rows: 32-96 MiB) and the GEMMs' outputs
    # (512 x 12288 bf16: 12 MiB each): 172 MiB on the H200; the three matrices in float32 were 660 MiB.
    assert peak < 2 * one_bf16, peak / 2 ** 20
