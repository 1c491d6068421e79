# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism over d_ff (docs/api.md, "Tensor parallelism over d_ff"): one process per GPU, each rank
holding d_ff / TP channels of every MLP, the replicated x in, one all-reduce of y out.

Rank r holds the channels [r d_ff/TP, (r + 1) d_ff/TP) (vLLM's column-parallel layout): those rows of W_gate
and W_up, their INT4 proxies (packed from the shard: the quantization is per channel, so they are exactly the
full pack's rows), and the same rows of W_down^T (the columns of the row-parallel W_down). Stage 1 on a shard
selects exactly the channels the full layer selects among its own (s~_j depends on channel j's proxy rows and
the replicated x alone), so Prox adds no communication: y is a partial sum, all-reduced once, the same single
all-reduce a dense tensor-parallel MLP needs.

    import torch.distributed as dist, prox
    dist.init_process_group("nccl")                                   # torchrun, one process per GPU
    torch.cuda.set_device(dist.get_rank())
    prox.distributed.shard_mlps(model, dist.group.WORLD)              # a full model on every rank -> its shards
    sp = prox.distributed.sparse_mlp_from_shards(gate_up=w_gu, down=w_down, d_ff=25600, tp=dist.group.WORLD)
    cfg = prox.sparsify(model, 0.5, calib_ids)                        # every rank: TP=1's thresholds, exactly

The reduce lives in one place: the communicator, any object with ``all_reduce_(tensor)`` (an in-place sum over
the ranks that returns the tensor), or a plain callable ``f(tensor)`` doing the same. ``tp=`` takes either a
torch.distributed process group (the default communicator for its tensors is chosen: NcclCommunicator for
CUDA, TorchCommunicator otherwise) or such a communicator (its ``group`` attribute, if any, names the process
group for the setup checks; else the default group). An engine passes its own collective, e.g. vLLM's
``tensor_model_parallel_all_reduce`` wrapped to write in place, or swaps it later with set_communicator().

Setup (sharding, threshold checks, calibration) talks through torch.distributed on the group; the decode hot
path talks through the communicator only. Setup errors are agreed on: every rank runs its checks, the ranks
exchange their outcomes in one small all-gather, and every rank raises the same error when any rank failed,
so no rank is left waiting in a collective.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import formats
from .calibration import Calibrator
from .nccl import NCCL_DTYPES, NCCL_IN_PROGRESS, NCCL_SUM, NcclLibrary, find_libnccl
from .nn import SparseMLP, detect_act, find_mlps, is_gated_mlp, model_pool, set_submodule
from .planned import PlannedFfn
from .thresholds import matrix_fingerprint

__all__ = [
    "NcclCommunicator", "NoOpCommunicator", "TorchCommunicator", "CallableCommunicator", "TPState", "agree",
    "agreed", "all_merge", "channel_range", "check_same_thresholds", "close", "communicator", "find_libnccl",
    "fingerprints", "planned_ffn_from_shards", "set_communicator", "shard_mlp", "shard_mlps",
    "sparse_mlp_from_shards",
]

# ---------------------------------------------------------------- setup collectives and error agreement


def _require_dist() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("prox: tensor parallelism needs torch.distributed initialized "
                           "(dist.init_process_group): setup checks and calibration run through its process group")


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _coll_device(group) -> torch.device:
    """Where tensors for the group's own collectives live: CPU for gloo (or a mixed cpu:gloo backend), the
    current CUDA device for NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_objects(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _message(exc: BaseException) -> str:
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)  # str(KeyError) quotes it
    return msg[len("prox: "):] if msg.startswith("prox: ") else msg


def agree(group, error: Optional[BaseException], info=None) -> list:
    """Every rank's (info, error) in rank order, through one all-gather. When any rank failed, every rank raises
    the same error, naming the failing ranks and their messages (a TypeError when the first failure was one,
    else a ValueError), chained to its own error where it had one."""
    rows = _gather_objects((info, None if error is None else (type(error).__name__, _message(error))), group)
    failed = [(r, e) for r, (_, e) in enumerate(rows) if e is not None]
    if failed:
        text = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in failed)
        cls = TypeError if failed[0][1][0] == "TypeError" else ValueError
        raise cls(f"prox: tensor-parallel setup failed on {len(failed)} of {len(rows)} ranks: {text}") from error
    return [i for i, _ in rows]


@contextlib.contextmanager
def agreed(group, enabled: bool = True):
    """Run a block on every rank of the group and agree on its outcome: when it raises on any rank, every rank
    raises (agree()). Nothing in the block may itself be a collective that a failed rank would skip."""
    if not enabled:
        yield
        return
    err = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (every error is agreed on, then raised on every rank)
        err = exc
    agree(group, err)


def _all_gather_tensor(t: torch.Tensor, group) -> list:
    """Every rank's 1-D tensor (lengths may differ), in rank order, on t's device."""
    dev = _coll_device(group)
    world = dist.get_world_size(group)
    n = torch.tensor([t.numel()], dtype=torch.int64, device=dev)
    ns = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(ns, n, group=group)
    sizes = [int(v) for v in ns]
    buf = torch.zeros(max(max(sizes), 1), dtype=t.dtype, device=dev)
    buf[:t.numel()] = t.reshape(-1).to(dev)
    outs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return [o[:k].to(t.device) for o, k in zip(outs, sizes)]


def all_reduce_float64(t: torch.Tensor, group) -> torch.Tensor:
    """sum over the ranks of t, in float64, through the group (setup and calibration; not the hot path)."""
    s = t.detach().to(device=_coll_device(group), dtype=torch.float64).contiguous()
    dist.all_reduce(s, group=group)
    return s.to(t.device)


# ---------------------------------------------------------------- communicators


class TorchCommunicator:
    """all_reduce_ through torch.distributed (dist.all_reduce on the group): eager. With gloo it runs on CPU
    tensors (the CPU tests). Not for CUDA-graph capture: torch.distributed's NCCL process group was seen to hang
    after a graph that captured its collectives (bench/experiments/tp_allreduce_capture.py)."""

    def __init__(self, group=None):
        _require_dist()
        self.group = group
        self.rank, self.world_size = _world(group)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t


class NoOpCommunicator:
    """all_reduce_ that does nothing: a TP=1 group, and the benchmark's step "without all-reduces" (each rank
    then carries its partial sum on: the same kernels and shapes, not the same numbers)."""

    group = None

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t


class CallableCommunicator:
    """A plain callable f(tensor) that sums the tensor over the ranks in place, as a communicator."""

    def __init__(self, fn, group=None):
        self.fn, self.group = fn, group

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        self.fn(t)
        return t


class NcclCommunicator:
    """An NCCL communicator of its own, called through ctypes (libnccl.so.2: find_libnccl()), as vLLM's
    PyNcclCommunicator does. ``all_reduce_`` is one ncclAllReduce (sum, in place) on the current stream, with no
    other CUDA call: it can be captured in a CUDA graph. The unique id travels through the torch.distributed
    group (gloo or NCCL); creating it is collective over the group. One serves every layer on a device
    (NcclCommunicator.for_group). Warm it up eagerly before capture (the constructor runs one all-reduce and
    checks its sum), and close() it before destroying the process group."""

    _cache: dict = {}

    def __init__(self, group=None, device=None, library: Optional[str] = None):
        _require_dist()
        self.group = group
        self.rank, self.world_size = _world(group)
        self.comm = None
        with agreed(group):
            self.device = _indexed("cuda" if device is None else device)
            if self.device.type != "cuda" or self.device.index is None:
                raise ValueError(f"prox: NcclCommunicator needs a CUDA device with an index, got {self.device}")
            self.lib = NcclLibrary.get(library)
            uid = self.lib.unique_id() if self.rank == 0 else bytes(128)
        t = torch.tensor(list(uid), dtype=torch.uint8, device=_coll_device(group))
        dist.broadcast(t, src=dist.get_process_group_ranks(group or dist.group.WORLD)[0], group=group)
        uid = bytes(t.cpu().tolist())
        with torch.cuda.device(self.device):
            self.comm = self.lib.comm_init_rank(self.world_size, uid, self.rank)
            self._ptr = self.comm.value
            probe = torch.ones(1, dtype=torch.float32, device=self.device)
            self.all_reduce_(probe)  # eager warm-up: connections made outside any capture
            ok = float(probe.item()) == float(self.world_size)
        with agreed(group):
            if not ok:
                raise RuntimeError(f"prox: NCCL warm-up all-reduce gave {float(probe.item())}, "
                                   f"expected {self.world_size}")

    @classmethod
    def for_group(cls, group, device: torch.device) -> "NcclCommunicator":
        """The communicator of (group, device), made on first use (collectively) and shared by every layer."""
        device = _indexed(device)
        key = (group if group is not None else dist.group.WORLD, str(device))
        comm = cls._cache.get(key)
        if comm is None or comm.comm is None:
            comm = cls._cache[key] = cls(group, device)
        return comm

    @property
    def version(self) -> str:
        return self.lib.version()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dt = NCCL_DTYPES.get(t.dtype)
        if dt is None or t.device != self.device or not t.is_contiguous():
            raise ValueError(f"prox: NcclCommunicator.all_reduce_ takes a contiguous tensor of "
                             f"{sorted(str(d) for d in NCCL_DTYPES)} on {self.device} "
                             f"(got {t.dtype} on {t.device}, contiguous: {t.is_contiguous()})")
        if self.comm is None:
            raise RuntimeError("prox: this NcclCommunicator is closed")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        r = self.lib.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), dt, NCCL_SUM, self._ptr, stream)
        if r != 0 and r != NCCL_IN_PROGRESS:
            self.lib.check(r, "ncclAllReduce")
        return t

    def close(self) -> None:
        """Destroy the NCCL communicator (after the graphs that captured it are gone and the work is done)."""
        if self.comm is not None:
            torch.cuda.synchronize(self.device)
            self.lib.comm_destroy(self.comm)
            self.comm = None
        for k in [k for k, v in NcclCommunicator._cache.items() if v is self]:
            del NcclCommunicator._cache[k]


def close() -> None:
    """Close every NcclCommunicator prox made (call before dist.destroy_process_group())."""
    for comm in list(NcclCommunicator._cache.values()):
        comm.close()


def _indexed(device) -> torch.device:
    """A device with its index (torch.device("cuda") names the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def group_of(tp):
    """The process group for setup collectives: tp itself when it is a group, else its ``group`` attribute,
    else None (the default group)."""
    if isinstance(tp, dist.ProcessGroup):
        return tp
    return getattr(tp, "group", None)


def _check_tp_arg(tp) -> None:
    if isinstance(tp, dist.ProcessGroup) or callable(getattr(tp, "all_reduce_", None)) or callable(tp):
        return
    raise TypeError(f"prox: tp must be a torch.distributed ProcessGroup, an object with all_reduce_(tensor), or a "
                    f"callable that sums a tensor over the ranks in place; got {type(tp).__name__}")


def communicator(tp, device: torch.device):
    """The communicator behind a ``tp=`` argument: a process group gets the default one for tensors on
    ``device`` (NcclCommunicator on CUDA, TorchCommunicator elsewhere; nothing to reduce on a group of one);
    an object with all_reduce_ is used as it is; a callable is wrapped."""
    if isinstance(tp, dist.ProcessGroup):
        if dist.get_world_size(tp) == 1:
            return NoOpCommunicator()
        if torch.device(device).type == "cuda":
            return NcclCommunicator.for_group(tp, _indexed(device))
        return TorchCommunicator(tp)
    if callable(getattr(tp, "all_reduce_", None)):
        return tp
    _check_tp_arg(tp)
    return CallableCommunicator(tp, group_of(tp))


# ---------------------------------------------------------------- the per-layer state


@dataclass
class TPState:
    """What a sharded layer (SparseMLP or PlannedFfn with tp=...) knows of its group."""

    comm: object  #: all_reduce_(tensor): the hot path's reduce
    group: object  #: torch.distributed group of the setup checks and calibration (None: the default group)
    rank: int
    world_size: int
    d_ff: int  #: the full layer's d_ff (the thresholds file records it)
    lo: int  #: this rank's first channel: it holds [lo, lo + d_ff / world_size)

    @property
    def local_d_ff(self) -> int:
        return self.d_ff // self.world_size

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        self.comm.all_reduce_(t)
        return t

    def agreed(self):
        """agreed() on this layer's group: a block whose failure on any rank raises on every rank."""
        return agreed(self.group)

    def check_replicated(self, value: float, what: str) -> None:
        """value (a statistic of the replicated x) is the same on every rank; raises on every rank otherwise."""
        check_replicated(value, self.group, what)

    def merge(self, cal: Calibrator) -> None:
        """Merge every rank's calibrator into each (all_merge): calibration's cross-rank reservoir."""
        all_merge(cal, self.group)

    def fingerprint(self, layer) -> dict:
        """The full layer's fingerprint of a shard (fingerprints(): collective)."""
        return fingerprints([layer])[0]

    def positions(self, first_token: int, tokens: int, device) -> torch.Tensor:
        """Stream positions of this rank's s~ values for tokens [first_token, first_token + tokens): token t's
        channel j sits at t d_ff + j in the full layer's row-major stream (the calibrator's sample priorities)."""
        t = torch.arange(first_token, first_token + tokens, dtype=torch.int64, device=device)
        j = torch.arange(self.lo, self.lo + self.local_d_ff, dtype=torch.int64, device=device)
        return t[:, None] * self.d_ff + j[None, :]


def channel_range(d_ff: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's channels [lo, hi): contiguous blocks of d_ff / world (vLLM's column-parallel split)."""
    _check_tp_shape(d_ff, world)
    n = d_ff // world
    return rank * n, (rank + 1) * n


def _check_tp_shape(d_ff: int, world: int) -> None:
    if not (isinstance(d_ff, int) and d_ff > 0):
        raise ValueError(f"prox: give the full layer's d_ff (a positive int), got {d_ff!r}")
    if d_ff % world or (d_ff // world) % 32:
        raise ValueError(f"prox: d_ff / TP must be a multiple of 32 (prox's d_ff rule applies to each shard); "
                         f"d_ff = {d_ff} over {world} ranks gives {d_ff / world:g}")


def _layer_info(layer) -> dict:
    w = layer.layer_tensors().w_gate
    th = layer.thresholds.detach().float().cpu().tolist()
    return {"d_model": int(layer.d_model), "d_ff_local": int(layer.d_ff), "format": layer.format,
            "dtype": str(w.dtype), "device": w.device.type, "act": layer.act,
            "thresholds": (float(th[0]), float(th[1]))}


def _check_consistent(infos: list, d_ff: int) -> None:
    """The ranks' shards form one layer: the same d_model, weight format, dtype, device kind, activation and
    thresholds, and d_ff / world channels each. Run identically on every rank (the same infos): every rank raises
    the same."""
    world = len(infos)
    first = infos[0]
    for key, what in (("d_model", "d_model"), ("d_ff_local", "channels per shard (gate/up rows)"),
                      ("format", "weight format"), ("dtype", "dtype"), ("device", "device type"),
                      ("act", "activation")):
        vals = [i[key] for i in infos]
        if any(v != vals[0] for v in vals):
            raise ValueError(f"prox: the shards differ across ranks in {what}: "
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals)))
    if first["d_ff_local"] * world != d_ff:
        raise ValueError(f"prox: {world} shards of {first['d_ff_local']} channels do not make d_ff = {d_ff} "
                         f"(the world size and the shard count disagree, or d_ff is not the full layer's)")
    ths = [i["thresholds"] for i in infos]
    if any(t != ths[0] for t in ths):
        raise ValueError("prox: the thresholds differ across ranks: "
                         + ", ".join(f"rank {r}: (tau_x, tau_s) = {t}" for r, t in enumerate(ths)))


def _sharded(tp, d_ff: Optional[int], build):
    """A layer on this rank's shard: build() (the shard's weights and the layer's own checks and derived state, on
    every rank), then one all-gather that agrees on every rank's outcome and checks that the shards form one layer
    (_check_consistent), then the communicator. Returns the layer with its TPState (``tp``)."""
    _require_dist()
    _require_tp(tp)
    group = group_of(tp)
    rank, world = _world(group)
    err, info, layer = None, None, None
    try:
        _check_tp_arg(tp)
        _check_tp_shape(d_ff if not isinstance(d_ff, bool) else None, world)
        layer = build()
        if layer.d_ff != d_ff // world:
            raise ValueError(f"prox: the gate shard has {layer.d_ff} rows, d_ff / TP = {d_ff} / {world} = "
                             f"{d_ff // world} (the world size and the shard count disagree)")
        info = _layer_info(layer)
    except Exception as exc:  # noqa: BLE001  (agreed on below, raised on every rank)
        err = exc
    infos = agree(group, err, info)
    _check_consistent(infos, d_ff)
    device = layer.layer_tensors().w_gate.device
    comm = communicator(tp, device)  # collective for a new NcclCommunicator (with its own agreement)
    layer.tp = TPState(comm, group, rank, world, int(d_ff), rank * (d_ff // world))
    return layer


# ---------------------------------------------------------------- sharding helpers


def _require_tp(tp) -> None:
    if tp is None:
        raise ValueError("prox: give tp: the process group (e.g. dist.group.WORLD) or a communicator")


def _linear_of(m, name: str) -> nn.Module:
    """A shard given as a tensor (wrapped in an nn.Linear, shared), or as a module with .weight (nn.Linear, an FP8
    linear with its scales, an engine's parallel linear: used as it is); a bias is refused (Prox's MLP has none)."""
    if m is None:
        raise ValueError(f"prox: give {name}")
    if isinstance(m, torch.Tensor):
        return formats.linear_module(m.detach())
    if not isinstance(getattr(m, "weight", None), torch.Tensor):
        raise TypeError(f"prox: {name} must be a tensor or a module with a .weight tensor, got {type(m).__name__}")
    if getattr(m, "bias", None) is not None:
        raise ValueError(f"prox: {name} has a bias; Prox's gated MLP has none")
    lin = formats.of_mlp({name: m})[1][name]
    return m if lin.scales is not None else formats.linear_module(lin.weight)  # scales: the module holds them


def _split_gate_up(gate_up) -> tuple:
    """The gate and up shards of a merged column-parallel weight [2 d_ff / TP, d_model] (a tensor: views; a module:
    its format's cuts, an FP8 module's block scales cut on a block boundary or refused)."""
    lin = _linear_of(gate_up, "gate_up")
    w = lin.weight
    if w.dim() != 2 or w.shape[0] % 2:
        raise ValueError(f"prox: gate_up must be [2 d_ff / TP, d_model], got {tuple(w.shape)}")
    n = w.shape[0] // 2
    if isinstance(gate_up, torch.Tensor):
        return formats.linear_module(w[:n]), formats.linear_module(w[n:])
    fmt, lins = formats.of_mlp({"gate_up": lin})
    return (fmt.cut(lins["gate_up"], "gate_up", rows=(0, n)), fmt.cut(lins["gate_up"], "gate_up", rows=(n, 2 * n)))


def sparse_mlp_from_shards(gate=None, up=None, down=None, *, d_ff: int, tp, gate_up=None, act: str = "silu", **kw):
    """A SparseMLP on this rank's shards as engines lay them out (column-parallel gate/up, row-parallel down).

    Args:
        gate, up: [d_ff / TP, d_model] (tensors, nn.Linear, FP8 linears with their scales, or any module with
            .weight; shared, not copied); or
        gate_up: the merged column-parallel weight [2 d_ff / TP, d_model], this rank's gate rows then its up rows
            (vLLM's MergedColumnParallelLinear); gate and up are views of it (an FP8 module: its cuts).
        down: the row-parallel down weight [d_model, d_ff / TP] (the columns of W_down for this rank's channels).
            It is transposed into W_down^T and dropped unless keep_down=True.
        d_ff: the full layer's d_ff (= d_ff / TP x world size; checked).
        tp: the process group or communicator (module docstring).
        act, **kw: SparseMLP's.
    Every rank must call it; bad input raises on every rank.
    """
    def build():
        if gate_up is not None:
            if gate is not None or up is not None:
                raise ValueError("prox: give gate and up, or gate_up, not both")
            g, u = _split_gate_up(gate_up)
        else:
            g, u = _linear_of(gate, "gate"), _linear_of(up, "up")
        return SparseMLP(g, u, _linear_of(down, "down"), act, **kw)
    return _sharded(tp, d_ff, build)


def shard_mlp(mlp: nn.Module, tp, *, act: Optional[str] = None, **kw):
    """This rank's shard of a full gated MLP (every rank holds the whole module) as a SparseMLP: its channel
    block (channel_range) of W_gate and W_up rows (copied, so the full weights can be freed) and of W_down's
    columns, cut by the weights' format (FP8: with their scales; 128 x 128 block scales only on block boundaries,
    else a ValueError naming the projection, its shape and the cut). Every rank must call it."""
    _require_dist()
    _require_tp(tp)
    group = group_of(tp)
    rank, world = _world(group)
    with agreed(group):
        if not is_gated_mlp(mlp):
            raise TypeError(f"prox: {type(mlp).__name__} is not a gated MLP with gate_proj/up_proj/down_proj "
                            "(bias-free nn.Linear or FP8 linears) and act_fn")
    d_ff = int(mlp.gate_proj.weight.shape[0])

    def build():
        lo, hi = channel_range(d_ff, rank, world)
        fmt, lins = formats.of_mlp({n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})
        with torch.no_grad():
            g = fmt.cut(lins["gate_proj"], "gate_proj", rows=(lo, hi))
            u = fmt.cut(lins["up_proj"], "up_proj", rows=(lo, hi))
            d = fmt.cut(lins["down_proj"], "down_proj", cols=(lo, hi))
        return SparseMLP(g, u, d, act or detect_act(mlp.act_fn), **kw)
    return _sharded(tp, d_ff, build)


def shard_mlps(model: nn.Module, tp, **kw) -> list:
    """Replace every gated MLP of a model (whole on every rank) by this rank's shard (shard_mlp). The rest of the
    model stays replicated: each rank runs it whole, and the MLPs' all-reduce makes their outputs whole again.
    Returns the names. Every rank must call it."""
    if kw.get("workspace") is None and kw.get("workspace_pool") is None:  # the model's own, as swap_mlps()
        kw["workspace_pool"] = model_pool(model)
    names = []
    for name, m in find_mlps(model):
        if not isinstance(m, SparseMLP):
            set_submodule(model, name, shard_mlp(m, tp, **kw))
            names.append(name)
    return names


def planned_ffn_from_shards(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: Optional[torch.Tensor] = None, *,
                            d_ff: int, tp, **kw):
    """A PlannedFfn on this rank's shards: w_gate, w_up [d_ff / TP, d_model], w_down the row-parallel
    [d_model, d_ff / TP] (or w_down_t=), FP8 weights with their scales (PlannedFfn's keywords); run() all-reduces y
    through the communicator. Every rank must call it."""
    return _sharded(tp, d_ff, lambda: PlannedFfn(w_gate, w_up, w_down, **kw))


def set_communicator(modules, comm) -> list:
    """Give every sharded layer among ``modules`` (a model, or an iterable of SparseMLP / PlannedFfn) another
    communicator (any object with all_reduce_, or a callable); returns the previous ones, in order, for
    restoring (set_communicator(modules, old) with the list)."""
    layers = _tp_layers(modules)
    olds = [m.tp.comm for m in layers]
    comms = comm if isinstance(comm, list) else [comm] * len(layers)
    for m, c in zip(layers, comms):
        m.tp.comm = c if callable(getattr(c, "all_reduce_", None)) else CallableCommunicator(c, m.tp.group)
    return olds


def _tp_layers(modules) -> list:
    if isinstance(modules, nn.Module):
        modules = modules.modules()
    return [m for m in modules if getattr(m, "tp", None) is not None]


# ---------------------------------------------------------------- thresholds and calibration


def check_same_thresholds(modules) -> None:
    """Every sharded layer among ``modules`` holds the same (tau_x, tau_s) on every rank: one all-gather for all
    of them (reads the device: setup, not the hot path). Raises on every rank when they differ."""
    layers = _tp_layers(modules)
    if not layers:
        return
    group = layers[0].tp.group
    mine = torch.stack([m.thresholds.detach().float().reshape(2).cpu() for m in layers]).tolist()
    rows = _gather_objects(mine, group)
    for li in range(len(layers)):
        vals = [tuple(r[li]) if li < len(r) else None for r in rows]
        if any(v != vals[0] for v in vals):
            raise ValueError(f"prox: the thresholds of sharded layer {li} differ across ranks: "
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals)))


def check_replicated(value: float, group, what: str) -> None:
    """value is the same on every rank (a statistic of the replicated x); raises on every rank otherwise."""
    vals = _gather_objects(float(value), group)
    if any(not (v == vals[0] or (math.isnan(v) and math.isnan(vals[0]))) for v in vals):
        raise ValueError(f"prox: {what} differs across ranks ("
                         + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals))
                         + "): the layer's input x must be the same on every rank")


def all_merge(cal, group) -> None:
    """Merge every rank's Calibrator into each (Calibrator.merge): afterwards every rank holds the reservoir that
    one calibrator fed all the ranks' samples would hold. One all-gather of at most ``capacity`` (key, value)
    pairs per rank, and one of the counts. The ranks' samples must have disjoint stream positions (TPState.
    positions)."""
    rank, world = _world(group)
    dev = cal._vals.device if cal._vals is not None else torch.device("cpu")
    keys = cal._keys if cal._keys is not None else torch.empty(0, dtype=torch.int64, device=dev)
    vals = cal._vals if cal._vals is not None else torch.empty(0, dtype=torch.float32, device=dev)
    all_keys = _all_gather_tensor(keys, group)
    all_vals = _all_gather_tensor(vals, group)
    counts = _all_gather_tensor(torch.tensor([cal.seen, cal.finite, cal.nan, cal.inf], dtype=torch.int64), group)
    others = []
    for r in range(world):
        if r == rank:
            continue
        o = Calibrator(cal.capacity, cal.seed)
        o._keys, o._vals = (all_keys[r], all_vals[r]) if all_keys[r].numel() else (None, None)
        o.seen, o.finite, o.nan, o.inf = (int(v) for v in counts[r].tolist())
        others.append(o)
    cal.merge(others)


def _partial_fingerprint(m) -> tuple:
    """A shard's part of its full layer's fingerprint (prox.thresholds.layer_fingerprint's numbers for W_gate,
    W_up and W_down in nn.Linear layout, as the format fingerprints them, and as matrix_fingerprint gives them for a
    block): (dtype name, float64 [3, 2 + S] on the device), kept per weight version like SparseMLP's own."""
    tp = m.tp
    key = (m._weight_versions(), m.down_t.data_ptr())
    cached = getattr(m, "_tp_fingerprint", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        dtype, wg, wu, wd = m.fingerprint_matrices()
        part = torch.stack([
            matrix_fingerprint(wg, (tp.d_ff, m.d_model), (tp.lo, 0), as_tensor=True),
            matrix_fingerprint(wu, (tp.d_ff, m.d_model), (tp.lo, 0), as_tensor=True),
            matrix_fingerprint(wd, (m.d_model, tp.d_ff), (0, tp.lo), as_tensor=True)])
    m._tp_fingerprint = (key, (dtype, part))
    return dtype, part


def fingerprints(layers) -> list:
    """The full layers' weight fingerprints (prox.thresholds.layer_fingerprint's format) of sharded SparseMLPs,
    computed from the shards: each rank's block sums and its samples of the full matrices (0.0 where another
    rank holds the position), summed over the ranks in one float64 all-reduce for all the layers. The sums
    equal the full layer's up to float64 rounding (fingerprint_mismatch allows 1e-9 of the absolute sum), and
    the samples exactly, so a TP-1 record checks a TP-N model and the reverse. Collective: every rank calls it
    with its shards of the same layers (an empty list: nothing, no collective)."""
    layers = list(layers)
    if not layers:
        return []
    group = layers[0].tp.group
    parts = None
    with agreed(group):
        parts = [_partial_fingerprint(m) for m in layers]
    total = all_reduce_float64(torch.stack([p.to(layers[0].down_t.device) for _, p in parts]), group).cpu().tolist()
    keys = ("gate", "up", "down")
    return [{"dtype": dtype, **{k: {"sum": v[0], "abs_sum": v[1], "samples": v[2:]} for k, v in zip(keys, rows)}}
            for (dtype, _), rows in zip(parts, total)]
