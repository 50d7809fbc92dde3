"""Where the peak resident memory of a training step goes, row by row, each row measured.

Our side runs in one fresh process through train.py's own functions (plumbing.models.load_model,
train.load_reference, train.make_optimizer, rollout.make_sampler, train.ppo_update, the sampler's
weight sync) on bench/vs_trl.py's work: the embedded SmolLM2-135M-Instruct, `arith` prompts in train.py's
order, 4 prompts x M = 8, <= 64 new tokens, micro-batches of 8, bf16 autocast over float32 master
weights, AdamW, beta 1e-3, and glibc keeping freed memory as train.py sets it on CPU. What is measured:

- resident memory (VmRSS, /proc/self/statm) after each phase; the process's peak (VmHWM);
- glibc's heap (mallinfo2: bytes in use, bytes free but kept), which holds every CPU tensor here (torch's
  CPU allocator is posix_memalign, and train.py's keep_freed_memory turns off mmap for large blocks);
- resident memory is read again at every tensor autograd saves, every gradient that lands, each decode
  call and the optimizer step; at its highest reading a snapshot records the heap, the phase (which
  forward, which micro-batch, the optimizer step), the gradients' and AdamW moments' tensor bytes, and
  the tensors autograd then holds for backward (saved_tensors_hooks, one count per storage, released
  when autograd frees them), sorted into bf16 weight casts, attention probabilities, logits and other
  activations;
- the sampler's KV cache: the bytes of its key/value tensors after each decode call (a forward hook);
- two isolated measurements, each in its own fresh process with glibc's default allocator (so freed
  memory is returned and the peak counter can be reset): the log-prob function's extra memory on one
  micro-batch's logits, and one micro-batch's forward with and without autograd saving for backward.

The rows at the peak add up to the snapshot's resident memory by construction only through the last
row, the part outside the malloc heap, which is printed, not hidden. TRL's side (--trl, bench/trl_grpo.py
in `.venv-trl`, which bench/vs_trl.py creates) is measured from outside: its peak RSS, and the RSS of its
imports alone; its training state and fp32 reference are arithmetic (the same optimizer and model).

    python bench/memory.py                       # ours, SmolLM2-135M, 4 steps
    python bench/memory.py --steps 2 --trl       # 2 steps, and TRL's side
    python bench/memory.py --steps 2 --trl-only  # TRL's side alone
    python bench/memory.py --model /tmp/tiny --steps 2 --max-tokens 8     # smoke test on a tiny model
"""

import argparse
import ctypes
import itertools
import json
import os
import subprocess
import sys
import weakref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PAGE = os.sysconf("SC_PAGE_SIZE")
SAVED_KINDS = ("weights_bf16", "attention_probs", "logits", "activations")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS from here on


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


try:
    _mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    _mallinfo2.restype = _Mallinfo2
except (OSError, AttributeError):  # not glibc >= 2.33: the heap rows cannot be measured
    _mallinfo2 = None


def trim():
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def heap() -> dict:
    """glibc's heap over all arenas: bytes handed out (mmapped blocks included) and bytes free but kept."""
    if _mallinfo2 is None:
        raise SystemExit("memory.py: needs glibc >= 2.33 (mallinfo2) to measure the heap")
    m = _mallinfo2()
    return {"in_use": m.uordblks + m.hblkhd, "free": m.fordblks}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def sampler_bytes(sampler) -> int:
    """The HF sampler's weights, buffers and the packed weights of its linear layers (rollout._pack_linears)."""
    packed = [m.packed_weight for m in sampler.model.modules() if getattr(m, "packed_weight", None) is not None]
    return tensor_bytes(sampler.model.parameters()) + tensor_bytes(sampler.model.buffers()) + tensor_bytes(packed)


