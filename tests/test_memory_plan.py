"""memory_plan.py: the model shapes, the activation formula against what autograd saves, the plan's logic,
its CLI, and (slow) the formulas against measured CPU peaks through bench/plan_check.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from warm_python import run_script

from speed.backward import configure_backward
from tools import memory_plan
from tools.memory_plan import Shape, activations, model_shape, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def meta_params(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


# scripts/gpu_check.sh's run on Qwen2.5-1.5B, as train.py's flags
GPU_CHECK_ARGS = dict(
    model="Qwen/Qwen2.5-1.5B",
    task="arith",
    M=8,
    rollout_batch=16,
    micro_batch=16,
    max_tokens=256,
    dtype="bfloat16",
    gpu_memory_utilization=0.3,
    beta=1e-3,
)


def test_shapes_count_the_real_models_parameters(tiny_model_dir):
    from transformers import AutoConfig, LlamaConfig, Qwen2Config

    assert model_shape("Qwen/Qwen2.5-1.5B").params == 1_543_714_304  # Qwen2.5-1.5B, tied embeddings
    qwen = Qwen2Config(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    assert meta_params(qwen) == memory_plan.SHAPES["Qwen/Qwen2.5-1.5B"].params  # q/k/v biases counted
    smol = LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    assert meta_params(smol) == memory_plan.SHAPES["smollm2-135m"].params
    assert model_shape(tiny_model_dir).params == meta_params(AutoConfig.from_pretrained(tiny_model_dir))
    untied = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    assert memory_plan.shape_from_config(untied.to_dict()).params == meta_params(untied)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bf16", [True, False])
def test_saved_activations_equal_what_autograd_saves(tiny_model_dir, bf16, packed):
    """Every tensor autograd saves in one forward (parameters excluded), counted by storage, against the plan;
    packed (--pack): the B sequences as one row, whose attention spans the whole row. Storage counts do not depend
    on the CPU. Packed, the plan may count up to 5% more: a row of one lets eager attention's repeated K/V heads
    (the tiny model's 2 query heads share 1) stay views, which the plan counts as copies."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from speed.logprobs import pack_batch, packed_logprobs, sequence_logprobs

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    configure_backward(model, bf16=bf16, checkpointing=False)  # as train.py: no bf16 weight copy is saved
    B, P, K = 4, 96, 64
    input_ids = torch.randint(0, config.vocab_size, (B, P + K))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if packed:
                rows = input_ids.tolist()
                packed_logprobs(model, pack_batch([r[:P] for r in rows], [r[P:] for r in rows]), torch.ones(B, K))
            else:
                sequence_logprobs(model, input_ids, torch.ones_like(input_ids), K)
    c = 2 if bf16 else 4
    act = activations(
        model_shape(tiny_model_dir),
        batch=B,
        prompt=P,
        completion=K,
        compute_bytes=c,
        checkpointing=False,
        attention="eager",
        packed=packed,
    )
    logits_once = c * B * (K if packed else K + 1) * config.vocab_size  # packed: the completion tokens' only
    at_logits = act["moments"]["backward (logits)"]  # forward's end: every layer's and the final norm's tensors
    planned = at_logits["saved"] + at_logits["final_norm"] + logits_once  # weights_bf16: a transient, not saved
    if packed:
        assert sum(saved.values()) <= planned <= 1.05 * sum(saved.values())
    else:
        assert sum(saved.values()) == pytest.approx(planned, rel=0.01)


def test_the_token_budget_sizes_the_micro_batch_and_a_packed_row_counts_its_whole_span():
    """--micro-batch-tokens N: the plan's micro-batch is the rows N lets in at the longest prompt and completion
    (speed/micro_batches.py counts rows x longest), at least one; --pack: one row of them, attention over it all."""
    from config import PRESETS, Args

    args = {**Args().__dict__, **PRESETS["gsm8k"], "task": "gsm8k"}
    S = memory_plan.task_prompt_tokens("gsm8k") + args["max_tokens"]

    def activation_bytes(**more):
        p = memory_plan.plan({**args, **more}, gpus=8, gpu_gb=80, grad_checkpointing=True)
        return next(size for phase, item, size, _ in p.rows if phase == "train" and item == "activations")

    shape = memory_plan.model_shape(args["model"])
    common = dict(prompt=S - args["max_tokens"], completion=args["max_tokens"], compute_bytes=2, checkpointing=True)
    for rows in (1, 3):
        assert activation_bytes(micro_batch_tokens=rows * S + S - 1) == pytest.approx(
            memory_plan.activations(shape, batch=rows, attention="sdpa", **common)["saved"]
        )
    assert activation_bytes(micro_batch_tokens=1) == activation_bytes(micro_batch_tokens=S)  # one, if one is longer
    packed = activation_bytes(micro_batch_tokens=3 * S, pack=True)
    assert packed == pytest.approx(
        memory_plan.activations(shape, batch=3, attention="sdpa", packed=True, **common)["saved"]
    )
    assert packed > activation_bytes(micro_batch_tokens=3 * S)  # SDPA's mask spans the row: (3S)^2, not 3 S^2


def test_fsdp2_gradient_accumulation_keeps_whole_model_gradients():
    base = dict(model="Qwen/Qwen2.5-1.5B", task="deepmath", M=16, rollout_batch=512, micro_batch=8, max_tokens=1024)
    n = model_shape("Qwen/Qwen2.5-1.5B").params
    grads = {
        row[1]: row[2] for row in plan(base, gpus=16, gpu_gb=80, grad_checkpointing=True).rows if row[0] == "train"
    }["grads"]
    assert grads == 4 * n  # 64 micro-batches per rank: unsharded float32 gradients
    one_micro = dict(base, rollout_batch=16, M=8)  # 8 sequences per rank: one micro-batch, reduce-scattered
    grads = {
        row[1]: row[2] for row in plan(one_micro, gpus=16, gpu_gb=80, grad_checkpointing=True).rows if row[0] == "train"
    }["grads"]
    assert grads == 4 * n / 16


def test_checkpointing_keeps_only_layer_inputs_and_the_verdict_follows_the_gpu():
    shape = Shape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, head_dim=128)
    kwargs = dict(batch=8, prompt=1024, completion=1024, compute_bytes=2, attention="sdpa")
    plain, ckpt = activations(shape, checkpointing=False, **kwargs), activations(shape, checkpointing=True, **kwargs)
    # float32 layer inputs, cos/sin, the bf16 (B, 1, S, S) mask
    assert ckpt["saved"] == 28 * 4 * 1536 * 8 * 2048 + 2 * 4 * 128 * 8 * 2048 + 2 * 8 * 2048 * 2048
    assert plain["saved"] > 10 * ckpt["saved"]
    args = dict(model="Qwen/Qwen2.5-1.5B", task="deepmath", M=16, rollout_batch=512, micro_batch=8, max_tokens=1024)
    big, small = (
        plan(args, gpus=16, gpu_gb=80, grad_checkpointing=False),
        plan(args, gpus=16, gpu_gb=40, grad_checkpointing=False),
    )
    assert big.fits != small.fits and "does NOT fit" in small.verdict


