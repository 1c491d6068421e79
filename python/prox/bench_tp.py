# SPDX-License-Identifier: Apache-2.0
"""End-to-end batch-1 decode under tensor parallelism, dense vs Prox: one process per GPU (torchrun).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m prox.bench_decode --tp 2 --models 32b
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m prox.bench_decode --tp 2 --models 14b

(``python -m prox.bench_decode --tp N`` dispatches here.) Setup, the same for dense and Prox:
- a Qwen3-shaped decoder (32B: d_model 5120, d_ff 25600, 64 layers, 64 query / 8 KV heads, head_dim 128,
  vocab 151936; 14B: 5120 / 17408 / 40 layers / 40 / 8) with random bf16 weights, each rank building only its
  shard (a TP=N model is its own random model; the timing depends on shapes and densities only);
- column-parallel QKV (each rank its n_heads / N query heads and n_kv / N KV heads, fused [q; k; v] rows),
  row-parallel o_proj and one all-reduce; column-parallel merged [gate; up] and row-parallel down, one
  all-reduce (dense: F.linear on the engine's layout; Prox: a SparseMLP of the rank's channels, built by
  prox.distributed.sparse_mlp_from_shards, which all-reduces through the same communicator); the embedding is
  replicated (a lookup), the LM head vocab-parallel (each rank its vocab / N rows; the argmax is combined by
  one more all-reduce of a [N, 2] float32 (max, index) table): 2 L + 1 all-reduces per step, all through
  prox.distributed.NcclCommunicator (libnccl via ctypes) on the current stream;
- a static KV cache of context + new tokens; one decode step (embedding -> logits -> argmax -> next token,
  position + 1, on the device) captured in one CUDA graph, all-reduces included, and replayed per token;
- the gpt-fast-like step of bench_decode's "lean" step: per layer a torch.compile'd attention block up to the
  partial o_proj, the all-reduce, a compiled residual + RMSNorm, the MLP, the all-reduce;
- thresholds per layer and e by the paper's split, calibrated through the TP calibration (tau_x from the
  replicated x, tau_s from the ranks' merged reservoirs) on the MLP inputs of a short dense prefill of random
  tokens (run as decode steps from position 0). One Prox graph serves every e (a device table switched
  between runs).

Reported per model: tokens/s dense and Prox per e (speed-up, Amdahl bound, fraction of the bound); the MLP share
of the dense step (the step with the MLP GEMVs removed and their all-reduce kept: the part Prox speeds up); the
all-reduce share (the dense step with the communicator swapped for prox.distributed.NoOpCommunicator before
warm-up and capture: the same kernels without the NCCL ones, each rank carrying its partial sums on); the
per-rank FFN speed-up of the rank's MLP stack alone (every rank at once, no all-reduce; the bound uses it), a
single-GPU Prox FFN of the shard's shape (a PlannedFfn on the same tensors, timed on rank 0 alone) and the ratio
of the two (target: >= 0.95); per-rank extra memory (the shard's proxies and scales: a SparseMLP with
keep_down=False keeps W_down^T only; this benchmark also keeps W_down for its dense baseline). Times are rank
0's; the JSON also has every rank's. JSON is rewritten after every model; a plot at the end.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

import prox
from prox import distributed as pd
from prox.benchlib import (DTYPES, HelpFormatter, Runner, amdahl, attention, dense_mlp, git_commit,
                           plot as plot_decode, rms_norm, time_graph, write_plot)

MODELS = {
    # Qwen3-32B (config.json of the released model) and Qwen3-14B
    "32b": dict(d_model=5120, d_ff=25600, layers=64, heads=64, kv_heads=8, head_dim=128, vocab=151936),
    "14b": dict(d_model=5120, d_ff=17408, layers=40, heads=40, kv_heads=8, head_dim=128, vocab=151936),
    # smoke tests (CPU included)
    "tiny": dict(d_model=256, d_ff=1024, layers=2, heads=4, kv_heads=4, head_dim=64, vocab=1024),  # splits over 1, 2, 4
}
EPS = 1e-6
ROPE_THETA = 1_000_000.0
T0 = time.time()


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


# ---------------------------------------------------------------- the TP decoder


def post_attn(h, o, w_ln2, eps: float):
    """The residual add of the all-reduced attention output, and the MLP's RMSNorm."""
    h = h + o
    return h, rms_norm(h, w_ln2, eps)


