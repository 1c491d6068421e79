# SPDX-License-Identifier: Apache-2.0
"""The benchmark library: what prox's benchmark CLIs share (bench_decode and its FP8, TP and generate modes,
bench_ffn_fp8, eval_ppl). Nothing here parses a command line; the CLIs sit on top and import from here, never
the other way round.

- the models: Qwen3-shaped transformers models with random weights built in code (``build_model``, fused QKV and
  gate/up storage; ``build_fp8_model`` with FP8 e4m3 MLPs);
- the lean decode step (``LeanDecoder``: a gpt-fast-like step on the model's weights) and the transformers step
  (``hf_step``);
- timing: ``Runner`` (a step captured in a CUDA graph, timed per token), ``capture_graph``, ``time_graph``,
  ``time_cell`` (one cell's dense / no-MLP / Prox timings) and the Amdahl bound (``amdahl``);
- thresholds from a prefill of random tokens (``calibrate_random``: every layer at e; ``calibrate_greedy``: each
  layer its own e, prox.sparsify(allocation="greedy"));
- the dense FP8 FFN through ``torch._scaled_mm`` (``make_scaled_mm``: bench_decode --fp8's and bench_ffn_fp8's
  baseline (a));
- reporting: ``log``, ``git_commit``, ``plot``, and ``HelpFormatter`` (every flag's default in ``--help``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

import prox
from prox import fp8
from prox.nn import SparseMLP
from prox.planned import summed_report

MODELS = {
    # Qwen3-8B and Qwen3-14B (config.json of the released models)
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # a small model for smoke tests (CPU included)
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
T0 = time.time()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every flag's default: "(default: X)" appended, unless the flag's help already says what its
    default is (a default computed from other flags)."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def dtype_name(dtype: torch.dtype) -> str:
    """DTYPES' name of a torch dtype ("bf16" for torch.bfloat16)."""
    return next(k for k, v in DTYPES.items() if v == dtype)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def qwen3_config(name: str, max_len: int):
    from transformers import Qwen3Config
    kw = dict(MODELS[name])
    return Qwen3Config(**kw, max_position_embeddings=max(max_len, 4096), rms_norm_eps=1e-6,
                       tie_word_embeddings=False, attention_bias=False, rope_theta=1_000_000.0,
                       attn_implementation="sdpa")


@contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(name: str, dtype, device, max_len: int, seed: int = 0):
    """A Qwen3ForCausalLM with random weights, made on the device in its dtype; fused QKV and gate/up storage."""
    from transformers import Qwen3ForCausalLM
    cfg = qwen3_config(name, max_len)
    torch.manual_seed(seed)
    with default_dtype(dtype), torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
            a.q_proj.weight = nn.Parameter(qkv[:nq], requires_grad=False)
            a.k_proj.weight = nn.Parameter(qkv[nq:nq + nk], requires_grad=False)
            a.v_proj.weight = nn.Parameter(qkv[nq + nk:], requires_grad=False)
            a._fused_qkv = qkv
            gu = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            dff = m.gate_proj.weight.shape[0]
            m.gate_proj.weight = nn.Parameter(gu[:dff], requires_grad=False)
            m.up_proj.weight = nn.Parameter(gu[dff:], requires_grad=False)
            m._fused_gate_up = gu
    return model, cfg


def build_fp8_model(name: str, dtype, device, max_len: int, layout: str):
    """bench_decode's model (random weights in ``dtype``) with its MLP projections quantized to FP8 e4m3 in
    ``layout`` (prox.quantize_mlps: transformers' FP8Linear for block128, prox.Fp8Linear per channel); the
    dtype MLP weights are freed."""
    model, cfg = build_model(name, dtype, device, max_len)
    with torch.no_grad():
        for layer in model.model.layers:
            m = layer.mlp
            for p in ("gate_proj", "up_proj", "down_proj"):
                setattr(m, p, fp8.quantize_linear(getattr(m, p), layout,
                                                  "transformers" if layout == "block128" and _has_fp8linear()
                                                  else "prox"))
            del m._fused_gate_up  # the dtype weights' storage
    return model, cfg


def _has_fp8linear() -> bool:
    try:
        import transformers.integrations.finegrained_fp8  # noqa: F401
        return True
    except ImportError:
        return False