class SavedTensors:
    """Bytes autograd holds for backward right now, per kind; a storage counts once, parameters never."""

    def __init__(self, model, vocab):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
        self.vocab, self.seq_len = vocab, -1
        self.live = dict.fromkeys(SAVED_KINDS, 0)
        self.most = dict.fromkeys(SAVED_KINDS, 0)  # the largest total seen, per kind
        self.refs = {}  # storage pointer -> [kind, bytes, live references]
        self.watcher = None

    def kind(self, t) -> str:
        import torch

        shape = tuple(t.shape)
        if t.dtype == torch.bfloat16 and shape in self.shapes and t.dim() == 2:
            return "weights_bf16"  # autocast's cast of a float32 weight, kept for the backward matmul
        if t.dim() == 4 and shape[-1] == shape[-2] == self.seq_len:
            return "attention_probs"  # eager attention's softmax output (B, heads, S, S)
        if shape and shape[-1] == self.vocab:
            return "logits"
        return "activations"

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params or ptr == 0:
            return t
        if ptr not in self.refs:
            kind = self.kind(t)
            self.refs[ptr] = [kind, t.untyped_storage().nbytes(), 0]
            self.live[kind] += self.refs[ptr][1]
            self.most[kind] = max(self.most[kind], self.live[kind])
            if self.watcher is not None:
                self.watcher()
        self.refs[ptr][2] += 1
        weakref.finalize(t, self.release, ptr)
        return t

    def release(self, ptr):
        entry = self.refs[ptr]
        entry[2] -= 1
        if entry[2] == 0:
            self.live[entry[0]] -= entry[1]
            del self.refs[ptr]

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class PeakWatcher:
    """Reads resident memory whenever called (from hooks in the step); at each new high, snapshots the heap,
    the phase and the live tensor bytes. In the training thread itself: a polling thread would take the GIL
    from it every few milliseconds, which on a loaded machine slows the step many times over."""

    def __init__(self, state):
        self.state, self.best, self.snapshot = state, 0, {}

    def __call__(self, *_):
        now = rss()
        if now > self.best:
            self.best = now
            self.snapshot = {"rss": now, **heap(), **self.state.live_bytes()}


class State:
    """What the step has alive, readable from the watcher thread."""

    def __init__(self):
        self.phase, self.model, self.optimizer, self.saved, self.sampler = "start", None, None, None, None

    def live_bytes(self) -> dict:
        grads = moments = 0
        if self.model is not None:
            grads = tensor_bytes([p.grad for p in list(self.model.parameters())])
        if self.optimizer is not None:
            states = list(self.optimizer.state.values())
            moments = sum(tensor_bytes([v for v in s.values() if hasattr(v, "numel") and v.dim() > 0]) for s in states)
        saved = dict(self.saved.live) if self.saved is not None else dict.fromkeys(SAVED_KINDS, 0)
        sampler = 0 if self.sampler is None else sampler_bytes(self.sampler)
        return {"phase": self.phase, "grads": grads, "moments": moments, "saved": saved, "sampler": sampler}


