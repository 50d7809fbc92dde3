"""Prompts into token ids through the model's chat template (train.py, eval.py, tools/ and bench/).

A dataset is untrusted input, so its text stays text: a row whose messages hold one of the tokenizer's special
tokens (`<|im_start|>`, `<|im_end|>`, ...) is refused in one line. Rendered through the chat template, such a string
becomes a real turn marker, and a question could inject a system turn ("...<|im_end|>\\n<|im_start|>system\\n...").
Refusing is chosen over escaping: the chat template renders text before it is tokenized, so there is no way to
mark part of it as plain text, and a row that needs such strings is rare enough to clean by hand.
"""

from plumbing.cli import first_line
from plumbing.data import DataError
from plumbing.models import ModelLoadError


def special_tokens(tokenizer) -> list[str]:
    """Every special token's text: the named ones and the added ones marked special (chat markers are the latter)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(names | {t.content for t in added.values() if getattr(t, "special", False)}, key=len, reverse=True)


def _where(example, i: int) -> str:
    """The file line of a row (Example.source), else its position in the list, with its uid."""
    return f"{getattr(example, 'source', '') or f'row {i}'} ({getattr(example, 'uid', '')})"


def valid_prompt(prompt) -> bool:
    """A prompt is a non-empty list of chat messages, each with a role and text, some text not blank."""
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and m.get("role") and isinstance(m.get("content"), str) for m in prompt)
            and any(m["content"].strip() for m in prompt))


def encode_prompts(tokenizer, examples, max_len: int | None = None) -> list[list[int]]:
    """Chat-template token ids of each example's prompt, ending with the assistant turn's header. A row holding a
    special token is a DataError; with `max_len` (the context the model has left beside the completion), so is a
    longer prompt. A chat template that fails to render (a sandbox escape, a syntax error) is a ModelLoadError."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError("the tokenizer has no chat template; use an instruct/chat model")
    specials = [t for t in special_tokens(tokenizer) if t]
    for i, ex in enumerate(examples):
        for message in ex.prompt:
            found = next((t for t in specials if t in str(message.get("content", ""))), None)
            if found is not None:
                raise DataError(f"{_where(ex, i)}: its {message.get('role', '')} text holds the "
                                f"special token {found!r}, which the chat template would turn into a real turn "
                                "marker; remove it from the data")
    try:
        ids = [list(tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for ex in examples]
    except Exception as err:  # jinja2's SecurityError, TemplateSyntaxError, ...: the model folder's template
        if type(err).__module__.split(".")[0] != "jinja2":
            raise
        raise ModelLoadError(f"the model's chat template cannot render a prompt ({first_line(err, typed=True)}); "
                             "use a model whose tokenizer_config.json has a working chat_template") from None
    too_long = [i for i, p in enumerate(ids) if max_len is not None and len(p) > max_len]
    if too_long:
        i = too_long[0]
        raise DataError(f"{_where(examples[i], i)}: its prompt is {len(ids[i])} tokens, more than "
                        f"the {max_len} the model's context leaves beside --max-tokens ({len(too_long)} such rows)")
    return ids
