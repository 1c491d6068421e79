# SPDX-License-Identifier: Apache-2.0
"""What a newcomer met (issue 47), on the host: a refused thresholds file leaves the model as it was (every kind of
refusal); sparsify checks e and its other arguments before the dense calibration pass; a thresholds file for
another e says what it holds and what to do; the CPU says once which path runs; a decode batch of more than 8
rows runs Prox (in calls of at most the workspace's capacity on the op's path), never the dense MLP silently."""
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

import prox
from prox import layer_ops, reference


def _weights(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) / math.sqrt(cols)


class GatedMLP(nn.Module):
    def __init__(self, d_model=64, d_ff=128, seed=0, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)
        with torch.no_grad():
            self.gate_proj.weight.copy_(_weights(d_ff, d_model, seed))
            self.up_proj.weight.copy_(_weights(d_ff, d_model, seed + 1))
            self.down_proj.weight.copy_(_weights(d_model, d_ff, seed + 2))
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.mlp = GatedMLP(seed=seed)

    def forward(self, hidden_states):
        return (hidden_states + self.mlp(hidden_states),)


class TinyLM(nn.Module):
    """Embedding, two decoder blocks with one gated MLP each, a head: what sparsify walks. Counts its forwards."""

    def __init__(self, seed=0):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        with torch.no_grad():
            self.embed.weight.copy_(_weights(32, 64, seed + 100))
        self.layers = nn.ModuleList([Block(seed + 10 * i) for i in range(2)])
        self.forwards = 0

    def forward(self, input_ids, use_cache=False):
        self.forwards += 1
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)[0]
        return h


def _snapshot(model):
    return ({n: type(m) for n, m in model.named_modules()}, {k: v.clone() for k, v in model.state_dict().items()})


