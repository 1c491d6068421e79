# SPDX-License-Identifier: Apache-2.0
"""prox's torch custom ops (namespace ``torch.ops.prox``): loading the extension, the fake (meta)
kernels that let torch.compile trace the ops, and thin Python wrappers.

The CUDA kernels are in csrc/bindings.cpp. Every op validates its inputs (dtype, device, shape,
contiguity, alignment) before launching anything and raises TypeError / ValueError with the tensor's
name; ``sparse_ffn`` allocates only its outputs (torch's caching allocator, which is graph-safe),
never synchronizes, and runs on the current stream, so it can be captured in a CUDA graph.

``sparse_ffn`` runs one token (x [d_model] or [1, d_model]: SparseFfn::run) or a batch of 2 to
MAX_TOKENS tokens (x [B, d_model]: SparseFfn::run_batch, each token what batch 1 would give it within
rounding); a batch needs a workspace of workspace_bytes(d_model, d_ff, max_tokens=B) bytes or more.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch

_IMPORT_ERROR: Optional[BaseException] = None
try:
    from . import _C  # noqa: F401  (registers torch.ops.prox.*)
except (ImportError, OSError) as exc:  # no compiled extension, or no CUDA runtime to load it with
    _IMPORT_ERROR = exc


def available() -> bool:
    """Whether the compiled extension (and with it the CUDA ops) could be loaded."""
    return _IMPORT_ERROR is None


def _require() -> None:
    if _IMPORT_ERROR is not None:
        raise RuntimeError(
            "prox: the compiled extension prox._C could not be loaded "
            f"({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}); install with "
            "`pip install ./python --no-build-isolation` against this torch"
        ) from _IMPORT_ERROR


#: Most tokens one sparse_ffn call runs (prox::kMaxBatchTokens).
MAX_TOKENS = 8

#: Activation codes of the ops (SparseFfn's Act template argument).
ACTS = {"silu": 0, "gelu_tanh": 1}


def act_code(act: str | int) -> int:
    if isinstance(act, int):
        if act not in (0, 1):
            raise ValueError(f"prox: act must be 0 (silu) or 1 (gelu_tanh), got {act}")
        return act
    try:
        return ACTS[act]
    except KeyError:
        raise ValueError(f"prox: act must be one of {sorted(ACTS)}, got {act!r}") from None


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """SparseFfn::PlanOptions (include/prox/sparse_ffn.cuh). Policy indices -1 = the default."""

    pdl: bool = True
    cluster: bool = False
    fuse_stage2: bool = True
    spread: bool = True
    cooperative: bool = True
    check_workspace: bool = True
    proxy: int = -1
    glu: int = -1
    down: int = -1
    glu_down: int = -1

    def encode(self) -> list[int]:
        flags = (1 if self.pdl else 0) | (2 if self.cluster else 0) | (4 if self.fuse_stage2 else 0)
        flags |= (8 if self.spread else 0) | (16 if self.cooperative else 0) | (32 if self.check_workspace else 0)
        return [flags, self.proxy, self.glu, self.down, self.glu_down]


# ---------------------------------------------------------------- fake kernels

if available():

    @torch.library.register_fake("prox::pack_int4")
    def _pack_int4_fake(w):
        d_ff, d_model = w.shape
        return (w.new_empty((d_model, d_ff // 8), dtype=torch.int32), w.new_empty((d_ff,), dtype=torch.float32))

    @torch.library.register_fake("prox::transpose")
    def _transpose_fake(w):
        return w.new_empty((w.shape[1], w.shape[0]))

    @torch.library.register_fake("prox::sparse_ffn")
    def _sparse_ffn_fake(x, w_gate, w_up, w_down_t, proxy_gate, scale_gate, proxy_up, scale_up, thresholds,
                         workspace, act, options, return_mask=False, return_s_proxy=False, return_s=False,
                         counters=None):
        d_ff = w_gate.shape[0]
        # A batch ([B, d_model], B >= 2) gives each output a leading B; one token keeps batch-1 shapes.
        lead = (x.shape[0],) if x.dim() == 2 and x.shape[0] != 1 else ()

        def out(wanted, n, dtype):
            return w_gate.new_empty(lead + (n,) if wanted else (0,), dtype=dtype)

        y = torch.empty_like(x)
        return (y, out(return_mask, d_ff // 32, torch.int32), out(return_s_proxy, d_ff, torch.float32),
                out(return_s, d_ff, torch.float32))

    @torch.library.register_fake("prox::proxy_values")
    def _proxy_values_fake(x, w_gate, w_up, w_down_t, proxy_gate, scale_gate, proxy_up, scale_up, thresholds,
                           workspace, act, options):
        d_ff = w_gate.shape[0]
        shape = (d_ff,) if x.dim() == 1 else (x.shape[0], d_ff)
        return x.new_empty(shape, dtype=torch.float32)

    @torch.library.register_fake("prox::initialize_workspace")
    def _initialize_workspace_fake(workspace):
        return None


# ---------------------------------------------------------------- wrappers


def workspace_bytes(d_model: int, d_ff: int, max_tokens: int = 1) -> int:
    """Bytes of workspace a layer of this shape needs for calls of up to ``max_tokens`` tokens (1..MAX_TOKENS;
    the same for fp16/bf16, SiLU/GeLU, any device). It grows with max_tokens: a batch holds every token's
    mask and s, and the batched kernels' split-K partials."""
    _require()
    return int(torch.ops.prox.workspace_bytes(d_model, d_ff, max_tokens))