def measure_ours(opts) -> dict:
    """One fresh process through train.py's functions; returns the raw measurements."""
    record = {"rss_imports": 0}
    import torch

    import plumbing.data
    import plumbing.models
    import speed.allocator
    import speed.backward
    import speed.compile
    import train
    from advantage import compute_advantages
    from rollout import make_sampler, resolve_model
    from tasks import encode_prompts, get_task

    record["rss_imports"], record["heap_imports"] = rss(), heap()
    speed.allocator.keep_freed_memory()  # as train.main on CPU, before any model is loaded
    torch.manual_seed(opts.seed)
    args = train.Args(
        task=opts.task,
        model=opts.model,
        M=opts.M,
        rollout_batch=opts.prompts,
        micro_batch=opts.micro_batch,
        minibatches=1,
        ppo_epochs=1,
        steps=opts.steps,
        max_tokens=opts.max_tokens,
        lr=opts.lr,
        warmup_steps=0,
        beta=opts.beta,
        dtype="bfloat16",
        sampler="hf",
        eval_examples=0,
        seed=opts.seed,
    )
    path = resolve_model(opts.model)
    state = State()
    watcher = PeakWatcher(state)
    phases = {}

    def phase(name, fn):
        state.phase, before = name, rss()
        out = fn()
        phases[name] = {"rss_before": before, "rss_after": rss()}
        watcher()
        return out

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    task = get_task(opts.task)
    train_set = task.load("train", seed=opts.seed)
    record["rss_data"] = rss()
    model = phase("load policy", lambda: plumbing.models.load_model(path, torch.float32, "cpu"))
    speed.backward.configure_backward(
        model, bf16=args.dtype == "bfloat16", checkpointing=args.grad_checkpointing
    )  # as train
    ref_model = phase("load reference", lambda: train.load_reference(path, args, torch.device("cpu")))
    optimizer = train.make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler = phase("load sampler", lambda: make_sampler("hf", path, dtype="bfloat16", seed=opts.seed))
    record["rss_loaded"], record["heap_loaded"] = rss(), heap()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    record.update(
        n_params=n_params,
        weights=tensor_bytes(model.parameters()),
        reference=tensor_bytes(ref_model.parameters()) + tensor_bytes(ref_model.buffers()),
        sampler=sampler_bytes(sampler),
    )
    state.model, state.optimizer, state.sampler = model, optimizer, sampler
    state.saved = SavedTensors(model, model.get_output_embeddings().weight.shape[0])
    state.saved.watcher = watcher

    kv = {"most": 0}

    def count_cache(module, args_, kwargs, output):
        cache = getattr(output, "past_key_values", None)
        tensors = [t for layer in getattr(cache, "layers", []) for t in (layer.keys, layer.values)]
        kv["most"] = max(kv["most"], tensor_bytes(tensors))
        watcher()

    def policy_forward(module, args_, kwargs):
        input_ids = (
            kwargs["input_ids"] if "input_ids" in kwargs else args_[0]
        )  # sequence_logprobs passes it by position
        state.saved.seq_len = input_ids.shape[1]
        if torch.is_grad_enabled():
            state.phase = f"step {step + 1}: policy forward/backward, micro-batch {next(counter) + 1}"

    sampler.model.register_forward_hook(count_cache, with_kwargs=True)
    model.register_forward_pre_hook(policy_forward, with_kwargs=True)
    ref_model.register_forward_pre_hook(lambda *a: setattr(state, "phase", f"step {step + 1}: reference forward"))
    grads_at_step = []

    def at_step(opt, *a):
        state.phase = f"step {step + 1}: optimizer step"
        grads_at_step.append(tensor_bytes([p.grad for p in model.parameters()]))
        watcher()

    def after_step(opt, *a):
        watcher()
        state.phase = f"step {step + 1}: after the update"

    for p in model.parameters():  # during backward, as each gradient lands
        p.register_post_accumulate_grad_hook(watcher)

    optimizer.register_step_pre_hook(at_step)
    optimizer.register_step_post_hook(after_step)
    shapes, sampling, training, syncing = [], [], [], []
    for step in range(opts.steps):
        counter = itertools.count()
        picked = [train_set[i] for i in plumbing.data.batch_indices(step, opts.prompts, len(train_set), opts.seed)]
        prompts = encode_prompts(tokenizer, picked)
        before = rss()
        reset_peak()
        state.phase = f"step {step + 1}: sampling"
        groups = sampler.generate(prompts, n=opts.M, max_tokens=opts.max_tokens, seed=opts.seed + step)
        sampling.append({"rss_before": before, "peak": peak_rss(), "rss_after": rss(), "kv_cache": kv["most"]})
        sampler.sleep()  # as train.py: its weights are freed until the sync
        speed.allocator.release_freed_memory()  # and the heap's free pages handed back before training
        rewards = torch.tensor([[task.reward(c.text, ex) for c in g] for ex, g in zip(picked, groups)])  # (G, M)
        adv = compute_advantages("softmax", rewards, 0.1).reshape(-1)  # (G * M,)
        flat = [(p, c) for p, g in zip(prompts, groups) for c in g]
        completions = [c.token_ids for _, c in flat]
        shapes.append([len(flat), max(map(len, prompts)), max(map(len, completions))])
        reset_peak()
        with state.saved.hooks():
            train.ppo_update(
                model,
                ref_model,
                optimizer,
                scheduler,
                [p for p, _ in flat],
                completions,
                [c.logprobs for _, c in flat],
                adv,
                args,
                pad_id,
            )
        training.append(peak_rss())
        state.phase = f"step {step + 1}: weight sync"
        reset_peak()
        sampler.update_weights(train.full_weights(model))
        watcher()
        syncing.append(peak_rss())
        print(
            f"step {step + 1} done, peak {sampling[-1]['peak'] / 1e9:.3f} / {training[-1] / 1e9:.3f} / "
            f"{syncing[-1] / 1e9:.3f} GB (sampling / training / sync)",
            file=sys.stderr,
            flush=True,
        )
    state.phase = "end"
    record.update(
        phases=phases,
        sampling=sampling,
        training=training,
        syncing=syncing,
        shapes=shapes,
        peak=max(peak_rss(), *training, *syncing, *(s["peak"] for s in sampling)),
        snapshot=watcher.snapshot,
        saved_most=state.saved.most,
        grads_at_step=max(grads_at_step),
        moments=State.live_bytes(state)["moments"],
        heap_end=heap(),
        rss_end=rss(),
        vocab=model.get_output_embeddings().weight.shape[0],
        sampling_most_kv=kv["most"],
    )
    return record