def _assert_unchanged(model, snap):
    types, state = snap
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert not any(isinstance(m, prox.SparseMLP) for m in model.modules())
    now = model.state_dict()
    assert set(now) == set(state) and all(torch.equal(now[k], v) for k, v in state.items())


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A thresholds file calibrated on TinyLM(seed 0) at e = 0.5."""
    path = tmp_path_factory.mktemp("th") / "th.json"
    model = TinyLM()
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(1))
    cfg = prox.sparsify(model, 0.5, ids, model_name="tiny")
    prox.save_thresholds(path, cfg)
    return path, cfg


def _edit(path, tmp_path, fn):
    d = json.loads(path.read_text())
    fn(d)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(d))
    return out


REFUSALS = {
    "another e in the file": (lambda d: d["configs"][0].update(e=0.6), {},
                              "thresholds hold no config for e=0.5, split='paper'; they hold \\(e=0.6, paper\\)"),
    "another split": (lambda d: None, {"split": "search"}, "no config for e=0.5, split='search'"),
    "other weights": (lambda d: d["configs"][0]["layers"][1]["fingerprint"]["gate"].update(sum=123.0), {},
                      "layers.1.mlp: other weights"),
    "a missing layer": (lambda d: d["configs"][0]["layers"].pop(), {}, "no thresholds for 1 layer"),
    "an extra layer": (lambda d: d["configs"][0]["layers"].append(dict(d["configs"][0]["layers"][0], name="x.mlp")),
                       {}, "thresholds for 1 layer\\(s\\) the model does not have"),
    "another INT4 layout": (lambda d: d.update(int4_layout="prox-int4-other"), {}, "INT4 layout"),
    "another model": (lambda d: None, {"model_name": "other"}, "calibrated for model 'tiny'"),
    "another activation": (lambda d: d["configs"][0]["layers"][0].update(act="gelu_tanh"), {}, "activation"),
    "another format": (lambda d: d["configs"][0]["layers"][0].update(format="fp8_channel"), {},
                       "calibrated on 'fp8_channel' weights"),
    "another shape": (lambda d: d["configs"][0]["layers"][0].update(d_ff=256), {}, "thresholds for shape"),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_refused_thresholds_file_leaves_the_model_unchanged(calibrated, tmp_path, kind):
    """sparsify(thresholds=...) builds every SparseMLP and checks the file against them before the first swap: after
    any refusal the model holds its own MLPs, W_down included (restore_mlps could not have brought back a W_down
    dropped with keep_down=False), with their weights as they were."""
    path, _ = calibrated
    edit, kw, message = REFUSALS[kind]
    model = TinyLM()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        prox.sparsify(model, 0.5, thresholds=str(_edit(path, tmp_path, edit)), **{"model_name": "tiny", **kw})
    _assert_unchanged(model, snap)
    prox.sparsify(model, 0.5, thresholds=str(path), model_name="tiny")  # the file itself applies
    assert all(isinstance(layer.mlp, prox.SparseMLP) for layer in model.layers)


def test_a_refusal_of_a_config_object_leaves_the_model_unchanged(calibrated):
    _, cfg = calibrated
    model = TinyLM()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="the ThresholdConfig given is for e=0.5"):
        prox.sparsify(model, 0.6, thresholds=cfg)
    _assert_unchanged(model, snap)


@pytest.mark.parametrize("kw, exc, message", [
    ({"e": 1.5}, ValueError, r"target effective sparsity must be in \[0, 0.9333\], got 1.5"),
    ({"e": -0.1}, ValueError, "target effective sparsity must be in"),
    ({"e": float("nan")}, ValueError, "target effective sparsity must be in"),
    ({"split": "best"}, ValueError, "split must be 'paper' or 'search'"),
    ({"backend": "cuda"}, ValueError, "backend must be 'auto', 'op' or 'torch'"),
    ({"prefill": "none"}, ValueError, "prefill must be 'dense' or 'sparse'"),
    ({"options": {}}, TypeError, "options must be a prox.PlanOptions"),
    ({"capacity": 0}, ValueError, "capacity must be an int >= 1"),
    ({"search_tokens": 0}, ValueError, "search_tokens must be an int >= 1"),
    ({"dtype": torch.float64}, TypeError, "dtype must be None, torch.float16"),
    ({"alpha": 0.0}, ValueError, "malformed allocation rule"),
])
def test_arguments_are_checked_before_the_dense_pass(kw, exc, message):
    """A bad e (or any other argument) raises before the model runs (on an 8B model the dense calibration pass takes
    minutes), and leaves the model as it was."""
    model = TinyLM()
    snap = _snapshot(model)
    ids = torch.randint(0, 32, (2, 24))
    args = {"e": 0.5, **kw}
    with pytest.raises(exc, match=message):
        prox.sparsify(model, args.pop("e"), ids, **args)
    assert model.forwards == 0
    _assert_unchanged(model, snap)


def test_the_cpu_says_once_which_path_runs(monkeypatch):
    """On the CPU, Prox runs the torch reference, slower than the dense MLP: SparseMLP says so once per process and
    reason (as on CUDA), not once per layer, and not silently."""
    monkeypatch.setattr(prox.sparse_mlp, "_WARNED", set())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        layers = [prox.SparseMLP.from_mlp(GatedMLP(seed=s)) for s in range(3)]
    said = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and all(m.backend_in_use() == "torch" for m in layers)
    assert "SparseMLP on cpu (native weights, torch.float32 activations) runs the torch reference of Prox, not the " \
           "CUDA op (slower than the dense MLP on the CPU)" in said[0]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        prox.SparseMLP.from_mlp(GatedMLP(), backend="torch")  # asked for: nothing to say
    assert not got


# ---------------------------------------------------------------- batches over 8 rows


def test_in_chunks_runs_a_batch_in_calls_of_at_most_the_capacity():
    x = torch.randn(17, 8)
    for rows, sizes in ((8, [8, 8, 1]), (1, [1] * 17), (17, [17]), (32, [17])):
        seen = []
        y = layer_ops.in_chunks(x, rows, lambda part: (seen.append(part.shape[0]), part * 2)[1])
        assert seen == sizes and torch.equal(y, x * 2)
    with pytest.raises(ValueError, match="a call takes at least one row \\(got a capacity of 0 rows\\)"):
        layer_ops.in_chunks(x, 0, lambda part: part)


@pytest.mark.parametrize("batch", [2, 9, 17])
def test_a_decode_batch_over_8_rows_runs_prox(batch):
    """A decode step of several sequences (x [B, 1, d_model]) runs Prox on every row whatever B (here the torch
    reference: each row what a one-token step gives it), not the dense MLP; the counters count every row.
    Several tokens of one sequence ([1, T, d_model]) stay a prefill."""
    sp = prox.SparseMLP.from_mlp(GatedMLP(), tau_x=0.4, tau_s=0.02, track_sparsity=True)
    x = torch.randn(batch, 1, 64)
    with torch.no_grad():
        y = sp(x)
        rows = torch.cat([sp(x[b:b + 1]) for b in range(batch)])
        dense = sp.dense(x)
    assert torch.allclose(y, rows, rtol=1e-5, atol=1e-6)
    assert (y - dense).norm() > 1e-3 * dense.norm()  # Prox at these thresholds, not the dense MLP
    assert int(sp.counters[0]) == 2 * batch
    with torch.no_grad():
        assert torch.equal(sp(x.reshape(1, batch, 64)), sp.dense(x.reshape(1, batch, 64)))  # one sequence: prefill
        sp.batched = False  # batches follow `prefill` (dense)
        assert torch.equal(sp(x), dense)


def test_the_capacity_of_a_layer_off_the_ops_path_is_zero():
    sp = prox.SparseMLP.from_mlp(GatedMLP())
    assert sp.capacity() == 0 and sp.backend_in_use() == "torch"