# ---------------------------------------------------------------- the lean step


def rms_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def attention(h, mlp_out, pos, cos_t, sin_t, k_cache, v_cache, w_ln1, w_qkv, w_qn, w_kn, w_o, eps: float,
              n_heads: int, n_kv: int, head_dim: int):
    """A decoder layer's attention for one token, up to o_proj: returns (h + mlp_out, o_proj's output). h [1, d]
    (the residual stream before the previous layer's MLP output is added), mlp_out [1, d]; k_cache, v_cache
    [n_kv, S, head_dim]. n_heads, n_kv: the query and KV heads w_qkv holds (a tensor-parallel rank's: bench_tp
    all-reduces the output before adding it)."""
    h = h + mlp_out
    x = rms_norm(h, w_ln1, eps)
    qkv = F.linear(x, w_qkv)
    q = qkv[:, :n_heads * head_dim].view(n_heads, head_dim)
    k = qkv[:, n_heads * head_dim:(n_heads + n_kv) * head_dim].view(n_kv, head_dim)
    v = qkv[:, (n_heads + n_kv) * head_dim:].view(n_kv, head_dim)
    q, k = rms_norm(q, w_qn, eps), rms_norm(k, w_kn, eps)
    cos, sin = cos_t[pos], sin_t[pos]  # [1, head_dim]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k_cache.index_copy_(1, pos, k[:, None])
    v_cache.index_copy_(1, pos, v[:, None])
    g = n_heads // n_kv
    s = torch.matmul(q.view(n_kv, g, head_dim), k_cache.transpose(1, 2)).float() * (head_dim ** -0.5)
    s = s.masked_fill(torch.arange(k_cache.shape[1], device=h.device) > pos, float("-inf"))
    p = torch.softmax(s, dim=-1).to(h.dtype)
    o = torch.matmul(p, v_cache).reshape(1, n_heads * head_dim)
    return h, F.linear(o, w_o)


def attn_block(h, mlp_out, pos, cos_t, sin_t, k_cache, v_cache, w_ln1, w_qkv, w_qn, w_kn, w_o, w_ln2, eps: float,
               n_heads: int, n_kv: int, head_dim: int):
    """One decoder layer up to the MLP, for one token (attention(), the residual add, RMSNorm). Returns
    (h, x_mlp)."""
    h, o = attention(h, mlp_out, pos, cos_t, sin_t, k_cache, v_cache, w_ln1, w_qkv, w_qn, w_kn, w_o, eps, n_heads,
                     n_kv, head_dim)
    h = h + o
    return h, rms_norm(h, w_ln2, eps)


def dense_mlp(x, w_gate_up, w_down, d_ff: int):
    gu = F.linear(x, w_gate_up)
    return F.linear(F.silu(gu[:, :d_ff]) * gu[:, d_ff:], w_down)


def final_block(h, mlp_out, w_norm, w_head, eps: float):
    h = h + mlp_out
    return F.linear(rms_norm(h, w_norm, eps), w_head)


