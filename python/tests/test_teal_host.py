# SPDX-License-Identifier: Apache-2.0
"""The TEAL-style baseline of eval_ppl (prox.eval_teal) on the host: the module against a float64 reference, its
counters and the realized effective sparsity, the sequential calibration, the greedy allocation (the allocator's
invariants on TEAL's layer errors), its thresholds file and its refusals. A tiny Qwen3-shaped model with random
weights (prox.benchlib.build_model) stands in for a real one."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import prox
from prox.allocation import LayerErrors, allocate_layers, weighted_mean

pytest.importorskip("transformers")
from prox import eval_teal  # noqa: E402  (needs transformers' models for the model-level tests)
from prox.benchlib import build_model  # noqa: E402


class _Mlp(nn.Module):
    def __init__(self, d, f, act_fn, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) / math.sqrt(lin.weight.shape[1])
        self.act_fn = act_fn


def _midpoint(v: torch.Tensor, q: float) -> float:
    """A threshold between two neighbouring magnitudes of v at quantile q (no value near it: float32 and float64
    select the same entries)."""
    a = v.abs().flatten().sort().values
    k = int(q * a.numel())
    return float((a[k] + a[k + 1]) / 2)


@pytest.mark.parametrize("act_fn,act", [(nn.SiLU(), F.silu), (nn.GELU(approximate="tanh"),
                                                              lambda g: F.gelu(g, approximate="tanh"))])
@torch.no_grad()
def test_teal_mlp_against_float64(act_fn, act):
    """y = W_down (s [|s| >= tau_s]), s = act(W_gate x~) (W_up x~), x~ = x [|x| >= tau_x], against float64; the
    counters count the tokens and the entries kept."""
    torch.manual_seed(1)
    mlp = _Mlp(48, 96, act_fn)
    x = torch.randn(2, 7, 48)
    x64 = x.double()
    tau_x = _midpoint(x, 0.4)
    xk = torch.where(x64.abs() >= tau_x, x64, 0.0)
    s = act(xk @ mlp.gate_proj.weight.double().t()) * (xk @ mlp.up_proj.weight.double().t())
    tau_s = _midpoint(s, 0.6)
    ks = s.abs() >= tau_s
    want = torch.where(ks, s, 0.0) @ mlp.down_proj.weight.double().t()
    teal = eval_teal.TealMLP(mlp, tau_x, tau_s)
    y = teal(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
    assert teal.counters.tolist() == [14, int((x64.abs() >= tau_x).sum()), int(ks.sum())]
    # thresholds 0 keep everything: the dense MLP; prefill="dense" runs it for several tokens, one token stays sparse
    teal.set_thresholds(0.0, 0.0)
    assert torch.allclose(teal(x), mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x)), rtol=1e-6, atol=1e-6)
    teal.set_thresholds(tau_x, tau_s)
    teal.prefill = "dense"
    assert torch.equal(teal(x), teal.dense(x))
    assert torch.allclose(teal(x[:1, :1]).double(), want[:1, :1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefill"):
        eval_teal.TealMLP(mlp, prefill="sparse ")


@torch.no_grad()
def test_teal_report_is_the_work_skipped():
    """The realized e is the dense FFN work skipped over the dense work: (2 s_x + s_s) / 3 per layer, the layers
    weighted by their cost (two shapes here) and tokens; s1 and s2 the fractions of x's and s's entries skipped."""
    torch.manual_seed(2)
    a, b = _Mlp(32, 64, nn.SiLU(), 1), _Mlp(64, 32, nn.SiLU(), 2)
    model = nn.ModuleList([eval_teal.TealMLP(a, 0.5, 0.05), eval_teal.TealMLP(b, 1.0, 0.2)])
    with pytest.raises(RuntimeError, match="no TealMLP"):
        eval_teal.teal_report(nn.Linear(2, 2))
    assert eval_teal.teal_report(model)["calls"] == 0
    xa, xb = torch.randn(5, 32), torch.randn(3, 64)
    model[0](xa)
    model[1](xb)
    skipped = work = zx = nx = zs = ns = 0
    for m, x in ((model[0], xa), (model[1], xb)):
        t, kx, ks = m.counters.tolist()
        assert t == x.shape[0]
        zx, nx = zx + t * m.d_model - kx, nx + t * m.d_model
        zs, ns = zs + t * m.d_ff - ks, ns + t * m.d_ff
        skipped += 2 * m.d_ff * (t * m.d_model - kx) + m.d_model * (t * m.d_ff - ks)
        work += 3 * t * m.d_model * m.d_ff
    rep = eval_teal.teal_report(model)
    assert rep["s1"] == pytest.approx(zx / nx) and rep["s2"] == pytest.approx(zs / ns)
    assert rep["effective"] == pytest.approx(skipped / work) and 0.05 < rep["effective"] < 0.95
    # one layer alone: its e is (2 s_x + s_s) / 3
    model[1].reset_counters()
    one = eval_teal.teal_report(model)
    assert one["effective"] == pytest.approx((2 * one["s1"] + one["s2"]) / 3)


@pytest.fixture(scope="module")
def tiny():
    """A tiny Qwen3-shaped model (2 layers, random weights) and 4 calibration sequences of 48 random tokens."""
    model, cfg = build_model("tiny", torch.float32, "cpu", 64)
    ids = torch.randint(0, cfg.vocab_size, (4, 48), generator=torch.Generator().manual_seed(3))
    return model, ids


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _mlp_inputs(model, layer, ids) -> torch.Tensor:
    """The inputs of decoder layer ``layer``'s MLP, one forward per sequence (as the calibration runs them)."""
    xs = []
    h = model.model.layers[layer].mlp.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, 256)))
    try:
        for i in range(ids.shape[0]):
            _logits(model, ids[i:i + 1])
    finally:
        h.remove()
    return torch.cat(xs)


