# SPDX-License-Identifier: Apache-2.0
"""SparseMLP and sparsify on the GPU with small transformers models: the decode path (the op) against the
torch reference, decode vs prefill, small batches (one batched op call) vs their tokens one at a time,
sequential calibration with realized sparsity near the targets, the thresholds file round trip, generate(),
GeGLU (Gemma) and Qwen3 MLPs."""
import copy

import pytest
import torch

import prox
from conftest import requires_cuda

pytestmark = requires_cuda
transformers = pytest.importorskip("transformers")


def tiny(kind="llama", dtype=torch.float16, layers=2, seed=0, device="cuda"):
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=64, **common)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "gemma":
        cfg = transformers.GemmaConfig(head_dim=64, hidden_act="gelu_pytorch_tanh", **common)
        cls = transformers.GemmaForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    return cls(cfg).to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_op_vs_reference_and_prefill(kind, dtype):
    m = tiny(kind, dtype)
    mlp = m.model.layers[0].mlp
    x = torch.randn(1, 12, 256, device="cuda", dtype=dtype)  # more than 8 tokens: a prefill, not a batch
    with torch.no_grad():
        dense = mlp(x)
        sp = prox.SparseMLP.from_mlp(mlp, keep_down=True)
        assert sp.act == ("gelu_tanh" if kind == "gemma" else "silu")
        assert torch.allclose(sp(x), dense, atol=1e-2, rtol=1e-2)  # prefill: dense through torch
        sp.set_thresholds(0.5, 0.01)
        one = sp(x[:, :1])  # decode: the CUDA op
        sp.backend = "torch"
        ref = sp(x[:, :1])
        sp.backend = "auto"
        rel = (one.float() - ref.float()).norm() / ref.float().norm()
        assert rel < 2e-2, rel  # fp32 reference: only channels within rounding of tau_s may differ
        sp.prefill = "sparse"  # every token through the op: bit for bit the decode path, token by token
        rows = sp(x)
        for t in range(12):
            assert torch.equal(rows[:, t:t + 1], sp(x[:, t:t + 1]))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_of_three_tokens(kind, dtype):
    """3 tokens (a small decode batch, speculative verification) run Prox as one batched op call, whatever
    prefill says: each token within rounding of its own decode step, counted as 3 calls."""
    m = tiny(kind, dtype)
    mlp = m.model.layers[0].mlp
    x = torch.randn(1, 3, 256, device="cuda", dtype=dtype)
    with torch.no_grad():
        sp = prox.SparseMLP.from_mlp(mlp, keep_down=True, tau_x=0.5, tau_s=0.01, track_sparsity=True)
        assert sp.workspace.numel() == prox.workspace_bytes(256, 768, prox.MAX_TOKENS)
        sp.plan()  # batch 1 and the batched plan: a batch then plans nothing
        n = prox.plan_cache_size()
        y = sp(x)
        assert prox.plan_cache_size() == n
        assert sp.counters.tolist()[0] == 3  # the sparse path (dense counts nothing), one call per token
        lt = sp.layer_tensors()
        assert torch.equal(y.reshape(3, 256), torch.ops.prox.sparse_ffn(x.reshape(3, 256), lt.tensors(),
                                                                         lt.format_code(), sp.thresholds, sp.workspace,
                                                                         sp.act_code, sp._options)[0])
        for t in range(3):
            one = sp(x[:, t:t + 1])  # the token as its own decode step (batch 1)
            rel = (y[:, t:t + 1].float() - one.float()).norm() / one.float().norm()
            assert rel < 2e-2, rel  # channels within rounding of tau_s may differ, and the rounding
        sp.prefill = "sparse"
        assert torch.equal(sp(x), y)  # the same batched call
        sp.batched = False  # 3 tokens follow prefill again: one op call per token, or dense
        rows = sp(x)
        for t in range(3):
            assert torch.equal(rows[:, t:t + 1], sp(x[:, t:t + 1]))
        sp.prefill = "dense"
        assert torch.equal(sp(x), sp.dense(x))
        sp.batched = True
        x9 = torch.randn(1, 9, 256, device="cuda", dtype=dtype)
        assert torch.equal(sp(x9), sp.dense(x9))  # more than 8 tokens: prefill
        ws1 = prox.new_workspace(256, 768)  # a given workspace for one token: batches follow prefill
        sp1 = prox.SparseMLP.from_mlp(mlp, keep_down=True, tau_x=0.5, tau_s=0.01, workspace=ws1)
        assert sp1.capacity() == 1 and sp1._batch_rows(x, 3) == 0 and torch.equal(sp1(x), sp1.dense(x))
        steps = x.reshape(3, 1, 256)  # a decode batch of 3 sequences: Prox in calls of 1 (what the workspace holds)
        assert torch.equal(sp1(steps), torch.cat([sp1(steps[b:b + 1]) for b in range(3)]))


