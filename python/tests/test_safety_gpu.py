# SPDX-License-Identifier: Apache-2.0
"""GPU tests of the Python layer's safety (issue 38): the "auto" backend's warning, mixed dtypes and autocast,
the workspace header, per-stream and per-model workspaces with two models on two streams at once, the plan
cache under capture, the cooperative-launch refusal at run time, checks at construction, refresh under a
captured graph."""
import time

import pytest
import torch
import torch.nn as nn

import prox
from prox.benchlib import capture_graph
from conftest import requires_cuda

pytestmark = requires_cuda


def linears(d_model, d_ff, dtype, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for a, b, s in ((d_model, d_ff, d_model), (d_model, d_ff, d_model), (d_ff, d_model, d_ff)):
        lin = nn.Linear(a, b, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) / s ** 0.5)
        out.append(lin.to(device=device, dtype=dtype))
    return out


def test_auto_warns_once_when_the_op_cannot_run(monkeypatch, recwarn):
    monkeypatch.setattr(prox._ops, "_IMPORT_ERROR", ImportError("undefined symbol: _ZN3c10xyz"))
    monkeypatch.setattr(prox._ops, "_IMPORT_REASON", "the compiled extension prox._C exists but could not be loaded "
                        "(ImportError: undefined symbol: _ZN3c10xyz)")
    monkeypatch.setattr(prox.sparse_mlp, "_WARNED", set())
    layers = [prox.SparseMLP(*linears(64, 128, torch.float16, seed=i)) for i in range(3)]
    w = [r for r in recwarn.list if issubclass(r.category, RuntimeWarning) and "torch reference" in str(r.message)]
    assert len(w) == 1 and "undefined symbol" in str(w[0].message)
    assert all(m.backend_in_use() == "torch" for m in layers)
    with pytest.raises(RuntimeError, match="undefined symbol"):
        prox.SparseMLP(*linears(64, 128, torch.float16), backend="op")(torch.randn(1, 64, device="cuda").half())


