"""scripts/gpu_check.sh is what a lent GPU runs, in minutes that can't be spent twice: its dry run
checks on this machine everything but the device (the cuda tests collect; the speed row's engines,
synthetic acceptance, timing and roofline arithmetic run on tiny shapes on the CPU)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_collects_the_cuda_tests_and_prints_the_speed_row():
    env = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    collected = int(done.stdout.split(" tests collected")[0].split()[-1])
    assert collected >= 9, done.stdout  # every cuda test is selected by the marker
    row = dict(line.split(None, 1) for line in done.stdout.splitlines() if line.count(" ") and "  " in line)
    assert row["device"].startswith("cpu"), row
    assert float(row["plain_tok_s"]) > 0 and float(row["spec_tok_s"]) > 0
    # synthetic acceptance 3.0 at K=4: the measured mean over a short run is near it
    assert 2.0 <= float(row["mean_acceptance_length"]) <= 4.0, row
    assert 0 < float(row["roofline_fraction"]), row
