"""bench/memory.py on the tiny model: its rows account for the measured peak, and its training state is AdamW's.

The accounting runs in its own process (it changes glibc's allocator settings and reads this process's
resident memory), as `python bench/memory.py` runs it.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK_TOLERANCE = 0.10  # the rows in the malloc heap, plus the runtime, cover the peak to within 10% of it


@pytest.mark.slow
def test_memory_rows_add_up_to_the_peak_and_training_state_is_16_bytes_per_parameter(tiny_model_dir, tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/memory.py",
            "--model",
            tiny_model_dir,
            "--steps",
            "2",
            "--max-tokens",
            "8",
            "--no-isolated",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {row["row"]: row for row in result["rows"]}
    named = sum(row["at_peak"] or 0 for name, row in rows.items() if name != "outside the malloc heap")
    peak = result["peak"]
    assert abs(named - peak) <= PEAK_TOLERANCE * peak, (named, peak)

    # float32 weights + float32 grads + two float32 AdamW moments, counted independently of the script
    n_params = sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).parameters()
    )
    state = rows["training state: fp32 weights + grads + AdamW moments"]["size"]
    assert abs(state - 16 * n_params) <= 0.01 * 16 * n_params, (state, 16 * n_params)

    # the peak falls in training, where autograd holds eager attention's probabilities and activations
    raw = result["raw"]
    assert raw["snapshot"]["phase"].startswith("step "), raw["snapshot"]["phase"]
    assert raw["saved_most"]["attention_probs"] > 0 and raw["saved_most"]["activations"] > 0
    assert raw["sampling_most_kv"] > 0
