"""scripts/slurm_2node.sbatch without a cluster: bash's syntax check, then the script run with fake Slurm
variables and a fake `srun` and `scontrol` on PATH, which record the command it would launch.

    python -m pytest tests/test_scripts.py -q
"""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "scripts", "slurm_2node.sbatch")


def fake_slurm(tmp_path, env):
    """Run the sbatch script as Slurm would on the first node, srun and scontrol replaced by scripts that log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun.args\nenv | grep _OFFLINE= | sort > {tmp_path}/srun.env\n'
    )
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[017-018]" ] || exit 9\nprintf "gpu017\\ngpu018\\n"\n'
    )
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HF_", "TRANSFORMERS_", "MASTER_"))}
    return subprocess.run(
        ["bash", SBATCH, "--seed", "3", "--save-every", "50"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**keep, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
    )


def test_the_sbatch_script_parses_and_asks_for_2_nodes_of_8_gpus():
    assert subprocess.run(["bash", "-n", SBATCH], capture_output=True).returncode == 0
    text = open(SBATCH).read()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "1" and directives["gpus-per-node"] == "8"
    assert "time" in directives and "cpus-per-task" in directives
    assert text.index("#SBATCH") < text.index("set -euo pipefail")  # sbatch stops reading at the first command


def test_the_sbatch_script_launches_torchrun_per_node_with_the_head_node_as_rendezvous(tmp_path, monkeypatch):
    import config

    result = fake_slurm(
        tmp_path,
        {"SLURM_JOB_NODELIST": "gpu[017-018]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": ROOT},
    )
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "srun.args").read_text().splitlines()
    torchrun = argv[argv.index("torchrun") :]
    assert torchrun == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "gpu017:29500",
        "--rdzv_id",
        "4242",
        "train.py",
        "--task",
        "deepmath",
        "--seed",
        "3",
        "--save-every",
        "50",
    ]
    assert (tmp_path / "srun.env").read_text().split() == [
        "HF_DATASETS_OFFLINE=1",
        "HF_HUB_OFFLINE=1",
        "TRANSFORMERS_OFFLINE=1",
    ]  # no rank reaches for the hub
    # the flags it hands train.py are train.py's: the DeepMath preset, the extra flags on top; parsed offline as the
    # script runs it (its hub id is then read from the cache at load, not looked up now)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = config.parse_args([*torchrun[torchrun.index("train.py") + 1 :], "--out-dir", str(tmp_path / "run")])
    assert (args.task, args.M, args.rollout_batch, args.seed, args.save_every) == ("deepmath", 16, 512, 3, 50)


def test_the_sbatch_script_outside_slurm_is_one_line(tmp_path):
    result = fake_slurm(tmp_path, {})
    assert result.returncode != 0 and not (tmp_path / "srun.args").exists()
    assert len(result.stderr.strip().splitlines()) == 1 and "submit this script with sbatch" in result.stderr
