# SPDX-License-Identifier: Apache-2.0
"""Perplexity of Prox with a per-layer allocation (prox.sparsify(allocation="greedy")) beside the uniform rows,
through prox.eval_ppl's own protocol (its windows, checks, counters and table): this script adds the rows
"prox-greedy" and "prox-greedy-search" to eval_ppl's METHODS and runs its main().

    PYTHONPATH=python python bench/experiments/greedy_ppl.py --model smollm2 --device cpu \\
        --methods prox-paper,prox-search,prox-greedy --e 0.4,0.5,0.6,0.7 --allocation-tokens 1024

The layer errors are measured once (prox.measure_layer_errors, on the first --allocation-tokens calibration tokens,
every --allocation-step of e) and every e is allocated from them (layer_errors=); --layer-errors FILE keeps them
in a JSON file (read when it exists, written after the measurement otherwise). Other flags are eval_ppl's
(python -m prox.eval_ppl --help).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import prox
from prox import eval_ppl


def prox_greedy(split: str, tokens: int, step: float, path: str) -> eval_ppl.Method:
    """Prox with each layer's own e (mean e), split into (s1, s2) by ``split``."""
    measured = {}

    def layer_errors(run: eval_ppl.Run) -> prox.LayerErrors:
        if "errors" not in measured:
            if path and os.path.exists(path):
                with open(path) as f:
                    measured["errors"] = prox.LayerErrors.from_dict(json.load(f))
                eval_ppl.log(f"layer errors read from {path}")
            else:
                measured["errors"] = prox.measure_layer_errors(run.model, [w[None] for w in run.calibration],
                                                               tokens=tokens, step=step, alpha=run.args.alpha,
                                                               backend=run.args.backend, progress=eval_ppl.log)
                if path:
                    with open(path, "w") as f:
                        json.dump(measured["errors"].to_dict(), f, indent=1)
        return measured["errors"]

    def apply(run: eval_ppl.Run, e: float) -> dict:
        a = run.args
        kw = dict(backend=a.backend, keep_down=True, track_sparsity=True, prefill="sparse", alpha=a.alpha)
        try:
            cfg = prox.find_config(run.known, e, split, "greedy")
            prox.sparsify(run.model, e, thresholds=cfg, split=split, allocation="greedy", strict=not a.no_strict,
                          model_name=run.desc, **kw)
            how = "loaded"
        except prox.thresholds.MissingThresholds:
            cfg = prox.sparsify(run.model, e, [w[None] for w in run.calibration], split=split, allocation="greedy",
                                layer_errors=layer_errors(run), model_name=run.desc, **kw)
            cfg.calibration["text"] = os.path.basename(a.calib_text)
            how = "calibrated"
            if a.thresholds:
                prox.save_thresholds(a.thresholds, cfg, model=run.desc)
        rec = cfg.calibration["allocation"]
        eval_ppl.log(f"e={e:.2f} greedy ({split}): layer e " + " ".join(f"{r.e:.2f}" for r in cfg.layers)
                     + f"; errors measured in {rec['info']['seconds']:.0f} s on {rec['tokens']} tokens")
        return {"split": split, "how": how, "allocation": "greedy", "layer_e": [r.e for r in cfg.layers],
                "layer_splits": [[r.s1, r.s2] for r in cfg.layers], "measure_seconds": rec["info"]["seconds"],
                "mean_ffn_error": sum(r.output_error for r in cfg.layers) / len(cfg.layers)}
    return eval_ppl.Method(f"Prox greedy, {split} split", apply)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--allocation-tokens", type=int, default=2048)
    p.add_argument("--allocation-step", type=float, default=prox.allocation.LAYER_GRID_STEP)
    p.add_argument("--layer-errors", default="", help="JSON file of the layer errors (read if it exists, else written)")
    args, rest = p.parse_known_args(argv)
    for name, split in (("prox-greedy", "paper"), ("prox-greedy-search", "search")):
        eval_ppl.METHODS[name] = prox_greedy(split, args.allocation_tokens, args.allocation_step, args.layer_errors)
    return eval_ppl.main(rest)


if __name__ == "__main__":
    sys.exit(main())