class LeanDecoder:
    """The lean decode step on a Qwen3 model's weights (shared, not copied), with its own KV cache."""

    def __init__(self, model, cfg, max_len: int, dense_mlps, compile: bool = True, dense_fns=None):
        self.model, self.cfg = model, cfg
        # the dense MLPs' weights: fused [gate; up] and W_down (the model's layers may hold other MLPs now); or,
        # given dense_fns (one callable x -> y per layer: the FP8 model's dense FFNs), those
        self.dense_fns = dense_fns
        self.dense = None if dense_fns is not None else [(m._fused_gate_up, m.down_proj.weight) for m in dense_mlps]
        dev, dt = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.d, self.dff = cfg.hidden_size, cfg.intermediate_size
        self.caches = [(torch.zeros(self.nkv, max_len, self.hd, device=dev, dtype=dt),
                        torch.zeros(self.nkv, max_len, self.hd, device=dev, dtype=dt)) for _ in model.model.layers]
        rot = model.model.rotary_emb
        inv = rot.inv_freq.float()
        t = torch.arange(max_len, device=dev, dtype=torch.float32)
        emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
        self.cos = (emb.cos() * rot.attention_scaling).to(dt)
        self.sin = (emb.sin() * rot.attention_scaling).to(dt)
        self.zero = torch.zeros(1, self.d, device=dev, dtype=dt)
        c = (lambda f: torch.compile(f, dynamic=False, fullgraph=True)) if compile else (lambda f: f)
        self.attn = c(attn_block)
        self.mlp_dense = c(dense_mlp)
        self.final = c(final_block)

    def step(self, tok, pos, mlps: str, sparse=None):
        """One decode step; mlps is 'dense', 'prox' (sparse: list of SparseMLP) or 'none'."""
        m = self.model
        h = m.model.embed_tokens(tok).reshape(1, self.d)
        mlp_out = self.zero
        for i, layer in enumerate(m.model.layers):
            a = layer.self_attn
            h, x = self.attn(h, mlp_out, pos, self.cos, self.sin, *self.caches[i], layer.input_layernorm.weight,
                             a._fused_qkv, a.q_norm.weight, a.k_norm.weight, a.o_proj.weight,
                             layer.post_attention_layernorm.weight, self.eps, self.nh, self.nkv, self.hd)
            if mlps == "dense":
                mlp_out = self.dense_fns[i](x) if self.dense_fns is not None else self.mlp_dense(x, *self.dense[i],
                                                                                                  self.dff)
            elif mlps == "prox":
                mlp_out = sparse[i](x)
            else:
                mlp_out = self.zero
        logits = self.final(h, mlp_out, m.model.norm.weight, m.lm_head.weight, self.eps)
        nxt = torch.argmax(logits, dim=-1)
        tok.copy_(nxt.view_as(tok))
        pos.add_(1)
        return logits


# ---------------------------------------------------------------- HF steps


