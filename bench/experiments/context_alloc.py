# SPDX-License-Identifier: Apache-2.0
"""Experiment (issue 48): a per-layer allocation by layer errors measured *in context*, beside eval_ppl's rows.

prox.sparsify(allocation="greedy") allocates by each layer's KL of the logits measured with that layer alone sparse
and every other layer dense. Those errors are not additive: at e = 0.7 on SmolLM2 the isolated KLs sum to 0.51 per
token while the whole uniform model's is 0.66 (docs/python.md). This method measures each layer's curve where the
allocation will use it: the model calibrated at e with one e for every layer (the paper's split, sequentially),
then for each layer l and each e' of a window around e, layer l recalibrated at e' on its inputs in that sparse
model while every other layer keeps its uniform thresholds; the error is the KL of the logits from the dense
model's (prox.layerwise.layer_kl_errors on a walk of the sparse model, scored against the dense walk's
log-probabilities). The same allocator (prox.allocate_layers) then allocates e from these curves, and
prox.sparsify(allocation="greedy", layer_errors=...) calibrates the result sequentially. --context-rounds 2
measures once more around that allocation and allocates again.

    python bench/experiments/context_alloc.py --model FILE.gguf --device cuda --dtype fp32 --backend torch \\
        --methods prox-paper,prox-search,prox-greedy,prox-greedy-context --e 0.6,0.7

The row "prox-greedy-context" joins eval_ppl's METHODS (its other flags are eval_ppl's). Its configs are not
saved to --thresholds (their key would be prox-greedy's).
"""
from __future__ import annotations

import argparse
import sys
import time

import prox
from prox import eval_ppl
from prox.allocation import LayerErrors, allocate_sparsity, layer_grid
from prox.calibration import DEFAULT_CAPACITY, DEFAULT_SEED
from prox.layerwise import LayerWalk, as_sequences, first_tokens, layer_kl_errors
from prox.nn import find_mlps, set_mode, sparse_mlps


def context_errors(model, calibration, grid, alpha, tokens, say) -> LayerErrors:
    """Each layer's KL at each e of ``grid`` with every other layer as the model has it now (its SparseMLPs)."""
    t0 = time.time()
    mlps = find_mlps(model)
    names = [n for n, _ in mlps]
    layers = [model.get_submodule(n.rpartition(".")[0]) for n in names]
    seqs = first_tokens(as_sequences(calibration, next(model.parameters()).device), tokens)
    modes = [(m, m.prefill, m.batched) for _, m in sparse_mlps(model)]
    was_training = model.training
    model.eval()
    try:
        set_mode(model, prefill="dense", batched=False)
        dense = LayerWalk(model, layers, seqs, keep_logprobs=True)
        set_mode(model, prefill="sparse", batched=False)
        walk = LayerWalk(model, layers, seqs)
        walk.logprobs = dense.logprobs
        del dense
        rows = layer_kl_errors(walk, [n.rpartition(".")[0] for n in names], names, lambda li: mlps[li][1],
                               [allocate_sparsity(g, alpha) for g in grid], capacity=DEFAULT_CAPACITY,
                               seed=DEFAULT_SEED, say=say)
    finally:
        for m, p, b in modes:
            m.prefill, m.batched = p, b
        model.train(was_training)
    costs = [3.0 * m.d_model * m.d_ff_full for _, m in mlps]
    seconds = time.time() - t0
    say(f"in-context layer errors measured in {seconds:.1f} s on {walk.tokens} tokens, grid {grid[0]:g}..{grid[-1]:g}")
    return LayerErrors(names, [float(g) for g in grid], rows, costs, "kl-in-context", walk.tokens,
                       {"seconds": round(seconds, 3), "split": "paper", "alpha": alpha})


def window(e: float, below: float, above: float, step: float) -> list:
    lo = max(0.0, round(e - below, 6))
    hi = min(prox.allocation.LAYER_E_MAX, round(e + above, 6))
    return layer_grid(lo, hi, step)


def prox_greedy_context(rounds: int, below: float, above: float) -> eval_ppl.Method:
    def apply(run: eval_ppl.Run, e: float) -> dict:
        a = run.args
        calib = [w[None] for w in run.calibration]
        kw = dict(backend=a.backend, keep_down=True, track_sparsity=True, prefill="sparse", alpha=a.alpha,
                  split="paper", model_name=run.desc)
        cfg = prox.sparsify(run.model, e, calib, **kw)  # the uniform context
        alpha = cfg.alpha
        grid = window(e, below, above, a.allocation_step)
        seconds = 0.0
        for r in range(rounds):
            errs = context_errors(run.model, calib, grid, alpha, a.allocation_tokens, eval_ppl.log)
            seconds += errs.info["seconds"]
            cfg = prox.sparsify(run.model, e, calib, allocation="greedy", layer_errors=errs, **kw)
            eval_ppl.log(f"e={e:.2f} in-context round {r + 1}: layer e "
                         + " ".join(f"{rec.e:.2f}" for rec in cfg.layers))
        row = eval_ppl.row_fields(cfg, "calibrated", eval_ppl.backend_used(run.model))
        row["layer_errors"]["seconds"] = round(seconds, 3)
        row["context_rounds"] = rounds
        return row
    return eval_ppl.Method("Prox greedy in context, paper split", apply, prox.sparsity_report)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--context-rounds", type=int, default=1)
    p.add_argument("--context-below", type=float, default=0.3, help="the window's extent below e")
    p.add_argument("--context-above", type=float, default=0.2, help="the window's extent above e")
    args, rest = p.parse_known_args(argv)
    eval_ppl.METHODS["prox-greedy-context"] = prox_greedy_context(args.context_rounds, args.context_below,
                                                                  args.context_above)
    return eval_ppl.main(rest)


if __name__ == "__main__":
    sys.exit(main())