def final_tp(h, mlp_out, w_norm, w_head, eps: float, rank: int, world: int):
    """Logits of this rank's vocab rows and its row of the [world, 2] (max, global index) table."""
    h = h + mlp_out
    logits = F.linear(rms_norm(h, w_norm, eps), w_head).float()
    m, i = logits.max(dim=-1)
    table = torch.zeros(world, 2, dtype=torch.float32, device=h.device)
    table[rank, 0] = m[0]
    table[rank, 1] = (i[0] + rank * w_head.shape[0]).float()
    return logits, table


class TPDecoder:
    """A Qwen3-shaped decoder's rank shard (weights, KV cache, rope tables) and its lean decode step.

    full=True draws every weight whole (the same on every rank for one seed) and keeps this rank's part, so the
    same model exists at any TP degree (tests, --check); else each rank draws only its part (a TP=N model of its
    own). world=1 with full=True is the unsharded model."""

    def __init__(self, spec: dict, rank: int, world: int, dtype, device, max_len: int, *, seed: int = 0,
                 full: bool = False, compile: bool = True, comm=None):
        self.spec, self.rank, self.world, self.dtype, self.device = spec, rank, world, dtype, torch.device(device)
        d, dff, hd = spec["d_model"], spec["d_ff"], spec["head_dim"]
        for key, what in (("heads", "query heads"), ("kv_heads", "KV heads"), ("vocab", "vocab rows")):
            if spec[key] % world:
                raise ValueError(f"prox: {spec[key]} {what} do not split over {world} ranks")
        self.d, self.n = d, dff // world
        self.nh, self.nkv, self.hd = spec["heads"] // world, spec["kv_heads"] // world, hd
        self.v_local = spec["vocab"] // world
        self.comm = comm or pd.NoOpCommunicator()
        self._seed, self._full = seed, full
        self._count = 0
        std = 0.02
        self.embed = self._draw((spec["vocab"], d), std, replicated=True)
        self.norm = torch.ones(d, dtype=dtype, device=self.device)
        self.head = self._draw((spec["vocab"], d), std, rows=(rank * self.v_local, (rank + 1) * self.v_local))
        lo, hi = rank * self.n, (rank + 1) * self.n
        nq, nk = spec["heads"] * hd, spec["kv_heads"] * hd
        self.layers = []
        for _ in range(spec["layers"]):
            L = types.SimpleNamespace()  # one layer's shard
            q = self._draw((nq, d), std, rows=(rank * self.nh * hd, (rank + 1) * self.nh * hd))
            k = self._draw((nk, d), std, rows=(rank * self.nkv * hd, (rank + 1) * self.nkv * hd))
            v = self._draw((nk, d), std, rows=(rank * self.nkv * hd, (rank + 1) * self.nkv * hd))
            L.wqkv = torch.cat([q, k, v])
            del q, k, v
            L.wo = self._draw((d, nq), std, cols=(rank * self.nh * hd, (rank + 1) * self.nh * hd))
            g = self._draw((dff, d), std, rows=(lo, hi))
            u = self._draw((dff, d), std, rows=(lo, hi))
            L.gate_up = torch.cat([g, u])  # merged column-parallel: this rank's gate rows, then its up rows
            del g, u
            L.w_down = self._draw((d, dff), std, cols=(lo, hi))  # row-parallel [d_model, d_ff / world]
            L.ln1 = torch.ones(d, dtype=dtype, device=self.device)
            L.ln2 = torch.ones(d, dtype=dtype, device=self.device)
            L.qn = torch.ones(hd, dtype=dtype, device=self.device)
            L.kn = torch.ones(hd, dtype=dtype, device=self.device)
            L.k_cache = torch.zeros(self.nkv, max_len, hd, dtype=dtype, device=self.device)
            L.v_cache = torch.zeros(self.nkv, max_len, hd, dtype=dtype, device=self.device)
            self.layers.append(L)
        inv = 1.0 / (ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd))
        t = torch.arange(max_len, dtype=torch.float32, device=self.device)
        emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.zero = torch.zeros(1, d, dtype=dtype, device=self.device)
        self.zero_mlp = torch.zeros(1, d, dtype=dtype, device=self.device)
        c = (lambda f: torch.compile(f, dynamic=False, fullgraph=True)) if compile else (lambda f: f)
        self.attn, self.post, self.mlp_dense, self.final = c(attention), c(post_attn), c(dense_mlp), c(final_tp)
        self.sparse = None
        self.record = None  # a list per layer: the MLP inputs of eager steps (calibration)

    def _draw(self, shape, std, *, rows=None, cols=None, replicated=False):
        """A random weight, or this rank's rows / columns of it. Each weight has its own generator seed (by
        creation order, and by rank for a per-rank shard), so drawing on the device costs no host work."""
        self._count += 1
        per_rank = not (self._full or replicated)
        g = torch.Generator(device=self.device)
        g.manual_seed(self._seed * 1_000_003 + self._count * 1009 + (self.rank + 1 if per_rank else 0))
        if per_rank:
            shape = (rows[1] - rows[0], shape[1]) if rows else (shape[0], cols[1] - cols[0]) if cols else shape
            rows = cols = None
        w = torch.randn(shape, generator=g, dtype=self.dtype, device=self.device).mul_(std)
        if rows:
            w = w[rows[0]:rows[1]].contiguous()
        if cols:
            w = w[:, cols[0]:cols[1]].contiguous()
        return w

    def step(self, tok, pos, mlps: str):
        """One decode step (in place: tok <- argmax, pos += 1); mlps: 'dense', 'prox' or 'none' (the MLP GEMVs
        removed, their all-reduce kept). Returns this rank's logits [1, vocab / world] (float32)."""
        h = F.embedding(tok.reshape(1), self.embed)
        y = self.zero
        for i, L in enumerate(self.layers):
            h, o = self.attn(h, y, pos, self.cos, self.sin, L.k_cache, L.v_cache, L.ln1, L.wqkv, L.qn, L.kn, L.wo,
                             EPS, self.nh, self.nkv, self.hd)
            self.comm.all_reduce_(o)
            h, x = self.post(h, o, L.ln2, EPS)
            if self.record is not None:
                self.record[i].append(x.detach().clone())
            if mlps == "dense":
                y = self.comm.all_reduce_(self.mlp_dense(x, L.gate_up, L.w_down, self.n))
            elif mlps == "prox":
                y = self.sparse[i](x)  # SparseMLP with tp: Prox on this rank's channels, then its all-reduce
            else:
                y = self.comm.all_reduce_(self.zero_mlp)
        logits, table = self.final(h, y, self.norm, self.head, EPS, self.rank, self.world)
        self.comm.all_reduce_(table)
        # A gather, not table[argmax, 1]: indexing with a 0-d CUDA tensor reads it on the host (a sync that graph
        # capture refuses).
        nxt = table[:, 1].gather(0, torch.argmax(table[:, 0]).reshape(1)).long()
        tok.copy_(nxt.view_as(tok))
        pos.add_(1)
        return logits

    def build_sparse(self, tp, *, track_sparsity: bool = True, backend: str = "auto"):
        """The Prox MLPs: one SparseMLP per layer on this rank's shard (views of gate_up; W_down^T made from
        w_down), thresholds read from rows of one [L, 2] device table (switching e is one copy). backend="op"
        makes a step that cannot run the CUDA op fail instead of running the torch reference."""
        self.table = torch.zeros(len(self.layers), 2, dtype=torch.float32, device=self.device)
        self.sparse = []
        for i, L in enumerate(self.layers):
            sp = pd.sparse_mlp_from_shards(gate_up=L.gate_up, down=L.w_down, d_ff=self.spec["d_ff"], tp=tp,
                                           act="silu", keep_down=False, track_sparsity=track_sparsity,
                                           backend=backend)
            sp.thresholds = self.table[i]
            self.sparse.append(sp)
        return self.sparse

    def set_comm(self, comm) -> None:
        self.comm = comm
        if self.sparse:
            pd.set_communicator(self.sparse, comm)


