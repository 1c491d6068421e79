# SPDX-License-Identifier: Apache-2.0
"""prox's torch custom ops (namespace ``torch.ops.prox``): loading the extension, the fake (meta)
kernels that let torch.compile trace the ops, and thin Python wrappers.

The CUDA kernels are in csrc/bindings.cpp. Every op validates its inputs (dtype, device, shape,
contiguity, alignment) before launching anything and raises TypeError / ValueError with the tensor's
name; ``sparse_ffn`` allocates only its outputs (torch's caching allocator, which is graph-safe),
never synchronizes, and runs on the current stream, so it can be captured in a CUDA graph.

The ops take a layer's tensors as one list, ``layer`` (``LayerTensors.tensors()``: one entry per slot of
LAYER_SLOTS, None where the layer's format has none), and its Stage-2 weight format as a code
(``LayerTensors.format_code()``).

``sparse_ffn`` runs one token (x [d_model] or [1, d_model]: SparseFfn::run) or a batch of 2 to
MAX_TOKENS tokens (x [B, d_model]: SparseFfn::run_batch, each token what batch 1 would give it within
rounding); a batch needs a workspace of workspace_bytes(d_model, d_ff, max_tokens=B) bytes or more.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import sys
import warnings
from typing import NamedTuple, Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _other_builds() -> list:
    """Compiled extensions of other copies of the prox package on sys.path (an installed one, when this
    copy is the source tree python/prox that shadows it)."""
    found = []
    for entry in sys.path:
        d = os.path.join(entry or os.getcwd(), "prox")
        try:
            if os.path.realpath(d) == os.path.realpath(_HERE):
                continue
        except OSError:
            continue
        found += sorted(glob.glob(os.path.join(d, "_C*.so")) + glob.glob(os.path.join(d, "_C*.pyd")))
    return found


def _load() -> tuple[Optional[BaseException], Optional[str]]:
    """Import prox._C (registers torch.ops.prox.*): (the exception, why in words) or (None, None)."""
    import importlib
    import importlib.util
    name = f"{__package__}._C"
    if importlib.util.find_spec(name) is None:
        exc = ModuleNotFoundError(f"No module named {name!r}", name=name)
        others = _other_builds()
        if others:
            return exc, (f"prox was imported from {_HERE}, which has no compiled extension, while a build "
                         f"exists at {others[0]}: this source tree shadows the installed package (run from "
                         "outside python/, or remove it from sys.path)")
        return exc, ("the compiled extension prox._C is not built: install with "
                     "`pip install ./python --no-build-isolation` against this torch")
    try:
        importlib.import_module(name)
        return None, None
    except ImportError as exc:  # an undefined symbol (ABI mismatch), a wrong ELF
        return exc, (f"the compiled extension prox._C exists but could not be loaded ({type(exc).__name__}: "
                     f"{exc}); rebuild it against this torch (`pip install ./python --no-build-isolation`)")
    except OSError as exc:  # a library it needs (the CUDA runtime) could not be loaded
        return exc, (f"the compiled extension prox._C could not be loaded ({type(exc).__name__}: {exc}): a "
                     "library it needs is missing")


_IMPORT_ERROR, _IMPORT_REASON = _load()
if _IMPORT_ERROR is not None and not (isinstance(_IMPORT_ERROR, ModuleNotFoundError) and not _other_builds()):
    # A build that exists but does not load (an ABI or undefined-symbol error, a missing library) or that
    # this copy shadows: say so now; only a package with no build at all is quiet (its pure-Python parts work).
    warnings.warn(f"prox: {_IMPORT_REASON}", RuntimeWarning, stacklevel=2)


def available() -> bool:
    """Whether the compiled extension (and with it the CUDA ops) could be loaded."""
    return _IMPORT_ERROR is None


def import_error() -> Optional[str]:
    """Why the compiled extension is not loaded (None when it is): not built, shadowed by this source tree,
    or built but not loadable, with the import error."""
    return _IMPORT_REASON


def _require() -> None:
    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"prox: {_IMPORT_REASON}") from _IMPORT_ERROR


def _driver_present() -> bool:
    import ctypes
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


@functools.lru_cache(maxsize=None)
def cuda_unavailable_reason() -> Optional[str]:
    """None when torch sees a CUDA GPU; else why not, in words: "no CUDA driver/GPU found" where no driver
    is installed (the CUDA runtime calls that "CUDA driver version is insufficient"), else torch's reason."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if torch.cuda.is_available():
            return None
    if not _driver_present():
        return "no CUDA driver/GPU found (libcuda.so.1 is not installed)"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return "no CUDA GPU found (a driver is installed, but torch sees no device)"


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