def test_sparsify_on_gpu_realized_sparsity_and_roundtrip(tmp_path):
    m = tiny("qwen3", torch.bfloat16, layers=3)
    ids = torch.randint(0, 512, (4, 64), device="cuda")
    cfg = prox.sparsify(m, 0.6, ids, track_sparsity=True, prefill="sparse")
    assert all(isinstance(mm, prox.SparseMLP) for _, mm in prox.find_mlps(m))
    with torch.no_grad():
        logits = m(ids).logits
    rep = prox.sparsity_report(m)
    st = prox.allocate_sparsity(0.6)
    # the calibration tokens, run token by token through the op: the realized sparsity is the target
    assert rep["s1"] == pytest.approx(st.s1, abs=0.02) and rep["s2"] == pytest.approx(st.s2, abs=0.03)
    path = tmp_path / "th.json"
    prox.save_thresholds(path, cfg)
    m2 = tiny("qwen3", torch.bfloat16, layers=3)
    prox.sparsify(m2, 0.6, thresholds=path, prefill="sparse")
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, logits)
    rep = prox.memory_report(m2)
    assert rep["proxies"] == 3 * 2 * 256 * 768 // 2 and rep["w_down_t"] == 0


def test_generate_runs_decode_steps_through_the_op():
    m = tiny("llama", torch.float16, layers=2)
    ids = torch.randint(0, 512, (1, 16), device="cuda")
    prox.sparsify(m, 0.5, torch.randint(0, 512, (2, 64), device="cuda"), track_sparsity=True)
    for _, mm in prox.find_mlps(m):
        mm.reset_counters()
    out = m.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 24)
    # prefill (16 tokens) is dense; each of the 7 decode steps after the first token runs the op once per layer
    calls = [int(mm.counters[0]) for _, mm in prox.find_mlps(m)]
    assert calls == [7, 7]