# ---------------------------------------------------------------- graphs and timing


def graph_step(fn, tok, pos, ctx: int, use_graph: bool):
    """benchlib's Runner for a TP step: captured with capture_error_mode='thread_local' (NCCL's own threads
    may call CUDA meanwhile), every rank starting each timed run together (a barrier)."""
    return Runner(fn, tok, pos, ctx, use_graph, before_timing=dist.barrier, capture_error_mode="thread_local")


def gathered(value):
    """Every rank's value (a list, rank order)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def timing(seconds: float) -> dict:
    every = gathered(seconds)
    return {"ms": seconds * 1e3, "tok_s": 1.0 / seconds, "rank_ms": [s * 1e3 for s in every]}


# ---------------------------------------------------------------- calibration


@torch.no_grad()
def calibrate(model: TPDecoder, e_values, tokens: int, seed: int = 1) -> dict:
    """{e: [L, 2] thresholds}: each layer's MLP inputs from `tokens` eager dense steps on random tokens (the same
    on every rank) from position 0, then prox.calibrate_layer with the layer's TPState (tau_x checked equal
    across ranks, tau_s over all d_ff channels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.spec["vocab"], (tokens,), generator=g).to(model.device)
    model.record = [[] for _ in model.layers]
    tok = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    pos = torch.zeros(1, dtype=torch.long, device=model.device)
    for t in range(tokens):
        tok.fill_(int(ids[t]))
        model.step(tok, pos, "dense")
    xs = [torch.cat(r) for r in model.record]
    model.record = None
    tables = {}
    for e in e_values:
        st = prox.allocate_sparsity(e)
        rows = []
        for sp, x in zip(model.sparse, xs):
            lt = prox.calibrate_layer(x, st.s1, st.s2, sp.proxy_values, tp=sp.tp)
            rows.append([lt.tau_x, lt.tau_s])
        tables[e] = torch.tensor(rows, dtype=torch.float32, device=model.device)
    return tables, xs