def measure_isolated(opts, batch, seq_len, completion_len) -> dict:
    """In a fresh process, default allocator: extra memory of the log-prob function on one micro-batch's
    logits, and of one micro-batch's forward with and without autograd saving tensors for backward."""
    import torch

    import plumbing.models
    from rollout import resolve_model
    from speed.logprobs import chunked_token_logprobs as token_logprobs  # the kernel training runs

    model = plumbing.models.load_model(resolve_model(opts.model), torch.float32, "cpu")
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)  # (B, S)
    out = {}

    def extra(fn):
        trim()  # free heap pages back to the OS, so that the peak counter starts from live memory only
        before = rss()
        reset_peak()
        result = fn()
        return peak_rss() - before, result

    logits = torch.randn(batch, completion_len, vocab, generator=g).bfloat16().requires_grad_()  # (B, K, V)
    targets = torch.randint(0, vocab, (batch, completion_len), generator=g)
    out["logprob_extra"], _ = extra(lambda: token_logprobs(logits, targets).sum().backward())
    out["logits_bytes"] = logits.numel() * 2
    logits.grad = None
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), autocast:
        out["forward_no_grad"], _ = extra(lambda: model(input_ids=ids, logits_to_keep=completion_len + 1).logits.sum())
    with autocast:
        trim()
        before = rss()
        reset_peak()
        loss = model(input_ids=ids, logits_to_keep=completion_len + 1).logits.float().logsumexp(-1).sum()
        out["forward_saving"], out["kept_for_backward"] = peak_rss() - before, rss() - before
    loss.backward()
    return out


def isolated(opts, shape) -> dict:
    batch, prompt_len, completion_len = shape
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--model",
        opts.model,
        "--isolated",
        f"{batch},{prompt_len + completion_len},{completion_len}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"memory.py: the isolated measurement failed: {last}")
    return json.loads(lines[-1][len("RESULT ") :])


def account(r: dict, iso: dict | None) -> list[dict]:
    """Rows (name, bytes live at the peak, largest size seen, how measured) from the raw measurements."""
    snap, base = r["snapshot"], r["heap_loaded"]
    ph = {name: v["rss_after"] - v["rss_before"] for name, v in r["phases"].items()}
    saved = snap["saved"]
    kv_now = r["sampling_most_kv"] if "sampling" in snap["phase"] else 0
    grown = snap["in_use"] - base["in_use"]  # heap bytes handed out since the models were loaded
    asleep = r["sampler"] - snap.get("sampler", r["sampler"])  # the sampler's weights freed for training
    others = grown + asleep - snap["grads"] - snap["moments"] - sum(saved.values()) - kv_now
    retained = snap["free"] - base["free"]
    outside = snap["rss"] - r["rss_loaded"] - grown - retained
    state_bytes = r["weights"] + r["grads_at_step"] + r["moments"]
    rows = [
        (
            "Python/torch runtime",
            r["rss_imports"],
            r["rss_imports"],
            "VmRSS after importing torch, transformers and the repository's modules",
        ),
        ("tokenizer and task data", r["rss_data"] - r["rss_imports"], None, "VmRSS growth until the first model"),
        (
            "training state: fp32 weights + grads + AdamW moments",
            ph["load policy"] + snap["grads"] + snap["moments"],
            state_bytes,
            f"weights: VmRSS growth of plumbing.models.load_model ({ph['load policy'] / 1e9:.3f} GB; tensors "
            f"{r['weights'] / 1e9:.3f}); grads, moments: tensor bytes at the peak; size: tensor bytes at "
            f"optimizer.step = {state_bytes / r['n_params']:.2f} B x {r['n_params'] / 1e6:.1f}M params",
        ),
        (
            "reference model (bf16 linears)",
            ph["load reference"],
            r["reference"],
            "VmRSS growth of train.load_reference; size: its tensor bytes",
        ),
        (
            "sampler's copy (bf16)",
            ph["load sampler"] - asleep,
            r["sampler"],
            "VmRSS growth of rollout.make_sampler (tokenizer included) less the weights it freed to sleep "
            "during training (tensor bytes at the peak); size: its tensor bytes, packed linear weights included",
        ),
        (
            "KV cache during sampling",
            kv_now,
            r["sampling_most_kv"],
            "key/value tensor bytes after each decode call (forward hook); freed before training",
        ),
        (
            "sampling peak above the loaded models",
            None,
            max(s["peak"] - s["rss_before"] for s in r["sampling"]),
            "VmHWM - VmRSS around generate(), per step, largest (KV cache, logits, CDF buffers)",
        ),
        (
            "saved for backward: bf16 weight casts",
            saved["weights_bf16"],
            r["saved_most"]["weights_bf16"],
            "saved_tensors_hooks, 2-D bf16 tensors shaped like a parameter (autocast's casts)",
        ),
        (
            "saved for backward: attention probabilities",
            saved["attention_probs"],
            r["saved_most"]["attention_probs"],
            "saved_tensors_hooks, (B, heads, S, S) tensors (eager attention's softmax)",
        ),
        (
            "saved for backward: logits",
            saved["logits"],
            r["saved_most"]["logits"],
            "saved_tensors_hooks, tensors ending in the vocabulary (the log-prob function's input)",
        ),
        (
            "saved for backward: other activations",
            saved["activations"],
            r["saved_most"]["activations"],
            "saved_tensors_hooks, every other saved storage",
        ),
        (
            "other live buffers (log-prob chunks, gradients of activations)",
            others,
            iso["logprob_extra"] if iso else None,
            "heap bytes in use at the peak - all rows above that are in the heap; size: isolated log-prob "
            "forward+backward on the largest micro-batch's logits (peak above them)",
        ),
        (
            "allocator retention (glibc keeps freed memory)",
            retained,
            r["heap_end"]["free"] - base["free"],
            "mallinfo2 free bytes at the peak minus after loading; size: at the end of the run",
        ),
        (
            "outside the malloc heap",
            outside,
            None,
            "VmRSS at the peak - every row above (file pages, thread stacks, late-loaded libraries)",
        ),
    ]
    return [{"row": name, "at_peak": at, "size": size, "how": how} for name, at, size, how in rows]


