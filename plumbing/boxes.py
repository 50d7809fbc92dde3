"""Reading answers out of model text for rewards.py: boxes, runs of boxes, nesting depth, bare gold numbers.

    python -m pytest tests/test_rewards.py -q
"""

import re


def last_boxed(text: str, limit: int = 2000) -> str | None:
    """Content of the last \\boxed{...} with balanced braces (scans at most `limit` characters)."""
    start = text.rfind("\\boxed{")
    box = _box_at(text, start, limit) if start >= 0 else None
    return None if box is None else box[0]


# What may part two boxes of one answer: "\\boxed{1} and \\boxed{2}", "\\boxed{(2, 2)} \\quad \\text{and} ...",
# "\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}", "y_1 = \\boxed{..} \\) and \\( y_2 = \\boxed{..}"
_LINK_WORDS = r"(?:and|or|for|part|parts|case|cases)"
_PART_LABEL = r"(?:\([a-z0-9]{1,3}\)|[a-z0-9]\))"  # (a), (ii), b)
_BOX_SEPARATOR = re.compile(r"(?:[\s,;$&]|\\quad|\\qquad|\\[,;()]|" + _PART_LABEL + r"|(?<![\w\\])" + _LINK_WORDS
                            + r"(?!\w)|\\text\{(?:[\s,]|" + _PART_LABEL + "|" + _LINK_WORDS + r"(?!\w))*\}"
                            r"|(?<![\w\\])[A-Za-z](?:_\{?[A-Za-z0-9]{1,3}\}?)?\s*=)*")


def _box_at(text: str, start: int, limit: int):
    """(content, index past its closing brace) of the \\boxed{ at `start`, or None when it does not close."""
    begin, depth = start + len("\\boxed{"), 1
    for i in range(begin, min(len(text), begin + limit)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[begin:i].strip(), i + 1
    return None


def last_boxes(text: str, limit: int = 2000) -> list[str]:
    """The contents of the answer's last run of boxes: the last \\boxed{} (last_boxed's), and the boxes before it
    that only separators part from it (commas, "and", "or", \\quad, \\text{and}, "(a)", "y_2 ="). math-verify reads
    several boxes as one set; a box that words part from the last ("\\boxed{2}, so the answer is \\boxed{3}") is
    working."""
    return _last_box_run(text, limit)[0]


def _last_box_run(text: str, limit: int) -> tuple[list[str], int]:
    """last_boxes' contents, and the index just past the last box (-1 when there is none)."""
    start = text.rfind("\\boxed{")
    last = _box_at(text, start, limit) if start >= 0 else None
    if last is None:
        return [], -1
    run, end = [last[0]], last[1]
    while (before := text.rfind("\\boxed{", 0, start)) >= 0:
        box = _box_at(text, before, limit)
        if box is None or box[1] > start or not _BOX_SEPARATOR.fullmatch(text[box[1]:start]):
            break
        run.insert(0, box[0])
        start = before
    return run, end


def _depth(text: str) -> int:
    """Deepest bracket nesting, counting unmatched closers too (a cut-off tail is all closers)."""
    depth = deepest = 0
    for char in text:
        depth += (char in "({[") - (char in ")}]")
        deepest = max(deepest, abs(depth))
    return deepest


def plain_number(gold: str) -> str:
    """A gold number with commas, as math-verify reads it bare: thousands ("7,425,000") or a decimal comma
    ("1,22"). Boxed as it is, "1,22" would be the pair (1, 22)."""
    if re.fullmatch(r"-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?", gold):  # "0,111" is a decimal comma
        return gold.replace(",", "")
    return gold.replace(",", ".") if re.fullmatch(r"-?\d+,\d+", gold) else gold
