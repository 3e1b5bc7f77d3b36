"""Issue #16: the memory a run plans is the memory its step then takes, within 10 %, for every workload.

The plan is the best gpuwise has for the model: traced on fake tensors for the models the analytic formulas
do not cover (the defects CNN, the recommender's embeddings), `gpuwise plan`'s formulas for a Llama. The
actual is counted as the plan counts: tensors, over one real step (the last: the optimizer states exist):
on the CPU the states it starts with plus the profiler's allocations over it. The process's resident
growth, which also holds the allocator's cache and the math library's buffers, is kept beside it as
`process_peak_bytes`.
"""

import json
import os
import subprocess
import sys

import pytest

from train_data import image_folder

TOLERANCE = 0.10

RUNS = {
    "defects": (["--batch-size", "16", "--max-steps", "3"], "traced on fake tensors"),
    "recommender": (["--batch-size", "128", "--max-steps", "3"], "traced on fake tensors"),
    "product-lm": (["--base", "scratch", "--batch-size", "4", "--max-steps", "3"], "analytic activations"),
    # fp32 as well (the default is bf16-mixed where the CPU has native bf16): the logits' terms differ
    "product-lm fp32": (
        ["--base", "scratch", "--batch-size", "4", "--max-steps", "3", "--precision", "32-true"],
        "analytic activations",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("workload", list(RUNS))
def test_planned_memory_is_within_10_percent_of_the_measured_step(workload, tmp_path):
    args, method = RUNS[workload]
    if workload == "defects":  # a step's memory depends on the image size, not on whose images: 48 at 128 px
        # spare the run ELPV's 2,624 images, which its evaluation would score 8 views each
        args = [*args, "--data", str(image_folder(tmp_path / "cells", per_class=24, size=128))]
    env = dict(os.environ, OMP_NUM_THREADS="1", GPUWISE_DB=str(tmp_path / "runs.sqlite"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwise",
            "train",
            workload.split()[0],
            *args,
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    s = json.loads(done.stdout)
    plan, actual = s["plan"], s["actual"]
    assert method in plan["method"] and "profiler's allocations" in actual["method"]
    assert actual["process_peak_bytes"] > 0  # the resident figure, kept for sizing a machine
    error = s["estimate_error"]["peak_bytes"]
    assert abs(error) <= TOLERANCE, (plan["peak_bytes"], actual["peak_bytes"], error)
