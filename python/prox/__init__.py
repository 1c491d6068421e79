# SPDX-License-Identifier: Apache-2.0
"""prox for PyTorch: the Prox sparse FFN (training-free activation sparsity for decoding: one token, or a
batch of up to 8) as torch custom ops (``torch.ops.prox``), a planned layer object, a drop-in sparse MLP and
sequential calibration.

    import prox
    cfg = prox.sparsify(model, 0.5, calib_ids)          # calibrate layer by layer, swap the MLPs
    prox.save_thresholds("thresholds.json", cfg)        # once; later: prox.sparsify(model, 0.5, thresholds=...)
    out = model.generate(ids, max_new_tokens=64)        # decode steps run Prox, prefill runs dense

The pure-Python parts (allocation rule, calibration rule, torch reference, thresholds file) work without
the compiled extension; the ops need it (prox.ops_available(); prox.ops_import_error() says why not).
"""
from ._ops import (ACTS, FORMATS, LAYER_SLOTS, MAX_TOKENS, PLAN_FLAGS, FfnOutputs, LayerTensors, PlanOptions,
                   allocate_sparsity_native, available as ops_available, check_layer, check_workspace, clear_plan_cache,
                   cuda_unavailable_reason, import_error as ops_import_error, initialize_workspace, int4_layout,
                   new_workspace, pack_int4, plan_cache_capacity, plan_cache_pinned, plan_cache_size,
                   set_plan_cache_capacity, transpose, workspace_bytes, workspace_dirty, workspace_header_bytes,
                   workspace_tokens)
from .allocation import (ALPHA, LayerErrors, StageSparsity, allocate_layers, allocate_sparsity, effective_sparsity,
                         max_effective_sparsity, split_candidates)
from .calibration import Calibrator, LayerThresholds, ThresholdResult, calibrate_layer, quantile_threshold
from .formats import FP8_ALPHA, alpha_for
from .nn import (SparseMLP, WorkspacePool, find_mlps, free_workspaces, memory_report, quantize_mlps, refresh, set_mode,
                 swap_mlps, workspace_pool)
from .planned import PlannedFfn, new_counters, sparsity_report as counters_report
from .sparsify import apply_thresholds, measure_layer_errors, sparsify, sparsity_report
from .thresholds import LayerRecord, ThresholdConfig, find_config, load_thresholds, save_thresholds
from .fp8 import Fp8Linear
from . import distributed, formats, fp8, reference

__version__ = "0.1.0"

__all__ = [
    "ACTS", "ALPHA", "Calibrator", "FORMATS", "FP8_ALPHA", "Fp8Linear", "FfnOutputs", "LAYER_SLOTS", "LayerErrors", "LayerRecord", "LayerTensors",
    "LayerThresholds", "MAX_TOKENS", "PLAN_FLAGS", "PlanOptions",
    "PlannedFfn", "SparseMLP", "StageSparsity", "ThresholdConfig", "ThresholdResult", "WorkspacePool",
    "allocate_layers", "allocate_sparsity", "allocate_sparsity_native", "alpha_for", "apply_thresholds", "calibrate_layer", "check_layer",
    "check_workspace", "clear_plan_cache", "counters_report", "cuda_unavailable_reason", "effective_sparsity",
    "find_config", "find_mlps", "formats", "fp8", "free_workspaces", "initialize_workspace", "int4_layout", "load_thresholds",
    "max_effective_sparsity", "measure_layer_errors", "memory_report", "new_counters", "new_workspace", "ops_available",
    "ops_import_error", "pack_int4", "plan_cache_capacity", "plan_cache_pinned", "plan_cache_size", "distributed",
    "quantile_threshold", "quantize_mlps", "reference", "refresh", "save_thresholds", "set_mode", "set_plan_cache_capacity",
    "sparsify", "sparsity_report", "split_candidates", "swap_mlps", "transpose", "workspace_bytes",
    "workspace_dirty", "workspace_header_bytes", "workspace_pool", "workspace_tokens",
]
