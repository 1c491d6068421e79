# SPDX-License-Identifier: Apache-2.0
"""End-to-end batch-1 decode speed, dense vs Prox, on Qwen3-8B- and 14B-shaped models with random weights.

    python -m prox.bench_decode                       # the default sweep (about 6-7 min on an H100)
    python -m prox.bench_decode --models 8b --dtypes bf16 --contexts 512 --steps lean
    torchrun --nproc-per-node 2 -m prox.bench_decode --tp 2 --models 32b   # tensor parallel: prox.bench_tp
    python -m prox.bench_decode --device cpu --models tiny   # a smoke test of the code paths: no timings
    python -m prox.bench_decode --models 8b --fp8 block128   # Qwen3-8B-FP8-shaped: FP8 MLPs (prox.bench_decode_fp8)

Prox is timed through the CUDA op only: without the compiled extension (or with a source tree shadowing the
installed package) the benchmark stops instead of timing the torch reference. The JSON records the backend
the layers ran ("backend_used"), whether the extension loaded, and why not. On the CPU it is a smoke test:
every step kind runs a few tokens through the torch reference and nothing is timed or compared.

Setup (the same for dense and Prox; only the MLPs differ):
- a transformers Qwen3ForCausalLM built from a Qwen3Config in code (nothing downloaded), random weights on
  the GPU; Q/K/V and gate/up weights are stored fused ([q; k; v], [gate; up]) and the model's Linear
  modules hold views of them, so the lean step's fused GEMVs cost no extra memory;
- a static KV cache of context + new tokens, one decode step (embedding -> logits -> argmax -> next token,
  position + 1, all on the device) captured in one CUDA graph and replayed for each new token;
- thresholds calibrated per layer (the paper's split of e) on the MLP inputs of a 64-token dense prefill of
  random tokens: the timing depends only on the densities, reported as realized during the timed tokens.
  One Prox graph per step serves every e: the thresholds live in device memory and are switched between
  runs (no re-capture).

Steps measured:
- "hf": the transformers model's forward (sdpa attention, static cache), no torch.compile, in a CUDA graph;
- "lean": a gpt-fast-like step written here on the same weights: per layer one torch.compile'd attention
  block (RMSNorm, fused QKV GEMV, q/k RMSNorm, RoPE, cache write, GQA attention as two small GEMMs over
  the cache, o_proj, residual, RMSNorm) and the MLP (dense: fused gate/up GEMV + SiLU*mul + down GEMV,
  compiled; Prox: the op), the whole step in one CUDA graph. Compiling one layer's block (reused by every
  layer) keeps compile time in seconds; an engine runs such a step because its non-MLP part is close to
  its weight bytes, so the MLP's share, and with it what a faster FFN gives, is largest.
- "hfc" (optional): the transformers model under torch.compile (default mode), captured in a CUDA graph;
  slow to compile (minutes for 8B).

Per step it reports tokens/s dense and Prox at each e, the MLP's share of the dense step (dense step minus
the step with the MLPs removed), the FFN speed-up measured in the same run (the MLP stack alone, dense vs
Prox, on inputs captured from the model) and the Amdahl bound it implies, and the fraction of that bound
reached. JSON is rewritten after every cell (partial results survive a time-out); a plot at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

import prox
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
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
T0 = time.time()


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
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
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
def calibrate_random(model, sparse, e_values, tokens: int, device, vocab: int, alpha=None):
    """Per layer and e: (tau_x, tau_s) by the paper's split (the allocation with ``alpha``, default the paper's) on
    the MLP inputs of a dense prefill of random tokens (s~ from the op's Stage 1 when on CUDA). Returns {e: tensor
    [L, 2]} and the captured inputs."""
    xs = [None] * len(sparse)

    def keep(i):
        return lambda mod, a: xs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))
    hooks = [layer.mlp.register_forward_pre_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    ids = torch.randint(0, vocab, (1, tokens), device=device)
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


# ---------------------------------------------------------------- the sweep


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


def run_model(args, name: str, dtype_name: str, results: dict, save):
    dtype = DTYPES[dtype_name]
    dev = torch.device(args.device)
    use_graph = dev.type == "cuda"
    max_len = max(args.contexts) + args.new_tokens
    t = time.time()
    model, cfg = build_model(name, dtype, dev, max_len)
    dense_mlps = [layer.mlp for layer in model.model.layers]
    thresholds = torch.zeros(len(dense_mlps), 2, dtype=torch.float32, device=dev)
    sparse = []
    pool = prox.WorkspacePool()  # this model's workspaces
    for i, m in enumerate(dense_mlps):
        sp = SparseMLP.from_mlp(m, act="silu", keep_down=True, track_sparsity=True, workspace_pool=pool,
                                backend="torch" if args.smoke else "op")
        sp.thresholds = thresholds[i]  # one [L, 2] table: switching e is one copy
        sparse.append(sp)
    results["backend_used"] = require_op(sparse, args.smoke)
    mem = prox.memory_report(nn.ModuleList(sparse))
    log(f"{name} {dtype_name}: model built in {time.time() - t:.1f} s; Prox adds "
        f"{mem['proxies'] / 2**30:.2f} GiB proxies + {mem['w_down_t'] / 2**30:.2f} GiB W_down^T "
        f"(+{mem['scales'] / 2**20:.1f} MiB scales)")
    tables, xs = calibrate_random(model, sparse, args.e, args.calib_tokens, dev, cfg.vocab_size, args.alpha)
    log(f"  thresholds calibrated for e = {args.e}")

    if args.smoke:
        log("  smoke test: the FFN alone is not timed")
        return run_cells(args, name, dtype_name, results, save, model, cfg, dense_mlps, sparse, thresholds, tables,
                         max_len, use_graph, None, dtype)
    # the FFN alone, dense vs Prox, on the inputs captured from the model: the speed-up of this run
    lean_tmp = LeanDecoder(model, cfg, 8, dense_mlps, compile=not args.no_compile)
    xs1 = [x[-1:].contiguous() for x in xs]

    def ffn_dense():
        for m, x in zip(dense_mlps, xs1):
            lean_tmp.mlp_dense(x, m._fused_gate_up, m.down_proj.weight, cfg.intermediate_size)

    def ffn_prox():
        for sp, x in zip(sparse, xs1):
            sp(x)
    ffn = {"dense_us": time_graph(ffn_dense, args.ffn_iters, use_graph) * 1e6 / len(sparse), "prox_us": {}}
    for e in args.e:
        thresholds.copy_(tables[e])
        ffn["prox_us"][str(e)] = time_graph(ffn_prox, args.ffn_iters, use_graph) * 1e6 / len(sparse)
    ffn["speedup"] = {k: ffn["dense_us"] / v for k, v in ffn["prox_us"].items()}

    log(f"  FFN alone: dense {ffn['dense_us']:.1f} us/layer; Prox "
        + ", ".join(f"e={k}: {v:.1f} us ({ffn['speedup'][k]:.2f}x)" for k, v in ffn["prox_us"].items()))
    run_cells(args, name, dtype_name, results, save, model, cfg, dense_mlps, sparse, thresholds, tables, max_len,
              use_graph, ffn, dtype)


def run_cells(args, name, dtype_name, results, save, model, cfg, dense_mlps, sparse, thresholds, tables, max_len,
              use_graph, ffn, dtype):
    dev = torch.device(args.device)
    zero = [ZeroMLP() for _ in dense_mlps]
    tok = torch.ones(1, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    for ctx in args.contexts:
        for kind in args.steps:
            key = f"{name}/{dtype_name}/{ctx}/{kind}"
            t = time.time()
            try:
                cell = run_cell(args, kind, model, cfg, dense_mlps, sparse, zero, thresholds, tables, tok, pos, ctx,
                                max_len, use_graph, ffn, dtype)
            except Exception as exc:  # noqa: BLE001  (one failing step kind must not lose the others)
                log(f"  {key}: FAILED: {type(exc).__name__}: {exc}")
                cell = {"error": f"{type(exc).__name__}: {exc}"}
                set_mlps(model, dense_mlps)
            cell.update(model=name, dtype=dtype_name, context=ctx, step=kind, ffn=ffn, seconds=time.time() - t)
            results["cells"][key] = cell
            save()
            if "error" not in cell and args.smoke:
                log(f"  {key}: smoke test passed (dense, no-MLP and Prox steps ran; realized e "
                    + ", ".join(f"{k}: {v['realized']['effective']:.2f}" for k, v in cell["prox"].items())
                    + f"; nothing timed) [{time.time() - t:.0f} s]")
            elif "error" not in cell:
                log(f"  {key}: dense {cell['dense']['tok_s']:.1f} tok/s ({cell['dense']['ms']:.2f} ms), MLP share "
                    f"{cell['mlp_share']:.0%}; Prox " + ", ".join(
                        f"e={k}: {v['speedup']:.2f}x (bound {v['amdahl_bound']:.2f}x, {v['fraction_of_bound']:.0%})"
                        for k, v in cell["prox"].items()) + f" [{time.time() - t:.0f} s]")
    set_mlps(model, dense_mlps)  # the caller frees the model (this frame's references end here)


def run_cell(args, kind, model, cfg, dense_mlps, sparse, zero, thresholds, tables, tok, pos, ctx, max_len, use_graph,
             ffn, dtype):
    from transformers import StaticCache
    runners = {}
    if kind == "lean":
        lean = LeanDecoder(model, cfg, ctx + args.new_tokens, dense_mlps, compile=not args.no_compile)
        t = time.time()
        runners["dense"] = Runner(lambda a, b: lean.step(a, b, "dense"), tok, pos, ctx, use_graph)
        compile_s = time.time() - t
        runners["none"] = Runner(lambda a, b: lean.step(a, b, "none"), tok, pos, ctx, use_graph)
        runners["prox"] = Runner(lambda a, b: lean.step(a, b, "prox", sparse), tok, pos, ctx, use_graph)
    else:
        cache = StaticCache(config=cfg, max_cache_len=ctx + args.new_tokens)
        compiled = torch.compile(model, dynamic=False) if kind == "hfc" else None
        t = time.time()
        for name, mlps in (("dense", dense_mlps), ("none", zero), ("prox", sparse)):
            runners[name] = Runner(hf_step(model, cache, compiled, mlps), tok, pos, ctx, use_graph,
                                   on_reset=lambda n: reset_cache_position(cache, n))
            if name == "dense":
                compile_s = time.time() - t
        set_mlps(model, dense_mlps)
    cell = time_cell(args, runners, thresholds, tables, sparse, ffn, compile_s, realized)
    del runners
    return cell


def realized(sparse, alpha=None) -> dict:
    """The realized s1, s2 and e of the layers' counters since their reset (alpha: the allocation's; None: the
    layers' own)."""
    if alpha is None:
        rep = prox.sparsity_report(nn.ModuleList(sparse))
    else:
        counts = torch.stack([sp.counters for sp in sparse]).tolist()
        rep = summed_report(((c, sp.d_model, sp.d_ff) for c, sp in zip(counts, sparse)), alpha)
    return {k: rep[k] for k in ("s1", "s2", "effective")}