def test_mixed_dtypes_and_autocast(recwarn):
    sp = prox.SparseMLP(*linears(64, 128, torch.float16), tau_x=0.2, tau_s=0.01)
    assert sp.backend_in_use() == "op"
    with pytest.raises(TypeError, match="x is torch.bfloat16 but this layer's weights are torch.float16"):
        sp(torch.randn(1, 64, device="cuda", dtype=torch.bfloat16))
    # fp32 weights under fp16 autocast: x arrives fp16, the op cannot run fp32 weights: the torch reference
    # runs (one warning at construction), never the op with no workspace.
    prox.sparse_mlp._WARNED.clear()
    lin = linears(64, 128, torch.float32, seed=3)
    sp32 = prox.SparseMLP(*lin, tau_x=0.2, tau_s=0.01)
    assert any("float32" in str(r.message) for r in recwarn.list)
    assert sp32.backend_in_use() == "torch" and sp32.workspace is None
    x = torch.randn(1, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        y = sp32(x.half())
        want = sp32.sparse_reference(x.half())  # under the same autocast: its matmuls round as the call's do
    assert y.dtype == torch.float16 and torch.equal(y, want)


def test_workspace_dirty_reads_only_whole_headers():
    for n in (16, 4096):
        ws = torch.zeros(n, dtype=torch.uint8, device="cuda")
        with pytest.raises(ValueError, match="at least"):
            prox.workspace_dirty(ws)
        with pytest.raises(ValueError, match="byte header"):
            torch.ops.prox.workspace_dirty(ws)
    ws = torch.zeros(prox.workspace_header_bytes(), dtype=torch.uint8, device="cuda")
    prox.initialize_workspace(ws)
    assert not prox.workspace_dirty(ws)


def _wait(events, seconds=60.0):
    """Poll instead of synchronize: a hung kernel fails the test rather than the run."""
    t = time.time()
    while not all(e.query() for e in events):
        if time.time() - t > seconds:
            pytest.fail("the GPU did not finish within a minute (a grid barrier shared by two streams?)")
        time.sleep(0.001)


def _model(seed, d_model=2048, d_ff=6144, layers=4):
    m = nn.ModuleList([nn.Module() for _ in range(layers)])
    for i, blk in enumerate(m):
        g, u, d = linears(d_model, d_ff, torch.float16, seed=100 * seed + i)
        blk.mlp = type("MLP", (nn.Module,), {"forward": lambda self, x: x})()
        blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj, blk.mlp.act_fn = g, u, d, nn.SiLU()
    prox.swap_mlps(m, tau_x=0.3, tau_s=0.01)
    return [blk.mlp for blk in m], m


def _run(layers, x, n):
    for _ in range(n):
        h = x
        for sp in layers:
            h = sp(h) * 0.5 + x
    return h


@pytest.mark.parametrize("tokens", [1, 4])
def test_two_models_on_two_streams_concurrently(tokens):
    """Two models, each on its own stream, at once: each its own workspaces (its own pool), each result the
    one it gives alone."""
    a, ma = _model(1)
    b, mb = _model(2)
    assert prox.workspace_pool(ma) is not prox.workspace_pool(mb)
    x = torch.randn(tokens, 2048, device="cuda").half()
    with torch.no_grad():
        want_a, want_b = _run(a, x, 1), _run(b, x, 1)
        sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
        sa.wait_stream(torch.cuda.current_stream())
        sb.wait_stream(torch.cuda.current_stream())
        for _ in range(20):
            with torch.cuda.stream(sa):
                ya = _run(a, x, 10)
            with torch.cuda.stream(sb):
                yb = _run(b, x, 10)
        ea, eb = sa.record_event(), sb.record_event()
        _wait([ea, eb])
    assert torch.equal(ya, want_a) and torch.equal(yb, want_b)
    for ws in (a[0].workspace, b[0].workspace):
        assert not prox.workspace_dirty(ws)


def test_one_model_on_two_streams_takes_a_workspace_per_stream():
    a, ma = _model(3, layers=2)
    x = torch.randn(1, 2048, device="cuda").half()
    with torch.no_grad():
        want = _run(a, x, 1)
        ws0 = a[0].workspace
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            y1 = _run(a, x, 20)
            ws1 = a[0].workspace
        with torch.cuda.stream(s2):
            y2 = _run(a, x, 20)
            ws2 = a[0].workspace
        _wait([s1.record_event(), s2.record_event()])
    ptrs = {ws0.data_ptr(), ws1.data_ptr(), ws2.data_ptr()}
    assert len(ptrs) == 3 and len(prox.workspace_pool(ma)) == 3
    assert torch.equal(y1, want) and torch.equal(y2, want)
    prox.workspace_pool(ma).clear()
    assert len(prox.workspace_pool(ma)) == 0


def test_plan_cache_never_evicts_a_captured_or_pinned_plan():
    cap = prox.plan_cache_capacity()
    prox.clear_plan_cache()
    prox.set_plan_cache_capacity(2)
    try:
        wg, wu, wd = (t.weight.detach() for t in linears(64, 128, torch.float16, seed=1))
        x = torch.randn(64, device="cuda").half()
        ws = prox.new_workspace(64, 128)
        th = torch.zeros(2, device="cuda")
        (pg, sg), (pu, su) = prox.pack_int4(wg), prox.pack_int4(wu)
        layer = prox.LayerTensors(w_gate=wg, w_up=wu, w_down_t=prox.transpose(wd), proxy_gate=pg, scale_gate=sg,
                                  proxy_up=pu, scale_up=su).tensors()
        call = lambda: torch.ops.prox.sparse_ffn(x, layer, 0, th, ws, 0, prox.PlanOptions().encode())[0]  # noqa: E731
        g, y = capture_graph(call)  # planned eagerly in the warm-up, then used during capture: kept
        assert prox.plan_cache_pinned() == 1
        others = [prox.PlannedFfn(*(t.weight.detach() for t in linears(64, 128, torch.float16, seed=10 + i)))
                  for i in range(4)]  # PlannedFfn pins its plans while it lives
        assert prox.plan_cache_pinned() == 5
        for i in range(6):  # unpinned plans beyond the capacity are evicted
            th2 = torch.zeros(2, device="cuda")
            torch.ops.prox.sparse_ffn(x, layer, 0, th2, ws, 0, prox.PlanOptions().encode())
        assert prox.plan_cache_size() == 5 + 2
        g2, y2 = capture_graph(call)  # captured again: its plan is still there (no "no plan yet" refusal)
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(y2, call())
        del others
        import gc
        gc.collect()
        assert prox.plan_cache_pinned() == 1
    finally:
        prox.set_plan_cache_capacity(cap)


def test_non_cooperative_fused_stage2_refused_at_run_time():
    wg, wu, wd = (t.weight.detach() for t in linears(64, 128, torch.float16))
    (pg, sg), (pu, su) = prox.pack_int4(wg), prox.pack_int4(wu)
    lt = prox.LayerTensors(w_gate=wg, w_up=wu, w_down_t=prox.transpose(wd), proxy_gate=pg, scale_gate=sg, proxy_up=pu,
                           scale_up=su)
    c = prox.new_counters()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="cooperative off"):
        torch.ops.prox.sparse_ffn(torch.randn(64, device="cuda").half(), lt.tensors(), lt.format_code(),
                                  torch.zeros(2, device="cuda"), prox.new_workspace(64, 128), 0,
                                  [1 | 4 | 8 | 32, -1, -1, -1, -1], False, False, False, c)
    torch.cuda.synchronize()
    assert int(c[0]) == 0
    ffn = prox.PlannedFfn(wg, wu, wd, options=prox.PlanOptions(cooperative=False, fuse_stage2=False))
    assert torch.isfinite(ffn(torch.randn(64, device="cuda").half()).float()).all()


def test_planned_ffn_names_the_tensor_at_construction():
    wg, wu, wd = (t.weight.detach() for t in linears(64, 128, torch.float16))
    buf = torch.zeros(128 * 64 + 8, dtype=torch.float16, device="cuda")
    mis = buf[1:1 + 128 * 64].view(128, 64)
    mis.copy_(wu)
    with pytest.raises(ValueError, match="w_up must be 16-byte aligned"):
        prox.PlannedFfn(wg, mis, wd)
    with pytest.raises(ValueError, match="calls of up to 8 tokens"):
        prox.PlannedFfn(wg, wu, wd, max_tokens=8, workspace=prox.new_workspace(64, 128))
    with pytest.raises(ValueError, match="thresholds"):
        prox.PlannedFfn(wg, wu, wd, thresholds=torch.zeros(2))


def test_refresh_updates_a_captured_graph_in_place():
    lin = linears(256, 768, torch.float16, seed=4)
    sp = prox.SparseMLP(*lin, keep_down=True, tau_x=0.3, tau_s=0.02)
    x = torch.randn(1, 256, device="cuda").half()
    with torch.no_grad():
        sp.plan()
        g, y = capture_graph(lambda: sp(x))
        with torch.no_grad():
            for t in lin:
                t.weight.mul_(0.5)
        sp.refresh()  # in place: the graph's pointers now hold the new proxies and W_down^T
        g.replay()
        torch.cuda.synchronize()
        fresh = prox.SparseMLP(*lin, keep_down=True, tau_x=0.3, tau_s=0.02)
        assert torch.equal(y, fresh(x))