def test_change_sparsity_per_request_without_recapture(tmp_path):
    m = tiny("llama", torch.float16, layers=2)
    calib = torch.randint(0, 512, (2, 64), device="cuda")
    c5 = prox.sparsify(m, 0.5, calib)
    m2 = tiny("llama", torch.float16, layers=2)
    c7 = prox.sparsify(m2, 0.7, calib)
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.float16)
    mlp = m.model.layers[0].mlp
    with torch.no_grad():
        mlp(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = mlp(x)
        for cfg in (c7, c5, c7):
            prox.apply_thresholds(m, cfg)
            g.replay()
            assert torch.equal(y, mlp(x))


@pytest.mark.parametrize("convert", ["cuda", "cuda_half"])
def test_sparse_mlp_built_on_cpu_then_moved_to_cuda(convert):
    """SparseMLPs made on the CPU and moved with the model get their model's workspace of their shape on the device
    (one tensor for all its layers, initialized once; another model's is another) and compute bit for bit what
    SparseMLPs made on the device do.
    "cuda_half": made from float32 weights that fp16 represents exactly (the same proxies), then .cuda().half()."""
    src = tiny("llama", torch.float16, layers=2, device="cpu")
    direct = copy.deepcopy(src).to(device="cuda", dtype=torch.float16)
    moved = src if convert == "cuda" else src.float()
    prox.swap_mlps(moved)
    assert all(mm.workspace is None for _, mm in prox.find_mlps(moved))
    moved.cuda()
    if convert == "cuda_half":
        moved.half()
    prox.swap_mlps(direct)
    a = [layer.mlp for layer in moved.model.layers]
    b = [layer.mlp for layer in direct.model.layers]
    ws = prox.workspace_pool(moved).get(256, 768, b[0].down_t.device)
    assert all(mm.workspace is not None and mm.workspace.data_ptr() == ws.data_ptr() for mm in a)
    wsb = prox.workspace_pool(direct).get(256, 768, b[0].down_t.device)
    assert wsb.data_ptr() != ws.data_ptr() and all(mm.workspace.data_ptr() == wsb.data_ptr() for mm in b)
    assert a[0].thresholds.dtype == torch.float32 and a[0].down_t.dtype == torch.float16
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        for ma, mb in zip(a, b):
            assert torch.equal(ma.proxy_gate, mb.proxy_gate) and torch.equal(ma.scale_up, mb.scale_up)
            ma.set_thresholds(0.5, 0.01)
            mb.set_thresholds(0.5, 0.01)
            assert ma._use_op(x.reshape(-1, 256))
            assert torch.equal(ma(x), mb(x))
    assert not prox.workspace_dirty(ws)  # initialized: the runs were sparse, not the exact-dense fallback


@pytest.mark.parametrize("batch", [9, 17, 40])
def test_decode_batches_over_8_rows_run_in_op_calls_of_8(batch):
    """A decode step of more than 8 sequences (x [B, 1, d_model]) runs Prox through the op in calls of at most 8 rows
    (the pool's workspace capacity): bit for bit the concatenated calls of 8, each token within rounding of its
    batch-1 result, every token counted; never the dense MLP. The op itself refuses a call of 9 rows, naming the
    rule, and a PlannedFfn of capacity 8 with it."""
    m = tiny("llama", torch.bfloat16)
    sp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp, tau_x=0.5, tau_s=0.01, track_sparsity=True)
    assert sp.capacity() == 8
    x = torch.randn(batch, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = sp(x)
        parts = torch.cat([sp(x[i:i + 8]) for i in range(0, batch, 8)])
        assert torch.equal(y, parts)
        for b in range(batch):
            one = sp(x[b:b + 1]).float()
            assert (y[b].float() - one).norm() <= 2e-2 * one.norm() + 1e-6
        assert int(sp.counters[0]) == 3 * batch  # y, the parts, the rows one at a time
        dense = sp.dense(x)
        assert (y.float() - dense.float()).norm() > 1e-2 * dense.float().norm()
    lt = sp.layer_tensors()
    with pytest.raises(ValueError, match="sparse_ffn runs at most 8 tokens per call .* run them in calls of at "
                                         "most 8 tokens"):
        torch.ops.prox.sparse_ffn(x[:9, 0], lt.tensors(), lt.format_code(), sp.thresholds, sp.workspace, 0,
                                  sp._options)
    ffn = prox.PlannedFfn(lt.w_gate, lt.w_up, w_down_t=lt.w_down_t, max_tokens=8)
    with pytest.raises(ValueError, match="at most 8 rows"):
        ffn.run(x[:9, 0])


def test_a_decode_batch_over_8_rows_is_captured():
    """A decode batch of 12 (two op calls) is captured in a CUDA graph and replays bit for bit, following the
    thresholds."""
    from conftest import assert_replays_follow_thresholds
    m = tiny("llama", torch.float16)
    sp = prox.SparseMLP.from_mlp(m.model.layers[0].mlp, tau_x=0.5, tau_s=0.01)
    sp.plan()
    assert_replays_follow_thresholds(sp, torch.randn(12, 1, 256, device="cuda", dtype=torch.float16))