def _restore(model, originals):
    for n, m in originals.items():
        prox.nn.set_submodule(model, n, m)


def test_calibrate_uniform_is_sequential(tiny, tmp_path):
    """Uniform: every layer at e (x and s each at e on the calibration tokens); layer 1's thresholds are those of
    its inputs under layer 0's TEAL thresholds (sequential), not the dense model's. The config round-trips through
    a thresholds file and apply() gives the same model; other weights are refused."""
    model, ids = tiny
    originals = dict(prox.find_mlps(model))
    dense_x1 = _mlp_inputs(model, 1, ids)
    ref = _logits(model, ids)
    cfg = eval_teal.calibrate(model, 0.5, ids)
    try:
        assert cfg.split == "teal" and cfg.allocation == "uniform" and len(cfg.layers) == 2
        for r in cfg.layers:
            assert r.e == r.s1 == r.s2 == 0.5
            assert abs(r.realized_s1 - 0.5) < 0.01 and abs(r.realized_s2 - 0.5) < 0.01 and 0 < r.output_error < 1
            assert r.fingerprint is not None
        teals = eval_teal.teal_mlps(model)
        assert [n for n, _ in teals] == list(originals) and all(m.counters.sum() == 0 for _, m in teals)
        x1 = _mlp_inputs(model, 1, ids)  # under layer 0's thresholds
        rep = eval_teal.teal_report(model)
        assert abs(rep["effective"] - 0.5) < 0.01  # the calibration tokens again
        lt = prox.calibrate_layer(x1, 0.5, 0.5, teals[1][1].proxy_values)
        assert (lt.tau_x, lt.tau_s) == (cfg.layers[1].tau_x, cfg.layers[1].tau_s)
        assert prox.calibrate_layer(dense_x1, 0.5, 0.5, teals[1][1].proxy_values).tau_x != lt.tau_x
        sparse = _logits(model, ids)
        assert not torch.allclose(sparse, ref)
        path = tmp_path / "teal.json"
        prox.save_thresholds(path, cfg)
        with pytest.raises(ValueError, match="already runs TealMLPs"):
            eval_teal.apply(model, prox.load_thresholds(path), 0.5)
    finally:
        _restore(model, originals)
    assert torch.equal(_logits(model, ids), ref)
    configs = prox.load_thresholds(path)
    eval_teal.apply(model, configs, 0.5)
    try:
        assert torch.equal(_logits(model, ids), sparse)
    finally:
        _restore(model, originals)
    with pytest.raises(prox.thresholds.MissingThresholds, match=r"hold \(e=0.5, teal\)\. Calibrate it: "
                       r"prox.eval_teal.calibrate\(model, e, calibration_ids, allocation='greedy'\)"):
        eval_teal.apply(model, configs, 0.5, "greedy")
    w = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        w[0, 0] += 1.0
    try:
        with pytest.raises(ValueError, match=r"model.layers.0.mlp: other weights \(W_up"):
            eval_teal.apply(model, configs, 0.5)
        assert not eval_teal.teal_mlps(model)  # all or nothing
    finally:
        with torch.no_grad():
            w[0, 0] -= 1.0


