# SPDX-License-Identifier: Apache-2.0
"""Host tests of the Python layer's safety (issue 38): no crash, no silent wrong result, no silent slow path.
The extension's C++ runtime, the kept import error and a source tree shadowing the installed package, biased
linears, derived state that follows the weights (refresh, load_state_dict, the state-dict round trip), the
thresholds file's fingerprints and checks, eval_ppl's BOS windows and dense check, the workspace header,
the cooperative-launch refusal, the checks made where a layer is built, the plan cache's knobs, and what the
tools say without a GPU."""
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import prox
from prox import _abi, reference
from conftest import requires_ext

PKG = os.path.dirname(os.path.abspath(prox.__file__))


def _linears(d_model=64, d_ff=128, bias=(False, False, False), dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = [nn.Linear(a, b, bias=bb) for (a, b), bb in zip(((d_model, d_ff), (d_model, d_ff), (d_ff, d_model)), bias)]
    return [m.to(dtype) for m in lin]


def _tiny_llama(layers=2, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


# ---------------------------------------------------------------- 1. one C++ runtime


@requires_ext
def test_extension_defines_no_libstdcxx_runtime():
    """A _C.so holding a static copy of libstdc++ (a compiler that finds libstdc++.a first) crashes on its first
    error message; the build links the shared one and must define none of its runtime's symbols."""
    path = importlib.import_module("prox._C").__file__
    bad = _abi.libstdcxx_symbols(path)
    assert bad == [], f"{path} defines {len(bad)} libstdc++ symbols, e.g. {bad[:5]}: {_abi.ADVICE}"
    with pytest.raises(ValueError, match="got 12"):  # the integer is formatted (a second runtime drops or crashes)
        prox.workspace_bytes(12, 64)


def test_libstdcxx_symbol_filter():
    names = ["_ZNSo9_M_insertIlEERSoT_", "_ZNSt6locale7classicEv", "__cxa_throw", "_Znwm", "PyInit__C",
             "_ZNSt7__cxx1115basic_stringbufIcSt11char_traitsIcESaIcEED1Ev", "_ZN3c1010ValueErrorD0Ev"]
    got = [n for n in names if _abi._PATTERN.match(n)]
    assert got == names[:4]  # a weak inline destructor of a std template is not the runtime


# ---------------------------------------------------------------- 2. the import error is kept, and said


def _package_copy(tmp_path, with_c=None):
    dst = tmp_path / "prox"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    if with_c is not None:
        with_c(dst)
    return dst


def _run(code, cwd, env_path=None):
    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    return subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_broken_extension_error_is_kept_and_exposed(tmp_path):
    """An extension that exists but does not load (here: an undefined symbol, as an ABI mismatch gives) is not
    swallowed: import warns with the error, ops_import_error() returns it, and the ops raise it."""
    import sysconfig
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"

    def broken(dst):
        src = tmp_path / "broken.c"
        src.write_text("extern void prox_missing_symbol(void);\nvoid *PyInit__C(void) { prox_missing_symbol(); "
                       "return 0; }\n")
        cc = shutil.which("cc") or shutil.which("gcc")
        out = dst / f"_C{suffix}"
        if cc is None or subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)]).returncode != 0:
            out.write_bytes(b"not an ELF file")
    _package_copy(tmp_path, broken)
    r = _run("import prox; print(prox.ops_available()); print(prox.ops_import_error())\n"
             "try:\n    prox.workspace_bytes(64, 128)\nexcept RuntimeError as e:\n    print('raised', e)",
             cwd=str(tmp_path), env_path=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "False"
    assert "could not be loaded" in lines[1] and ("undefined symbol" in lines[1] or "ELF" in lines[1])
    assert lines[2].startswith("raised prox: the compiled extension prox._C exists but could not be loaded")
    assert "RuntimeWarning" in r.stderr and "could not be loaded" in r.stderr


@requires_ext
def test_source_tree_shadowing_is_detected(tmp_path):
    """Run from a directory whose prox/ (the source tree python/prox) has no build while an installed build
    exists: said at import and by ops_import_error(), and bench_decode refuses instead of timing the reference."""
    _package_copy(tmp_path)
    installed = os.path.dirname(PKG)
    r = _run("import prox, sys; print(prox.__file__); print(prox.ops_import_error())\n"
             "from prox import bench_decode\n"
             "try:\n    bench_decode.main(['--models', 'tiny'])\nexcept SystemExit as e:\n    print('exit', e)",
             cwd=str(tmp_path), env_path=installed)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(str(tmp_path))
    assert "shadows the installed package" in lines[1] and installed in lines[1]
    assert "shadows the installed package" in r.stderr  # the import warning
    assert lines[-1].startswith("exit ")  # a GPU: refused for the missing op; none: said so (argparse, on stderr)
    assert "torch reference" in lines[-1] or "no CUDA driver/GPU found" in r.stderr


def test_bench_decode_refuses_the_reference(monkeypatch):
    """On CUDA without the op, bench_decode stops rather than report Prox timings of the torch reference."""
    from prox import bench_decode
    monkeypatch.setattr(prox, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(prox, "ops_available", lambda: False)
    monkeypatch.setattr(prox, "ops_import_error", lambda: "undefined symbol: _ZN3c10")
    with pytest.raises(SystemExit, match="Refusing to time Prox through the torch reference"):
        bench_decode.main(["--models", "tiny"])


# ---------------------------------------------------------------- 3a. biased linears


@pytest.mark.parametrize("which", [0, 1, 2])
def test_biased_linears_are_refused(which):
    bias = [False, False, False]
    bias[which] = True
    with pytest.raises(ValueError, match=f"{['gate_proj', 'up_proj', 'down_proj'][which]} has a bias"):
        prox.SparseMLP(*_linears(bias=tuple(bias)))


# ---------------------------------------------------------------- 3b. derived state follows the weights


def _want(sp, lin, x, tau_x, tau_s):
    """What a SparseMLP built fresh from these linears' current weights gives."""
    fresh = prox.SparseMLP(*lin, keep_down=True, tau_x=tau_x, tau_s=tau_s, prefill="sparse")
    return fresh(x)


@pytest.mark.parametrize("keep_down", [True, False])
def test_inplace_update_then_refresh(keep_down):
    lin = _linears()
    sp = prox.SparseMLP(*lin, keep_down=keep_down, tau_x=0.3, tau_s=0.02, prefill="sparse")
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = sp(x)
        lin[0].weight.mul_(-1.5)  # as a LoRA merge or load_state_dict does: in place
        with pytest.raises(RuntimeError, match="refresh"):
            sp(x)
        if keep_down:
            lin[2].weight.add_(0.05)
        sp.refresh()
        got = sp(x)
        want = _want(sp, [lin[0], lin[1], lin[2] if keep_down else _down_from(sp)], x, 0.3, 0.02)
    assert torch.equal(got, want) and not torch.equal(got, before)


def _down_from(sp):
    lin = nn.Linear(sp.d_ff, sp.d_model, bias=False)
    with torch.no_grad():
        lin.weight.copy_(sp.down_t.t())
    return lin


def test_state_dict_round_trip_of_a_swapped_model():
    """keep_down=False keeps W_down only as down_t: the state dict still holds it (as down_proj.weight, the dense
    MLP's key), so a round trip gives an equivalent model, and dense and swapped models exchange state dicts."""
    ids = torch.randint(0, 128, (1, 12))
    a = _tiny_llama(seed=0)
    with torch.no_grad():
        dense_logits = a(ids).logits
    prox.swap_mlps(a, keep_down=False, prefill="sparse", tau_x=0.2, tau_s=0.01)
    sd = a.state_dict()
    assert "model.layers.0.mlp.down_proj.weight" in sd
    b = _tiny_llama(seed=1)  # other weights
    prox.swap_mlps(b, keep_down=False, prefill="sparse", tau_x=0.2, tau_s=0.01)
    res = b.load_state_dict(sd)
    assert not res.missing_keys and not res.unexpected_keys
    with torch.no_grad():
        assert torch.equal(b(ids).logits, a(ids).logits)  # proxies re-derived on load
        for (_, ma), (_, mb) in zip(prox.find_mlps(a), prox.find_mlps(b)):
            assert torch.equal(ma.proxy_gate, mb.proxy_gate) and torch.equal(ma.down_t, mb.down_t)
    c = _tiny_llama(seed=2)  # a dense model takes the swapped model's state dict
    c.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(c(ids).logits, dense_logits)
    d = _tiny_llama(seed=3)  # and a swapped model takes a dense one's (keep_down either way)
    prox.swap_mlps(d, keep_down=True, prefill="sparse", tau_x=0.2, tau_s=0.01)
    d.load_state_dict(c.state_dict())
    with torch.no_grad():
        assert torch.equal(d(ids).logits, a(ids).logits)


# ---------------------------------------------------------------- 3c. thresholds files


def _calibrated(tmp_path, seed=0, name="tiny"):
    m = _tiny_llama(seed=seed)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    cfg = prox.sparsify(m, 0.5, ids, model_name=name)
    path = tmp_path / "th.json"
    prox.save_thresholds(path, cfg)
    return m, cfg, path


def test_thresholds_file_records_fingerprints(tmp_path):
    m, cfg, path = _calibrated(tmp_path)
    d = json.loads(path.read_text())
    assert d["version"] == prox.thresholds.VERSION == 4 and d["model"] == "tiny"
    fp = d["configs"][0]["layers"][0]["fingerprint"]
    assert fp["dtype"] == "float32" and len(fp["gate"]["samples"]) == prox.thresholds.FINGERPRINT_SAMPLES
    m2 = _tiny_llama(seed=0)
    prox.sparsify(m2, 0.5, thresholds=path, model_name="tiny")  # the same weights: applies
    assert [mm.get_thresholds() for _, mm in prox.find_mlps(m2)] == [mm.get_thresholds() for _, mm in prox.find_mlps(m)]


def test_thresholds_of_other_weights_are_refused(tmp_path):
    _, cfg, path = _calibrated(tmp_path)
    other = _tiny_llama(seed=7)  # same shapes, other checkpoint
    with pytest.raises(ValueError, match="other weights"):
        prox.sparsify(other, 0.5, thresholds=path)
    with pytest.warns(RuntimeWarning, match="other weights"):
        prox.sparsify(_tiny_llama(seed=7), 0.5, thresholds=path, strict=False)
    tuned = _tiny_llama(seed=0)  # the same checkpoint, one weight changed a little (a fine-tune)
    with torch.no_grad():
        tuned.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    with pytest.raises(ValueError, match="model.layers.1.mlp: other weights"):
        prox.sparsify(tuned, 0.5, thresholds=path)


def test_thresholds_layers_layout_act_model_and_e_are_checked(tmp_path):
    _, cfg, path = _calibrated(tmp_path)
    m = _tiny_llama(seed=0)
    prox.swap_mlps(m)
    extra = prox.ThresholdConfig(**{**cfg.__dict__, "layers": cfg.layers + [
        prox.LayerRecord("model.layers.9.mlp", 64, 128, "silu", 0.1, 0.7, 0.1, 0.1)]})
    with pytest.raises(ValueError, match="the model does not have"):
        prox.apply_thresholds(m, extra)
    with pytest.raises(ValueError, match="no thresholds for 1 layer"):
        prox.apply_thresholds(m, prox.ThresholdConfig(**{**cfg.__dict__, "layers": cfg.layers[:1]}))
    with pytest.raises(ValueError, match="INT4 layout"):
        prox.apply_thresholds(m, prox.ThresholdConfig(**{**cfg.__dict__, "int4_layout": "prox-int4-other-v9"}))
    import dataclasses
    gelu = [dataclasses.replace(r, act="gelu_tanh") for r in cfg.layers]
    with pytest.raises(ValueError, match="activation"):
        prox.apply_thresholds(m, prox.ThresholdConfig(**{**cfg.__dict__, "layers": gelu}))
    with pytest.raises(ValueError, match="calibrated for model 'tiny'"):
        prox.apply_thresholds(m, cfg, model_name="another")
    with pytest.raises(ValueError, match="e=0.5"):
        prox.sparsify(_tiny_llama(seed=0), 0.7, thresholds=cfg)  # the config must not override e
    with pytest.raises(ValueError, match="split"):
        prox.sparsify(_tiny_llama(seed=0), 0.5, thresholds=cfg, split="search")
    prox.apply_thresholds(m, cfg, model_name="tiny")


def test_thresholds_version1_file_loads_and_warns(tmp_path):
    _, cfg, path = _calibrated(tmp_path)
    d = json.loads(path.read_text())
    d["version"] = 1
    for c in d["configs"]:
        for r in c["layers"]:
            del r["fingerprint"]
    path.write_text(json.dumps(d))
    m = _tiny_llama(seed=0)
    with pytest.warns(RuntimeWarning, match="no weight fingerprint"):
        prox.sparsify(m, 0.5, thresholds=path)
    prox.save_thresholds(path, prox.load_thresholds(path), fingerprints=m)  # upgraded in place
    assert json.loads(path.read_text())["version"] == prox.thresholds.VERSION
    with pytest.raises(ValueError, match="other weights"):
        prox.sparsify(_tiny_llama(seed=7), 0.5, thresholds=path)


def test_thresholds_file_merge_refuses_other_weights(tmp_path):
    _, _, path = _calibrated(tmp_path)
    m = _tiny_llama(seed=7)
    cfg7 = prox.sparsify(m, 0.7, torch.randint(0, 128, (2, 24)))
    with pytest.raises(ValueError, match="other weights"):
        prox.save_thresholds(path, cfg7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fingerprint_rule_across_dtypes(dtype):
    """Exact on one dtype; calibrated in float32 and run in a 16-bit type, within the coarser rounding; another
    checkpoint never."""
    from prox.thresholds import fingerprint_mismatch, layer_fingerprint
    w = [torch.randn(128, 64), torch.randn(128, 64), torch.randn(64, 128)]
    fp32 = layer_fingerprint(*w)
    assert fingerprint_mismatch(fp32, layer_fingerprint(*[t.clone() for t in w])) is None
    assert fingerprint_mismatch(fp32, layer_fingerprint(*[t.to(dtype) for t in w])) is None
    assert fingerprint_mismatch(fp32, layer_fingerprint(w[0], w[1], w[2].t().contiguous().t())) is None  # layout
    other = [torch.randn(128, 64).to(dtype), torch.randn(128, 64).to(dtype), torch.randn(64, 128).to(dtype)]
    assert fingerprint_mismatch(fp32, layer_fingerprint(*other)) is not None
    w2 = [t.clone() for t in w]
    w2[1][100, 7] += 0.01
    assert "W_up" in fingerprint_mismatch(fp32, layer_fingerprint(*w2))


# ---------------------------------------------------------------- 3e. eval_ppl: BOS windows, dense check


def test_eval_ppl_windows_start_with_bos():
    from prox import eval_ppl
    ids = torch.arange(10, 1010)
    wins = eval_ppl.windows(ids, 512, bos=1)
    assert [w.numel() for w in wins] == [512, 490] and all(int(w[0]) == 1 for w in wins)
    assert torch.equal(torch.cat([w[1:] for w in wins]), ids)  # every text token scored once
    assert len(eval_ppl.windows(ids[:560], 512, bos=1)) == 1  # a last window of < 64 text tokens is dropped


def test_eval_ppl_scores_text_tokens_after_bos():
    from prox import eval_ppl
    m = _tiny_llama(seed=0)
    ids = torch.randint(2, 128, (200,))
    wins = eval_ppl.windows(ids, 64, bos=1, min_len=1)
    ppl, n = eval_ppl.perplexity(m, wins, "cpu")
    assert n == 200 and math.isfinite(ppl)
    with pytest.raises(SystemExit, match="perplexity is 543.0, above 300"):
        eval_ppl.check_dense(543.0, 300)
    with pytest.raises(SystemExit):
        eval_ppl.check_dense(float("nan"), 300)
    eval_ppl.check_dense(20.5, 300)


# ---------------------------------------------------------------- 4. workspace header, cooperative launch


@requires_ext
def test_workspace_dirty_needs_the_whole_header():
    hb = prox.workspace_header_bytes()
    assert hb == 4096 + 256  # 16 header copies 256 bytes apart, then the status word's line
    for n in (16, 4096):
        with pytest.raises(ValueError, match=f"has {n} bytes; it needs at least {hb}"):
            prox.workspace_dirty(torch.zeros(n, dtype=torch.uint8))
        with pytest.raises(ValueError, match=f"{hb}-byte header"):
            torch.ops.prox.workspace_dirty(torch.zeros(n, dtype=torch.uint8))


def test_plan_options_refuse_non_cooperative_fused_stage2():
    with pytest.raises(ValueError, match="cooperative=False"):
        prox.PlanOptions(cooperative=False)
    assert prox.PlanOptions(cooperative=False, fuse_stage2=False).encode()[0] == 1 | 8 | 32
    with pytest.raises(ValueError, match="policy index"):
        prox.PlanOptions(glu=64)


@requires_ext
def test_op_refuses_non_cooperative_fused_stage2():
    """The C++ flags check, for raw-op callers: flags with fuse_stage2 (4) but not cooperative (16)."""
    w = torch.zeros(32, 8, dtype=torch.float16)
    p, s = prox.pack_int4(w)
    layer = prox.LayerTensors(w_gate=w, w_up=w, w_down_t=w, proxy_gate=p, scale_gate=s, proxy_up=p, scale_up=s).tensors()
    flags = 1 | 4 | 8 | 32
    for call in (lambda: torch.ops.prox.plan_ffn(layer, 0, torch.zeros(2), 0, [flags, -1, -1, -1, -1]),
                 lambda: torch.ops.prox.sparse_ffn(w[0], layer, 0, torch.zeros(2), torch.zeros(8192, dtype=torch.uint8),
                                                   0, [flags, -1, -1, -1, -1])):
        with pytest.raises(ValueError, match="cooperative off"):
            call()


@requires_ext
def test_plan_cache_capacity_knob():
    assert prox.plan_cache_capacity() == 4096 and prox.plan_cache_pinned() >= 0
    with pytest.raises(ValueError, match=">= 1"):
        prox.set_plan_cache_capacity(0)
    prox.set_plan_cache_capacity(7)
    try:
        assert prox.plan_cache_capacity() == 7
    finally:
        prox.set_plan_cache_capacity(4096)


# ---------------------------------------------------------------- 5. checks where the layer is built


def _layer_tensors(d_model=64, d_ff=128, dtype=torch.float16):
    wg, wu = (torch.randn(d_ff, d_model).to(dtype) for _ in range(2))
    wdt = torch.randn(d_ff, d_model).to(dtype)
    pg, sg = reference.pack_int4(wg)
    pu, su = reference.pack_int4(wu)
    return prox.LayerTensors(w_gate=wg, w_up=wu, w_down_t=wdt, proxy_gate=pg, scale_gate=sg, proxy_up=pu, scale_up=su)


@requires_ext
def test_check_layer_names_the_tensor():
    t = _layer_tensors()
    th = torch.zeros(2)
    assert prox.check_layer(t, th, torch.zeros(prox.workspace_bytes(64, 128), dtype=torch.uint8)) == (64, 128)
    buf = torch.zeros(64 * 128 + 1, dtype=torch.float16)
    cases = [
        (dict(w_up=t.w_up.bfloat16()), TypeError, r"w_up must be torch.float16 \(it is torch.bfloat16\)"),
        (dict(w_up=t.w_up[:, :56]), ValueError, r"w_up must have shape \(128, 64\) \(it has \(128, 56\)\)"),
        (dict(w_up=t.w_up.t().contiguous().t()), ValueError, "w_up must be contiguous"),
        (dict(w_down_t=buf[1:].view(128, 64)), ValueError, "w_down_t must be 16-byte aligned"),
        (dict(proxy_up=t.proxy_up.long()), TypeError, "proxy_up must be torch.int32"),
        (dict(scale_gate=t.scale_gate[:64]), ValueError, r"scale_gate must have shape \(128,\)"),
        (dict(thresholds=torch.zeros(2, device="meta")), ValueError, "thresholds is on meta"),
        (dict(workspace=torch.zeros(1024, dtype=torch.uint8)), ValueError, "workspace .* has 1024 bytes"),
        (dict(workspace=torch.zeros(8192, dtype=torch.int32)), TypeError, "workspace .* must be torch.uint8"),
        (dict(w_gate=torch.zeros(128, 60, dtype=torch.float16)), ValueError, "d_model must be a multiple of 8"),
    ]
    for over, exc, text in cases:
        args = {"thresholds": th, "workspace": None, **over}
        layer = t._replace(**{k: v for k, v in over.items() if k in prox.LAYER_SLOTS})
        with pytest.raises(exc, match=text):
            prox.check_layer(layer, args["thresholds"], args["workspace"])
    big = prox.workspace_bytes(64, 128, 4)
    with pytest.raises(ValueError, match="calls of up to 5 tokens"):
        prox.check_layer(t, th, torch.zeros(big, dtype=torch.uint8), max_tokens=5)
    with pytest.raises(TypeError, match="prox.LayerTensors"):
        prox.check_layer(tuple(t), th)  # positional tensors: refused
    with pytest.raises(TypeError, match="scale_up must be a tensor"):
        prox.check_layer(t._replace(scale_up=[1.0] * 128), th)


# ---------------------------------------------------------------- the layer's tensors: one structure, one slot table


@requires_ext
def test_layer_slots_have_one_definition():
    """The slots are written once (csrc/ffn_api.h, PROX_EXT_LAYER_SLOTS): the extension reports them in the ops'
    list order, prox.LAYER_SLOTS is that list, LayerTensors has a field for each, and tensors() puts each field
    at its slot's position. The formats likewise (setup.py's FORMATS, reported by the extension)."""
    names = tuple(torch.ops.prox.layer_slot_names())
    assert names == prox.LAYER_SLOTS
    assert tuple(f for f in prox.LayerTensors._fields if f != "format") == names
    t = _layer_tensors()
    assert [id(v) for v in t.tensors()] == [id(getattr(t, n)) for n in names]
    assert tuple(torch.ops.prox.layer_format_names()) == prox.FORMATS
    assert t.format == "native" and t.format_code() == prox.FORMATS.index("native")
    with pytest.raises(ValueError, match="unknown layer format 'fp4'"):
        t._replace(format="fp4").format_code()
    # The C++ side reads the list by the same names: each slot, given a wrong dtype, is named in the error, by
    # the op's own check (torch.ops.prox.check_layer: what every op call runs first).
    # (The FP8 formats' own slots, None here, are checked the same way in test_fp8_host.py.)
    wrong = {"w_gate": torch.float32, "proxy_gate": torch.int64, "proxy_up": torch.int64}
    for i, name in enumerate(names):
        if getattr(t, name) is None:
            continue
        bad = getattr(t, name).to(wrong.get(name, torch.float64 if name.startswith("scale") else torch.bfloat16))
        layer = t.tensors()
        layer[i] = bad
        with pytest.raises(TypeError, match=rf"prox: {name} must be torch\."):
            torch.ops.prox.check_layer(layer, 0, torch.zeros(2))


@requires_ext
def test_layer_list_is_checked_by_slot_name():
    t = _layer_tensors()
    th = torch.zeros(2)
    assert list(torch.ops.prox.check_layer(t.tensors(), t.format_code(), th)) == [64, 128]
    # A missing slot, by name, in every op (the CPU kernels check the list before saying they need CUDA).
    for i, name in enumerate(prox.LAYER_SLOTS):
        if getattr(t, name) is None:  # a slot the native format has no use for (FP8's scales)
            continue
        layer = t.tensors()
        layer[i] = None
        with pytest.raises(ValueError, match=rf"prox: {name} is missing \(None\): the native format needs it"):
            torch.ops.prox.check_layer(layer, 0, th)
    # The list's length: one entry per slot, all named.
    for layer in (t.tensors()[:-1], t.tensors() + [None]):
        with pytest.raises(ValueError, match="layer must have 10 entries, one per slot \\(w_gate, w_up, w_down_t, "
                                             "proxy_gate, scale_gate, proxy_up, scale_up, w_gate_scale, w_up_scale, "
                                             "w_down_t_scale\\)"):
            torch.ops.prox.check_layer(layer, 0, th)
        with pytest.raises(ValueError, match="layer must have 10 entries"):
            torch.ops.prox.sparse_ffn(t.w_gate[0], layer, 0, th, torch.zeros(8192, dtype=torch.uint8), 0,
                                      prox.PlanOptions().encode())
    for code in (-1, len(prox.FORMATS)):
        with pytest.raises(ValueError, match="format must be a code of torch.ops.prox.layer_format_names"):
            torch.ops.prox.check_layer(t.tensors(), code, th)
        with pytest.raises(ValueError, match="format must be a code"):
            torch.ops.prox.plan_ffn(t.tensors(), code, th, 0, prox.PlanOptions().encode())
    # The activation type: the native format's is its weights' dtype.
    assert list(torch.ops.prox.check_layer(t.tensors(), 0, th, torch.float16)) == [64, 128]
    with pytest.raises(TypeError, match="dtype must be torch.float16, the dtype of the native format's weights "
                                        r"\(it is torch.bfloat16\)"):
        prox.check_layer(t, th, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w_gate must be a 2-D"):
        torch.ops.prox.check_layer([t.w_gate[0]] + t.tensors()[1:], 0, th)
    with pytest.raises(ValueError, match="w_up is on meta, the layer's tensors on cpu"):
        prox.check_layer(t._replace(w_up=t.w_up.to("meta")), th)


@requires_ext
def test_op_call_from_layer_tensors_traces_with_torch_compile():
    """torch.compile (fullgraph) traces a call that builds its layer list from a LayerTensors by name: the
    Tensor?[] argument and the fake kernel, on CPU tensors (the graph is captured, not run: the op runs on CUDA)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: (torch.zeros(64),)

    def f(x, wg, wu, wdt, pg, sg, pu, su, th, ws):
        lt = prox.LayerTensors(w_gate=wg, w_up=wu, w_down_t=wdt, proxy_gate=pg, scale_gate=sg, proxy_up=pu, scale_up=su)
        layer, fmt = prox._ops.layer_args(lt)  # what SparseMLP.forward and PlannedFfn.run call
        return torch.ops.prox.sparse_ffn(x, layer, fmt, th, ws, 0, [61, -1, -1, -1, -1])[0]

    t = _layer_tensors()
    torch._dynamo.reset()
    native = [v for v in t.tensors() if v is not None]  # the native format's seven slots, in f's order
    out = torch.compile(f, backend=backend, fullgraph=True)(torch.zeros(64, dtype=torch.float16), *native,
                                                           torch.zeros(2), torch.zeros(8192, dtype=torch.uint8))
    assert len(graphs) == 1 and out.shape == (64,)
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "sparse_ffn" in str(n.target)]
    assert len(calls) == 1


@requires_ext
def test_sparse_mlp_checks_a_given_workspace_when_built():
    with pytest.raises(ValueError, match="has 16 bytes"):
        prox.SparseMLP(*_linears(), workspace=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(TypeError, match="torch.uint8"):
        prox.SparseMLP(*_linears(), workspace=torch.zeros(1 << 16, dtype=torch.int32))


# ---------------------------------------------------------------- 6. what a newcomer meets


def test_sparsity_report_says_when_nothing_counts():
    m = nn.ModuleList([prox.SparseMLP(*_linears())])
    with pytest.raises(RuntimeError, match="track_sparsity=True"):
        prox.sparsity_report(m)
    with pytest.raises(RuntimeError, match="no SparseMLP"):
        prox.sparsity_report(nn.ModuleList())


def test_no_gpu_reason_names_the_missing_driver():
    reason = prox.cuda_unavailable_reason()
    if torch.cuda.is_available():
        assert reason is None
        return
    assert reason and "insufficient" not in reason
    if not prox._ops._driver_present():
        assert reason.startswith("no CUDA driver/GPU found")


def test_eval_ppl_cuda_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from prox import eval_ppl
    with pytest.raises(SystemExit):
        eval_ppl.main(["--device", "cuda"])
    err = capsys.readouterr().err
    assert "no CUDA" in err and "insufficient" not in err


def test_gguf_extra_declared():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    path = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
    with open(path, "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert {"gguf", "accelerate", "psutil", "requests"} <= {d.split(">")[0].split("=")[0] for d in extras["gguf"]}
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")).read()
    assert "pip install --no-deps gguf accelerate psutil requests" in doc  # the one documented command


# ---------------------------------------------------------------- one description of a layer type (issue 39)


@requires_ext
def test_plan_flags_have_one_encoding():
    """The flag bits are defined once (csrc/ffn_api.h): the extension reports their names, Python encodes by
    them, and each is a PlanOptions field; the C++ decoder refuses bits past the list."""
    names = prox._ops.plan_flag_names()
    assert names == prox.PLAN_FLAGS
    fields = {f.name for f in __import__("dataclasses").fields(prox.PlanOptions)}
    assert set(names) <= fields
    for i, name in enumerate(names):
        kw = {name: not getattr(prox.PlanOptions(), name)}
        if name == "cooperative":
            kw.update(fuse_stage2=False)
        flip = prox.PlanOptions(**kw).encode()[0] ^ prox.PlanOptions(**{k: v for k, v in kw.items()
                                                                        if k != name}).encode()[0]
        assert flip == 1 << i, name
    with pytest.raises(ValueError, match="fuse_batch_stage2"):
        prox.PlanOptions(cooperative=False, fuse_stage2=False, fuse_batch_stage2=True)
    w = torch.zeros(32, 8, dtype=torch.float16)
    p, s = prox.pack_int4(w)
    layer = prox.LayerTensors(w_gate=w, w_up=w, w_down_t=w, proxy_gate=p, scale_gate=s, proxy_up=p, scale_up=s).tensors()
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.prox.plan_ffn(layer, 0, torch.zeros(2), 0, [1 << len(names), -1, -1, -1, -1])


def test_layer_types_come_from_one_list():
    """setup.py's LAYER_TYPES is the one list: the build generates one translation unit per entry and the list
    the C++ factories and dispatch are made from."""
    gen = os.path.join(os.path.dirname(__file__), "..", "csrc", "generated")
    if not os.path.isdir(gen):
        pytest.skip("python/csrc/generated is written by the build (pip install ./python)")
    inc = open(os.path.join(gen, "layer_types.inc")).read()
    entries = [ln for ln in inc.splitlines() if ln.startswith("PROX_EXT_LAYER(")]
    names = sorted(ln[len("PROX_EXT_LAYER("):].split(",")[0] for ln in entries)
    assert names == sorted(f"{d}_{a}_{f}" for d in ("f16", "bf16") for a in ("silu", "gelu")
                           for f in ("native", "fp8_channel", "fp8_block128"))
    assert sorted(f for f in os.listdir(gen) if f.endswith(".cu")) == [f"ffn_{n}.cu" for n in names]
    # The formats' list (setup.py's FORMATS), in code order, is what the extension reports; every layer type's
    # format is one of it.
    fmts = [ln[len("PROX_EXT_FORMAT("):].rstrip(")").split(", ")
            for ln in open(os.path.join(gen, "formats.inc")).read().splitlines() if ln.startswith("PROX_EXT_FORMAT(")]
    assert tuple(name for name, _ in fmts) == prox.FORMATS
    assert {ln.rstrip(")").split(", ")[-1] for ln in entries} <= {code for _, code in fmts}
