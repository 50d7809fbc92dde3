"""memory_plan.py's formulas against measured CPU peaks: the training state and one micro-batch's activations.

Each measurement runs in a fresh process and reads the kernel's resident-set counters: the training state is
the growth of RssAnon from before the model exists to after one AdamW step (float32 parameters, gradients,
both moments); a micro-batch's activations are the peak (VmHWM, reset through /proc/self/clear_refs) above
the resident set during a second forward + backward, after a first one has allocated the gradients and
warmed every lazy buffer. glibc is told to serve every block over 64 KiB with its own mapping and return it
at free, so resident memory follows the live tensors instead of the heap's high-water mark. The model is
built from its config with random weights (memory does not depend on the values); attention is eager, as
plumbing/models.py: load_model picks on CPU, and the plan is asked for eager attention too.

    python bench/plan_check.py                          # tiny, SmolLM2-135M and 2 of its layers; bf16 and float32
    python bench/plan_check.py --models smollm2-135m --dtypes bfloat16
    python bench/plan_check.py --models tiny --pack     # and each micro-batch packed in one row (--pack)
"""

import argparse
import itertools
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {  # model -> (sequences, prompt tokens, completion tokens) of the measured micro-batch
    "tiny": (8, 256, 256),
    "smollm2-135m": (8, 40, 48),  # the CPU demo's micro-batch
    "smollm2-2-layers": (8, 40, 48),  # its tied 49152 x 576 head on 2 of its 30 layers: the head's moments, fast
}


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _map_large_blocks():
    import ctypes

    mallopt = ctypes.CDLL("libc.so.6").mallopt
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    mallopt(M_TRIM_THRESHOLD, 64 * 1024)


def _model(model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def measure_state(model_dir) -> int:
    import torch

    def build_and_step():
        model = _model(model_dir)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # train.make_optimizer, one process
        optimizer.step()
        return model, optimizer

    _map_large_blocks()
    warm = build_and_step()  # once first, and kept: lazy imports and kernels load outside the measurement,
    before = _kib("RssAnon:")  # and no freed block of it can hold the measured state
    model, optimizer = build_and_step()
    measured = (_kib("RssAnon:") - before) * 1024
    del warm, model, optimizer
    return measured


def measure_activations(model_dir, batch, prompt, completion, dtype, checkpointing, packed=False) -> int:
    import torch

    from loss import policy_loss
    from speed.backward import configure_backward
    from speed.logprobs import pack_batch, packed_logprobs, sequence_logprobs

    _map_large_blocks()
    model = _model(model_dir)
    configure_backward(model, bf16=dtype == "bfloat16", checkpointing=checkpointing)  # as train.load_models
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, prompt + completion), generator=g)
    attention_mask = torch.ones_like(input_ids)  # no padding: every position is a real token
    mask = torch.ones(batch, completion)
    adv = torch.randn(batch, generator=g)
    rows = input_ids.tolist()
    row = pack_batch([r[:prompt] for r in rows], [r[prompt:] for r in rows])  # --pack: one row, no pad

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            if packed:
                logp = packed_logprobs(model, row, mask)  # (B, K), scattered back
            else:
                logp = sequence_logprobs(model, input_ids, attention_mask, completion)  # (B, K)
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, ref_logp=logp.detach() + 0.1)
        loss.backward()

    step()  # gradients exist from here on (they belong to the training state), lazy buffers are warm
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    base = _kib("VmRSS:")
    step()
    return (_kib("VmHWM:") - base) * 1024


def model_dir(name: str) -> str:
    if name == "tiny":
        import tempfile

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from tools.tiny_model import build_tiny_model

        return build_tiny_model(tempfile.mkdtemp(prefix="plan-check-tiny-"))
    from rollout import resolve_model

    if name != "smollm2-2-layers":
        return resolve_model(name)
    import tempfile

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m"))
    config.num_hidden_layers = 2
    config.save_pretrained(path := tempfile.mkdtemp(prefix="plan-check-smollm2-"))
    return path


def child(cmd: list[str]) -> int:
    result = subprocess.run([sys.executable, __file__, *cmd], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "child failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(models, dtypes, one_process=False, pack=False) -> list[dict]:
    """Measured vs planned bytes for each model: training state, then activations per dtype x checkpointing (x
    padded or packed, with `pack`: the micro-batch's sequences as one row, --pack). `one_process`: measure in this
    process, one after another (faster; the state comes first, on a clean heap)."""
    from speed.logprobs import CPU_CHUNK_ELEMENTS
    from tools.memory_plan import activations, model_shape, training_state

    def measure(cmd):
        if not one_process:
            return child(cmd)
        if cmd[0] == "--state":
            return measure_state(cmd[1])
        path, batch, prompt, completion, dtype, ckpt, packed = cmd[1:]
        return measure_activations(path, int(batch), int(prompt), int(completion), dtype, ckpt == "1", packed == "1")

    rows = []
    for name in models:
        path = model_dir(name)
        shape = model_shape(path)
        planned = sum(training_state(shape, ranks=1, unsharded_grads=False).values())
        rows.append(dict(model=name, what="training state", measured=measure(["--state", path]), planned=planned))
        batch, prompt, completion = SHAPES[name]
        for dtype, ckpt, packed in itertools.product(dtypes, (False, True), (False, True) if pack else (False,)):
            act = activations(
                shape,
                batch=batch,
                prompt=prompt,
                completion=completion,
                compute_bytes=2 if dtype == "bfloat16" else 4,
                checkpointing=ckpt,
                attention="eager",
                chunk_elements=CPU_CHUNK_ELEMENTS,
                packed=packed,
            )  # measured on CPU
            flags = [str(batch), str(prompt), str(completion), dtype, str(int(ckpt)), str(int(packed))]
            measured = measure(["--activations", path, *flags])
            rows.append(
                dict(
                    model=name,
                    what=f"activations {batch}x({prompt}+{completion}) {dtype}{' ckpt' * ckpt}{' packed' * packed}",
                    measured=measured,
                    planned=act["peak"],
                )
            )
    for row in rows:
        row["error"] = row["planned"] / row["measured"] - 1
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    parser.add_argument("--one-process", action="store_true", help="measure in this process, not one per row")
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--pack", action="store_true", help="also measure each micro-batch packed in one row (--pack)")
    parser.add_argument("--activations", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.state:  # child processes
        print(json.dumps(measure_state(args.state)))
        return
    if args.activations:
        path, batch, prompt, completion, dtype, ckpt, packed = args.activations
        sizes = int(batch), int(prompt), int(completion)
        print(json.dumps(measure_activations(path, *sizes, dtype, ckpt == "1", packed == "1")))
        return
    rows = check(args.models, args.dtypes, args.one_process, args.pack)
    if args.json:
        print(json.dumps(rows))
        return
    mib = 2**20
    print(f"{'model':<14}{'what':<44}{'measured MiB':>14}{'planned MiB':>13}{'plan error':>12}")
    for row in rows:
        print(
            f"{row['model']:<14}{row['what']:<44}{row['measured'] / mib:>14.1f}{row['planned'] / mib:>13.1f}"
            f"{row['error']:>+12.1%}"
        )


if __name__ == "__main__":
    main()