@torch.no_grad()
def check_against_unsharded(args, dtype, device, group) -> float:
    """The TP step's logits against the unsharded model's (the same weights: full draws), teacher-forced over
    a few steps: the largest relative L2 difference of this rank's vocab rows, over the ranks."""
    spec = MODELS[args.check_model]
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        dtype = torch.float32
    tp = TPDecoder(spec, rank, world, dtype, device, 16, seed=7, full=True, compile=False,  # eager: no compile time
                   comm=pd.communicator(group, device))
    one = TPDecoder(spec, 0, 1, dtype, device, 16, seed=7, full=True, compile=False)
    toks = torch.randint(0, spec["vocab"], (6,), generator=torch.Generator().manual_seed(5)).tolist()
    a = torch.zeros(1, 1, dtype=torch.long, device=device)
    b = a.clone()
    pa = torch.zeros(1, dtype=torch.long, device=device)
    pb = pa.clone()
    worst = 0.0
    lo = rank * tp.v_local
    for t in toks:
        a.fill_(t)
        b.fill_(t)
        la = tp.step(a, pa, "dense")
        lb = one.step(b, pb, "dense")[:, lo:lo + tp.v_local]
        worst = max(worst, float((la - lb).norm() / lb.norm()))
    return max(gathered(worst))


# ---------------------------------------------------------------- one model