#: The plan options' flags in bit order (csrc/ffn_api.h, PROX_EXT_PLAN_FLAGS, is the one definition; with the
#: extension loaded the names are read from it, and a host test checks this copy against it).
PLAN_FLAGS = ("pdl", "cluster", "fuse_stage2", "spread", "cooperative", "check_workspace", "fuse_batch_stage2")


@functools.lru_cache(maxsize=None)
def plan_flag_names() -> tuple:
    """The flags' names in bit order, as the loaded extension decodes them (PLAN_FLAGS without it)."""
    return tuple(torch.ops.prox.plan_flag_names()) if available() else PLAN_FLAGS


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """SparseFfn::PlanOptions (include/prox/sparse_ffn.cuh): its flags, and the policy indices (-1 = the
    default). ``encode()`` is the one encoding the ops take, ``[flags, proxy, glu, down, glu_down]``, bit i of
    flags being the i-th of plan_flag_names().

    ``cooperative=False`` needs ``fuse_stage2=False`` and ``fuse_batch_stage2=False``: a fused Stage 2 waits at
    a grid-wide barrier that only a cooperative launch guarantees to be reachable (every block resident);
    launched otherwise it can hang the GPU, so the combination is refused here and by the op."""

    pdl: bool = True
    cluster: bool = False
    fuse_stage2: bool = True
    spread: bool = True
    cooperative: bool = True
    check_workspace: bool = True
    fuse_batch_stage2: bool = False
    proxy: int = -1
    glu: int = -1
    down: int = -1
    glu_down: int = -1

    def __post_init__(self):
        if (self.fuse_stage2 or self.fuse_batch_stage2) and not self.cooperative:
            raise ValueError("prox: PlanOptions(cooperative=False) needs fuse_stage2=False (and fuse_batch_stage2="
                             "False): a fused Stage 2 waits at a grid-wide barrier, which only a cooperative launch "
                             "makes safe (a non-cooperative grid can hang); pass fuse_stage2=False with "
                             "cooperative=False")
        for name in ("proxy", "glu", "down", "glu_down"):
            v = getattr(self, name)
            if not (isinstance(v, int) and -1 <= v < 64):
                raise ValueError(f"prox: PlanOptions.{name} must be a policy index in [-1, 63], got {v!r}")

    def encode(self) -> list[int]:
        flags = sum(1 << i for i, name in enumerate(plan_flag_names()) if getattr(self, name))
        return [flags, self.proxy, self.glu, self.down, self.glu_down]


# ---------------------------------------------------------------- the layer's tensors

#: The layer's tensor slots in the order of the ops' ``layer`` list (csrc/ffn_api.h, PROX_EXT_LAYER_SLOTS, is the
#: one definition; with the extension loaded the order is read from it, and a host test checks this copy and
#: LayerTensors' fields against it).
LAYER_SLOTS = ("w_gate", "w_up", "w_down_t", "proxy_gate", "scale_gate", "proxy_up", "scale_up", "w_gate_scale",
               "w_up_scale", "w_down_t_scale")

#: The Stage-2 weight formats, code = position (setup.py's FORMATS is the one definition; read from the
#: extension when loaded, and checked against this copy by a host test).
FORMATS = ("native", "fp8_channel", "fp8_block128")


def _from_extension(op: str, copy: tuple) -> tuple:
    """The names the loaded extension reports (``copy`` without it, or from a build too old to say)."""
    if not available():
        return copy
    try:
        return tuple(getattr(torch.ops.prox, op)())
    except (AttributeError, RuntimeError):
        warnings.warn(f"prox: the compiled extension has no op {op}: it was built from another version of prox; "
                      "rebuild it (pip install ./python --no-build-isolation)", RuntimeWarning, stacklevel=2)
        return copy