def test_cli_prints_the_plan_and_refuses_bad_input_in_one_line(tmp_path):
    def run(*flags):
        return run_script("-m", "tools.memory_plan", *flags)

    ok = run("--task", "deepmath", "--gpus", "16", "--gpu-gb", "80")
    assert ok.returncode == 0, ok.stderr
    assert "vllm awake" in ok.stdout and ok.stdout.strip().splitlines()[-1].startswith(("fits", "does NOT fit"))
    bad_model = run("--task", "deepmath", "--model", str(tmp_path))
    assert bad_model.returncode == 2 and bad_model.stderr.count("\n") == 1 and "config.json" in bad_model.stderr
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    broken = run("--task", "deepmath", "--model", str(tmp_path))
    assert broken.returncode == 2 and broken.stderr.count("\n") == 1 and "KeyError" in broken.stderr
    table = run("--table")  # docs/memory_plan.md's preset table: every paper preset, both columns
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("| ") and "GiB)" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| " + t for t in memory_plan.PAPER_HARDWARE]


@pytest.mark.slow
def test_formulas_agree_with_measured_cpu_peaks_on_the_tiny_model():
    """bench/plan_check.py's measurements (peak resident memory, fresh process) on the tiny model."""
    result = subprocess.run(
        [sys.executable, "bench/plan_check.py", "--models", "tiny", "--dtypes", "bfloat16", "--json", "--one-process"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(rows) == 3
    for row in rows:
        assert abs(row["error"]) < 0.10, row


@pytest.mark.slow
def test_lm_head_and_embedding_moments_agree_with_measured_cpu_peaks_on_smollm2():
    """SmolLM2-135M's tied 49152 x 576 head makes the lm_head's and the embedding's backward the peak; the plan
    counts both moments, to 10%. On 2 of its 30 layers (fast) the head's moment is the peak with checkpointing
    and without; the whole model: bench/plan_check.py --models smollm2-135m."""
    result = subprocess.run(
        [
            sys.executable,
            "bench/plan_check.py",
            "--models",
            "smollm2-2-layers",
            "--dtypes",
            "float32",
            "--json",
            "--one-process",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert [row["what"] for row in rows][1:] == ["activations 8x(40+48) float32", "activations 8x(40+48) float32 ckpt"]
    for row in rows:
        assert abs(row["error"]) < 0.10, row


def test_every_preset_plans_with_its_tasks_prompt_length_and_the_paper_ones_have_hardware():
    from config import PRESETS, Args
    from tasks import get_task

    for task in PRESETS:  # whatever presets there are: each plans from its task's prompt_tokens
        p = plan({**Args().__dict__, **PRESETS[task], "task": task}, gpus=8, gpu_gb=80, grad_checkpointing=True)
        assert f"longest prompt {get_task(task).prompt_tokens} tokens" in p.assumptions[0]
    assert memory_plan.task_prompt_tokens("arith") == 40 and memory_plan.task_prompt_tokens("gsm8k") == 1024
    paper = {"gsm8k", "countdown", "deepmath", "poetry", "meetingbank", "openthoughts"}  # Tables B.1-B.2
    assert paper <= set(memory_plan.PAPER_HARDWARE) <= set(PRESETS)  # the demos have no paper GPUs
    args = {**Args().__dict__, **PRESETS["openthoughts"], "task": "openthoughts"}  # Table B.2's transfer run
    p = plan(args, gpus=16, gpu_gb=139, grad_checkpointing=True)
    assert "longest prompt 2048 tokens, completion 6144" in " ".join(p.assumptions)  # official openthoughts.yaml
    assert p.fits


def test_a_new_preset_and_task_plan_with_no_edit_here(monkeypatch, capsys):
    """A fork's task and preset: the plan reads the task's prompt_tokens (1024 when it does not say); an unknown
    task is one line asking for --prompt-tokens."""
    import config
    import tasks

    monkeypatch.setitem(
        tasks.TASKS,
        "qa",
        tasks.Task(name="qa", columns=("problem", "answer"), key=("problem",), verifier=lambda completion, ex: 0.0),
    )  # gsm8k's exact reward
    monkeypatch.setitem(tasks.TASKS, "essays", tasks.Task(name="essays", columns=("essay",), prompt_tokens=3000))
    monkeypatch.setitem(config.PRESETS, "qa", dict(config.PRESETS["gsm8k"]))
    monkeypatch.setitem(config.PRESETS, "essays", dict(config.PRESETS["poetry"]))
    assert memory_plan.main(["--task", "qa", "--gpus", "8", "--gpu-gb", "80"]) == 0
    assert "longest prompt 1024 tokens" in capsys.readouterr().out
    assert memory_plan.main(["--task", "essays", "--gpus", "8", "--gpu-gb", "80"]) == 0
    assert "longest prompt 3000 tokens" in capsys.readouterr().out
    args = {**config.Args().__dict__, "task": "not-a-task"}
    with pytest.raises(ValueError, match="no prompt length assumed for task 'not-a-task': pass prompt_tokens"):
        plan(args, gpus=1, gpu_gb=80, grad_checkpointing=True)
    assert (
        "longest prompt 77 tokens"
        in plan(args, gpus=1, gpu_gb=80, grad_checkpointing=True, prompt_tokens=77).assumptions[0]
    )


def test_under_torchrun_one_gpu_holds_what_fsdp2_holds_and_torchs_count_leaves_out_the_overhead():
    """scripts/gpu_check.sh's N = 1 runs under torchrun: FSDP2 over one rank, so a float32 reference, bf16 roots
    left gathered after their forwards and foreach AdamW's float32 temporary; one process has bf16 linears and
    fused AdamW. trainer_allocated, what the memory gate holds against torch's peaks, has neither CUDA_OVERHEAD
    nor the engine's rows, and its train phase is the larger of the backward and the optimizer step."""
    args = dict(GPU_CHECK_ARGS)
    n, embedding = model_shape("Qwen/Qwen2.5-1.5B").params, model_shape("Qwen/Qwen2.5-1.5B").embedding
    torchrun = plan(args, gpus=1, gpu_gb=139, grad_checkpointing=True, prompt_tokens=128, torchrun=True)
    alone = plan(args, gpus=1, gpu_gb=139, grad_checkpointing=True, prompt_tokens=128)

    def row(p, phase, item):
        return next(size for ph, it, size, _ in p.rows if ph == phase and it == item)

    assert row(torchrun, "rollout", "reference") == 4 * n and row(alone, "rollout", "reference") < 0.6 * 4 * n
    assert row(torchrun, "optimizer", "adamw temporary") == 4 * n and row(alone, "optimizer", "adamw temporary") == 0
    roots = row(torchrun, "rollout", "fsdp2 roots gathered")
    if not memory_plan.ROOT_RESHARDED_AFTER_FORWARD:  # the policy's and the reference's embedding, bf16
        assert roots > 2 * 2 * embedding and row(alone, "rollout", "fsdp2 roots gathered") == 0
    for p in (torchrun, alone):
        counted = memory_plan.trainer_allocated(p)
        engine = {
            ph: sum(size for phase, item, size, _ in p.rows if phase == ph and item in memory_plan.ENGINE_ROWS)
            for ph in p.phases
        }
        for phase in ("rollout", "sync"):
            assert counted[phase] == pytest.approx(p.phases[phase] - memory_plan.CUDA_OVERHEAD - engine[phase])
        assert counted["train"] == pytest.approx(
            max(p.phases[ph] - memory_plan.CUDA_OVERHEAD - engine[ph] for ph in ("train", "optimizer"))
        )
    # at one rank the step's float32 temporary of the whole model outweighs this small batch's backward
    assert torchrun.phases["optimizer"] > torchrun.phases["train"]
    assert alone.phases["optimizer"] < alone.phases["train"]


def test_every_row_says_what_backs_it_and_none_claims_a_gpu_it_has_not_seen():
    """No row has been calibrated on a GPU (docs/gpu.md records no run yet); a row added without saying whether
    it is checked or estimated fails here, and a GPU-calibrated row must name a run that docs/gpu.md records."""
    from config import PRESETS, Args

    assert not memory_plan.CPU_CHECKED & memory_plan.ESTIMATED
    items = set()
    for task in PRESETS:
        for torchrun in (True, False):
            for ckpt in (True, False):
                p = plan(
                    {**Args().__dict__, **PRESETS[task], "task": task},
                    gpus=8 if torchrun else 1,
                    gpu_gb=80,
                    grad_checkpointing=ckpt,
                    torchrun=torchrun,
                )
                items |= {item for _, item, _, _ in p.rows}
                text = memory_plan.format_plan(p)
    assert {memory_plan.calibration(item) for item in items} <= {"gpu", "cpu", "estimate"}  # KeyError if unclassified
    assert memory_plan.calibration("reference") == "estimate" and memory_plan.calibration("activations") == "cpu"
    for item, run in memory_plan.GPU_CALIBRATED.items():
        assert item in items and run in open(os.path.join(ROOT, "docs", "gpu.md")).read()
    if not memory_plan.GPU_CALIBRATED:
        assert "No row has been calibrated on a GPU yet" in text
    assert all(f"[{tag}]" in text for tag in ("cpu", "est"))


def test_the_paper_presets_are_sized_by_the_plan_for_80_gb():
    """config.PRESETS on their paper GPU count: vLLM's share holds its bf16 weights, 2 GiB of activations and CUDA
    graphs and the KV cache of the rank's samples at full length (max_num_seqs 0: the rank's share), and not much
    more; the micro-batch is the largest power of two whose train phase takes <= 75% of 80 GiB; both fit 139 GiB."""
    from config import PRESETS, Args

    for task, (gpus, _, _) in memory_plan.PAPER_HARDWARE.items():
        args = {**Args().__dict__, **PRESETS[task], "task": task}
        shape, seqs = model_shape(args["model"]), args["rollout_batch"] * args["M"] // gpus
        assert args["max_num_seqs"] == 0  # train.py: the rank's share of the batch, seqs
        kv_per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2  # bf16 keys and values
        engine = (
            2 * shape.params
            + 2 * memory_plan.GiB
            + seqs * (memory_plan.task_prompt_tokens(task) + args["max_tokens"]) * kv_per_token
        )
        assert engine <= args["gpu_memory_utilization"] * 80 * memory_plan.GiB < 1.5 * engine, task

        for gpu_gb in (80, 139):
            p = plan(args, gpus=gpus, gpu_gb=gpu_gb, grad_checkpointing=True)
            assert p.fits and p.phases["train"] <= 0.75 * p.gpu_bytes, (task, gpu_gb)
        larger = 2 * args["micro_batch"]
        assert (
            larger > seqs
            or plan({**args, "micro_batch": larger}, gpus=gpus, gpu_gb=80, grad_checkpointing=True).phases["train"]
            > 0.75 * 80 * memory_plan.GiB
        ), task


def test_the_official_qwen3_run_plans_on_its_32_gpus_and_its_preset_is_its_yaml():
    """qwen3_base.yaml (docs/tasks.md, "Polaris"): Qwen3-1.7B-Base on trainer.nnodes 4 x n_gpus_per_node 8; the
    shape counts every parameter but Qwen3's q/k norms (2 x head_dim a layer)."""
    from transformers import Qwen3Config

    from config import PRESETS

    shape = model_shape("Qwen/Qwen3-1.7B-Base")
    qwen3 = Qwen3Config(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=6144,
        vocab_size=151936,
        head_dim=128,
        tie_word_embeddings=True,
    )
    assert meta_params(qwen3) == shape.params + shape.layers * 2 * shape.head_dim
    preset = PRESETS["polaris"]
    assert preset["steps"] == 5 * (53_291 // 256)  # total_epochs 5 of 53,291 rows, verl dropping the last batch
    assert {
        k: preset[k]
        for k in (
            "tau",
            "M",
            "rollout_batch",
            "max_tokens",
            "clip_high",
            "max_grad_norm",
            "beta",
            "top_p",
            "seed",
            "eval_samples",
            "eval_top_p",
            "plan_gpus",
        )
    } == dict(
        tau=0.3,
        M=16,
        rollout_batch=256,
        max_tokens=4096,
        clip_high=0.2,
        max_grad_norm=0.3,
        beta=0.0,
        top_p=1.0,
        seed=79,
        eval_samples=32,
        eval_top_p=0.95,
        plan_gpus=32,
    )
    result = run_script("train.py", "--task", "polaris", "--plan")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "polaris (Qwen/Qwen3-1.7B-Base) on 32 x 80 GiB, with gradient checkpointing"
    assert "128 sequences per rank per minibatch in micro-batches of 8" in result.stdout  # 256 x 16 / 32
    assert lines[-1].startswith("fits: peak ") and "(rollout) of 80 GiB" in lines[-1]  # vLLM's 0.7 x 80 GiB


QWEN2_7B = dict(  # Qwen2.5-7B's config.json: untied embeddings, 4 key/value heads
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
)


def test_the_engine_share_holds_the_weights_and_one_full_sequences_kv_cache_or_names_the_share_that_does():
    """A 7B model, by hand: 7,615,616,512 parameters (28 layers of 233,057,792, two 152064 x 3584 embeddings, the
    final norm) are 15,231,233,024 bf16 bytes; a token's keys and values 2 x 28 x 4 x 128 x 2 = 57,344 bytes, 1,280
    tokens 73,400,320. Both need 0.178 of 80 GiB: 0.12 is refused with 0.18, which holds them, as does a share
    just above it, and 0.17 does not. train.py's start-up reads the shape from the model's config (to_dict)."""
    from transformers import Qwen2Config

    config = Qwen2Config(**QWEN2_7B)
    shape = memory_plan.shape_from_config(config.to_dict())
    assert shape.params == 7_615_616_512 == meta_params(config)
    gpu = 80 * memory_plan.GiB
    check = dict(dtype="bfloat16", gpu_bytes=gpu, length=1280)
    assert memory_plan.engine_share_error(shape, utilization=0.12, **check) == (
        "--gpu-memory-utilization 0.12 gives vLLM 9.6 GiB of the GPU's 80.0 GiB, below its 14.2 GiB of bfloat16 "
        "weights and 0.07 GiB of KV cache for one sequence of 1,280 tokens: pass at least 0.18"
    )
    assert (15_231_233_024 + 73_400_320) / gpu == pytest.approx(0.17817, abs=1e-5)
    assert memory_plan.engine_share_error(shape, utilization=0.18, **check) is None
    assert memory_plan.engine_share_error(shape, utilization=0.181, **check) is None
    assert memory_plan.engine_share_error(shape, utilization=0.17, **check).endswith("pass at least 0.18")
    # float32 weights and keys and values: twice the bytes, 0.357 of the GPU
    assert memory_plan.engine_share_error(shape, utilization=0.3, **{**check, "dtype": "float32"}).endswith(
        "28.4 GiB of float32 weights and 0.14 GiB of KV cache for one sequence of 1,280 tokens: pass at least 0.36"
    )
    # the KV cache counts: a 100,000-token sequence's 5.3 GiB takes the same 7B past 0.18
    assert memory_plan.engine_share_error(shape, utilization=0.18, **{**check, "length": 100_000}).endswith("0.25")
    # no share config.py allows holds a model larger than the GPU
    assert "no share below 1 does" in memory_plan.engine_share_error(
        shape, utilization=0.9, **{**check, "gpu_bytes": 14 * memory_plan.GiB}
    )


def test_plan_refuses_a_7b_model_at_the_gsm8k_presets_share_and_takes_the_share_it_names(tmp_path):
    """gsm8k's preset gives vLLM 0.12 of the GPU, which holds Qwen2.5-1.5B but not a 7B model's 14.2 GiB of bf16
    weights: vLLM would fail at start-up on every rank, so `train.py --plan` says "does NOT fit" (its misfit
    verdict, as for a peak over the GPU) with the one line train.py's start-up raises, and the plan table's
    paper presets all still fit (test_the_paper_presets_are_sized_by_the_plan_for_80_gb checks each)."""
    from transformers import Qwen2Config

    from config import PRESETS, Args

    Qwen2Config(**QWEN2_7B).save_pretrained(tmp_path)  # a config, no weights: the plan reads only config.json
    refused = run_script("train.py", "--task", "gsm8k", "--plan", "--model", tmp_path)
    assert refused.returncode == 0, refused.stderr[-2000:]
    assert refused.stdout.strip().splitlines()[-1] == (
        "does NOT fit: --gpu-memory-utilization 0.12 gives vLLM 9.6 GiB of the GPU's 80.0 GiB, below its 14.2 GiB "
        "of bfloat16 weights and 0.07 GiB of KV cache for one sequence of 1,280 tokens: pass at least 0.18"
    )
    taken = run_script("train.py", "--task", "gsm8k", "--plan", "--model", tmp_path, "--gpu-memory-utilization", 0.18)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert taken.stdout.strip().splitlines()[-1].startswith("fits: peak ")
    args = {**Args().__dict__, **PRESETS["gsm8k"], "task": "gsm8k", "model": str(tmp_path)}
    assert not plan(args, gpus=8, gpu_gb=80, grad_checkpointing=True).fits


def test_the_hf_sampler_budgets_its_own_weights_and_sampling_not_vllms_share():
    """--sampler hf: the rollout phase holds the HF sampler's bf16 copy of Qwen2.5-1.5B (2 x 1,543,714,304 bytes)
    and rollout.py's sampling_bytes for this rank's 16 x 8 = 128 samples of 128 + 256 tokens, by hand: a layer's
    keys and values 2 x 2 x 128 x 2 x 384 = 393,216 bytes a row, 29 of them (28 layers + one layer's copy), float32
    logits x3 151,936 x 12, 5,000 more: 13,231,496 a row. No vLLM share and no share check; "auto" stays vLLM."""
    from transformers import Qwen2Config

    from rollout import sampling_bytes

    args = dict(GPU_CHECK_ARGS)
    kwargs = dict(gpus=1, gpu_gb=139, grad_checkpointing=True, prompt_tokens=128, torchrun=True)
    hf, vllm = plan({**args, "sampler": "hf"}, **kwargs), plan({**args, "sampler": "vllm"}, **kwargs)
    rollout = {item: size for phase, item, size, _ in hf.rows if phase == "rollout"}
    sampling = 128 * 13_231_496
    assert rollout["hf sampler awake"] == 2 * 1_543_714_304 + sampling and "vllm awake" not in rollout
    # the same formula train.py's start-up holds against the free memory, on the model's real config
    config = Qwen2Config(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
    )
    assert sampling_bytes(config, 128, 384, "bfloat16") == sampling
    assert hf.phases["rollout"] < vllm.phases["rollout"]  # 4.5 GiB of its own, not 0.3 x 139 GiB
    # the vLLM plan is as it was: its share, for --sampler vllm and for auto (vLLM on a GPU) alike
    vllm_rollout = {item: size for phase, item, size, _ in vllm.rows if phase == "rollout"}
    assert vllm_rollout["vllm awake"] == 0.3 * 139 * memory_plan.GiB and "hf sampler awake" not in vllm_rollout
    assert plan({**args, "sampler": "auto"}, **kwargs).phases == plan(args, **kwargs).phases == vllm.phases
    # a share that could not hold vLLM's engine is no HF sampler's concern
    starved = {**args, "gpu_memory_utilization": 0.01}
    assert plan({**starved, "sampler": "vllm"}, **kwargs).engine_error is not None
    hf_starved = plan({**starved, "sampler": "hf"}, **kwargs)
    assert hf_starved.engine_error is None and hf_starved.fits and hf_starved.phases == hf.phases
    assert "hf sampler awake" in memory_plan.format_plan(hf)  # a classified row: calibration raises on none
