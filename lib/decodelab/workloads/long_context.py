"""Long-context workloads from shipped text: one long document (a standard-library module's source) shared by
every row, then a per-row request about a different function of it (edit it / explain it).

A row's prompt is `prefix + suffixes[b]`: the prefix (chat header + the document) is token-identical across
rows, so a decoder may prefill it once and replicate its KV into B rows (see
`decodelab.speculation.sparse_draft.prefill_once`), and the sweep's time goes to decoding, not to B long
prefills. The document is cut so the longest row's prompt is `context` tokens.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

from decodelab.workloads.prompts import chat_text

DEFAULT_MODULE = "argparse"  # ~2,600 lines: a 4k-token cut holds dozens of functions to ask about
TASKS = {
    "edit": "Rewrite the function `{name}` from the module above with type hints. Reply with code only.",
    "explain": "Explain what the function `{name}` in the module above does, step by step.",
}
MARKER = "\x00DOC\x00"


@dataclass
class LongContextWorkload:
    """prefix: shared token ids (chat header + document); suffixes: B per-row request ids (ending with the
    assistant header); functions: the function each row asks about; context: the target prompt length."""

    prefix: list[int]
    suffixes: list[list[int]]
    functions: list[str]
    context: int
    module: str
    task: str

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prefix + s for s in self.suffixes]

    @property
    def batch_size(self) -> int:
        return len(self.suffixes)


def module_source(module: str = DEFAULT_MODULE) -> str:
    """The source text of a standard-library module (shipped with Python), from its first top-level `def` or
    `class` on (a module's header docstring defines nothing to ask about)."""
    try:
        path = importlib.import_module(module).__file__
    except ImportError as error:
        raise ValueError(f"module={module!r} is not an importable module ({error})") from None
    if not path or not path.endswith(".py"):
        raise ValueError(f"module={module!r} has no Python source file (got {path!r})")
    text = Path(path).read_text(encoding="utf-8")
    first = re.search(r"^(def|class)\s", text, flags=re.M)
    return text[first.start():] if first else text


def function_names(source: str) -> list[str]:
    """Names of the functions and methods defined in `source`, in order, without repeats."""
    seen = []
    for name in re.findall(r"^\s*def\s+([A-Za-z_]\w*)\s*\(", source, flags=re.M):
        if name not in seen:
            seen.append(name)
    return seen


def long_context_workload(tokenizer, *, context: int, batch: int, task: str = "edit",
                          module: str = DEFAULT_MODULE) -> LongContextWorkload:
    """B prompts of ~`context` tokens: the first part of `module`'s source + row b's request about the b-th
    function defined in that part (cycling when there are fewer functions than rows)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; allowed: {sorted(TASKS)}")
    if not isinstance(context, int) or context < 256:
        raise ValueError(f"context={context!r} must be an int >= 256 tokens")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an int >= 1")
    template = chat_text(tokenizer, [{"role": "user", "content": f"```python\n{MARKER}\n```\n\n{MARKER}"}])
    head, middle, tail = template.split(MARKER)

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    doc_ids = ids(module_source(module))
    head_ids = ids(head)
    # the longest request bounds the document: cut it, then ask only about functions inside the cut
    probe = [ids(middle + TASKS[task].format(name=n) + tail) for n in function_names(module_source(module))]
    room = context - len(head_ids) - max(map(len, probe))
    if room > len(doc_ids):
        raise ValueError(f"context={context} is longer than module={module!r} ({len(doc_ids)} tokens); "
                         "allowed: a shorter context or a longer module")
    document = tokenizer.decode(doc_ids[:room])
    names = function_names(document)
    if not names:
        raise ValueError(f"context={context}: the first {room} tokens of {module!r} define no function to ask about")
    rows = [names[b % len(names)] for b in range(batch)]
    prefix = head_ids + doc_ids[:room]
    suffixes = [ids(middle + TASKS[task].format(name=n) + tail) for n in rows]
    return LongContextWorkload(prefix=prefix, suffixes=suffixes, functions=rows, context=context, module=module,
                               task=task)