def time_cell(args, runners, thresholds, tables, sparse, ffn, compile_s, report=realized) -> dict:
    """One cell from its runners ("dense", "none", "prox"): on the CPU (smoke) each runs a few tokens and only the
    realized sparsity is recorded; on the GPU the dense and no-MLP steps are timed, and the Prox step at each e (the
    same captured graph, the thresholds switched), with the speed-up, the FFN speed-up of ``ffn`` (the same run),
    its Amdahl bound and the fraction of it reached. ``report(sparse, alpha)``: the realized sparsity."""
    if args.smoke:  # run every step kind, time nothing
        cell = {"smoke": True, "prox": {}}
        for r in ("dense", "none"):
            runners[r].time(args.new_tokens, 1)
        for e in args.e:
            thresholds.copy_(tables[e])
            for sp in sparse:
                sp.reset_counters()
            runners["prox"].time(args.new_tokens, 1)
            cell["prox"][str(e)] = {"realized": report(sparse, args.alpha), "target": target(e, args.alpha)}
        return cell
    t_dense = runners["dense"].time(args.new_tokens, args.repeats)
    t_none = runners["none"].time(args.new_tokens, args.repeats)
    share = max(t_dense - t_none, 0.0) / t_dense
    cell = {"dense": {"ms": t_dense * 1e3, "tok_s": 1.0 / t_dense},
            "no_mlp": {"ms": t_none * 1e3, "tok_s": 1.0 / t_none},
            "mlp_share": share, "prox": {}, "warmup_and_capture_s": compile_s}
    for e in args.e:
        thresholds.copy_(tables[e])  # the same captured graph, new thresholds
        for sp in sparse:
            sp.reset_counters()
        t_prox = runners["prox"].time(args.new_tokens, args.repeats)
        s = ffn["speedup"][str(e)]
        bound = amdahl(t_dense, t_none, s)
        sp_e2e = t_dense / t_prox
        t_mlp_prox = max(t_prox - t_none, 1e-12)
        cell["prox"][str(e)] = {"ms": t_prox * 1e3, "tok_s": 1.0 / t_prox, "speedup": sp_e2e, "ffn_speedup": s,
                                "amdahl_bound": bound, "fraction_of_bound": sp_e2e / bound,
                                "ffn_speedup_in_step": max(t_dense - t_none, 0.0) / t_mlp_prox,
                                "realized": report(sparse, args.alpha), "target": target(e, args.alpha)}
    return cell


