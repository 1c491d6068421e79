# SPDX-License-Identifier: Apache-2.0
"""Perplexity of Prox with a per-layer allocation (prox.sparsify(allocation="greedy")) beside the uniform rows,
through prox.eval_ppl's own protocol (its windows, checks, counters and table): this script adds the rows
"prox-greedy" and "prox-greedy-search" to eval_ppl's METHODS and runs its main().

    PYTHONPATH=python python bench/experiments/greedy_ppl.py --model smollm2 --device cpu \\
        --methods prox-paper,prox-search,prox-greedy --e 0.4,0.5,0.6,0.7 --allocation-tokens 1024

The layer errors are measured once (on the first --allocation-tokens calibration tokens, every --allocation-step
of e) and every e after the first is allocated from the first greedy config's record (layer_errors=). Other flags
are eval_ppl's (python -m prox.eval_ppl --help).
"""
from __future__ import annotations

import argparse
import os
import sys

import prox
from prox import eval_ppl


def prox_greedy(split: str, tokens: int, step: float) -> eval_ppl.Method:
    """Prox with each layer's own e (mean e), split into (s1, s2) by ``split``."""
    measured = {}  # the first greedy config: its layer errors serve every later e

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
                                layer_errors=measured.get("cfg"), allocation_tokens=tokens, allocation_step=step,
                                model_name=run.desc, progress=eval_ppl.log if "cfg" not in measured else None, **kw)
            cfg.calibration["text"] = os.path.basename(a.calib_text)
            how = "calibrated"
            if a.thresholds:
                prox.save_thresholds(a.thresholds, cfg, model=run.desc)
        measured.setdefault("cfg", cfg)
        info = cfg.calibration["allocation"]["info"]
        eval_ppl.log(f"e={e:.2f} greedy ({split}): layer e " + " ".join(f"{r.e:.2f}" for r in cfg.layers)
                     + f"; errors measured in {info['seconds']:.0f} s on {cfg.calibration['allocation']['tokens']} tokens")
        return {"split": split, "how": how, "allocation": "greedy", "layer_e": [r.e for r in cfg.layers],
                "layer_splits": [[r.s1, r.s2] for r in cfg.layers], "measure_seconds": info["seconds"],
                "mean_ffn_error": sum(r.output_error for r in cfg.layers) / len(cfg.layers)}
    return eval_ppl.Method(f"Prox greedy, {split} split", apply)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--allocation-tokens", type=int, default=2048)
    p.add_argument("--allocation-step", type=float, default=prox.allocation.LAYER_GRID_STEP)
    args, rest = p.parse_known_args(argv)
    eval_ppl.METHODS["prox-greedy"] = prox_greedy("paper", args.allocation_tokens, args.allocation_step)
    eval_ppl.METHODS["prox-greedy-search"] = prox_greedy("search", args.allocation_tokens, args.allocation_step)
    return eval_ppl.main(rest)


if __name__ == "__main__":
    sys.exit(main())
