# SPDX-License-Identifier: Apache-2.0
"""A causal LM's decoder layers run one at a time on cached hidden states (LayerWalk: prox.sparsify's sequential
calibration), and the per-layer errors allocation="greedy" allocates by (layer_kl_errors).

LayerWalk: one dense forward per sequence captures each decoder layer's call arguments (masks, position
embeddings; they may differ per layer type, as in Gemma 3) and layer 0's input hidden states; a layer then runs
on any hidden states with its own arguments, so a pass over the layers costs one model forward, not L.

layer_kl_errors: for each layer l and each effective sparsity g of a grid, layer l alone runs Prox at g (its
thresholds calibrated on its dense inputs, the paper's split), every other layer dense; the error is the mean over
the tokens of KL(p_dense || p), p the model's next-token distribution. The model runs from layer l on: the layers
before it are replaced by a module that returns layer l's cached dense input, so one measurement costs the
layers from l to the last and the LM head. A layer's G grid points cost G (L - l) layer forwards: the whole
measurement about G L / 2 model forwards of the tokens (plus one dense forward), O(G L^2 T).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.nn as nn

from .allocation import StageSparsity
from .calibration import Calibrator, proxy_calibrator, quantile_threshold
from .nn import SparseMLP, set_submodule


def as_sequences(inputs, device) -> list:
    """Calibration inputs as a list of model-input dicts (one sequence each)."""
    if isinstance(inputs, torch.Tensor):
        inputs = [inputs[i:i + 1] for i in range(inputs.shape[0])] if inputs.dim() == 2 else [inputs[None]]
    out = []
    for s in inputs:
        if isinstance(s, dict):
            out.append({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in s.items()})
        else:
            s = torch.as_tensor(s)
            out.append({"input_ids": (s if s.dim() == 2 else s[None]).to(device)})
    return out


def sequence_length(seq: dict) -> int:
    return int(seq["input_ids"].shape[-1]) if "input_ids" in seq else int(seq["inputs_embeds"].shape[-2])


def first_tokens(seqs: list, n: int) -> list:
    """The first n tokens of the sequences: whole sequences, the last one cut (every tensor of the sequence's
    [1, T] or [1, T, ...] shape is cut along T)."""
    out, left = [], n
    for s in seqs:
        if left <= 0:
            break
        t = sequence_length(s)
        if t > left:
            s = {k: (v[:, :left] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == t else v)
                 for k, v in s.items()}
            t = left
        out.append(s)
        left -= t
    return out


def hidden_of(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def with_hidden(args, kwargs, h):
    if args:
        return (h,) + tuple(args[1:]), kwargs
    kw = dict(kwargs)
    kw["hidden_states"] = h
    return args, kw


def output_hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class LayerWalk:
    """The decoder layers ``layers`` of ``model`` (one forward call per layer and sequence), run one at a time.

    The constructor runs one forward per sequence (the model as it is: dense for a dense model) and keeps each
    layer's call arguments without its hidden states, layer 0's input (``hidden0``) and, with keep_logprobs, the
    log-probabilities of the model's output (``logprobs``, float32 [T, vocab] per sequence)."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], seqs: list, keep_logprobs: bool = False):
        self.model, self.layers, self.seqs = model, list(layers), seqs
        self.calls = [[None] * len(seqs) for _ in self.layers]
        self.hidden0 = [None] * len(seqs)
        self.tuple_out = [False] * len(self.layers)  # whether each layer returns a tuple (older transformers)
        self.logprobs = [] if keep_logprobs else None
        current = {"i": 0}

        def pre(li):
            def hook(mod, args, kwargs):
                i = current["i"]
                if li == 0:
                    self.hidden0[i] = hidden_of(args, kwargs)
                self.calls[li][i] = with_hidden(tuple(args), dict(kwargs), None)  # no hidden states kept
            return hook

        def post(li):
            def hook(mod, args, kwargs, out):
                self.tuple_out[li] = isinstance(out, (tuple, list))
            return hook

        hooks = []
        for li, layer in enumerate(self.layers):
            hooks.append(layer.register_forward_pre_hook(pre(li), with_kwargs=True))
            hooks.append(layer.register_forward_hook(post(li), with_kwargs=True))
        try:
            for i, s in enumerate(seqs):
                current["i"] = i
                out = model(**s, use_cache=False)
                if keep_logprobs:
                    self.logprobs.append(torch.log_softmax(out.logits[0].float(), dim=-1))
        finally:
            for h in hooks:
                h.remove()
        self.tokens = sum(int(h.shape[0] * h.shape[1]) if h.dim() == 3 else int(h.shape[0]) for h in self.hidden0)

    def run(self, li: int, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer li on sequence i's hidden states h (its own call arguments): its output hidden states."""
        args, kwargs = with_hidden(*self.calls[li][i], h)
        return output_hidden(self.layers[li](*args, **kwargs))

    def outputs(self, li: int, hidden: list) -> list:
        """Layer li on each sequence's hidden states: its outputs, per sequence (the next layer's inputs)."""
        return [self.run(li, i, h) for i, h in enumerate(hidden)]

    def mlp_inputs(self, li: int, mlp: nn.Module, hidden: list):
        """Layer li on each sequence's hidden states: (the inputs of ``mlp``, the MLP inside it, as one
        tokens x d_model tensor; the layer's outputs, per sequence)."""
        xs = []
        hk = mlp.register_forward_pre_hook(lambda mod, args: xs.append(args[0].reshape(-1, args[0].shape[-1])))
        try:
            out = self.outputs(li, hidden)
        finally:
            hk.remove()
        return torch.cat(xs), out


class _Replay(nn.Module):
    """Stands in for the decoder layers before the one measured: returns that layer's input (the current
    sequence's), whatever it is given."""

    def __init__(self, hidden: list, as_tuple: bool):
        super().__init__()
        self.hidden, self.as_tuple, self.i = hidden, as_tuple, 0

    def forward(self, *args, **kwargs):
        h = self.hidden[self.i]
        return (h,) if self.as_tuple else h


def kl_sum(logits: torch.Tensor, logprobs_dense: torch.Tensor) -> float:
    """sum over the tokens of KL(p_dense || p) for logits [T, vocab] (p = softmax(logits))."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return float((logprobs_dense.exp() * (logprobs_dense - lp)).sum(dtype=torch.float64))


@torch.no_grad()
def layer_kl_errors(walk: LayerWalk, layer_names: Sequence[str], mlp_names: Sequence[str],
                    sparse_of: Callable[[int], SparseMLP], splits: Sequence[StageSparsity], *, capacity: int,
                    seed: int, say: Callable[[str], None] = lambda s: None) -> list:
    """errors[l][i]: the mean KL(p_dense || p) per token when layer l alone runs Prox at (s1, s2) = splits[i]
    (its thresholds calibrated on its dense inputs, calibrate_layer's rule), on the walk's sequences (walk: made
    with keep_logprobs, on the dense model; its MLPs must run dense on several tokens).

    layer_names / mlp_names: each decoder layer's and its MLP's qualified names; sparse_of(l): a SparseMLP of layer
    l's MLP (the MLP itself when it is one: its thresholds and prefill mode are put back afterwards)."""
    model, seqs = walk.model, walk.seqs
    hidden = list(walk.hidden0)  # layer l's dense inputs, per sequence
    errors = []
    for li, layer in enumerate(walk.layers):
        t0 = time.time()
        mlp = model.get_submodule(mlp_names[li])
        x, nxt = walk.mlp_inputs(li, mlp, hidden)
        sp = sparse_of(li)
        cal = Calibrator(capacity, seed)
        cal.add(x)
        ax = cal.magnitudes()
        proxies = {}  # tau_x -> the calibrator of |s~| under it (grid points of one s1 share one pass of Stage 1)
        replay = _Replay(hidden, walk.tuple_out[li - 1] if li else False)
        saved = sp.get_thresholds(), sp.prefill
        row = []
        try:
            set_submodule(model, mlp_names[li], sp)
            for lj in range(li):
                set_submodule(model, layer_names[lj], replay)
            sp.prefill = "sparse"
            for st in splits:
                tau_x = quantile_threshold(ax, st.s1)[0]
                if tau_x not in proxies:
                    proxies[tau_x] = proxy_calibrator(x, tau_x, sp.proxy_values, capacity=capacity, seed=seed,
                                                      tp=sp.tp)
                sp.set_thresholds(tau_x, proxies[tau_x].finalize(st.s2).tau)
                total = 0.0
                for i, s in enumerate(seqs):
                    replay.i = i
                    total += kl_sum(model(**s, use_cache=False).logits[0], walk.logprobs[i])
                row.append(total / walk.tokens)
        finally:
            for lj in range(li):
                set_submodule(model, layer_names[lj], walk.layers[lj])
            set_submodule(model, mlp_names[li], mlp)
            sp.set_thresholds(*saved[0])
            sp.prefill = saved[1]
        errors.append(row)
        hidden = nxt
        say(f"  {mlp_names[li]}: KL per token " + ", ".join(f"{v:.4f}" for v in row[::max(1, len(row) // 4)])
            + f" ... [{time.time() - t0:.1f} s]")
    return errors
