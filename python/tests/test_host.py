# SPDX-License-Identifier: Apache-2.0
"""Host tests (no GPU): the allocation and calibration rules, the INT4 format (the C++ host packer behind
the op's CPU kernel against the torch reimplementation), fake kernels, the thresholds file, and SparseMLP /
sparsify on CPU through the torch reference."""
import json
import math

import pytest
import torch

import prox
from prox import calibration, reference
from conftest import requires_ext


# ---------------------------------------------------------------- allocation


def test_allocation_rule_paper_points():
    # README: 40 % -> (0, 62.2 %), 50 % -> (10 %, 70 %), 60 % -> (55 %, 70 %), 70 % -> (70 %, 76.7 %)
    want = {0.4: (0.0, 0.6222), 0.5: (0.1, 0.7), 0.6: (0.55, 0.7), 0.7: (0.7, 0.7667)}
    for e, (s1, s2) in want.items():
        st = prox.allocate_sparsity(e)
        assert st.s1 == pytest.approx(s1, abs=1e-4) and st.s2 == pytest.approx(s2, abs=1e-4)
        assert prox.effective_sparsity(st.s1, st.s2) == pytest.approx(e, abs=1e-12)


@pytest.mark.parametrize("e", [-0.1, float("nan"), 0.95, 1.0])
def test_allocation_rejects_bad_targets(e):
    with pytest.raises(ValueError):
        prox.allocate_sparsity(e)


@requires_ext
def test_allocation_matches_cpp():
    for i in range(0, 94):
        e = i / 100
        py = prox.allocate_sparsity(e)
        s1, s2 = prox.allocate_sparsity_native(e)
        assert (py.s1, py.s2) == (s1, s2)  # same double arithmetic
    with pytest.raises(ValueError):
        prox.allocate_sparsity_native(0.99)


def test_split_candidates_on_the_e_line():
    for e in (0.4, 0.5, 0.6, 0.7):
        cands = prox.split_candidates(e)
        assert any(abs(c.s1 - prox.allocate_sparsity(e).s1) < 1e-9 for c in cands)
        for c in cands:
            assert prox.effective_sparsity(c.s1, c.s2) == pytest.approx(e, abs=1e-12)
            assert 0.0 <= c.s1 < 1.0 and 0.0 <= c.s2 <= 1.0


# ---------------------------------------------------------------- calibration rule


def test_sample_priority_is_prox_calib_mix64():
    idx = [0, 1, 7, 2 ** 31, 2 ** 40 + 3, 2 ** 63 - 1]
    p = calibration.sample_priority(calibration.DEFAULT_SEED, torch.tensor(idx))
    for i, v in zip(idx, p.tolist()):
        want = calibration.mix64_int(i ^ calibration.mix64_int(calibration.DEFAULT_SEED))
        assert v & ((1 << 64) - 1) == want


def test_reservoir_independent_of_chunking():
    x = torch.randn(20000)
    a = prox.Calibrator(capacity=777)
    a.add(x)
    b = prox.Calibrator(capacity=777)
    for part in torch.split(x, [1, 999, 5000, 14000]):
        b.add(part)
    assert torch.equal(a.magnitudes(), b.magnitudes())
    assert a.finalize(0.3).tau == b.finalize(0.3).tau


def test_quantile_rule():
    x = torch.arange(1, 101, dtype=torch.float32)  # |v| = 1..100
    c = prox.Calibrator()
    c.add(-x)
    r = c.finalize(0.25)
    assert r.tau == 26.0 and r.realized == 0.25  # a[floor(0.25 * 100)] = a[25]
    assert c.finalize(1.0).tau == math.inf
    assert c.finalize(0.0).tau == 1.0
    # ties: 60 % exact zeros, s = 0.4 -> the nearer achievable sparsity (0.6) and the smallest non-zero |v|
    t = torch.cat([torch.zeros(60), torch.arange(1, 41, dtype=torch.float32)])
    c2 = prox.Calibrator()
    c2.add(t)
    r2 = c2.finalize(0.4)
    assert r2.tau == 1.0 and r2.realized == pytest.approx(0.6) and not r2.reachable


def test_calibrator_skips_nonfinite():
    c = prox.Calibrator()
    c.add(torch.tensor([1.0, float("nan"), float("inf"), 2.0, -3.0]))
    r = c.finalize(0.5)
    assert (r.seen, r.finite, r.nan, r.inf, r.reservoir) == (5, 3, 1, 1, 3)
    with pytest.raises(ValueError):
        prox.Calibrator().finalize(0.5)


