"""Chat prompts into token ids through the model's chat template; special tokens in text are refused (unescapable)."""

from plumbing.cli import first_line
from plumbing.data import DataError
from plumbing.models import ModelLoadError


def valid_prompt(prompt) -> bool:
    """A non-empty list of chat messages with roles and some non-blank text."""
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and m.get("role") and isinstance(m.get("content"), str) for m in prompt)
            and any(m["content"].strip() for m in prompt))


def encode_prompts(tokenizer, examples, max_len: int | None = None) -> list[list[int]]:
    """Chat-template token ids of each prompt, ending with the assistant header; DataError for bad rows."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError("the tokenizer has no chat template; use an instruct/chat model")
    added = [token.content for token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
             if getattr(token, "special", False)]
    specials = sorted({*(getattr(tokenizer, "all_special_tokens", []) or []), *added} - {""}, key=len, reverse=True)
    where = [f"{getattr(ex, 'source', '') or f'row {i}'} ({getattr(ex, 'uid', '')})" for i, ex in enumerate(examples)]
    for i, ex in enumerate(examples):
        for message in ex.prompt:
            if found := next((t for t in specials if t in str(message.get("content", ""))), None):
                raise DataError(f"{where[i]}: its {message.get('role', '')} text holds the special token {found!r}, "
                                "which the chat template would turn into a real turn marker; remove it from the data")
    try:
        ids = [list(tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for ex in examples]
    except Exception as err:
        if type(err).__module__.split(".")[0] != "jinja2":
            raise
        raise ModelLoadError(f"the model's chat template cannot render a prompt ({first_line(err, typed=True)}); "
                             "use a model whose tokenizer_config.json has a working chat_template") from None
    too_long = [i for i, p in enumerate(ids) if max_len is not None and len(p) > max_len]
    if too_long:
        i = too_long[0]
        raise DataError(f"{where[i]}: its prompt is {len(ids[i])} tokens, more than the {max_len} the model's "
                        f"context leaves beside --max-tokens ({len(too_long)} such rows)")
    return ids
