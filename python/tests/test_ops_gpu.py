# SPDX-License-Identifier: Apache-2.0
"""The ops on the GPU against torch references: INT4 packing and the transpose bit for bit, the FFN against
the float64 reference of Prox on the device's own channel mask (with fp32 error bounds), boundary
densities, counters, the workspace contract, bad inputs (a clear error and nothing launched), CUDA-graph
capture with thresholds changed between replays, torch.compile, and torch.library.opcheck; batches of 2 to
8 tokens (run_batch) against the same reference and against each token run alone."""
import math

import pytest
import torch

import prox
import refs
from conftest import Decoder, assert_replays_follow_thresholds, requires_cuda
from prox import reference

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]
ACTS = ["silu", "gelu_tanh"]
# (d_model, d_ff): the smallest legal, odd multiples, SmolLM2-135M, a Qwen3-1.7B-sized layer
SHAPES = [(8, 32), (72, 160), (200, 96), (576, 1536), (2048, 6144)]


def make_layer(d_model, d_ff, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = 1.0 / math.sqrt(d_model)
    wg = (torch.randn(d_ff, d_model, device="cuda", generator=g) * s).to(dtype)
    wu = (torch.randn(d_ff, d_model, device="cuda", generator=g) * s).to(dtype)
    wd = (torch.randn(d_model, d_ff, device="cuda", generator=g) / math.sqrt(d_ff)).to(dtype)
    return wg, wu, wd


def thresholds_for(x, wg, wu, ffn, act, s1, s2):
    """(tau_x, tau_s) realizing about (s1, s2) on this token (float64 reference)."""
    a = x.float().abs().reshape(-1).sort().values
    tau_x = float(a[min(int(s1 * a.numel()), a.numel() - 1)])
    sp, _ = refs.stage1(x, ffn.proxy_gate, ffn.scale_gate, ffn.proxy_up, ffn.scale_up, tau_x, act)
    b = sp.abs().sort().values
    tau_s = float(b[min(int(s2 * b.numel()), b.numel() - 1)])
    return tau_x, tau_s


# ---------------------------------------------------------------- offline ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 1), (32, 37), (160, 72), (1536, 576), (12288, 4096)])
def test_pack_int4_device_matches_reference(shape, dtype):
    w = (torch.randn(shape, device="cuda") * 0.03).to(dtype)
    w[1] = 0
    p, s = prox.pack_int4(w)
    p_ref, s_ref = reference.pack_int4(w)
    assert torch.equal(p, p_ref) and torch.equal(s, s_ref)
    p_host, s_host = prox.pack_int4(w.cpu())  # prox::int4::pack_host
    assert torch.equal(p.cpu(), p_host) and torch.equal(s.cpu(), s_host)


def test_pack_int4_device_rejects_bad_input():
    w = torch.zeros(64, 16, dtype=torch.float16, device="cuda")
    w[5, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        prox.pack_int4(w)
    with pytest.raises(ValueError, match="multiple of 32"):
        prox.pack_int4(torch.zeros(40, 16, dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        prox.pack_int4(torch.zeros(16, 64, dtype=torch.float16, device="cuda").t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (576, 1536), (4096, 12288)])
def test_transpose_device(shape, dtype):
    w = torch.randn(shape, device="cuda").to(dtype)
    assert torch.equal(prox.transpose(w), w.t().contiguous())


# ---------------------------------------------------------------- the FFN


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("target", [(0.1, 0.7), (0.55, 0.7), (0.7, 0.77)])
def test_ffn_matches_float64_reference(shape, dtype, act, target):
    d_model, d_ff = shape
    wg, wu, wd = make_layer(d_model, d_ff, dtype)
    ffn = prox.PlannedFfn(wg, wu, wd, act=act)
    torch.manual_seed(1)
    for token in range(3):
        x = torch.randn(d_model, device="cuda").to(dtype)
        tau_x, tau_s = thresholds_for(x, wg, wu, ffn, act, *target)
        ffn.set_thresholds(tau_x, tau_s)
        out = ffn.run(x, return_mask=True, return_s_proxy=True, return_s=True)
        assert out.y.shape == x.shape and out.y.dtype == dtype
        mask = reference.mask_words_to_bool(out.mask, d_ff)
        # Stage 1: s~ within its bound; the mask is exactly |s~| >= tau_s on the device's own s~, and agrees
        # with the reference wherever the reference's decision is not within rounding of tau_s.
        sp_ref, sp_err = refs.stage1(x, ffn.proxy_gate, ffn.scale_gate, ffn.proxy_up, ffn.scale_up, tau_x, act)
        assert ((out.s_proxy.double() - sp_ref).abs() <= sp_err + 1e-30).all()
        assert torch.equal(mask, out.s_proxy.abs() >= tau_s)
        clear = ((sp_ref.abs() - tau_s).abs() > sp_err)
        assert torch.equal(mask[clear], (sp_ref.abs() >= tau_s)[clear])
        # Stage 2 on the device's mask: s and y within their bounds (+ the output rounding to fp16/bf16)
        s_ref, s_err, y_ref, y_err = refs.stage2(x, wg, wu, ffn.w_down_t, mask, act)
        assert ((out.s.double() - s_ref).abs() <= s_err + 1e-30).all()
        assert (out.s[~mask] == 0).all()
        tol = y_err + refs.store_rel(dtype) * y_ref.abs() + 1e-30
        assert ((out.y.double() - y_ref).abs() <= tol).all(), float(((out.y.double() - y_ref).abs() - tol).max())


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ffn_boundary_densities(dtype, act):
    d_model, d_ff = 576, 1536
    wg, wu, wd = make_layer(d_model, d_ff, dtype, seed=3)
    ffn = prox.PlannedFfn(wg, wu, wd, act=act)
    x = torch.randn(1, d_model, device="cuda").to(dtype)
    dense = refs.dense(x, wg, wu, ffn.w_down_t, act)
    _, _, _, y_err = refs.stage2(x, wg, wu, ffn.w_down_t, torch.ones(d_ff, dtype=torch.bool, device="cuda"), act)
    tol = y_err + refs.store_rel(dtype) * dense.abs() + 1e-30
    for tau_x, tau_s in [(0.0, 0.0), (math.inf, 0.0)]:  # everything kept / no input: s~ = 0 >= 0, every channel
        ffn.set_thresholds(tau_x, tau_s)
        out = ffn.run(x, return_mask=True)
        assert bool((out.mask == -1).all())
        assert ((out.y.double().reshape(-1) - dense).abs() <= tol).all()
    for tau_x, tau_s in [(0.0, math.inf), (0.0, 1e30)]:  # no channel: y = 0 exactly
        ffn.set_thresholds(tau_x, tau_s)
        out = ffn.run(x, return_mask=True)
        assert bool((out.mask == 0).all()) and torch.count_nonzero(out.y) == 0
    ffn.thresholds[1] = float("nan")  # device thresholds are not validated: NaN keeps nothing
    assert torch.count_nonzero(ffn.run(x)) == 0


def test_counters():
    d_model, d_ff = 576, 1536
    wg, wu, wd = make_layer(d_model, d_ff, torch.float16, seed=4)
    ffn = prox.PlannedFfn(wg, wu, wd, tau_x=0.5, tau_s=0.01)
    c = prox.new_counters()
    kept = sel = 0
    for _ in range(7):
        x = torch.randn(d_model, device="cuda").half()
        out = ffn.run(x, return_mask=True, counters=c)
        kept += int((x.float().abs() >= 0.5).sum())
        sel += int(reference.mask_words_to_bool(out.mask, d_ff).sum())
    assert c.tolist()[:3] == [7, kept, sel]
    rep = prox.counters_report(c, d_model, d_ff)
    assert rep["s1"] == pytest.approx(1 - kept / (7 * d_model))


def test_proxy_values_op():
    d_model, d_ff = 576, 1536
    wg, wu, wd = make_layer(d_model, d_ff, torch.bfloat16, seed=5)
    ffn = prox.PlannedFfn(wg, wu, wd, act="gelu_tanh", tau_x=0.3, tau_s=0.0)
    x = torch.randn(6, d_model, device="cuda").bfloat16()
    s = ffn.proxy_values(x)
    assert s.shape == (6, d_ff) and s.dtype == torch.float32
    for t in range(6):
        assert torch.equal(s[t], ffn.run(x[t], return_s_proxy=True).s_proxy)
    assert ffn.proxy_values(x[0]).shape == (d_ff,)


def test_workspace_contract():
    d_model, d_ff = 576, 1536
    wg, wu, wd = make_layer(d_model, d_ff, torch.float16, seed=6)
    garbage = torch.full((prox.workspace_bytes(d_model, d_ff),), 0x37, dtype=torch.uint8, device="cuda")
    ffn = prox.PlannedFfn(wg, wu, wd, tau_x=0.5, tau_s=0.05, workspace=garbage)  # used as given: never initialized
    x = torch.randn(d_model, device="cuda").half()
    out = ffn.run(x, return_mask=True)
    assert bool((out.mask == -1).all())  # not ready: exact dense, flagged
    assert prox.workspace_dirty(garbage)
    out = ffn.run(x, return_mask=True)  # Stage 2 stamped the header: sparse again
    assert not bool((out.mask == -1).all())
    prox.initialize_workspace(garbage)
    assert not prox.workspace_dirty(garbage)


def test_shared_workspace_and_plan_cache():
    d_model, d_ff = 576, 1536
    ws = prox.new_workspace(d_model, d_ff)
    layers = [prox.PlannedFfn(*make_layer(d_model, d_ff, dt, seed=i), act=a, workspace=ws, tau_x=0.3, tau_s=0.02)
              for i, (dt, a) in enumerate([(torch.float16, "silu"), (torch.bfloat16, "gelu_tanh")])]
    n = prox.plan_cache_size()
    for layer in layers:
        assert len(layer.policies) == 4 and layer.policies[0] >= 0
        x = torch.randn(d_model, device="cuda").to(layer.dtype)
        y = layer.run(x)
        assert torch.equal(y, layer.run(x))  # deterministic
    assert prox.plan_cache_size() == n  # runs found the plans made at construction
    assert not prox.workspace_dirty(ws)


def test_plan_cache_key_covers_every_slot():
    """A plan holds the pointers of every slot of the layer list (and the thresholds'): a layer with any one slot
    moved to a copy gets a plan of its own, never another layer's, and runs as the original does."""
    d_model, d_ff = 72, 160
    ffn = prox.PlannedFfn(*make_layer(d_model, d_ff, torch.float16, seed=12), tau_x=0.3, tau_s=0.01)
    lt = ffn.layer_tensors()
    x = torch.randn(d_model, device="cuda").half()
    y = ffn.run(x)
    opts = prox.PlanOptions().encode()
    for i, name in enumerate(prox.LAYER_SLOTS):
        if getattr(lt, name) is None:  # a slot the native format has no use for (FP8's: test_fp8_gpu.py)
            continue
        moved = lt._replace(**{name: getattr(lt, name).clone()})
        n = prox.plan_cache_size()
        assert moved.tensors()[i].data_ptr() != lt.tensors()[i].data_ptr()
        torch.ops.prox.plan_ffn(moved.tensors(), moved.format_code(), ffn.thresholds, 0, opts)
        assert prox.plan_cache_size() == n + 1, f"{name}: a copy of it found the original's plan"
        got = torch.ops.prox.sparse_ffn(x, moved.tensors(), moved.format_code(), ffn.thresholds, ffn.workspace, 0,
                                        opts)[0]
        assert torch.equal(got, y), name
    n = prox.plan_cache_size()
    torch.ops.prox.plan_ffn(lt.tensors(), lt.format_code(), ffn.thresholds.clone(), 0, opts)
    assert prox.plan_cache_size() == n + 1  # the thresholds' pointer too


# ---------------------------------------------------------------- bad inputs: clear errors, nothing launched


def _bad_cases(d_model, d_ff):
    def mk(**over):
        wg, wu, wd = make_layer(d_model, d_ff, torch.float16, seed=7)
        ffn = prox.PlannedFfn(wg, wu, wd, tau_x=0.0, tau_s=0.0)
        args = dict(x=torch.randn(d_model, device="cuda").half(), **ffn.layer_tensors()._asdict(),
                    thresholds=ffn.thresholds, workspace=ffn.workspace, act=0, options=prox.PlanOptions().encode())
        args.update(over)
        return args
    big = torch.randn(2 * d_model + 8, device="cuda").half()
    return [
        (dict(x=torch.randn(d_model, device="cuda")), TypeError, "x must be"),
        (dict(x=torch.randn(d_model).half()), ValueError, "x must be a CUDA tensor"),
        (dict(x=torch.randn(9, d_model, device="cuda").half()), ValueError, "at most 8"),
        (dict(x=torch.randn(2, d_model, device="cuda").half()), ValueError, "max_tokens=2"),  # 1-token workspace
        (dict(x=torch.randn(d_model + 8, device="cuda").half()), ValueError, "x must be"),
        (dict(x=big[: 2 * d_model: 2]), ValueError, "contiguous"),
        (dict(x=big[1:1 + d_model]), ValueError, "aligned"),
        (dict(w_up=torch.zeros(d_ff, d_model + 8, dtype=torch.float16, device="cuda")), ValueError, "w_up"),
        (dict(w_up=torch.zeros(d_ff, d_model, dtype=torch.bfloat16, device="cuda")), TypeError, "w_up"),
        (dict(proxy_gate=torch.zeros(d_model, d_ff // 8, dtype=torch.int64, device="cuda")), TypeError, "proxy_gate"),
        (dict(scale_up=torch.zeros(d_ff, dtype=torch.float16, device="cuda")), TypeError, "scale_up"),
        (dict(thresholds=torch.zeros(3, device="cuda")), ValueError, "thresholds"),
        (dict(thresholds=torch.zeros(2, dtype=torch.float16, device="cuda")), TypeError, "thresholds"),
        (dict(workspace=torch.zeros(1024, dtype=torch.uint8, device="cuda")), ValueError, "workspace has"),
        (dict(workspace=torch.zeros(1 << 22, dtype=torch.int32, device="cuda")), TypeError, "workspace"),
        (dict(act=2), ValueError, "act"),
        (dict(options=[29, -1, -1, -1]), ValueError, "options"),
        (dict(options=[29, 99, -1, -1, -1]), ValueError, "policy"),
    ], mk


def test_bad_inputs_raise_before_launch():
    d_model, d_ff = 576, 1536
    cases, mk = _bad_cases(d_model, d_ff)
    for over, exc, text in cases:
        a = mk(**over)
        c = prox.new_counters()
        torch.cuda.synchronize()
        lt = prox.LayerTensors(**{k: a[k] for k in prox.LayerTensors._fields})
        with pytest.raises(exc, match=text):
            torch.ops.prox.sparse_ffn(a["x"], lt.tensors(), lt.format_code(), a["thresholds"], a["workspace"],
                                      a["act"], a["options"], False, False, False, c)
        torch.cuda.synchronize()  # no asynchronous error either
        assert int(c[0]) == 0, f"{over}: a kernel ran"
    a = mk()
    lt = prox.LayerTensors(**{k: a[k] for k in prox.LayerTensors._fields})
    with pytest.raises(TypeError, match="counters"):
        torch.ops.prox.sparse_ffn(a["x"], lt.tensors(), lt.format_code(), a["thresholds"], a["workspace"], 0,
                                  a["options"], False, False, False, torch.zeros(4, dtype=torch.int32, device="cuda"))


def test_bad_shapes_planned_ffn():
    wg = torch.zeros(64, 12, dtype=torch.float16, device="cuda")  # d_model 12: not a multiple of 8
    with pytest.raises(ValueError, match="d_model"):
        prox.PlannedFfn(wg, wg, torch.zeros(12, 64, dtype=torch.float16, device="cuda"))
    wg = torch.zeros(48, 16, dtype=torch.float16, device="cuda")  # d_ff 48
    with pytest.raises(ValueError):
        prox.PlannedFfn(wg, wg, torch.zeros(16, 48, dtype=torch.float16, device="cuda"))
    wg = torch.zeros(64, 16, device="cuda")
    with pytest.raises(TypeError):
        prox.PlannedFfn(wg, wg, wg.t())
    ffn = prox.PlannedFfn(*make_layer(64, 64, torch.float16))
    with pytest.raises(ValueError):
        ffn.set_thresholds(-1.0, 0.0)


# ---------------------------------------------------------------- graphs and compile


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])  # 5: the batched kernels (run_batch)
def test_cuda_graph_replay_with_changing_thresholds(dtype, tokens):
    d_model, d_ff = 2048, 6144
    wg, wu, wd = make_layer(d_model, d_ff, dtype, seed=8)
    ffn = prox.PlannedFfn(wg, wu, wd, tau_x=0.0, tau_s=0.0, max_tokens=tokens)
    x = torch.randn(tokens, d_model, device="cuda").to(dtype)
    settings = [(0.0, 0.0), (0.5, 0.02), (1.0, 0.05), (0.2, math.inf)]
    eager = []
    for t in settings:
        ffn.set_thresholds(*t)
        eager.append(ffn.run(x, return_mask=True))
    c = prox.new_counters()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch.cuda.graph recommends
        ffn.run(x, counters=c)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ffn.run(x, return_mask=True, counters=c)  # [4] counters: a batch's per-token sum is captured too
    c.zero_()
    for t, e in zip(settings, eager):
        ffn.set_thresholds(*t)  # written into device memory: the captured graph reads it
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.y, e.y) and torch.equal(out.mask, e.mask)
    assert int(c[0]) == tokens * len(settings)
    x.copy_(torch.randn_like(x))  # new input through the same graph
    ffn.set_thresholds(0.5, 0.02)
    g.replay()
    assert torch.equal(out.y, ffn.run(x))


def _sparse_mlp(d_model, d_ff, dtype, act="silu"):
    wg, wu, wd = make_layer(d_model, d_ff, dtype, seed=9)
    lin = lambda w: torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=dtype)  # noqa: E731
    g, u, d = lin(wg), lin(wu), lin(wd)
    with torch.no_grad():
        g.weight.copy_(wg), u.weight.copy_(wu), d.weight.copy_(wd)
    return prox.SparseMLP(g, u, d, act, tau_x=0.3, tau_s=0.02, track_sparsity=True)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph(mode):
    torch._dynamo.reset()
    mod = Decoder(_sparse_mlp(1024, 2816, torch.bfloat16))
    h = torch.randn(1, 1, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = mod(h)
        comp = torch.compile(mod, fullgraph=True, mode=mode)
        for _ in range(3):  # reduce-overhead: warm-up, record, replay
            got = comp(h)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    mod.mlp.set_thresholds(0.6, 0.05)  # device thresholds: no recompile, the replayed graph sees them
    with torch.no_grad():
        assert torch.equal(comp(h), mod(h))


def test_sparse_mlp_graph_capture():
    mlp = _sparse_mlp(576, 1536, torch.float16)
    x = torch.randn(1, 1, 576, device="cuda", dtype=torch.float16)
    assert_replays_follow_thresholds(mlp, x)


def test_opcheck():
    d_model, d_ff = 72, 160
    wg, wu, wd = make_layer(d_model, d_ff, torch.float16, seed=10)
    ffn = prox.PlannedFfn(wg, wu, wd, tau_x=0.3, tau_s=0.01)
    x = torch.randn(1, d_model, device="cuda").half()
    lt = ffn.layer_tensors()
    args = (x, lt.tensors(), lt.format_code(), ffn.thresholds, ffn.workspace, 0, ffn._options, True, True, True,
            prox.new_counters())
    torch.library.opcheck(torch.ops.prox.sparse_ffn.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.prox.pack_int4.default, (wg,), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.prox.transpose.default, (wd,), test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------- batches of 2..8 tokens (run_batch)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [2, 3, 8])
def test_batch_matches_float64_reference(tokens, shape, dtype, act):
    """Each token of a batch against the float64 reference on its own channel mask (as the batch-1 test), and
    against its batch-1 run: the same channel set but for channels within rounding of tau_s."""
    d_model, d_ff = shape
    wg, wu, wd = make_layer(d_model, d_ff, dtype, seed=11)
    ffn = prox.PlannedFfn(wg, wu, wd, act=act, max_tokens=prox.MAX_TOKENS)
    torch.manual_seed(12)
    x = torch.randn(tokens, d_model, device="cuda").to(dtype)
    tau_x, tau_s = thresholds_for(x[0], wg, wu, ffn, act, 0.55, 0.7)  # thresholds are per layer: one pair
    ffn.set_thresholds(tau_x, tau_s)
    out = ffn.run(x, return_mask=True, return_s_proxy=True, return_s=True)
    assert out.y.shape == (tokens, d_model) and out.y.dtype == dtype
    assert out.mask.shape == (tokens, d_ff // 32) and out.s_proxy.shape == out.s.shape == (tokens, d_ff)
    for b in range(tokens):
        xb = x[b]
        mask = reference.mask_words_to_bool(out.mask[b], d_ff)
        sp_ref, sp_err = refs.stage1(xb, ffn.proxy_gate, ffn.scale_gate, ffn.proxy_up, ffn.scale_up, tau_x, act)
        assert ((out.s_proxy[b].double() - sp_ref).abs() <= sp_err + 1e-30).all()
        assert torch.equal(mask, out.s_proxy[b].abs() >= tau_s)
        clear = ((sp_ref.abs() - tau_s).abs() > sp_err)
        assert torch.equal(mask[clear], (sp_ref.abs() >= tau_s)[clear])
        s_ref, s_err, y_ref, y_err = refs.stage2(xb, wg, wu, ffn.w_down_t, mask, act)
        assert ((out.s[b].double() - s_ref).abs() <= s_err + 1e-30).all()
        assert (out.s[b][~mask] == 0).all()
        tol = y_err + refs.store_rel(dtype) * y_ref.abs() + 1e-30
        assert ((out.y[b].double() - y_ref).abs() <= tol).all(), float(((out.y[b].double() - y_ref).abs() - tol).max())
        alone = reference.mask_words_to_bool(ffn.run(xb, return_mask=True).mask, d_ff)
        assert torch.equal(alone[clear], mask[clear])


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_deterministic_and_counters(dtype):
    d_model, d_ff = 576, 1536
    tau_x = 0.5
    ffn = prox.PlannedFfn(*make_layer(d_model, d_ff, dtype, seed=13), tau_x=tau_x, tau_s=0.05, max_tokens=8)
    torch.manual_seed(14)
    for tokens in (2, 3, 5, 8):
        x = torch.randn(tokens, d_model, device="cuda").to(dtype)
        per_token = torch.zeros(tokens + 1, 4, dtype=torch.int64, device="cuda")
        a = ffn.run(x, return_mask=True, return_s_proxy=True, return_s=True, counters=per_token)
        b = ffn.run(x, return_mask=True, return_s_proxy=True, return_s=True)
        for u, v in zip(a, b):
            assert torch.equal(u, v)  # bit for bit
        masks = [reference.mask_words_to_bool(a.mask[t], d_ff) for t in range(tokens)]
        kept = [x[t].float().abs() >= tau_x for t in range(tokens)]
        want = [[1, int(kept[t].sum()), int(masks[t].sum())] for t in range(tokens)]
        union = [1, int(torch.stack(kept).any(0).sum()), int(torch.stack(masks).any(0).sum())]
        assert per_token[:, :3].tolist() == want + [union]  # each token's, then the union's
        summed = prox.new_counters()
        ffn.run(x, counters=summed)  # [4]: each token counted as a call, as batch 1 counts
        assert summed.tolist()[:3] == [tokens, sum(w[1] for w in want), sum(w[2] for w in want)]


def test_batch_bad_inputs_raise_before_launch():
    d_model, d_ff = 576, 1536
    wg, wu, wd = make_layer(d_model, d_ff, torch.float16, seed=15)
    small = prox.PlannedFfn(wg, wu, wd)  # a workspace for one token
    big = prox.PlannedFfn(wg, wu, wd, max_tokens=8)
    assert small.max_tokens == 1 and big.max_tokens == 8
    x = torch.randn(9, d_model, device="cuda").half()
    cases = [
        (big, x, prox.new_counters(), ValueError, "at most 8"),
        (big, x[:0], prox.new_counters(), ValueError, "no rows"),
        (small, x[:2], prox.new_counters(), ValueError, "max_tokens=2"),
        (big, x[:3], torch.zeros(3, 4, dtype=torch.int64, device="cuda"), ValueError, "counters"),  # needs [4, 4]
        (big, x[:3], torch.zeros(4, 4, dtype=torch.int32, device="cuda"), TypeError, "counters"),
        (big, x[:3].float(), prox.new_counters(), TypeError, "x must be"),
    ]
    for ffn, xb, c, exc, text in cases:
        torch.cuda.synchronize()
        with pytest.raises(exc, match=text):
            ffn.run(xb, counters=c)
        torch.cuda.synchronize()  # no asynchronous error either
        assert int(c.sum()) == 0, f"{text}: a kernel ran"
    with pytest.raises(ValueError, match="max_tokens"):
        prox.PlannedFfn(wg, wu, wd, max_tokens=9)
    # A workspace for 4 tokens serves batches of up to 4.
    mid = prox.PlannedFfn(wg, wu, wd, workspace=prox.new_workspace(d_model, d_ff, max_tokens=4))
    assert mid.max_tokens == 4
    assert mid.run(x[:4]).shape == (4, d_model)
    with pytest.raises(ValueError, match="max_tokens=5"):
        mid.run(x[:5])


def test_batch_plans_made_at_construction():
    """PlannedFfn plans batch 1 and the batched plan of its workspace: no batch size plans again."""
    d_model, d_ff = 576, 1536
    ffn = prox.PlannedFfn(*make_layer(d_model, d_ff, torch.bfloat16, seed=16), tau_x=0.3, tau_s=0.02, max_tokens=8)
    n = prox.plan_cache_size()
    for tokens in range(1, 9):
        ffn.run(torch.randn(tokens, d_model, device="cuda").bfloat16())
    ffn.run(torch.randn(d_model, device="cuda").bfloat16())
    assert prox.plan_cache_size() == n
    assert not prox.workspace_dirty(ffn.workspace)  # batch 1 and batches share the workspace


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph_batch(mode):
    torch._dynamo.reset()
    mod = Decoder(_sparse_mlp(1024, 2816, torch.bfloat16))
    h = torch.randn(1, 4, 1024, device="cuda", dtype=torch.bfloat16)  # 4 tokens: one batched call
    with torch.no_grad():
        want = mod(h)
        comp = torch.compile(mod, fullgraph=True, mode=mode)
        for _ in range(3):
            got = comp(h)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert mod.mlp._batch_rows(h, 4) == 8  # one batched call of a plan for 8


def test_opcheck_batch():
    d_model, d_ff = 72, 160
    ffn = prox.PlannedFfn(*make_layer(d_model, d_ff, torch.float16, seed=18), tau_x=0.3, tau_s=0.01, max_tokens=8)
    x = torch.randn(3, d_model, device="cuda").half()
    for c in (prox.new_counters(), torch.zeros(4, 4, dtype=torch.int64, device="cuda")):
        lt = ffn.layer_tensors()
        args = (x, lt.tensors(), lt.format_code(), ffn.thresholds, ffn.workspace, 0, ffn._options, True, True, True, c)
        torch.library.opcheck(torch.ops.prox.sparse_ffn.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