def test_greedy_allocates_by_the_layer_errors(tiny, tmp_path):
    """Greedy: each layer's e is allocate_layers' on the layer errors given (the cheaper layer sparser), their
    cost-weighted mean e, each calibrated at its own e; the errors are recorded and read back (layer_errors_of),
    also from a file, so another e is allocated without measuring."""
    model, ids = tiny
    originals = dict(prox.find_mlps(model))
    names = list(originals)
    grid = [0.0, 0.3, 0.6, 0.9]
    errors = LayerErrors(names, grid, [[0.0, 0.01, 0.02, 0.4], [0.0, 0.1, 0.3, 0.9]], [3.0 * 256 * 768] * 2)
    cfg = eval_teal.calibrate(model, 0.5, ids, allocation="greedy", layer_errors=errors)
    _restore(model, originals)
    want = allocate_layers(0.5, grid, errors.errors, errors.costs)
    got = [r.e for r in cfg.layers]
    assert got == pytest.approx(want) and got[0] > got[1]
    assert weighted_mean(got, errors.costs) == pytest.approx(0.5, abs=1e-12)
    for r in cfg.layers:
        assert r.s1 == r.s2 == r.e and abs(r.realized_s1 - r.e) < 0.01 and abs(r.realized_s2 - r.e) < 0.01
    path = tmp_path / "teal.json"
    prox.save_thresholds(path, cfg)
    (back,) = prox.load_thresholds(path)
    assert eval_teal.layer_errors_of(back) == errors
    cfg7 = eval_teal.calibrate(model, 0.7, ids, allocation="greedy", layer_errors=eval_teal.layer_errors_of(back))
    _restore(model, originals)
    assert all(b >= a - 1e-12 for a, b in zip(got, [r.e for r in cfg7.layers]))  # monotone in e
    with pytest.raises(ValueError, match="no greedy TEAL-style config"):
        eval_teal.layer_errors_of(prox.ThresholdConfig(0.5, "paper", allocation="greedy"))
    with pytest.raises(ValueError, match="cannot be reached"):
        eval_teal.calibrate(model, 0.95, ids, allocation="greedy", layer_errors=errors)
    with pytest.raises(ValueError, match="other layers"):
        eval_teal.calibrate(model, 0.5, ids, allocation="greedy",
                            layer_errors=LayerErrors(["a", "b"], grid, errors.errors, errors.costs))
    assert not eval_teal.teal_mlps(model)


def test_measured_layer_errors(tiny):
    """The measured errors: KL of the logits with one layer TEAL-sparse at each grid point, 0 at e = 0 (every entry
    kept: the dense model, bit for bit) and growing with e; the model is left dense."""
    model, ids = tiny
    ref = _logits(model, ids)
    errors = eval_teal.measure_errors(model, ids, tokens=96, step=0.45)
    assert errors.grid == [0.0, 0.45, 0.9] and errors.tokens == 96 and errors.signal == "kl"
    assert errors.names == [n for n, _ in prox.find_mlps(model)] and errors.costs == [3.0 * 256 * 768] * 2
    for row in errors.errors:
        assert abs(row[0]) < 1e-9 and 1e-9 < row[1] < row[2]
    assert not eval_teal.teal_mlps(model) and torch.equal(_logits(model, ids), ref)


def test_bad_inputs(tiny):
    model, ids = tiny
    for e in (-0.1, 1.0, float("nan"), "0.5"):
        with pytest.raises(ValueError, match="target effective sparsity"):
            eval_teal.calibrate(model, e, ids)
    with pytest.raises(ValueError, match="allocation must be"):
        eval_teal.calibrate(model, 0.5, ids, allocation="greedy ")
    with pytest.raises(ValueError, match="layer_errors are for allocation='greedy'"):
        eval_teal.calibrate(model, 0.5, ids, layer_errors=LayerErrors([], [0.0, 1.0], [], []))
    with pytest.raises(ValueError, match="layer_bounds"):
        eval_teal.measure_errors(model, ids, layer_bounds=(0.5, 0.5))
    with pytest.raises(ValueError, match="no gated MLP"):
        eval_teal.calibrate(nn.Sequential(nn.Linear(4, 4)), 0.5, ids)
    assert not eval_teal.teal_mlps(model)


def test_eval_ppl_refuses_teal_rows_on_fp8():
    from prox import eval_ppl
    with pytest.raises(SystemExit):
        eval_ppl.main(["--methods", "teal-uniform", "--fp8", "channel"])
    assert {"prox-paper", "prox-search", "prox-greedy", "teal-uniform", "teal-greedy"} <= set(eval_ppl.METHODS)
