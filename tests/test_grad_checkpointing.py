"""Gradient checkpointing (plumbing/models.py: enable_grad_checkpointing) leaves the loss and gradients unchanged; so do
compiled layers (speed/compile.py: compile_layers, train.py --compile), to float rounding, with and without it.

float32, the tiny model, PPO loss with a reference KL; in one process and under FSDP2 with
`torchrun --nproc_per_node 2` (tests/grad_ckpt_worker.py). Each test also checks that the layers really
were recomputed: Hugging Face checkpoints only in train mode, so a helper that forgot it would pass an
equivalence test while saving nothing.
"""

import os
import subprocess
import sys

import pytest
import torch
from grad_ckpt_worker import loss_and_grads

from plumbing.models import enable_grad_checkpointing, load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    from tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ref"), seed=1)  # a different reference: the KL has a gradient


def assert_same(plain, ckpt, rtol=1e-5):
    assert ckpt["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    assert plain["grads"].keys() == ckpt["grads"].keys()
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(ckpt["grads"][name], grad, atol=1e-5, rtol=rtol, msg=name)
    assert max(g.abs().max().item() for g in plain["grads"].values()) > 1e-4  # there was a gradient to compare


def test_checkpointing_keeps_loss_and_gradients_one_process(tiny_model_dir, ref_dir):
    plain, ckpt = (
        {k: v for k, v in zip(("loss", "grads", "layer0_calls"), loss_and_grads(tiny_model_dir, ref_dir, c))}
        for c in (False, True)
    )
    assert_same(plain, ckpt)
    assert (plain["layer0_calls"], ckpt["layer0_calls"]) == (2, 4)  # 2 micro-batches; each layer rerun in backward


def run_worker(tmp_path, name, modes, ranks, model_dir, ref_dir, timeout=600):
    """tests/grad_ckpt_worker.py in one process (ranks 1) or under torchrun; its saved results by mode."""
    worker = os.path.join(ROOT, "tests", "grad_ckpt_worker.py")
    launcher = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    )
    result = subprocess.run(
        [*launcher, worker, str(tmp_path / f"{name}.pt"), model_dir, ref_dir, modes],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp_path / f"{name}.pt")


def assert_close(eager, compiled):
    """Compiled kernels round differently: equal to float32 rounding, not bit for bit."""
    assert compiled["graphs"] >= 1  # the layers ran compiled, not silently eager
    assert_same(eager, compiled, rtol=1e-4)


@pytest.mark.slow
def test_compiled_layers_keep_loss_and_gradients_one_process(tiny_model_dir, ref_dir, tmp_path):
    runs = run_worker(tmp_path, "one", "plain,compiled,compiled+ckpt", 1, tiny_model_dir, ref_dir, timeout=900)
    assert runs["plain"]["graphs"] == 0
    assert_close(runs["plain"], runs["compiled"])
    assert_close(runs["plain"], runs["compiled+ckpt"])
    assert (runs["compiled"]["layer0_calls"], runs["compiled+ckpt"]["layer0_calls"]) == (2, 4)  # still rerun


@pytest.mark.slow
def test_compiled_layers_keep_loss_and_gradients_under_fsdp2(tiny_model_dir, ref_dir, tmp_path):
    one = run_worker(tmp_path, "one", "plain", 1, tiny_model_dir, ref_dir, timeout=900)
    two = run_worker(tmp_path, "two", "compiled,compiled+ckpt", 2, tiny_model_dir, ref_dir, timeout=900)
    assert_close(one["plain"], two["compiled"])
    assert_close(one["plain"], two["compiled+ckpt"])


def test_checkpointing_rejects_a_model_with_dropout(tiny_model_dir):
    model = load_model(tiny_model_dir)
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout 0.1"):
        enable_grad_checkpointing(model)


@pytest.mark.slow
def test_checkpointing_keeps_loss_and_gradients_under_fsdp2(tiny_model_dir, ref_dir, tmp_path):
    runs = {
        name: run_worker(tmp_path, name, "plain,ckpt", ranks, tiny_model_dir, ref_dir)
        for name, ranks in (("one", 1), ("two", 2))
    }
    two = runs["two"]
    assert_same(two["plain"], two["ckpt"])
    assert (two["plain"]["layer0_calls"], two["ckpt"]["layer0_calls"]) == (2, 4)  # rank 0's count
    assert_same(runs["one"]["plain"], two["ckpt"])  # and FSDP2 + checkpointing equals one process on the whole batch
