# SPDX-License-Identifier: Apache-2.0
"""prox.bench_ffn_fp8 on the host (no GPU): the CPU smoke test's JSON (rows, bytes, the explicit skip of (a) with
torch's refusal), and (a)'s correctness check through an emulated torch._scaled_mm that reads the scales the way
torch's CUDA checks require them (ScaledBlas.cpp: row-wise [M, 1] and [1, N] contiguous; 1 x 128 activation scales
[M, K/128] with strides (1, M); 128 x 128 weight scales [K/128, N/128] with strides (1, K/128)): the check passes on
the right scales, records a refused block scaling as the per-channel requantization, and raises on misread ones."""
import json

import pytest
import torch

from prox import bench_ffn_fp8 as bench
from prox import fp8


def _main(tmp_path, *extra):
    out = tmp_path / "ffn.json"
    assert bench.main(["--device", "cpu", "--shapes", "tiny", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_cpu_smoke_skips_a_explicitly(tmp_path):
    res = _main(tmp_path)
    assert res["smoke"] is True and res["compile"] is False and res["torch"] == torch.__version__
    assert "copy_GBps" not in res and res["check_bound"] == bench.CHECK_BOUND
    d_model, d_ff = bench.SHAPES["tiny"]
    keys = [(r["layout"], r["batch"]) for r in res["rows"]]
    assert keys == [(lay, b) for lay in ("channel", "block128") for b in (1, 2, 4)]
    for r in res["rows"]:
        # (a): tried, refused by torch's CPU _scaled_mm (per-tensor scales only), and said so; nothing timed.
        assert "scaled_mm_us" not in r and "bf16_us" not in r and r["fp8_floor_us"] is None
        assert r["skipped"].startswith("torch._scaled_mm refused every scaling on cpu")
        assert set(r["refused"]) == ({"row"} if r["layout"] == "channel" else {"block", "row"})
        assert all("per-tensor" in v for v in r["refused"].values())
        # (d)'s check ran: bf16 against float32 on the same weights.
        assert 0 < r["bf16_check_rel_err"] < bench.BF16_BOUND
        blocks = fp8.blocks(d_ff) * fp8.blocks(d_model)
        scales = 4 * (2 * d_ff + d_model) if r["layout"] == "channel" else 12 * blocks
        assert r["fp8_bytes"] == 3 * d_model * d_ff + scales and r["rows"] == 16


def _emulated_scaled_mm(misread: str = "", refuse_blocks: bool = False):
    """torch._scaled_mm in float32 on the dequantized operands, with torch's CUDA layout checks; ``misread``
    "weight" or "activation" reads that block-scale tensor's storage row-major (a stride bug)."""
    def mm(a, b, scale_a, scale_b, out_dtype=None, **kw):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == fp8.E4M3 and a.stride(1) == 1 and b.stride(0) == 1  # row-major x col-major
        if tuple(scale_a.shape) == (m, 1):
            assert tuple(scale_b.shape) == (1, n) and scale_a.is_contiguous() and scale_b.is_contiguous()
            sa, sb = scale_a, scale_b
        else:
            kb, nb = k // 128, n // 128
            assert tuple(scale_a.shape) == (m, kb) and scale_a.stride() == (1, m)
            assert tuple(scale_b.shape) == (kb, nb) and scale_b.stride() == (1, kb)
            if refuse_blocks:
                raise RuntimeError("emulated: no blockwise scaling here")
            if misread == "activation":
                scale_a = torch.as_strided(scale_a, (m, kb), (kb, 1))
            if misread == "weight":
                scale_b = torch.as_strided(scale_b, (kb, nb), (nb, 1))
            sa = scale_a.repeat_interleave(128, 1)
            sb = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)
    return mm


@pytest.mark.parametrize("refuse_blocks", [False, True])
def test_a_check_passes_on_the_right_scales(tmp_path, monkeypatch, refuse_blocks):
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm(refuse_blocks=refuse_blocks))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    res = _main(tmp_path, "--batches", "1,3")
    assert len(res["rows"]) == 4
    for r in res["rows"]:
        assert "skipped" not in r and "scaled_mm_us" not in r and r["compiled"] is False
        assert 0.01 < r["check_rel_err"] < bench.CHECK_BOUND  # e4m3 activations: a few percent, never zero
        block = r["layout"] == "block128" and not refuse_blocks
        assert r["scaling"] == ("block128 x 1x128" if block else "row-wise")
        assert r["requantized"] == (r["layout"] == "block128" and refuse_blocks)
        assert set(r["refused"]) == ({"block"} if r["requantized"] else set())


@pytest.mark.parametrize("misread", ["weight", "activation"])
def test_a_check_raises_on_misread_scales(tmp_path, monkeypatch, misread):
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm(misread))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match=r"tiny block128 B=1 \(a\) block128 x 1x128: relative L2 error"):
        _main(tmp_path, "--layouts", "block128")


@pytest.mark.parametrize("bad", [["--shapes", "7b"], ["--batches", "17"], ["--batches", "0"],
                                 ["--layouts", "int4"]])
def test_bad_arguments_are_refused(tmp_path, bad):
    with pytest.raises(SystemExit):
        _main(tmp_path, *bad)