# ---------------------------------------------------------------- INT4 format


@pytest.mark.parametrize("shape", [(32, 1), (32, 8), (64, 37), (160, 72), (1536, 576)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_pack_roundtrip(shape, dtype):
    w = (torch.randn(shape) * 0.05).to(dtype)
    w[3] = 0  # an all-zero row: scale 0, every nibble 8
    packed, scales = reference.pack_int4(w)
    assert packed.shape == (shape[1], shape[0] // 8) and packed.dtype == torch.int32
    assert scales[3] == 0
    q = reference.unpack_int4(packed)
    assert q.shape == shape and int(q.min()) >= -7 and int(q.max()) <= 7
    want = torch.round(w.float() / torch.where(scales[:, None] == 0, 1.0, scales[:, None])).clamp(-7, 7)
    assert torch.equal(q.float(), want)
    assert (reference.dequantize_int4(packed, scales) - w.float()).abs().max() <= scales.max() / 2 + 1e-6


@requires_ext
@pytest.mark.parametrize("shape", [(32, 1), (64, 37), (96, 1000), (1536, 576)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpp_host_pack_matches_reference(shape, dtype):
    w = (torch.randn(shape) * 0.02).to(dtype)
    w[0, 0] = 7.0  # one large weight: clamped neighbours
    p, s = prox.pack_int4(w)  # CPU tensor: prox::int4::pack_host
    p2, s2 = reference.pack_int4(w)
    assert torch.equal(p, p2) and torch.equal(s, s2)


@requires_ext
def test_cpp_host_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN or Inf"):
        prox.pack_int4(torch.full((32, 8), float("nan"), dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 32"):
        prox.pack_int4(torch.zeros(48, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        prox.pack_int4(torch.zeros(32, 8))
    with pytest.raises(ValueError, match="2-D"):
        prox.pack_int4(torch.zeros(32, dtype=torch.float16))


@requires_ext
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (33, 65)])
def test_cpp_host_transpose(shape):
    w = torch.randn(shape).half()
    assert torch.equal(prox.transpose(w), w.t().contiguous())


@requires_ext
def test_cuda_only_ops_refuse_cpu_tensors():
    w = torch.zeros(32, 8, dtype=torch.float16)
    p, s = prox.pack_int4(w)
    lt = prox.LayerTensors(w_gate=w, w_up=w, w_down_t=w, proxy_gate=p, scale_gate=s, proxy_up=p, scale_up=s)
    th = torch.zeros(2)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        torch.ops.prox.sparse_ffn(w[0], lt.tensors(), lt.format_code(), th, torch.zeros(4096, dtype=torch.uint8), 0,
                                  prox.PlanOptions().encode())


@requires_ext
def test_workspace_bytes():
    assert prox.workspace_bytes(4096, 12288) == prox.workspace_bytes(4096, 12288)
    assert prox.workspace_bytes(576, 1536) > 256
    with pytest.raises(ValueError):
        prox.workspace_bytes(12, 64)
    assert prox.int4_layout() == prox.thresholds.INT4_LAYOUT  # the tag thresholds files record


@requires_ext
@pytest.mark.parametrize("shape", [(8, 32), (576, 1536), (4096, 12288)])
def test_workspace_bytes_max_tokens(shape):
    """A batch's workspace holds every token's mask and s and the batched partials: it grows with max_tokens,
    and max_tokens=1 (the default) is the batch-1 size. workspace_tokens() inverts it."""
    d_model, d_ff = shape
    sizes = [prox.workspace_bytes(d_model, d_ff, m) for m in range(1, prox.MAX_TOKENS + 1)]
    assert prox.MAX_TOKENS == 8
    assert sizes[0] == prox.workspace_bytes(d_model, d_ff) == torch.ops.prox.workspace_bytes(d_model, d_ff)
    assert all(a <= b for a, b in zip(sizes, sizes[1:])) and sizes[-1] > sizes[0]
    for m, b in enumerate(sizes, 1):
        assert prox.workspace_tokens(d_model, d_ff, b) >= m > prox.workspace_tokens(d_model, d_ff, b - 1)
    assert prox.workspace_tokens(d_model, d_ff, 0) == 0
    assert prox.workspace_tokens(d_model, d_ff, 2 * sizes[-1]) == prox.MAX_TOKENS
    for bad in (0, -1, 9):
        with pytest.raises(ValueError, match="max_tokens"):
            prox.workspace_bytes(d_model, d_ff, bad)


@requires_ext
def test_fake_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        w = torch.empty(128, 64, dtype=torch.bfloat16, device="cuda")
        p, s = torch.ops.prox.pack_int4(w)
        assert p.shape == (64, 16) and p.dtype == torch.int32 and s.shape == (128,)
        assert torch.ops.prox.transpose(w).shape == (64, 128)
        lt = prox.LayerTensors(w_gate=w, w_up=w, w_down_t=w, proxy_gate=p, scale_gate=s, proxy_up=p, scale_up=s)
        layer, fmt = lt.tensors(), lt.format_code()
        x = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")
        th = torch.empty(2, device="cuda")
        ws = torch.empty(4096, dtype=torch.uint8, device="cuda")
        y, m, sp, st = torch.ops.prox.sparse_ffn(x, layer, fmt, th, ws, 1, prox.PlanOptions().encode(),
                                                 True, False, True)
        assert y.shape == (1, 64) and y.dtype == torch.bfloat16
        assert m.shape == (4,) and sp.shape == (0,) and st.shape == (128,)
        y, m, sp, st = torch.ops.prox.sparse_ffn(x[0], layer, fmt, th, ws, 1, prox.PlanOptions().encode(),
                                                 True, True, False)
        assert y.shape == (64,) and m.shape == (4,) and sp.shape == (128,) and st.shape == (0,)
        xb = torch.empty(3, 64, dtype=torch.bfloat16, device="cuda")  # a batch: a leading 3 on every output
        y, m, sp, st = torch.ops.prox.sparse_ffn(xb, layer, fmt, th, ws, 1, prox.PlanOptions().encode(),
                                                 True, False, True)
        assert y.shape == (3, 64) and m.shape == (3, 4) and m.dtype == torch.int32
        assert sp.shape == (0,) and st.shape == (3, 128) and st.dtype == torch.float32
        v = torch.ops.prox.proxy_values(torch.empty(5, 64, dtype=torch.bfloat16, device="cuda"), layer, fmt, th, ws,
                                        0, prox.PlanOptions().encode())
        assert v.shape == (5, 128) and v.dtype == torch.float32


def test_plan_options_encoding():
    assert prox.PlanOptions().encode() == [1 | 4 | 8 | 16 | 32, -1, -1, -1, -1]
    assert prox.PlanOptions(pdl=False, cluster=True, fuse_stage2=False, proxy=2).encode() == [2 | 8 | 16 | 32, 2, -1, -1, -1]


# ---------------------------------------------------------------- torch reference of the method


def test_reference_boundaries():
    torch.manual_seed(0)
    K, N = 64, 128
    wg, wu, wdt = (torch.randn(N, K) / 8 for _ in range(3))
    pg, sg = reference.pack_int4(wg.half())
    pu, su = reference.pack_int4(wu.half())
    x = torch.randn(3, K)
    dense = reference.dense_ffn(x, wg, wu, wdt, "silu")
    y = reference.prox_ffn(x, wg, wu, wdt, pg, sg, pu, su, 0.0, 0.0, "silu")
    assert torch.allclose(y, dense, atol=1e-5)  # everything kept
    y = reference.prox_ffn(x, wg, wu, wdt, pg, sg, pu, su, math.inf, 0.0, "silu")
    assert torch.allclose(y, dense, atol=1e-5)  # no input: s~ = 0 >= 0 keeps every channel
    y = reference.prox_ffn(x, wg, wu, wdt, pg, sg, pu, su, 0.0, math.inf, "gelu_tanh")
    assert torch.count_nonzero(y) == 0  # no channel
    words = torch.tensor([0b101, -1], dtype=torch.int32)
    m = reference.mask_words_to_bool(words, 64)
    assert m[:3].tolist() == [True, False, True] and bool(m[32:].all())


# ---------------------------------------------------------------- thresholds file


def test_thresholds_file_roundtrip(tmp_path):
    rec = prox.LayerRecord("model.layers.0.mlp", 576, 1536, "silu", 0.1, 0.7, 0.123456789, math.inf, 0.1, 0.7, 0.05)
    cfg = prox.ThresholdConfig(0.5, "paper", [rec], calibration={"tokens": 10})
    path = tmp_path / "t.json"
    prox.save_thresholds(path, cfg, model="m")
    d = json.loads(path.read_text())
    assert d["format"] == "prox-thresholds" and d["configs"][0]["layers"][0]["tau_s"] == "inf"
    cfg2 = prox.ThresholdConfig(0.7, "search", [rec])
    prox.save_thresholds(path, cfg2)  # merged
    back = prox.load_thresholds(path)
    assert len(back) == 2
    got = prox.find_config(back, 0.5, "paper")
    assert got.layers == cfg.layers and got.calibration == cfg.calibration and got.model == "m"
    assert got.int4_layout == prox.thresholds.INT4_LAYOUT
    assert got.layers[0].tau_x == 0.123456789 and got.layers[0].tau_s == math.inf
    with pytest.raises(ValueError, match=r"the thresholds hold no config for e=0.6, split='paper'; they hold "
                                         r"\(e=0.5, paper\), \(e=0.7, search\)\. Ask for one of those, or "
                                         r"calibrate this one \(cfg = prox.sparsify\(model, 0.6, calibration_ids, "
                                         r"split='paper'\)\) and add it to the file"):
        prox.find_config(back, 0.6)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError):
        prox.load_thresholds(path)


# ---------------------------------------------------------------- SparseMLP and sparsify on CPU


def _tiny_llama(layers=3, act="silu"):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   hidden_act="silu" if act == "silu" else "gelu_pytorch_tanh")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_detect_act():
    import torch.nn as nn
    assert prox.nn.detect_act(nn.SiLU()) == "silu"
    assert prox.nn.detect_act(nn.GELU(approximate="tanh")) == "gelu_tanh"
    with pytest.raises(ValueError, match="erf"):
        prox.nn.detect_act(nn.GELU())


def test_sparse_mlp_decode_and_prefill_cpu():
    m = _tiny_llama()
    mlp = m.model.layers[0].mlp
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        ref = mlp(x)
        sp = prox.SparseMLP.from_mlp(mlp, keep_down=True)
        assert torch.allclose(sp(x), ref, atol=1e-6)  # prefill: dense, thresholds 0 anyway
        sp.set_thresholds(0.5, 0.01)
        dense_pre = sp(x)
        assert torch.allclose(dense_pre, ref, atol=1e-6)  # prefill stays dense whatever the thresholds
        one = sp(x[:, :1])  # decode: Prox
        want = reference.prox_ffn(x[0, :1], mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight.t(),
                                  sp.proxy_gate, sp.scale_gate, sp.proxy_up, sp.scale_up, 0.5, 0.01, "silu")
        assert torch.allclose(one[0], want, atol=1e-6)
        sp.prefill = "sparse"
        rows = sp(x)
        for t in range(5):
            assert torch.allclose(rows[0, t], sp(x[:, t:t + 1])[0, 0], atol=1e-6)
    r = sp.memory_bytes()
    assert r["proxies"] == 2 * 64 * 128 // 2 and r["scales"] == 2 * 128 * 4 and r["w_down_t"] == 128 * 64 * 4


def test_sparse_mlp_batched_flag_cpu():
    """Off CUDA a few tokens are a prefill as before (the batched op is CUDA's); batched is an option and a
    set_mode switch."""
    m = _tiny_llama(1)
    sp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp, tau_x=0.5, tau_s=0.01, track_sparsity=True)
    assert sp.batched and "batched=True" in repr(sp)
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        assert sp.capacity() == 0 and sp._batch_rows(x, 3) == 0  # no op here: no batch
        assert torch.equal(sp(x), sp.dense(x)) and int(sp.counters[0]) == 0
    prox.set_mode(torch.nn.ModuleList([sp]), batched=False)
    assert not sp.batched
    assert not prox.SparseMLP.from_mlp(_tiny_llama(1).model.layers[0].mlp, batched=False).batched


def test_sparse_mlp_keeps_float32_buffers_on_dtype_change():
    m = _tiny_llama(1)
    sp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp)
    sp.set_thresholds(0.1234567, 0.7654321)
    sp.to(torch.bfloat16)
    assert sp.thresholds.dtype == torch.float32 and sp.scale_gate.dtype == torch.float32
    assert sp.get_thresholds() == (torch.tensor(0.1234567).item(), torch.tensor(0.7654321).item())
    assert sp.gate_proj.weight.dtype == torch.bfloat16 and sp.down_t.dtype == torch.bfloat16


def test_sparse_mlp_workspace_is_derived_state_cpu():
    """Off CUDA a SparseMLP has no workspace, whatever it is converted to; a workspace already on the module's
    device is kept as it is through conversions (not copied, not re-initialized); a move off it drops it."""
    m = _tiny_llama(1)
    sp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp, track_sparsity=True)
    assert sp.workspace is None
    sp.to(torch.bfloat16).float().to("cpu")
    assert sp.workspace is None
    n = prox.workspace_bytes(64, 128) if prox.ops_available() else 8192
    ws = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)  # a given workspace, any contents
    want = ws.clone()
    sp2 = prox.SparseMLP.from_mlp(_tiny_llama(1).model.layers[0].mlp, workspace=ws)
    sp2.to(torch.bfloat16).half().to("cpu")
    assert sp2.workspace is ws and torch.equal(ws, want)
    sp2.to("meta")  # another device, not CUDA: no workspace there
    assert sp2.workspace is None and sp2.down_t.device.type == "meta"


def test_sparse_mlp_counters_and_reports_cpu():
    """The torch path's counters are the op's {calls, kept inputs, selected channels, 0}; the model-wide report
    sums every tracking layer of any shape (one read of all counters) and skips layers without counters."""
    import torch.nn as nn
    torch.manual_seed(0)
    layers, want = nn.ModuleList(), [0, 0, 0, 0, 0]  # calls, kept, selected, calls * d_model, calls * d_ff
    for d_model, d_ff, track, tokens in ((64, 128, True, 5), (32, 96, True, 3), (64, 128, False, 4)):
        lin = [nn.Linear(a, b, bias=False) for a, b in ((d_model, d_ff), (d_model, d_ff), (d_ff, d_model))]
        sp = prox.SparseMLP(*lin, prefill="sparse", tau_x=0.4, tau_s=0.03, track_sparsity=track)
        x = torch.randn(tokens, d_model)
        with torch.no_grad():
            sp(x)
            sp(x[:1])
        layers.append(sp)
        if not track:
            assert sp.counters is None
            continue
        selected = 0
        for xc in (x, x[:1]):  # the two calls
            _, _, mask, _ = reference.prox_ffn(xc, lin[0].weight, lin[1].weight, sp.down_t, sp.proxy_gate,
                                               sp.scale_gate, sp.proxy_up, sp.scale_up, sp.thresholds[0],
                                               sp.thresholds[1], "silu", return_all=True)
            selected += int(mask.sum())
        kept = int((x.abs() >= torch.tensor(0.4)).sum()) + int((x[:1].abs() >= torch.tensor(0.4)).sum())
        c = [tokens + 1, kept, selected, 0]
        assert sp.counters.tolist() == c
        s1, s2 = 1 - c[1] / (c[0] * d_model), 1 - c[2] / (c[0] * d_ff)
        assert sp.sparsity_report() == prox.counters_report(sp.counters, d_model, d_ff) == {
            "calls": c[0], "s1": s1, "s2": s2, "effective": prox.effective_sparsity(s1, s2)}
        want = [w + v for w, v in zip(want, c[:3] + [c[0] * d_model, c[0] * d_ff])]
    rep = prox.sparsity_report(layers)
    s1, s2 = 1 - want[1] / want[3], 1 - want[2] / want[4]
    assert rep == {"calls": want[0], "s1": s1, "s2": s2, "effective": prox.effective_sparsity(s1, s2)}
    with pytest.raises(RuntimeError, match="no SparseMLP"):  # nothing counts: said, not a report of zeros
        prox.sparsity_report(nn.ModuleList())


def test_sparsify_sequential_order_and_roundtrip(tmp_path):
    m = _tiny_llama()
    ids = torch.randint(0, 128, (3, 24))
    with torch.no_grad():
        dense_logits = m(ids).logits
    log = []
    cfg = prox.sparsify(m, 0.6, ids, progress=log.append, track_sparsity=True)
    assert len(cfg.layers) == 3 and [r.name for r in cfg.layers] == [f"model.layers.{i}.mlp" for i in range(3)]
    for r in cfg.layers:
        assert (r.s1, r.s2) == pytest.approx((0.55, 0.7))
        assert r.realized_s1 == pytest.approx(0.55, abs=0.02) and r.realized_s2 == pytest.approx(0.7, abs=0.02)
    with torch.no_grad():
        assert torch.allclose(m(ids).logits, dense_logits, atol=1e-5)  # prefill dense
        prox.set_mode(m, prefill="sparse")
        sparse_logits = m(ids).logits
    rep = prox.sparsity_report(m)
    # the calibration tokens themselves: the realized sparsity is the target (sequential order)
    assert rep["s1"] == pytest.approx(0.55, abs=0.02) and rep["s2"] == pytest.approx(0.7, abs=0.03)
    path = tmp_path / "th.json"
    prox.save_thresholds(path, cfg)
    m2 = _tiny_llama()
    cfg2 = prox.sparsify(m2, 0.6, thresholds=path, prefill="sparse")
    assert cfg2 == cfg
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, sparse_logits)


