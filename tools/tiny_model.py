"""A tiny random-weight Llama and a character-level tokenizer, saved as a normal Hugging Face folder for tests.

Tied embeddings, like SmolLM2 and Qwen2.5, so the weight sync of tied parameters is exercised too.

    python -c "from tools.tiny_model import build_tiny_model; build_tiny_model('/tmp/tiny')"
"""

import string

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus chat specials; EOS is <|im_end|>."""
    chars = list(string.printable[:95]) + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    # BPE with no merges splits text into single characters; Fuse joins them back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(path, seed: int = 0, num_layers: int = 2, attention_bias: bool = False) -> str:
    """Write a random-weight Llama (about 0.2M parameters) and its tokenizer to `path` (`attention_bias`:
    biases on q/k/v/o, as Qwen2 has on q/k/v)."""
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
        attention_bias=attention_bias,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