def check_lean(args):
    """The lean step computes what the transformers model computes: logits of a few decode steps compared
    (dense MLPs, same random weights; run on CPU in float32 for tests, or on the device)."""
    dev = torch.device(args.device)
    dtype = torch.float32 if dev.type == "cpu" else DTYPES[args.dtypes[0]]
    from transformers import StaticCache
    model, cfg = build_model(args.check_model, dtype, dev, 64)
    lean = LeanDecoder(model, cfg, 64, [layer.mlp for layer in model.model.layers],
                       compile=dev.type == "cuda" and not args.no_compile)
    cache = StaticCache(config=cfg, max_cache_len=64)
    hf = hf_step(model, cache)
    tok_a = torch.full((1, 1), 3, dtype=torch.long, device=dev)
    tok_b = tok_a.clone()
    pos_a = torch.zeros(1, dtype=torch.long, device=dev)
    pos_b = pos_a.clone()
    worst = 0.0
    with torch.no_grad():
        for _ in range(6):
            la = hf(tok_a, pos_a).float()
            lb = lean.step(tok_b, pos_b, "dense").float()
            worst = max(worst, float((la - lb).norm() / la.norm()))
            tok_b.copy_(tok_a)  # follow the same tokens
    return worst


def plot(results: dict, path: str, targets=None, title: str = "prox end-to-end batch-1 decode") -> None:
    """Speed-up against e per (model, step), the Amdahl bound dashed; targets: {model or (model, step): (e %
    values, speed-ups, label)} drawn as stars (default: the 8B targets). bench_tp draws its plot with it."""
    targets = {"8b": ([50, 70], [1.45, 1.8], "targets (8B, H100)")} if targets is None else targets
    import matplotlib
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