def test_sparsify_sequential_differs_from_independent():
    """Layer 1's thresholds come from inputs computed with layer 0 already sparse."""
    m = _tiny_llama(2)
    ids = torch.randint(0, 128, (2, 32))
    cfg = prox.sparsify(m, 0.7, ids)
    m2 = _tiny_llama(2)
    xs = []
    h = m2.model.layers[1].mlp.register_forward_pre_hook(lambda mod, a: xs.append(a[0].reshape(-1, 64)))
    with torch.no_grad():
        m2(ids)
    h.remove()
    tau_x_dense = prox.Calibrator()
    tau_x_dense.add(torch.cat(xs))
    assert cfg.layers[1].tau_x != tau_x_dense.finalize(0.7).tau


def test_sparsify_search_split():
    m = _tiny_llama(2)
    ids = torch.randint(0, 128, (2, 32))
    cfg = prox.sparsify(m, 0.6, ids, split="search")
    rows = cfg.calibration["search"]["model.layers.0.mlp"]
    best = min(rows, key=lambda r: r[2])
    assert (cfg.layers[0].s1, cfg.layers[0].s2) == pytest.approx((best[0], best[1]))
    for s1, s2, _ in rows:
        assert prox.effective_sparsity(s1, s2) == pytest.approx(0.6)


