# SPDX-License-Identifier: Apache-2.0
"""How long prox.sparsify takes with allocation="greedy" against "uniform", on a randomly initialised model of a
given shape (default: Qwen3-8B's, 36 layers, 4096 x 12288, vocabulary 151,936) and random calibration tokens.
Random weights give meaningless errors; the timing is what this measures (the work does not depend on the values).

    PYTHONPATH=python python bench/experiments/greedy_time.py --device cuda --json greedy-time-8b.json
    PYTHONPATH=python python bench/experiments/greedy_time.py --device cpu --layers 4 --d-model 256 --d-ff 768 \\
        --vocab 1024 --sequences 2 --seq-len 128 --allocation-tokens 256        # a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import prox


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bf16, fp16, fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-ff", type=int, default=12288)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--sequences", type=int, default=4, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--allocation-tokens", type=int, default=2048)
    p.add_argument("--allocation-step", type=float, default=prox.allocation.LAYER_GRID_STEP)
    p.add_argument("--e", type=float, default=0.6)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    import transformers
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype] if a.dtype else (
        torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    cfg = transformers.Qwen3Config(hidden_size=a.d_model, intermediate_size=a.d_ff, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   head_dim=a.d_model // a.heads, vocab_size=a.vocab, max_position_embeddings=4096)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(a.device):  # initialised where it runs (an 8B model on the CPU would take minutes)
        model = transformers.Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    torch.set_default_dtype(old)
    ids = torch.randint(0, a.vocab, (a.sequences, a.seq_len), generator=torch.Generator().manual_seed(1))
    originals = dict(prox.find_mlps(model))
    out = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "shape": vars(a), "rows": {}}
    for allocation in ("uniform", "greedy"):
        kw = dict(allocation_tokens=a.allocation_tokens, allocation_step=a.allocation_step) \
            if allocation == "greedy" else {}
        log = []
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.time()
        cfg = prox.sparsify(model, a.e, ids, allocation=allocation, keep_down=True, progress=log.append, **kw)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        total = time.time() - t
        measured = cfg.calibration["allocation"]["info"]["seconds"] if allocation == "greedy" else 0.0
        out["rows"][allocation] = {"seconds": total, "measure_seconds": measured,
                                   "calibrate_seconds": total - measured, "layer_e": [r.e for r in cfg.layers]}
        print(f"{allocation}: {total:.1f} s (layer errors {measured:.1f} s, calibration {total - measured:.1f} s)",
              flush=True)
        prox.nn.restore_mlps(model, originals=originals)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