def main(argv=None) -> int:
    if any(a == "--tp" or a.startswith("--tp=") for a in (sys.argv[1:] if argv is None else argv)):
        from . import bench_tp  # tensor parallelism: torchrun, one process per GPU (prox/bench_tp.py)
        return bench_tp.main(argv)
    p = argparse.ArgumentParser(prog="python -m prox.bench_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="8b,14b", help="comma list of 8b, 14b, tiny")
    p.add_argument("--dtypes", default=None, help="comma list of fp16, bf16 (default: both; bf16 with --fp8)")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--e", default="0.4,0.5,0.6,0.7", help="effective sparsities")
    p.add_argument("--steps", default=None, help="hf, lean, hfc (transformers + torch.compile: slow); default hf,lean "
                                                 "(lean with --fp8)")
    p.add_argument("--fp8", choices=("channel", "block128"), default=None,
                   help="FP8 e4m3 MLPs (the Qwen3-*-FP8 checkpoints: block128): the lean step, dense FP8 (the faster "
                        "of torch._scaled_mm and prox's own FP8 Stage 2 with every channel kept) against Prox-FP8; "
                        "the rest of the model stays in --dtypes (prox/bench_decode_fp8.py)")
    p.add_argument("--alpha", type=float, default=None,
                   help="the allocation's alpha (default: the paper's 1/3, or prox.FP8_ALPHA with --fp8)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of new-tokens steps per cell (median)")
    p.add_argument("--ffn-iters", type=int, default=20)
    p.add_argument("--calib-tokens", type=int, default=64)
    p.add_argument("--only-14b", default="fp16:512",
                   help="for 14b, the dtype:context cells to run (comma list; 'all' for every cell) to fit the budget")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", action="store_true", help="lean step without torch.compile")
    p.add_argument("--check", action="store_true", help="first compare the lean step's logits with transformers'")
    p.add_argument("--check-model", default="tiny")
    p.add_argument("--out", default="decode.json")
    p.add_argument("--plot", default="", help="SVG/PNG path for the plot (default: next to --out)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = "lean" if args.fp8 else "hf,lean"
    if args.dtypes is None:
        args.dtypes = "bf16" if args.fp8 else "fp16,bf16"
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.e = [float(e) for e in args.e.split(",") if e]
    args.steps = [s for s in args.steps.split(",") if s]
    for s in args.steps:
        if s not in ("hf", "lean", "hfc"):
            p.error(f"unknown step {s}")
    if args.fp8 and args.steps != ["lean"]:
        p.error("--fp8 measures the lean step only (--steps lean): the transformers step would run the FP8 "
                "linears' own kernels, not the dense baselines of the issue")
    if args.fp8 and args.alpha is None:
        args.alpha = prox.FP8_ALPHA
    args.smoke = torch.device(args.device).type != "cuda"
    if args.smoke:
        if args.models != ["tiny"]:
            p.error(f"--device {args.device} is a smoke test of the code paths (the torch reference, no timings): "
                    "use --models tiny")
        args.no_compile, args.new_tokens, args.repeats = True, min(args.new_tokens, 4), 1
        log("smoke test on the CPU: each step kind runs a few tokens through the torch reference of Prox; "
            "nothing is timed (speed-ups are measured on a GPU with the CUDA op)")
    else:
        if prox.cuda_unavailable_reason():
            p.error(f"--device {args.device}: {prox.cuda_unavailable_reason()} (--device cpu --models tiny runs a "
                    "smoke test)")
        if not prox.ops_available():
            raise SystemExit(f"prox.bench_decode: the CUDA op is not loaded: {prox.ops_import_error()}. Refusing to "
                             "time Prox through the torch reference")
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512

    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": args.smoke,
               "prox_file": prox.__file__, "ops_available": prox.ops_available(),
               "ops_import_error": prox.ops_import_error(),
               "argv": sys.argv[1:] if argv is None else list(argv),
               "config": {"new_tokens": args.new_tokens, "repeats": args.repeats, "e": args.e,
                          "calibration_tokens": args.calib_tokens}, "cells": {},
               "fp8": args.fp8, "alpha": args.alpha if args.alpha is not None else prox.ALPHA}
    if args.fp8:
        results["non_mlp"] = "+".join(args.dtypes)

    def save():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.out)

    if args.check:
        results["lean_check_rel_error"] = check_lean(args)
        log(f"lean step vs transformers: worst relative logits difference {results['lean_check_rel_error']:.2e}")
        save()
    only = None if args.only_14b == "all" else {tuple(c.split(":")) for c in args.only_14b.split(",") if c}
    for name in args.models:
        for dt in args.dtypes:
            a = args
            if name == "14b" and only is not None:
                ctxs = [c for c in args.contexts if (dt, str(c)) in only]
                if not ctxs:
                    continue
                a = argparse.Namespace(**{**vars(args), "contexts": ctxs})
            if args.fp8:
                from .bench_decode_fp8 import run_model_fp8
                run_model_fp8(a, name, dt, results, save)
            else:
                run_model(a, name, dt, results, save)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    save()
    path = args.plot or os.path.splitext(args.out)[0] + ".svg"
    try:
        plot(results, path)
        log(f"wrote {args.out} and {path}")
    except Exception as exc:  # noqa: BLE001
        log(f"wrote {args.out}; no plot ({exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