def measure_trl(opts, model_path) -> dict:
    """TRL's run from outside: bench/trl_grpo.py's own peak RSS, and the RSS of its imports alone."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from vs_trl import trl_python, write_prompts

    python = trl_python(opts.venv)
    prompts_file = os.path.join(REPO, "runs", "bench", "memory-prompts.jsonl")
    os.makedirs(os.path.dirname(prompts_file), exist_ok=True)
    write_prompts(prompts_file, opts.task, model_path, opts.steps * opts.prompts, opts.seed)
    probe = (
        "import resource, torch, transformers, trl, datasets\n"
        "print(int(open('/proc/self/statm').read().split()[1]) * __import__('os').sysconf('SC_PAGE_SIZE'))"
    )
    runtime = int(subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout)
    cmd = [
        python,
        "bench/trl_grpo.py",
        "--model",
        model_path,
        "--prompts-file",
        prompts_file,
        "--task",
        opts.task,
        "--steps",
        str(opts.steps),
        "--prompts",
        str(opts.prompts),
        "--M",
        str(opts.M),
        "--max-tokens",
        str(opts.max_tokens),
        "--micro-batch",
        str(opts.micro_batch),
        "--lr",
        str(opts.lr),
        "--seed",
        str(opts.seed),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(
            f"memory.py: bench/trl_grpo.py failed (exit {proc.returncode}): "
            f"{(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}"
        )
    return {"runtime": runtime, "peak": int(json.loads(lines[-1][len("RESULT ") :])["peak_rss_gb"] * 1e9)}


def trl_rows(trl: dict, n_params: int) -> list[dict]:
    state, ref = 16 * n_params, 4 * n_params
    rest = trl["peak"] - trl["runtime"] - state - ref
    return [
        {
            "row": "Python/torch/TRL runtime",
            "at_peak": trl["runtime"],
            "size": None,
            "how": "VmRSS after importing torch, transformers, trl, datasets in .venv-trl",
        },
        {"row": "training state (16 B/param, same optimizer)", "at_peak": state, "size": None, "how": "arithmetic"},
        {"row": "reference model (fp32 copy)", "at_peak": ref, "size": None, "how": "arithmetic (4 B/param)"},
        {
            "row": "everything else (activations, sampling, allocator)",
            "at_peak": rest,
            "size": None,
            "how": "peak RSS - the rows above",
        },
        {"row": "total = peak RSS", "at_peak": trl["peak"], "size": None, "how": "trl_grpo.py's ru_maxrss, one run"},
    ]


def print_trl(opts, n_params: int) -> dict:
    trl = measure_trl(opts, opts.model)
    rows = trl_rows(trl, n_params)
    print(f"\nTRL (bench/trl_grpo.py, from outside; {n_params / 1e6:.1f}M parameters)")
    for row in rows:
        print(f"{row['row']:<66}{gb(row['at_peak']):>11}   {row['how']}")
    return {"raw": trl, "rows": rows}


def gb(x) -> str:
    return "" if x is None else f"{x / 1e9:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="embedded alias or HF folder")
    parser.add_argument("--task", default="arith")
    parser.add_argument("--steps", type=int, default=4, help="training steps in the measured process")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--M", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--beta", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl", action="store_true", help="also measure TRL's run (bench/trl_grpo.py in --venv)")
    parser.add_argument("--trl-only", action="store_true", help="measure TRL's run alone")
    parser.add_argument("--venv", default=os.path.join(REPO, ".venv-trl"))
    parser.add_argument("--no-isolated", action="store_true", help="skip the isolated micro-batch measurements")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "bench", "memory.json"))
    parser.add_argument("--isolated", help=argparse.SUPPRESS)  # child: B,S,K
    parser.add_argument("--ours", action="store_true", help=argparse.SUPPRESS)  # child: the measured run
    opts = parser.parse_args()
    if opts.isolated:
        batch, seq_len, completion_len = map(int, opts.isolated.split(","))
        print("RESULT " + json.dumps(measure_isolated(opts, batch, seq_len, completion_len)))
        return
    if opts.ours:
        raw = measure_ours(opts)
        with open(os.path.splitext(opts.out)[0] + "-raw.json", "w") as f:  # kept even if a later part fails
            json.dump(raw, f)
        print("RESULT " + json.dumps(raw))
        return
    if opts.steps < 2:
        parser.error("--steps must be >= 2 (AdamW's moments exist from the second step on)")

    from rollout import resolve_model

    opts.model = resolve_model(opts.model)  # converted once here, not inside a measured process
    if opts.trl_only:
        import math

        from safetensors import safe_open

        with safe_open(os.path.join(opts.model, "model.safetensors"), "pt") as f:  # counted, not loaded
            n_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        print_trl(opts, n_params)
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--ours", *sys.argv[1:], "--model", opts.model]
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)  # progress lines pass through
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"memory.py: the measured run failed (exit {proc.returncode})")
    raw = json.loads(lines[-1][len("RESULT ") :])
    largest = max(raw["shapes"], key=lambda s: s[1] + s[2])  # (sequences, longest prompt, longest completion)
    iso = None if opts.no_isolated else isolated(opts, [min(opts.micro_batch, largest[0]), *largest[1:]])
    rows = account(raw, iso)
    total = sum(row["at_peak"] or 0 for row in rows)
    named = total - rows[-1]["at_peak"]
    print(
        f"ours: {opts.model}, {opts.prompts} prompts x M={opts.M}, <= {opts.max_tokens} new tokens, micro-batches "
        f"of {opts.micro_batch}, {opts.steps} steps in one process; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"peak at: {raw['snapshot']['phase']} (polled VmRSS {raw['snapshot']['rss'] / 1e9:.3f} GB, VmHWM "
        f"{raw['peak'] / 1e9:.3f} GB)\n"
    )
    print(f"{'row':<66}{'at peak GB':>11}{'size GB':>9}")
    for row in rows:
        print(f"{row['row']:<66}{gb(row['at_peak']):>11}{gb(row['size']):>9}")
    print(f"{'sum of the rows above but the last':<66}{gb(named):>11}")
    print(f"{'process peak (VmHWM)':<66}{gb(raw['peak']):>11}")
    print(f"rows but the last / peak: {named / raw['peak']:.3f}")
    if iso:
        print(
            f"\nisolated, micro-batch {largest[1:]} (B, P, K) -> ({min(opts.micro_batch, largest[0])}, "
            f"{largest[1] + largest[2]}, {largest[2]}): forward with autograd saving peaks "
            f"{gb(iso['forward_saving'])} GB above its start and keeps {gb(iso['kept_for_backward'])} GB for "
            f"backward; without saving (no_grad) {gb(iso['forward_no_grad'])} GB; log-prob function "
            f"{gb(iso['logprob_extra'])} GB above its {gb(iso['logits_bytes'])} GB of logits"
        )
    result = {"options": vars(opts), "raw": raw, "isolated": iso, "rows": rows, "peak": raw["peak"]}
    if opts.trl:
        result["trl"] = print_trl(opts, raw["n_params"])
        print(f"ours / TRL peak RSS: {raw['peak'] / result['trl']['raw']['peak']:.3f}")
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nraw results: {opts.out}")


if __name__ == "__main__":
    main()