class ZeroMLP(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def reset_cache_position(cache, position: int) -> None:
    """transformers >= 5 static caches write at their own per-layer counter (cumulative_length), not at
    cache_position. Each update advances it by one, in step with the decode step's pos += 1, so the two drift
    apart only when a runner rewinds pos: rewind the counters with it, so that a step replayed from the reset
    position writes where it reads. (Before a layer's lazy initialization the counter is a CPU tensor, which
    that initialization moves to the device with its value.) Older caches, which write at cache_position,
    have no such counter."""
    for layer in getattr(cache, "layers", ()):
        n = getattr(layer, "cumulative_length", None)
        if isinstance(n, torch.Tensor):
            n.fill_(position)


def hf_step(model, cache, compiled=None, mlps=None):
    """One transformers decode step from position pos (in place: tok <- argmax, pos += 1); mlps, when given,
    are installed in the model first (the runners share one model). A runner that rewinds pos must rewind the
    cache's counters too (reset_cache_position)."""
    fwd = compiled or model

    def step(tok, pos):
        if mlps is not None:
            set_mlps(model, mlps)
        out = fwd(input_ids=tok, cache_position=pos, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
        tok.copy_(torch.argmax(logits, dim=-1).view_as(tok))
        pos.add_(1)
        return logits
    return step


def set_mlps(model, mlps):
    for layer, m in zip(model.model.layers, mlps):
        layer.mlp = m


# ---------------------------------------------------------------- timing


class Runner:
    """Captures a step in a CUDA graph (or runs it eagerly on the CPU) and times new tokens. on_reset(ctx),
    when given, runs whenever the position is reset to ctx (outside the graph); before_timing(), when given,
    before each timed run (bench_tp: a barrier of the ranks). capture_error_mode: torch.cuda.graph's ("thread_local"
    for a step holding NCCL calls, whose own threads may call CUDA meanwhile). ``out`` is the captured step's
    return value (refreshed by every replay)."""

    def __init__(self, fn, tok, pos, ctx: int, use_graph: bool, on_reset=None, before_timing=None,
                 capture_error_mode: str = "global"):
        self.fn, self.tok, self.pos, self.ctx, self.use_graph = fn, tok, pos, ctx, use_graph
        self.on_reset, self.before_timing = on_reset, before_timing
        self.graph = None
        with torch.no_grad():
            for _ in range(2):  # warm-up: plans, lazy caches, compiled kernels
                self.reset()
                fn(tok, pos)
            if use_graph:
                torch.cuda.synchronize()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    self.reset()
                    fn(tok, pos)
                torch.cuda.current_stream().wait_stream(s)
                self.graph = torch.cuda.CUDAGraph()
                self.reset()
                with torch.cuda.graph(self.graph, capture_error_mode=capture_error_mode):
                    self.out = fn(tok, pos)

    def reset(self):
        self.tok.fill_(1)
        self.pos.fill_(self.ctx)
        if self.on_reset is not None:
            self.on_reset(self.ctx)

    def time(self, new_tokens: int, repeats: int = 1) -> float:
        """Seconds per token (median over repeats of new_tokens steps from position ctx)."""
        best = []
        for _ in range(repeats):
            self.reset()
            if self.use_graph:
                torch.cuda.synchronize()
            if self.before_timing is not None:
                self.before_timing()
            if self.use_graph:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(new_tokens):
                    self.graph.replay()
                b.record()
                b.synchronize()
                best.append(a.elapsed_time(b) / 1e3 / new_tokens)
            else:
                t = time.perf_counter()
                with torch.no_grad():
                    for _ in range(new_tokens):
                        self.fn(self.tok, self.pos)
                best.append((time.perf_counter() - t) / new_tokens)
        best.sort()
        return best[len(best) // 2]


def capture_graph(fn):
    """fn() once on a side stream (the warm-up torch.cuda.graph asks for), then captured: (the graph, the output of
    the captured call)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def time_graph(fn, iters: int, use_graph: bool) -> float:
    """Seconds per call of fn (captured in a graph on CUDA)."""
    with torch.no_grad():
        fn()
        fn()
        if not use_graph:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) / iters
        torch.cuda.synchronize()
        g, _ = capture_graph(fn)
        g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        b.synchronize()
        del g
        return a.elapsed_time(b) / 1e3 / iters


# ---------------------------------------------------------------- calibration for timing


@torch.no_grad()
def calibrate_random(model, sparse, e_values, tokens: int, device, vocab: int, alpha=None, ids=None):
    """Per layer and e: (tau_x, tau_s) by the paper's split (the allocation with ``alpha``, default the paper's) on
    the MLP inputs of a dense prefill of random tokens (``ids`` [1, tokens], default drawn here; s~ from the op's
    Stage 1 when on CUDA). Returns {e: tensor [L, 2]} and the captured inputs."""
    xs = [None] * len(sparse)

    def keep(i):
        return lambda mod, a: xs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))
    hooks = [layer.mlp.register_forward_pre_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    ids = torch.randint(0, vocab, (1, tokens), device=device) if ids is None else ids
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    tables = {}
    for e in e_values:
        st = prox.allocate_sparsity(e) if alpha is None else prox.allocate_sparsity(e, alpha)
        rows = []
        for sp, x in zip(sparse, xs):
            lt = prox.calibrate_layer(x, st.s1, st.s2, sp.proxy_values)
            rows.append([lt.tau_x, lt.tau_s])
        tables[e] = torch.tensor(rows, dtype=torch.float32, device=device)
    return tables, xs


@torch.no_grad()
def calibrate_greedy(model, sparse, dense_mlps, e_values, ids, alpha=None, progress=None) -> tuple[dict, dict]:
    """Per e, each layer's (tau_x, tau_s) of a greedy allocation (prox.sparsify(allocation="greedy"): each layer's e
    chosen by its measured KL of the logits at the cost-weighted mean e, then the sequential calibration, the paper's
    split of each layer's e) on the random tokens ``ids`` [1, T], all of them the error measurement's too. The
    bench's own SparseMLPs ``sparse`` are put in the model for it (their thresholds are written in place) and the
    dense MLPs put back afterwards; the layer errors are measured once, for the first e, and every other e is
    allocated from them. Returns ({e: tensor [L, 2]}, {e: each layer's e})."""
    tables, layer_e, errors = {}, {}, None
    set_mlps(model, sparse)
    try:
        for e in e_values:
            cfg = prox.sparsify(model, e, ids, allocation="greedy", layer_errors=errors, alpha=alpha,
                                allocation_tokens=int(ids.numel()), progress=progress if errors is None else None)
            errors = errors or cfg
            tables[e] = torch.tensor([[r.tau_x, r.tau_s] for r in cfg.layers], dtype=torch.float32,
                                     device=ids.device)
            layer_e[e] = [r.e for r in cfg.layers]
    finally:
        set_mlps(model, dense_mlps)
    return tables, layer_e


# ---------------------------------------------------------------- results


def git_commit() -> str:
    """The source's commit: $PROX_COMMIT where set (a copy without .git, e.g. an installed package), else git's."""
    if os.environ.get("PROX_COMMIT"):
        return os.environ["PROX_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def target(e: float, alpha=None) -> dict:
    """The allocation's (s1, s2) for e (alpha None: the paper's)."""
    st = prox.allocate_sparsity(e) if alpha is None else prox.allocate_sparsity(e, alpha)
    return {"s1": st.s1, "s2": st.s2}


def amdahl(t_dense: float, t_nomlp: float, ffn_speedup: float) -> float:
    t_mlp = max(t_dense - t_nomlp, 0.0)
    return t_dense / (t_nomlp + t_mlp / ffn_speedup)


def require_op(sparse, smoke: bool) -> str:
    """The backend the SparseMLPs run; outside a smoke test anything but the CUDA op raises: Prox timings of the
    torch reference are never reported."""
    used = {sp.backend_in_use() for sp in sparse}
    if not smoke and used != {"op"}:
        raise RuntimeError(f"prox.bench_decode: the layers would run {sorted(used)}, not the CUDA op: refusing to "
                           "report Prox timings of the torch reference")
    return sorted(used)[0]


def realized(sparse, alpha=None) -> dict:
    """The realized s1, s2 and e of the layers' counters since their reset (alpha: the allocation's; None: the
    layers' own)."""
    if alpha is None:
        rep = prox.sparsity_report(nn.ModuleList(sparse))
    else:
        counts = torch.stack([sp.counters for sp in sparse]).tolist()
        rep = summed_report(((c, sp.d_model, sp.d_ff) for c, sp in zip(counts, sparse)), alpha)
    return {k: rep[k] for k in ("s1", "s2", "effective")}


def time_cell(args, runners, thresholds, tables, sparse, ffn, compile_s, report=realized, greedy=None) -> dict:
    """One cell from its runners ("dense", "none", "prox"): on the CPU (smoke) each runs a few tokens and only the
    realized sparsity is recorded; on the GPU the dense and no-MLP steps are timed, and the Prox step at each e (the
    same captured graph, the thresholds switched), with the speed-up, the FFN speed-up of ``ffn`` (the same run),
    its Amdahl bound and the fraction of it reached. ``report(sparse, alpha)``: the realized sparsity.

    greedy: {e: thresholds [L, 2]} of a per-layer allocation at each e (calibrate_greedy), timed after the uniform
    tables in the same graph: cell["prox_greedy"][e] holds the same fields (its FFN speed-up from ffn
    ["greedy_speedup"]) and "vs_uniform", the uniform step's time over the greedy one's (above 1: greedy faster)."""
    cell = {"smoke": True, "prox": {}} if args.smoke else {}
    if not args.smoke:
        t_dense = runners["dense"].time(args.new_tokens, args.repeats)
        t_none = runners["none"].time(args.new_tokens, args.repeats)
        cell.update({"dense": {"ms": t_dense * 1e3, "tok_s": 1.0 / t_dense},
                     "no_mlp": {"ms": t_none * 1e3, "tok_s": 1.0 / t_none},
                     "mlp_share": max(t_dense - t_none, 0.0) / t_dense, "prox": {}, "warmup_and_capture_s": compile_s})
    else:  # run every step kind, time nothing
        for r in ("dense", "none"):
            runners[r].time(args.new_tokens, 1)

    def run(e, table, speedups):
        thresholds.copy_(table)  # the same captured graph, new thresholds
        for sp in sparse:
            sp.reset_counters()
        t_prox = runners["prox"].time(args.new_tokens, 1 if args.smoke else args.repeats)
        if args.smoke:
            return {"realized": report(sparse, args.alpha)}, t_prox
        s = ffn[speedups][str(e)]
        bound = amdahl(t_dense, t_none, s)
        sp_e2e = t_dense / t_prox
        return {"ms": t_prox * 1e3, "tok_s": 1.0 / t_prox, "speedup": sp_e2e, "ffn_speedup": s,
                "amdahl_bound": bound, "fraction_of_bound": sp_e2e / bound,
                "ffn_speedup_in_step": max(t_dense - t_none, 0.0) / max(t_prox - t_none, 1e-12),
                "realized": report(sparse, args.alpha)}, t_prox

    t_uniform = {}
    for e in args.e:
        cell["prox"][str(e)], t_uniform[e] = run(e, tables[e], "speedup")
        cell["prox"][str(e)]["target"] = target(e, args.alpha)
    if greedy is not None:
        cell["prox_greedy"] = {}
        for e in args.e:
            row, t = run(e, greedy[e], "greedy_speedup")
            row["target"] = {"e": e, "allocation": "greedy"}
            if not args.smoke:
                row["vs_uniform"] = t_uniform[e] / t
            cell["prox_greedy"][str(e)] = row
    return cell


#: How to get the plots (matplotlib is not a dependency of prox: it is the ``plot`` extra of python/pyproject.toml).
PLOT_HINT = "pip install matplotlib (prox's `plot` extra)"


def write_plot(results: dict, json_path: str, path: str = "", draw=None) -> str:
    """Draw the results' plot (``draw(results, path)``, default ``plot``) at ``path`` (default: the JSON's path
    with .svg) and return the one line to log: what was written, or why no plot was drawn (a smoke test times
    nothing; matplotlib missing, with how to get it; the drawing's error)."""
    if results.get("smoke"):
        return f"wrote {json_path}; no plot (a smoke test times nothing)"
    if importlib.util.find_spec("matplotlib") is None:
        return f"wrote {json_path}; no plot: matplotlib is not installed ({PLOT_HINT})"
    path = path or os.path.splitext(json_path)[0] + ".svg"
    try:
        (draw or plot)(results, path)
    except Exception as exc:  # noqa: BLE001  (the JSON is written; a failed drawing is said, not raised)
        return f"wrote {json_path}; no plot ({type(exc).__name__}: {exc})"
    return f"wrote {json_path} and {path}"


def plot(results: dict, path: str, targets=None, title: str = "prox end-to-end batch-1 decode") -> None:
    """Speed-up against e per (model, step), the Amdahl bound dashed; targets: {model or (model, step): (e %
    values, speed-ups, label)} drawn as stars (default: the 8B targets). bench_tp draws its plot with it."""
    targets = {"8b": ([50, 70], [1.45, 1.8], "targets (8B, H100)")} if targets is None else targets
    import matplotlib  # the plot extra (write_plot checks it is there)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for c in results["cells"].values() if "error" not in c]
    if not cells:
        return
    groups = sorted({(c["model"], c["step"]) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for ax, (model, step) in zip(axes[0], groups):
        for c in cells:
            if (c["model"], c["step"]) != (model, step):
                continue
            es = sorted(float(e) for e in c["prox"])
            lab = f"{c['dtype']} ctx {c['context']}"
            line, = ax.plot([100 * e for e in es], [c["prox"][str(e)]["speedup"] for e in es], "o-", label=lab)
            ax.plot([100 * e for e in es], [c["prox"][str(e)]["amdahl_bound"] for e in es], "--",
                    color=line.get_color(), alpha=0.6)
        star = targets.get((model, step), targets.get(model))
        if star:
            ax.plot(star[0], star[1], "k*", markersize=11, label=star[2])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"Qwen3-{model.upper()} shape, {step} step")
        ax.set_xlabel("effective sparsity e (%)")
        ax.set_ylabel("decode speed-up vs dense (dashed: Amdahl bound)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}, {results['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


#: M (the token rows) torch._scaled_mm is given: one token padded (cuBLAS's FP8 GEMM wants 16-row multiples).
SCALED_MM_ROWS = 16


# ---------------------------------------------------------------- dense (a): torch._scaled_mm


def scaled_mm_mlp(x, w_gu, s_gu, w_d, s_d, d_ff: int, block: bool):
    """The dense FP8 SwiGLU FFN of one token x [1, K] through torch._scaled_mm: w_gu [2 d_ff, K] and w_d [K, d_ff]
    e4m3 (nn.Linear layout, row-major: the GEMM reads them transposed, column-major), with 128 x 128 block scales
    ([2 d_ff/128, K/128], [K/128, d_ff/128]) when ``block``, else per-channel ([1, 2 d_ff], [1, K])."""
    xp = F.pad(x, (0, 0, 0, SCALED_MM_ROWS - x.shape[0]))
    quant = fp8.quantize_1x128 if block else fp8.quantize_rows
    xq, xs = quant(xp)
    gu = torch._scaled_mm(xq, w_gu.t(), scale_a=xs, scale_b=s_gu.t() if block else s_gu, out_dtype=x.dtype)
    h = F.silu(gu[:, :d_ff]) * gu[:, d_ff:]
    hq, hs = quant(h)
    y = torch._scaled_mm(hq, w_d.t(), scale_a=hs, scale_b=s_d.t() if block else s_d, out_dtype=x.dtype)
    return y[:x.shape[0]]


def _cat8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.view(torch.uint8), b.view(torch.uint8)]).view(fp8.E4M3)


def scaled_mm_weights(sp: SparseMLP, mode: str):
    """(w_gu, s_gu, w_d, s_d) of one FP8 MLP for scaled_mm_mlp: the layer's own codes and scales in ``mode`` "block"
    (its 128 x 128 blocks; d_ff and d_model multiples of 128) or "row" (per-channel scales: the layer's own, or
    for block-scaled weights a per-channel requantization of the dequantized weights, this baseline's copy)."""
    g, u, d = (fp8.linear_info(getattr(sp, n), n) for n in ("gate_proj", "up_proj", "down_proj"))
    if mode == "block":
        s = [i.normalized("block128") for i in (g, u, d)]
        return _cat8(g.q, u.q), torch.cat([s[0], s[1]]), d.q, s[2]
    if sp.layout == "channel":
        s = [i.normalized("channel") for i in (g, u, d)]
        return _cat8(g.q, u.q), torch.cat([s[0], s[1]])[None], d.q, s[2][None]
    qs = [fp8.quantize(fp8.dequantize(i.q, i.normalized(sp.layout), sp.layout), "channel") for i in (g, u, d)]
    return _cat8(qs[0][0], qs[1][0]), torch.cat([qs[0][1], qs[1][1]])[None], qs[2][0], qs[2][1][None]


def make_scaled_mm(sparse, x, use_compile: bool):
    """The dense (a) callables, one per layer, and what they run: blockwise scales where torch takes them (the
    weights' own layout), else row-wise; compiled where torch.compile takes it. Each variant is tried eagerly on one
    layer first (an unsupported scaling raises there, not in a graph)."""
    sp0 = sparse[0]
    modes = ["block", "row"] if sp0.layout == "block128" and sp0.d_model % 128 == 0 and sp0.d_ff % 128 == 0 \
        else ["row"]
    errors = {}
    for mode in modes:
        try:
            w0 = scaled_mm_weights(sp0, mode)
            with torch.no_grad():
                y = scaled_mm_mlp(x, *w0, sp0.d_ff, mode == "block")
            torch.cuda.synchronize()
            if not torch.isfinite(y.float()).all():
                raise RuntimeError("non-finite output")
        except Exception as exc:  # noqa: BLE001  (torch or cuBLAS without this scaling: the next mode)
            errors[mode] = f"{type(exc).__name__}: {exc}"
            continue
        ws = [w0] + [scaled_mm_weights(sp, mode) for sp in sparse[1:]]
        fn = scaled_mm_mlp
        compiled = False
        if use_compile:
            try:
                c = torch.compile(scaled_mm_mlp, dynamic=False, fullgraph=True)
                with torch.no_grad():
                    c(x, *w0, sp0.d_ff, mode == "block")
                fn, compiled = c, True
            except Exception as exc:  # noqa: BLE001
                errors[f"{mode}/compile"] = f"{type(exc).__name__}: {exc}"
        fns = [(lambda xx, w=w, n=sp.d_ff: fn(xx, *w, n, mode == "block")) for w, sp in zip(ws, sparse)]
        return fns, {"scales": "block128 x 1x128" if mode == "block" else "row-wise", "compiled": compiled,
                     "rows": SCALED_MM_ROWS, "refused": errors}
    return None, {"refused": errors}