def run_model(args, name: str, dtype_name: str, group, results: dict, save) -> None:
    dtype = DTYPES[dtype_name]
    dev = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    use_graph = dev.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = MODELS[name]
    ctx = args.context
    comm = pd.communicator(group, dev)
    t = time.time()
    model = TPDecoder(spec, rank, world, dtype, dev, ctx + args.new_tokens, compile=not args.no_compile, comm=comm)
    sparse = model.build_sparse(group, backend="op" if use_graph else "torch")
    if use_graph:
        torch.cuda.synchronize()
    mem = prox.memory_report(torch.nn.ModuleList(sparse))
    n = model.n
    w_down_bytes = sum(L.w_down.numel() * L.w_down.element_size() for L in model.layers)
    memory = {"proxies": mem["proxies"], "scales": mem["scales"], "workspaces": mem["workspaces"],
              "extra_total": mem["proxies"] + mem["scales"] + mem["workspaces"], "dense_mlp": mem["dense_mlp"],
              "extra_fraction_of_mlp": (mem["proxies"] + mem["scales"]) / mem["dense_mlp"],
              "w_down_kept_twice": bool(mem["w_down_t"]), "bench_only_dense_w_down": w_down_bytes,
              "cuda_allocated": torch.cuda.memory_allocated(dev) if use_graph else 0}
    log(f"{name} {dtype_name} TP={world}: rank shard built in {time.time() - t:.1f} s (d_ff / TP = {n}); Prox adds "
        f"{memory['proxies'] / 2**30:.2f} GiB proxies + {memory['scales'] / 2**20:.1f} MiB scales per rank")
    t = time.time()
    tables, xs = calibrate(model, args.e, args.calib_tokens)
    log(f"  thresholds calibrated (TP calibration, {args.calib_tokens} tokens) for e = {args.e} "
        f"[{time.time() - t:.1f} s]")
    every = gathered([tables[e].tolist() for e in args.e])
    table_same = all(r == every[0] for r in every)

    # the FFN alone: the rank's MLP stack (every rank at once, no all-reduce) and a single-GPU FFN of the shard's
    # shape (a PlannedFfn on the same tensors, rank 0 alone)
    xs1 = [x[-1:].contiguous() for x in xs]
    L = len(model.layers)

    def stack_dense():
        for layer, x in zip(model.layers, xs1):
            model.mlp_dense(x, layer.gate_up, layer.w_down, n)

    def stack_prox():
        for sp, x in zip(sparse, xs1):
            sp.forward_local(x)
    ffn = {"dense_us": 0.0, "prox_us": {}, "speedup": {}}
    dist.barrier()
    ffn["dense_us"] = time_graph(stack_dense, args.ffn_iters, use_graph) * 1e6 / L
    for e in args.e:
        model.table.copy_(tables[e])
        dist.barrier()
        ffn["prox_us"][str(e)] = time_graph(stack_prox, args.ffn_iters, use_graph) * 1e6 / L
        ffn["speedup"][str(e)] = ffn["dense_us"] / ffn["prox_us"][str(e)]
    single = None
    if rank == 0:
        single = {"dense_us": 0.0, "prox_us": {}, "speedup": {}}
        planned = []
        if use_graph:
            for sp in sparse:
                planned.append(prox.PlannedFfn(sp.gate_proj.weight, sp.up_proj.weight, w_down_t=sp.down_t,
                                               proxies=((sp.proxy_gate, sp.scale_gate), (sp.proxy_up, sp.scale_up)),
                                               thresholds=sp.thresholds, workspace=sp.workspace))
        run_one = (lambda p, x: p(x)) if use_graph else (lambda p, x: p.forward_local(x))
        items = planned if use_graph else sparse

        def single_prox():
            for p, x in zip(items, xs1):
                run_one(p, x)
        single["dense_us"] = time_graph(stack_dense, args.ffn_iters, use_graph) * 1e6 / L
        for e in args.e:
            model.table.copy_(tables[e])
            single["prox_us"][str(e)] = time_graph(single_prox, args.ffn_iters, use_graph) * 1e6 / L
            single["speedup"][str(e)] = single["dense_us"] / single["prox_us"][str(e)]
        del planned
    dist.barrier()
    single = gathered(single)[0]
    single["rank_to_single"] = {k: ffn["speedup"][k] / v for k, v in single["speedup"].items()}
    log(f"  FFN alone per layer: dense {ffn['dense_us']:.1f} us, Prox " + ", ".join(
        f"e={k}: {v:.1f} us ({ffn['speedup'][k]:.2f}x; single GPU {single['speedup'][k]:.2f}x, "
        f"ratio {single['rank_to_single'][k]:.3f})" for k, v in ffn["prox_us"].items()))

    # the decode step
    tok = torch.ones(1, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    t = time.time()
    dense = graph_step(lambda a, b: model.step(a, b, "dense"), tok, pos, ctx, use_graph)
    compile_s = time.time() - t
    none = graph_step(lambda a, b: model.step(a, b, "none"), tok, pos, ctx, use_graph)
    noop = pd.NoOpCommunicator()
    model.set_comm(noop)
    try:
        noar = graph_step(lambda a, b: model.step(a, b, "dense"), tok, pos, ctx, use_graph)
    finally:
        model.set_comm(comm)
    sparse_step = graph_step(lambda a, b: model.step(a, b, "prox"), tok, pos, ctx, use_graph)
    t_dense = dense.time(args.new_tokens, args.repeats)
    t_none = none.time(args.new_tokens, args.repeats)
    t_noar = noar.time(args.new_tokens, args.repeats)
    cell = {"model": name, "dtype": dtype_name, "context": ctx, "step": f"tp{world}", "tp": world,
            "dense": timing(t_dense), "no_mlp": timing(t_none), "no_allreduce": timing(t_noar),
            "mlp_share": max(t_dense - t_none, 0.0) / t_dense,
            "allreduce_share": max(t_dense - t_noar, 0.0) / t_dense,
            "allreduces_per_step": 2 * L + 1,
            "allreduce_us_each": max(t_dense - t_noar, 0.0) * 1e6 / (2 * L + 1),
            "ffn": ffn, "ffn_single": single, "memory_per_rank": memory, "thresholds_same_on_every_rank": table_same,
            "warmup_and_capture_s": compile_s, "prox": {}}
    for e in args.e:
        model.table.copy_(tables[e])  # the same captured graph, new thresholds
        pd.check_same_thresholds(sparse)
        for sp in sparse:
            sp.reset_counters()
        t_prox = sparse_step.time(args.new_tokens, args.repeats)
        reps = gathered(prox.sparsity_report(torch.nn.ModuleList(sparse)))
        s1 = reps[0]["s1"]
        s2 = sum(r["s2"] for r in reps) / len(reps)  # equal shards: the layer's s2 is the ranks' mean
        s = ffn["speedup"][str(e)]
        bound = amdahl(t_dense, t_none, s)
        st = prox.allocate_sparsity(e)
        cell["prox"][str(e)] = {**timing(t_prox), "speedup": t_dense / t_prox, "ffn_speedup": s,
                                "amdahl_bound": bound, "fraction_of_bound": t_dense / t_prox / bound,
                                "ffn_speedup_in_step": max(t_dense - t_none, 0.0) / max(t_prox - t_none, 1e-12),
                                "realized": {"s1": s1, "s2": s2, "effective": prox.effective_sparsity(s1, s2)},
                                "target": {"s1": st.s1, "s2": st.s2}}
    del dense, none, noar, sparse_step
    key = f"{name}/{dtype_name}/{ctx}/tp{world}"
    results["cells"][key] = cell
    save()
    log(f"  {key}: dense {cell['dense']['tok_s']:.1f} tok/s ({cell['dense']['ms']:.2f} ms), MLP share "
        f"{cell['mlp_share']:.0%}, all-reduce share {cell['allreduce_share']:.0%} "
        f"({cell['allreduce_us_each']:.1f} us x {2 * L + 1}); Prox " + ", ".join(
            f"e={k}: {v['speedup']:.2f}x (bound {v['amdahl_bound']:.2f}x, {v['fraction_of_bound']:.0%})"
            for k, v in cell["prox"].items()))


def plot(results: dict, path: str) -> None:
    """benchlib's plot of these cells (one panel per model and TP degree), with the issue's target."""
    plot_decode(results, path, targets={("32b", "tp2"): ([70], [1.6], "target (32B TP=2, H100)")},
                title=f"prox tensor-parallel batch-1 decode, {results['world']} x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m prox.bench_decode --tp N",
                                description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree (= the number of processes)")
    p.add_argument("--models", default="32b", help="comma list of 32b, 14b, tiny")
    p.add_argument("--dtypes", default="bf16", help="comma list of fp16, bf16")
    p.add_argument("--context", "--contexts", type=int, default=512,
                   help="tokens in the KV cache before the timed ones")
    p.add_argument("--e", default="0.4,0.5,0.6,0.7", help="effective sparsities")
    p.add_argument("--new-tokens", type=int, default=128, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (median)")
    p.add_argument("--ffn-iters", type=int, default=20, help="graph replays of the FFN stack alone")
    p.add_argument("--calib-tokens", type=int, default=64, help="random tokens of the calibration prefill")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (gloo, --models tiny)")
    p.add_argument("--backend", default="", help="torch.distributed backend (default: nccl on CUDA, gloo on CPU)")
    p.add_argument("--no-compile", action="store_true", help="the step without torch.compile")
    p.add_argument("--check", action="store_true", help="first compare the TP step's logits with the unsharded "
                                                        "step's on a small model (--check-model)")
    p.add_argument("--check-model", default="tiny", help="the model --check compares on")
    p.add_argument("--out", default="decode-tp.json", help="JSON results path")
    p.add_argument("--plot", default="", help="SVG/PNG path for the plot (default: --out with .svg)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.e = [float(e) for e in args.e.split(",") if e]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m}")
    if args.device == "cpu":
        args.no_compile = True
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != args.tp:
        p.error(f"--tp {args.tp} needs {args.tp} processes (torchrun --nproc-per-node {args.tp}); WORLD_SIZE is "
                f"{world_env}")
    if args.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            p.error("no CUDA device (use --device cpu --models tiny for a smoke test)")
        if not prox.ops_available():
            raise SystemExit("prox.bench_tp: the CUDA op is not loaded (prox._C): refusing to time Prox through the "
                             "torch reference")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):  # NVLink multicast
        os.environ.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")                   # off unless set
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    kw = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
    # torch._dynamo first: imported after init_process_group, it takes references to the default group that
    # destroy_process_group() does not release (torch 2.11), so the group's threads outlive it and a gloo worker
    # thread can abort the process at interpreter exit (SIGABRT). This removes that holder, not every one
    # (docs/history.md, round at d66344c)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300), **kw)
    group = dist.group.WORLD
    rank = dist.get_rank()
    cuda = args.device == "cuda"
    results = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
               "world": args.tp, "tp": args.tp, "torch": torch.__version__, "backend": backend,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "",
               "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "smoke": not cuda, "prox_file": prox.__file__, "ops_available": prox.ops_available(),
               "backend_used": "op" if cuda else "torch",
               "argv": sys.argv[1:] if argv is None else list(argv),
               "env": {k: os.environ.get(k, "") for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                          "NVSHMEM_DISABLE_NVLS")},
               "layout": {"embedding": "replicated", "lm_head": "vocab-parallel, argmax through one all-reduce",
                          "attention": "column-parallel QKV (heads split), row-parallel o_proj + all-reduce",
                          "mlp": "merged column-parallel gate/up, row-parallel down + all-reduce"},
               "config": {"new_tokens": args.new_tokens, "repeats": args.repeats, "e": args.e,
                          "calibration_tokens": args.calib_tokens, "context": args.context}, "cells": {}}

    def save():
        if rank != 0:
            return
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.out)

    ok = False
    try:
        if cuda and rank == 0:
            comm = pd.communicator(group, torch.device("cuda", torch.cuda.current_device()))
            results["nccl"] = getattr(comm, "version", results["nccl"])
        elif cuda:
            pd.communicator(group, torch.device("cuda", torch.cuda.current_device()))
        if args.check:
            dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            results["check_rel_error"] = check_against_unsharded(args, DTYPES[args.dtypes[0]], dev, group)
            log(f"TP step vs unsharded step ({args.check_model}): worst relative logits difference "
                f"{results['check_rel_error']:.2e}")
            save()
        for name in args.models:
            for dt in args.dtypes:
                try:
                    run_model(args, name, dt, group, results, save)
                except Exception as exc:  # noqa: BLE001  (recorded; the ranks may be out of step: stop)
                    log(f"{name} {dt}: FAILED: {type(exc).__name__}: {exc}")
                    results["cells"][f"{name}/{dt}/{args.context}/tp{args.tp}"] = {
                        "error": f"{type(exc).__name__}: {exc}"}
                    save()
                    raise
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        save()
        if rank == 0:
            log(write_plot(results, args.out, args.plot, plot))
        ok = True
    finally:
        if cuda:
            torch.cuda.synchronize()
        if ok:
            dist.barrier()
        pd.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
