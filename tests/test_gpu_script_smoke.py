"""bench/gpu/run.sh --smoke: the GPU script's every variant runs end to end on the CPU at tiny sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_smoke_runs_every_variant(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", str(ROOT / "bench/gpu/run.sh"), str(tmp_path), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wan = json.loads((tmp_path / "wan_480p_smoke.json").read_text())
    rows = wan["rows"]
    assert set(rows) == {"diffusers", "fv", "fv_sta", "fv_fbcache", "fastwan_3step", "fastwan_3step_compiled"}
    assert not [name for name, row in rows.items() if "error" in row]
    assert {row["dtype"] for row in rows.values()} == {"torch.bfloat16"}
    sta_kernel = rows["fv_sta"]["kernel"]
    assert sta_kernel["variant"] == "sta" and sta_kernel["call"]["path"] == "gather"
    assert rows["fv"]["kernel"]["variant"] == "sdpa"
    cache = rows["fv_fbcache"]["cache_dit"]
    assert cache["interceptor"] == "fbcache" and cache["computed"] + cache["cached"] > 0
    assert rows["fastwan_3step_compiled"]["steps"] == 3
    assert rows["diffusers"]["frames_shape"][1:] == rows["fv"]["frames_shape"] == [5, 32, 32, 3]
    sta = json.loads((tmp_path / "sta_attention_smoke.json").read_text())
    assert sta["compile_sweep"]["lengths"] == 2 and sta["compile_sweep"]["compiles"] == 1
    assert all(0 < row[k]["fraction_of_limit"] for row in sta["rows"] for k in ("gather", "flex"))
    assert (tmp_path / "sta_attention_smoke.png").stat().st_size > 0


def test_nft_published_script_smoke_trains_a_segment_and_judges_it(tmp_path):
    out = tmp_path / "nft_published_smoke.json"
    args = ["--smoke", "--out", str(out), "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/nft_published.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and [s["step"] for s in report["segments"]] == [1]
    segment = report["segments"][0]
    assert segment["g1"]["all"]["n"] == segment["g4"]["all"]["n"] == 8 == report["parent"]["g1"]["all"]["n"]
    assert set(segment["targets"]) == {
        "held_out_shape_g1>=0.95", "shape_g4>=0.90", "spread>=0.8x", "colour_kept", "direction_kept"
    }  # fmt: skip
    checkpoint = tmp_path / "run" / "checkpoint-1"  # resumable: the adapters, the old policy, the optimiser
    assert all(
        (checkpoint / f).exists() for f in ("student_lora.safetensors", "old", "optimizer.safetensors")
    )