#: What the loaded extension says: module constants, so torch.compile reads them as constants.
_SLOTS = _from_extension("layer_slot_names", LAYER_SLOTS)
_FORMAT_CODES = {name: i for i, name in enumerate(_from_extension("layer_format_names", FORMATS))}
_W_GATE = _SLOTS.index("w_gate")


class LayerTensors(NamedTuple):
    """A layer's tensors by name, and its Stage-2 weight format: what the ops take, as ``tensors()`` (the list in
    the extension's slot order) and ``format_code()``. Built by name, never by position:

        lt = prox.LayerTensors(w_gate=wg, w_up=wu, w_down_t=wdt, proxy_gate=pg, scale_gate=sg, proxy_up=pu,
                               scale_up=su)
        y = torch.ops.prox.sparse_ffn(x, lt.tensors(), lt.format_code(), thresholds, workspace, act, options)[0]

    ``format="native"``: fp16/bf16 W_gate, W_up and W_down^T ([d_ff, d_model], the activation dtype) and the INT4
    proxies of W_gate and W_up (``pack_int4``: int32 [d_model, d_ff/8] and float32 [d_ff] scales).
    ``format="fp8_channel"`` / ``"fp8_block128"`` (docs/fp8-format.md, prox.fp8): W_gate, W_up and W_down^T
    torch.float8_e4m3fn [d_ff, d_model] with their float32 scales in ``w_gate_scale``, ``w_up_scale`` ([d_ff]) and
    ``w_down_t_scale`` ([d_model]: one per output, a column of W_down^T) per channel, or all three
    [ceil(d_ff/128), ceil(d_model/128)] in 128 x 128 blocks (W_down^T's: prox.fp8.transpose_down), and the INT4
    proxies packed from the dequantized weights (prox.fp8.pack_int4); the activation dtype is the call's (x), or
    ``dtype=`` for plan_ffn / check_layer. A format's own tensors are fields with a default of None, for the formats
    that have none. The thresholds and the workspace are not slots: they change at run time (the thresholds between
    graph replays, often a row of one shared table) or per stream, and the workspace is written (``Tensor(a!)``).
    ``prox.check_layer`` checks every slot, naming it; each op checks again on every call."""

    w_gate: torch.Tensor  #: W_gate [d_ff, d_model] (nn.Linear layout)
    w_up: torch.Tensor  #: W_up [d_ff, d_model]
    w_down_t: torch.Tensor  #: W_down^T [d_ff, d_model] (prox.transpose of nn.Linear's W_down)
    proxy_gate: torch.Tensor  #: INT4 proxy of W_gate, int32 [d_model, d_ff/8] (layout v1)
    scale_gate: torch.Tensor  #: its float32 scales [d_ff]
    proxy_up: torch.Tensor  #: INT4 proxy of W_up
    scale_up: torch.Tensor  #: its float32 scales [d_ff]
    w_gate_scale: Optional[torch.Tensor] = None  #: FP8: W_gate's float32 scales ([d_ff] or blocks)
    w_up_scale: Optional[torch.Tensor] = None  #: FP8: W_up's float32 scales
    w_down_t_scale: Optional[torch.Tensor] = None  #: FP8: W_down^T's float32 scales ([d_model] or blocks)
    format: str = "native"  #: the Stage-2 weight format (FORMATS)

    def tensors(self) -> list:
        """The ops' ``layer`` list: each slot's tensor (or None) in the extension's slot order."""
        return layer_list(self)

    def format_code(self) -> int:
        """The ops' ``format``: the format's code in the extension (its position in FORMATS)."""
        return format_code(self.format)


def layer_list(layer: LayerTensors) -> list:
    """``layer.tensors()`` as a function."""
    return [getattr(layer, name) for name in _SLOTS]


def layer_args(layer: LayerTensors) -> tuple[list, int]:
    """The ops' ``layer`` and ``format`` arguments (module functions: torch.compile traces them in forward())."""
    return layer_list(layer), format_code(layer.format)


def format_code(name: str) -> int:
    """The ops' ``format`` code of a format name (FORMATS)."""
    code = _FORMAT_CODES.get(name)
    if code is None:
        raise ValueError(f"prox: unknown layer format {name!r} (this extension has {', '.join(_FORMAT_CODES)})")
    return code