@functools.lru_cache(maxsize=None)
def _workspace_sizes(d_model: int, d_ff: int) -> tuple[int, ...]:
    return tuple(workspace_bytes(d_model, d_ff, m) for m in range(1, MAX_TOKENS + 1))


def workspace_tokens(d_model: int, d_ff: int, nbytes: int) -> int:
    """The most tokens one sparse_ffn call of a (d_model, d_ff) layer can run with a workspace of ``nbytes``
    (0: not even one). A batch runs the plan of this many tokens (one plan serves every batch size the
    workspace holds), so it is the ``max_tokens`` to give plan_ffn before capturing batched calls."""
    return sum(1 for b in _workspace_sizes(d_model, d_ff) if b <= nbytes)


def new_workspace(d_model: int, d_ff: int, device: torch.device | str = "cuda", *,
                  max_tokens: int = 1) -> torch.Tensor:
    """A workspace for layers of shape (d_model, d_ff) and calls of up to ``max_tokens`` tokens, initialized
    (asynchronously, on the current stream). One workspace serves every layer of that shape that runs on one
    stream."""
    ws = torch.empty(workspace_bytes(d_model, d_ff, max_tokens), dtype=torch.uint8, device=device)
    initialize_workspace(ws)
    return ws


def initialize_workspace(workspace: torch.Tensor) -> None:
    """Zero a workspace and write its header (two memsets on the current stream; capturable)."""
    _require()
    torch.ops.prox.initialize_workspace(workspace)


def workspace_dirty(workspace: torch.Tensor) -> bool:
    """Whether a kernel found this workspace not initialized since its last initialization (the runs it
    flagged were exact-dense). Synchronizes the current stream: not for the hot path."""
    _require()
    return bool(torch.ops.prox.workspace_dirty(workspace))


def pack_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 proxy of an nn.Linear weight [d_ff, d_model] (fp16/bf16): (packed [d_model, d_ff/8] int32
    holding uint32 words, scales [d_ff] float32), layout v1 (docs/int4-format.md). A CUDA weight is packed on
    the device (int4::pack_device), a CPU one by the host packer (int4::pack_host); the two are bit-identical.
    Offline: on CUDA it synchronizes the stream (to reject NaN/Inf weights)."""
    _require()
    return torch.ops.prox.pack_int4(w)


def transpose(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> contiguous [cols, rows] on the device (W_down^T from nn.Linear's W_down)."""
    _require()
    return torch.ops.prox.transpose(w)


def write_thresholds(thresholds: torch.Tensor, tau_x: float, tau_s: float) -> None:
    """Write (tau_x, tau_s) into a layer's device float32 [2] thresholds tensor: two fills on the current
    stream (no host sync, no re-plan, seen by graphs already captured)."""
    if not (tau_x >= 0.0 and tau_s >= 0.0):  # NaN fails too
        raise ValueError(f"prox: thresholds must be >= 0, got ({tau_x}, {tau_s})")
    thresholds[0].fill_(float(tau_x))
    thresholds[1].fill_(float(tau_s))


class FfnOutputs(NamedTuple):
    """The op's outputs; for a batch of B >= 2 tokens each has a leading B (one row per token)."""

    y: torch.Tensor
    mask: Optional[torch.Tensor]  #: [d_ff/32] int32: bit j%32 of word j/32 = channel j selected
    s_proxy: Optional[torch.Tensor]  #: [d_ff] float32: Stage 1's s~ of every channel
    s: Optional[torch.Tensor]  #: [d_ff] float32: s_j for selected channels, 0 for the others


def allocate_sparsity_native(e: float) -> tuple[float, float]:
    """prox::allocate_sparsity through the extension (the Python rule is prox.allocation.allocate_sparsity)."""
    _require()
    return tuple(torch.ops.prox.allocate_sparsity(float(e)))


def int4_layout() -> str:
    _require()
    return str(torch.ops.prox.int4_layout())


def plan_cache_size() -> int:
    _require()
    return int(torch.ops.prox.plan_cache_size())


def clear_plan_cache() -> None:
    _require()
    torch.ops.prox.clear_plan_cache()
