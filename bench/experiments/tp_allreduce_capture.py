# SPDX-License-Identifier: Apache-2.0
"""Probe: can a decode step's all-reduce ([1, d_model] bf16, one process per GPU, NCCL) be captured in a CUDA
graph, and what does one cost per call, eager and replayed? (issue 41's first step)

    NCCL_NVLS_ENABLE=0 timeout 120 torchrun --nproc-per-node 2 bench/experiments/tp_allreduce_capture.py \
        --mode torch-global|torch-thread|pynccl [--n 5120] [--calls 128] [--json out.json]

Modes:
- torch-global: torch.distributed.all_reduce, warmed up on a side stream, captured with the default
  (global) capture error mode;
- torch-thread: the same, captured with capture_error_mode="thread_local" (other threads' CUDA calls, such as
  NCCL's proxy or torch's watchdog, do not invalidate the capture);
- pynccl: libnccl called directly through ctypes (ncclCommInitRank, ncclAllReduce on the current stream), the
  way vLLM's PyNcclCommunicator captures its collectives; the unique id travels through torch.distributed.
  The binding is the package's: prox.distributed.NcclCommunicator (prox must be importable).

Each call all-reduces a fresh copy of x = rank + 1, so every element must equal sum_r (r + 1); each rank
checks that after the eager calls and after the first replay.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["torch-global", "torch-thread", "pynccl"], required=True)
    ap.add_argument("--n", type=int, default=5120)
    ap.add_argument("--calls", type=int, default=128)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    say = (lambda *m: print(f"[{a.mode}]", *m, flush=True)) if rank == 0 else (lambda *m: None)

    def phase(name: str) -> None:  # every rank: where a hang happens
        print(f"[{a.mode}] rank {rank}: {name}", file=sys.stderr, flush=True)

    if a.mode == "pynccl":
        from prox.distributed import NcclCommunicator
        comm = NcclCommunicator(None, torch.device("cuda", rank))
        reduce = comm.all_reduce_
    else:
        reduce = dist.all_reduce
    want = float(sum(r + 1 for r in range(world)))
    src = torch.full((1, a.n), float(rank + 1), dtype=torch.bfloat16, device="cuda")
    bufs = [torch.empty_like(src) for _ in range(a.calls)]

    def step():
        for b in bufs:
            b.copy_(src)
            reduce(b)

    # warm-up on a side stream (communicator set up, lazy init done) as torch.cuda.graphs recommends
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    ok_eager = all(bool((b == want).all()) for b in bufs)

    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    ev0.record()
    for _ in range(10):
        step()
    ev1.record()
    torch.cuda.synchronize()
    eager_us = ev0.elapsed_time(ev1) * 1e3 / (10 * a.calls)
    say(f"eager: {eager_us:.2f} us per copy+all-reduce, sums ok: {ok_eager}")

    g = torch.cuda.CUDAGraph()
    t0 = time.time()
    kw = {"capture_error_mode": "thread_local"} if a.mode in ("torch-thread", "pynccl") else {}
    with torch.cuda.graph(g, **kw):
        step()
    torch.cuda.synchronize()
    say(f"captured {a.calls} all-reduces in {time.time() - t0:.2f} s")
    for b in bufs:
        b.zero_()
    dist.barrier()
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    ok_graph = all(bool((b == want).all()) for b in bufs)
    dist.barrier()
    torch.cuda.synchronize()
    ev0.record()
    for _ in range(a.replays):
        g.replay()
    ev1.record()
    torch.cuda.synchronize()
    graph_us = ev0.elapsed_time(ev1) * 1e3 / (a.replays * a.calls)
    phase("replays done")
    # the copies alone, for the all-reduce's own share
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        for b in bufs:
            b.copy_(src)
    g2.replay()
    torch.cuda.synchronize()
    ev0.record()
    for _ in range(a.replays):
        g2.replay()
    ev1.record()
    torch.cuda.synchronize()
    copy_us = ev0.elapsed_time(ev1) * 1e3 / (a.replays * a.calls)
    say(f"graph: {graph_us:.2f} us per copy+all-reduce (copy alone {copy_us:.2f} us), sums ok: {ok_graph}")
    phase("copy graph done")
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"mode": a.mode, "world": world, "n": a.n, "dtype": "bf16", "calls": a.calls,
                       "eager_us": eager_us, "graph_us": graph_us, "copy_us": copy_us, "ok_eager": ok_eager,
                       "ok_graph": ok_graph, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}, f)
    phase("barrier")
    dist.barrier()
    phase("destroy")
    dist.destroy_process_group()
    phase("exit")


if __name__ == "__main__":
    main()