def _check_layer_fields() -> None:
    """The loaded extension's slots are LayerTensors' fields (a build of another prox version may differ)."""
    missing = [n for n in _SLOTS if n not in LayerTensors._fields]
    if missing:
        warnings.warn(f"prox: the compiled extension has layer slots prox.LayerTensors lacks ({', '.join(missing)}): "
                      "it was built from another version of prox; rebuild it (pip install ./python "
                      "--no-build-isolation)", RuntimeWarning, stacklevel=3)


_check_layer_fields()


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
    def _sparse_ffn_fake(x, layer, format, thresholds, workspace, act, options, return_mask=False,
                         return_s_proxy=False, return_s=False, counters=None):
        w_gate = layer[_W_GATE]  # [d_ff, d_model] in every format
        d_ff = w_gate.shape[0]
        # A batch ([B, d_model], B >= 2) gives each output a leading B; one token keeps batch-1 shapes.
        lead = (x.shape[0],) if x.dim() == 2 and x.shape[0] != 1 else ()

        def out(wanted, n, dtype):
            return w_gate.new_empty(lead + (n,) if wanted else (0,), dtype=dtype)

        y = torch.empty_like(x)
        return (y, out(return_mask, d_ff // 32, torch.int32), out(return_s_proxy, d_ff, torch.float32),
                out(return_s, d_ff, torch.float32))

    @torch.library.register_fake("prox::proxy_values")
    def _proxy_values_fake(x, layer, format, thresholds, workspace, act, options):
        d_ff = layer[_W_GATE].shape[0]
        shape = (d_ff,) if x.dim() == 1 else (x.shape[0], d_ff)
        return x.new_empty(shape, dtype=torch.float32)

    @torch.library.register_fake("prox::dense_ffn")
    def _dense_ffn_fake(x, layer, format, thresholds, act, options):
        return torch.empty_like(x)

    @torch.library.register_fake("prox::fp8_quantize")
    def _fp8_quantize_fake(w, layout):
        rows, cols = w.shape
        shape = (rows,) if layout == 0 else ((rows + 127) // 128, (cols + 127) // 128)
        return w.new_empty(w.shape, dtype=torch.float8_e4m3fn), w.new_empty(shape, dtype=torch.float32)

    @torch.library.register_fake("prox::fp8_transpose_down")
    def _fp8_transpose_down_fake(q, scales, layout):
        d_model, d_ff = q.shape
        shape = (d_model,) if layout == 0 else ((d_ff + 127) // 128, (d_model + 127) // 128)
        return q.new_empty((d_ff, d_model)), scales.new_empty(shape)

    @torch.library.register_fake("prox::fp8_pack_int4")
    def _fp8_pack_int4_fake(q, scales, layout):
        d_ff, d_model = q.shape
        return (q.new_empty((d_model, d_ff // 8), dtype=torch.int32), q.new_empty((d_ff,), dtype=torch.float32))

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


def workspace_header_bytes() -> int:
    """Bytes of a workspace's header (prox::detail::kHeaderBytes): the least any workspace holds."""
    _require()
    return int(torch.ops.prox.workspace_header_bytes())


def check_workspace(workspace, device: Optional[torch.device] = None, *, need: int = 0,
                    what: str = "workspace") -> None:
    """A workspace as the ops take it: a contiguous uint8 tensor, 16-byte aligned, on ``device`` (when given),
    of at least ``need`` bytes (and at least the header). Raises TypeError / ValueError naming it."""
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"prox: {what} must be a torch.uint8 tensor (it is {type(workspace).__name__})")
    if workspace.dtype != torch.uint8:
        raise TypeError(f"prox: {what} must be torch.uint8 (it is {workspace.dtype})")
    if device is not None and workspace.device != device:
        raise ValueError(f"prox: {what} is on {workspace.device}, the layer's tensors on {device}")
    if not workspace.is_contiguous():
        raise ValueError(f"prox: {what} must be contiguous")
    if workspace.device.type != "meta" and workspace.data_ptr() % 16:
        raise ValueError(f"prox: {what} must be 16-byte aligned (data_ptr {workspace.data_ptr():#x})")
    need = max(need, workspace_header_bytes())
    if workspace.numel() < need:
        raise ValueError(f"prox: {what} has {workspace.numel()} bytes; it needs at least {need}")


def initialize_workspace(workspace: torch.Tensor) -> None:
    """Zero a workspace and write its header (two memsets on the current stream; capturable)."""
    _require()
    torch.ops.prox.initialize_workspace(workspace)


def workspace_dirty(workspace: torch.Tensor) -> bool:
    """Whether a kernel found this workspace not initialized since its last initialization (the runs it
    flagged were exact-dense). Synchronizes the current stream: not for the hot path. The workspace must
    hold at least the header (workspace_header_bytes()): the status word lies at its end."""
    _require()
    check_workspace(workspace)
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


def fp8_layout() -> str:
    """The FP8 layout tag of this build (prox::fp8::kLayoutTag)."""
    _require()
    return str(torch.ops.prox.fp8_layout())


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
    """Plans the extension holds (a layer has at most two: batch 1 and batches)."""
    _require()
    return int(torch.ops.prox.plan_cache_size())


def plan_cache_capacity() -> int:
    """The most unpinned plans the cache keeps (least recently used ones are evicted past it)."""
    _require()
    return int(torch.ops.prox.plan_cache_capacity())


def set_plan_cache_capacity(capacity: int) -> None:
    """Bound the unpinned plans (>= 1; default 4096). Pinned plans (PlannedFfn's, SparseMLP.plan()'s, and
    every plan a captured call used) are never evicted and do not count against it."""
    _require()
    torch.ops.prox.set_plan_cache_capacity(int(capacity))


def plan_cache_pinned() -> int:
    """Plans the cache may not evict: pinned by an owner (plan_ffn(pin=True)) or used during stream capture."""
    _require()
    return int(torch.ops.prox.plan_cache_pinned())


def unpin_plan(handle: int) -> None:
    """Release a pin plan_ffn(pin=True) returned (its owner is gone); the plan becomes evictable. Unknown
    handles are ignored (clear_plan_cache() dropped them)."""
    if available():
        torch.ops.prox.unpin_plan(int(handle))


def clear_plan_cache() -> None:
    """Drop every plan, pinned ones included: layers plan again on their next eager call (or plan());
    calls captured afterwards need that first."""
    _require()
    torch.ops.prox.clear_plan_cache()


# ---------------------------------------------------------------- validation where the user is


def check_layer(layer: LayerTensors, thresholds: torch.Tensor, workspace=None, *, max_tokens: int = 1,
                dtype: Optional[torch.dtype] = None) -> tuple[int, int]:
    """The checks the ops make on a layer's tensors, made when the layer is built (PlannedFfn, SparseMLP) so that
    the error names the tensor where the user is: each slot of the layer's format (dtype, device and its index,
    shape, contiguity, alignment; a slot the format has no use for must be None), the thresholds, the activation
    ``dtype`` where given (the native format's is its weights'), and the workspace's size for ``max_tokens``
    tokens. FP8 formats need ``dtype`` (the activation dtype: their weights do not give it). Returns (d_model,
    d_ff). The slot checks are the extension's own (torch.ops.prox.check_layer, which
    runs on any device), the ones every op call makes again (the second line, for C++ and raw-op callers)."""
    _require()
    if not isinstance(layer, LayerTensors):
        raise TypeError(f"prox: layer must be a prox.LayerTensors (it is {type(layer).__name__})")
    for name in _SLOTS:
        t = getattr(layer, name)
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"prox: {name} must be a tensor (it is {type(t).__name__})")
    if not isinstance(thresholds, torch.Tensor):
        raise TypeError(f"prox: thresholds must be a tensor (it is {type(thresholds).__name__})")
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"prox: max_tokens must be in [1, {MAX_TOKENS}], got {max_tokens}")
    d_model, d_ff = (int(v) for v in torch.ops.prox.check_layer(layer_list(layer), format_code(layer.format),
                                                                 thresholds, dtype))
    if workspace is not None:
        need = workspace_bytes(d_model, d_ff, max_tokens)
        check_workspace(workspace, layer.w_gate.device, need=need,
                        what=f"workspace (for calls of up to {max_tokens} token{'s' if max_tokens > 1 else ''}: "
                             f"prox.workspace_bytes({d_model}, {d_ff}, max_tokens={max_tokens}))")
    return d_model, d_ff