def test_restore_mlps_cpu():
    """eval_ppl's round trip: sparsify, then the original modules back (any keep_down), or generic dense MLPs."""
    m = _tiny_llama(2)
    ids = torch.randint(0, 128, (2, 16))
    originals = dict(prox.find_mlps(m))
    with torch.no_grad():
        dense = m(ids).logits
    prox.sparsify(m, 0.6, ids, prefill="sparse")
    prox.nn.restore_mlps(m, originals=originals)
    assert dict(prox.find_mlps(m)) == originals
    with torch.no_grad():
        assert torch.equal(m(ids).logits, dense)
    prox.sparsify(m, 0.6, ids, prefill="sparse")
    with pytest.raises(RuntimeError, match="keep_down"):
        prox.nn.restore_mlps(m)
    prox.swap_mlps(m2 := _tiny_llama(2), keep_down=True)
    prox.nn.restore_mlps(m2)
    assert all(isinstance(mm, prox.nn.DenseMLP) for _, mm in prox.find_mlps(m2))
    with torch.no_grad():
        assert torch.allclose(m2(ids).logits, dense, atol=1e-5)


def test_gemma_style_gelu_mlp_cpu():
    m = _tiny_llama(1, act="gelu_tanh")
    sp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp)
    assert sp.act == "gelu_tanh"


