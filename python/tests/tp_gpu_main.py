# SPDX-License-Identifier: Apache-2.0
"""The multi-GPU tensor-parallel tests: one process per GPU under torchrun (scripts/tp_tests.sh), NCCL, the CUDA
op. Runs tp_cases.py's cases (bf16 and fp16; bad inputs once) and the GPU-only ones below, gathers every rank's
outcome on rank 0, prints one line per case and "ALL PASSED", and exits 0 only then, after tearing down cleanly
(graphs freed, prox's NCCL communicators closed, the process group destroyed).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 python/tests/tp_gpu_main.py
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prox  # noqa: E402
import tp_cases  # noqa: E402
from prox import distributed as pd  # noqa: E402
from prox import reference  # noqa: E402


def case_planned_masks(ctx: tp_cases.Ctx) -> dict:
    """PlannedFfn on the shard (planned_ffn_from_shards) against PlannedFfn on the full layer, the same Stage-1
    policy: the op's own s~ and channel mask of each rank are the full layer's on its channels, bit for bit;
    y after the all-reduce within rounding of the full layer's; s1 counted the same."""
    mlp = tp_cases.GatedMLP(ctx.d_model, ctx.d_ff, ctx.dtype, ctx.device, 11)
    x = tp_cases.inputs(ctx, seed=12)
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    full0 = prox.PlannedFfn(wg, wu, wd, options=ctx.options)
    st = prox.allocate_sparsity(0.6)
    lt = prox.calibrate_layer(x, st.s1, st.s2, full0.proxy_values)
    full = prox.PlannedFfn(wg, wu, wd, tau_x=lt.tau_x, tau_s=lt.tau_s, options=ctx.options)
    lo, hi = pd.channel_range(ctx.d_ff, ctx.rank, ctx.world)
    shard = pd.planned_ffn_from_shards(wg[lo:hi].contiguous(), wu[lo:hi].contiguous(), wd[:, lo:hi].contiguous(),
                                       d_ff=ctx.d_ff, tp=ctx.group, tau_x=lt.tau_x, tau_s=lt.tau_s,
                                       options=ctx.options)
    assert full.policies[0] == shard.policies[0] == ctx.options.proxy
    cf, cs = prox.new_counters(), prox.new_counters()
    worst = 0.0
    check = tp_cases.Checks()
    for t in range(8):
        xt = x[t:t + 1]
        a = full.run(xt, return_mask=True, return_s_proxy=True, counters=cf)
        b = shard.run(xt, return_mask=True, return_s_proxy=True, counters=cs)
        check(torch.equal(b.s_proxy, a.s_proxy[lo:hi]), f"token {t}: s~ differs")
        check(torch.equal(b.mask, a.mask[lo // 32:hi // 32]), f"token {t}: the channel mask differs")
        sel = reference.mask_words_to_bool(a.mask, ctx.d_ff)
        lt = shard.layer_tensors()
        p_abs = pd.all_reduce_float64(torch.ops.prox.sparse_ffn(xt, lt.tensors(), lt.format_code(), shard.thresholds,
                                                                shard.workspace, shard.act_code,
                                                                shard._options)[0].double().abs(), ctx.group)
        bound = tp_cases.y_bound(ctx, xt, mlp, sel, p_abs, a.y)
        err = (b.y.double() - a.y.double()).abs().reshape(-1)
        check(bool((err <= bound).all()), f"token {t}: y off by {float((err / bound).max()):.2f} x the bound")
        worst = max(worst, float((err / bound).max()))
    c_full, c_shard = cf.tolist(), cs.tolist()
    check(c_shard[0] == c_full[0] and c_shard[1] == c_full[1], (c_shard, c_full))  # calls, kept inputs
    sel = pd.all_reduce_float64(torch.tensor([float(c_shard[2])]), ctx.group)
    check(int(sel.item()) == c_full[2], "the ranks' selected channels must add up to the full layer's")
    check.done()
    return {"worst_err_over_bound": worst, "selected": c_full[2]}


def case_nccl_communicator(ctx: tp_cases.Ctx) -> dict:
    """The ctypes NCCL communicator: the NCCL torch loaded, sums right for every dtype a step uses, refuses what
    it cannot reduce, and 64 all-reduces captured in one CUDA graph replay right (values changed between
    replays) with their cost per call."""
    comm = pd.communicator(ctx.group, ctx.device)
    assert isinstance(comm, pd.NcclCommunicator) and comm is pd.communicator(ctx.group, ctx.device)  # one, shared
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int64):
        t = torch.full((5,), ctx.rank + 1, dtype=dt, device=ctx.device)
        assert comm.all_reduce_(t) is t
        assert bool((t == sum(range(1, ctx.world + 1))).all()), dt
    for bad in (torch.zeros(4, dtype=torch.int16, device=ctx.device), torch.zeros(4, 4, device=ctx.device).t(),
                torch.zeros(4)):
        try:
            comm.all_reduce_(bad)
            raise AssertionError("accepted a tensor it cannot reduce")
        except ValueError:
            pass
    src = torch.zeros(64, 1, ctx.d_model, dtype=torch.bfloat16, device=ctx.device)
    bufs = torch.empty_like(src)

    def body():
        for i in range(64):
            bufs[i].copy_(src[i])
            comm.all_reduce_(bufs[i])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        body()
    small = (torch.arange(64, device=ctx.device) % 8).view(64, 1, 1)  # sums stay integers bf16 holds exactly
    for k in range(3):
        src.copy_(small.to(torch.bfloat16) * (ctx.rank + 1 + k))
        g.replay()
        torch.cuda.synchronize()
        want = small.float() * sum(r + 1 + k for r in range(ctx.world))
        assert torch.equal(bufs.float(), want.expand_as(bufs)), f"replay {k}"
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier(group=ctx.group)
    torch.cuda.synchronize()
    a.record()
    for _ in range(20):
        g.replay()
    b.record()
    b.synchronize()
    del g
    return {"nccl": comm.version, "graph_us_per_copy_allreduce": a.elapsed_time(b) * 1e3 / (20 * 64)}


GPU_CASES = {"planned_masks": case_planned_masks, "nccl_communicator": case_nccl_communicator}


def main() -> int:
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)  # NVLink multicast off (scripts/tp_tests.sh sets them too)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    tmp = [tempfile.mkdtemp(prefix="prox-tp-") if rank == 0 else None]
    dist.broadcast_object_list(tmp, src=0)
    t0 = time.time()
    mine = {}
    tp_cases.CASES.update({k: v for k, v in GPU_CASES.items()})
    for dtype in (torch.bfloat16, torch.float16):
        ctx = tp_cases.Ctx(rank, world, dev, dtype, tmp[0], d_model=512, d_ff=2048, tokens=32, group=group,
                           options=prox.PlanOptions(proxy=0))
        names = [n for n in tp_cases.CASES if dtype == torch.bfloat16 or n not in ("bad_inputs", "decode_step",
                                                                                   "nccl_communicator")]
        for name, r in tp_cases.run_cases(ctx, names).items():
            mine[f"{name}/{str(dtype)[6:]}"] = r
    every = [None] * world
    dist.all_gather_object(every, mine)
    ok = True
    if rank == 0:
        for key in mine:
            rows = [e[key] for e in every]
            bad = [(r, row["error"]) for r, row in enumerate(rows) if not row["ok"]]
            if key.startswith("bad_inputs") and not bad:
                ctx0 = tp_cases.Ctx(0, world, dev, torch.bfloat16, "", group=group)
                fails = tp_cases.check_bad_inputs(ctx0, [row["data"] for row in rows])
                bad = [(-1, "\n".join(fails))] if fails else []
            ok &= not bad
            data = "" if bad or key.startswith("bad") or not rows[0]["data"] else f" {rows[0]['data']}"
            print(f"{'PASS' if not bad else 'FAIL'} {key} [{max(row['seconds'] for row in rows):.1f} s]{data}",
                  flush=True)
            for r, err in bad:
                print(f"  rank {r}:\n{err}", flush=True)
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0)
    torch.cuda.synchronize()
    dist.barrier()
    pd.close()
    dist.destroy_process_group()
    if rank == 0:
        print(f"{'ALL PASSED' if verdict[0] else 'FAILED'} on {world} GPUs ({torch.cuda.get_device_name()}) in "
              f"{time.time() - t0:.0f} s", flush=True)
    return 0 if verdict[0] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(2)
