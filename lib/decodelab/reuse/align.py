"""Text alignment for reuse: which words of an earlier question stand for which words of the new one, the
earlier trace rewritten with them, and a token sequence cut into reasoning steps.

Only the two *questions* are aligned (both known when the new query arrives): numbers, names, items and
pronouns that differ at the same word position. Intermediate results and answers of the earlier trace are
left as they were, so nothing the new query has not said leaks into a draft; a step whose arithmetic no longer
holds is the target's to reject.
"""
from __future__ import annotations

import re

_WORD = re.compile(r"\w+|[^\w\s]")
STEP_END = (".", "\n")  # a token whose text ends with one of these closes a reasoning step


def words(text: str) -> list[str]:
    """Words and punctuation marks of `text`, in order."""
    return _WORD.findall(text)


def question_alignment(old: str, new: str) -> dict[str, str]:
    """old word -> new word at every position where two questions of equal word count differ; {} when the
    counts differ (different templates do not align) or a word would map two ways (ambiguous, dropped)."""
    a, b = words(old), words(new)
    if len(a) != len(b):
        return {}
    pairs: dict[str, str] = {}
    clashes = set()
    for x, y in zip(a, b):
        if x == y:
            continue
        if pairs.get(x, y) != y:
            clashes.add(x)
        pairs[x] = y
    # A word equal in one place and changed in another ("3" kept and "3" -> "7") is ambiguous too.
    kept = {x for x, y in zip(a, b) if x == y}
    return {x: y for x, y in pairs.items() if x not in clashes and x not in kept}


def substitute(text: str, mapping: dict[str, str]) -> str:
    """Replace every whole-word occurrence of mapping's keys in one pass (so 3 -> 5 and 5 -> 8 do not chain);
    longer keys first, so "12" is not read as "1" + "2"."""
    if not mapping:
        return text
    keys = sorted(mapping, key=len, reverse=True)
    pattern = re.compile(r"(?<!\w)(" + "|".join(re.escape(k) for k in keys) + r")(?!\w)")
    return pattern.sub(lambda m: mapping[m.group(1)], text)


def is_step_end(piece: str) -> bool:
    """Does a token's text close a reasoning step (a sentence end or a line break)?"""
    return piece.rstrip(" ").endswith(STEP_END)


def split_steps(tokens: list[int], pieces: list[str]) -> list[list[int]]:
    """Cut token ids into steps after each token whose text (`pieces[i]`) closes a step; a trailing part
    without a closing token is a step too."""
    if len(tokens) != len(pieces):
        raise ValueError(f"split_steps: {len(tokens)} tokens but {len(pieces)} pieces; need one text per token")
    steps, current = [], []
    for token, piece in zip(tokens, pieces):
        current.append(token)
        if is_step_end(piece):
            steps.append(current)
            current = []
    if current:
        steps.append(current)
    return steps


def token_pieces(tokenizer, tokens: list[int]) -> list[str]:
    """Each token's own text (decoded alone)."""
    return [tokenizer.decode([t]) for t in tokens]


_SUM = re.compile(r"(?<![\w.])(\d+(?:\s*[-+*x×]\s*\d+)+)\s*=\s*(\d+)(?![\w])")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "x": lambda a, b: a * b,
        "×": lambda a, b: a * b}


def _evaluate(expression: str) -> int:
    """Left-to-right value of "a op b op c" (the traces' one-line sums; * before + is not needed there)."""
    parts = re.findall(r"\d+|[-+*x×]", expression)
    value = int(parts[0])
    for op, number in zip(parts[1::2], parts[2::2]):
        value = _OPS[op](value, int(number))
    return value


def recompute(text: str) -> str:
    """Redo the arithmetic of a substituted trace: every "a op b = c" gets c = the true value of the left side,
    and every later whole-word occurrence of an old result becomes its new value (so "The answer is 14" follows
    "4 + 10 = 14" -> "16 + 17 = 33"). For *lossless* drafting only: a draft is verified token by token, so a
    recomputed number is accepted only where the target itself writes it; step reuse (lossy) keeps the old
    results (module docstring) so no arithmetic the target did not do enters an answer."""
    mapping: dict[str, str] = {}
    out, last = [], 0
    for match in _SUM.finditer(text):
        expression = substitute(match.group(1), mapping)
        value = str(_evaluate(expression))
        if match.group(2) != value:
            mapping[match.group(2)] = value
        out.append(substitute(text[last:match.start()], mapping) + f"{expression} = {value}")
        last = match.end()
    out.append(substitute(text[last:], mapping))
    return "".join(out)