def test_bench_decode_cpu_smoke(tmp_path):
    """bench_decode on CPU is a smoke test (tiny Qwen3 shape, no graphs, the torch reference): every cell runs,
    including repeated runs from a reset position (a transformers static cache keeps its own write position), and
    the lean step matches transformers; nothing is timed, so no speed-up is reported."""
    pytest.importorskip("transformers")
    from prox import bench_decode
    out = tmp_path / "decode.json"
    rc = bench_decode.main(["--check", "--device", "cpu", "--models", "tiny", "--dtypes", "bf16", "--contexts", "16",
                            "--e", "0.5,0.7", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["backend_used"] == "torch" and "ops_available" in res
    assert res["lean_check_rel_error"] < 3e-2
    assert sorted(res["cells"]) == ["tiny/bf16/16/hf", "tiny/bf16/16/lean"]
    for cell in res["cells"].values():
        assert "error" not in cell, cell.get("error")
        assert cell["smoke"] and set(cell["prox"]) == {"0.5", "0.7"} and cell["ffn"] is None
        assert "dense" not in cell and "mlp_share" not in cell
        for v in cell["prox"].values():
            assert set(v) == {"realized", "target"} and 0.0 <= v["realized"]["s2"] <= 1.0
    with pytest.raises(SystemExit):
        bench_decode.main(["--device", "cpu", "--models", "8b"])  # the CPU runs the tiny smoke test only
