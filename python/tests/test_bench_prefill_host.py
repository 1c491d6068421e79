# SPDX-License-Identifier: Apache-2.0
"""prox.bench_prefill (the FP8 prefill measurement) on the CPU: every layout and path runs, the paths agree with the
float32 path within the activation dtype's rounding, and the JSON says what ran (no timings are claimed on a CPU)."""
import json

import prox.bench_prefill as bench


def test_bench_prefill_cpu_smoke(tmp_path):
    out = tmp_path / "prefill.json"
    assert bench.main(["--device", "cpu", "--d-model", "256", "--d-ff", "768", "--layers", "2", "--tokens", "16",
                       "--reps", "1", "--warmup", "0", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["meta"]["smoke"] and d["meta"]["tokens"] == 16
    rows = {(r["layout"], r["path"]): r for r in d["rows"]}
    assert set(rows) == {(l, p) for l in ("channel", "block128") for p in bench.PATHS}
    for (layout, path), r in rows.items():
        assert r["peak_extra_mib"] is None  # CPU: no peak memory figure
        if path == "float32":
            assert r["rel_diff_vs_first_path"] == 0.0 and r["gemms"].startswith("float32")
        else:  # bfloat16 GEMMs on the dequantized weights: within bf16 rounding of the float32 path
            assert 0.0 < r["rel_diff_vs_first_path"] < 2e-2 and r["gemms"].startswith("bfloat16")
