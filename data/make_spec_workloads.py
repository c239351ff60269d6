"""Write data/spec_workloads.jsonl: the speculative-decoding workloads of notebook 01, by category.

- code_edit: real functions from the installed Python standard library, with an instruction to
  rename, add type hints or reformat, the source in the prompt (the answer copies most of it:
  the input-grounded case where prompt lookup shines).
- extraction: a passage (a stdlib module's docstring) with an instruction to extract or summarize.
- chat: open-ended questions (hand-written): little to copy from the prompt.

Deterministic for a given Python version (the stdlib source is the input; its version is recorded).

    python data/make_spec_workloads.py [--out data/spec_workloads.jsonl]
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

# (stdlib file, function or Class.method) picked for 10-40 line bodies with names worth renaming.
CODE_FUNCTIONS = [
    ("textwrap.py", "dedent"), ("textwrap.py", "indent"), ("textwrap.py", "shorten"),
    ("shlex.py", "join"), ("shlex.py", "quote"), ("json/encoder.py", "py_encode_basestring_ascii"),
    ("json/__init__.py", "detect_encoding"), ("fnmatch.py", "filter"), ("fnmatch.py", "fnmatchcase"),
    ("bisect.py", "insort_right"), ("bisect.py", "bisect_right"), ("bisect.py", "bisect_left"),
    ("heapq.py", "heappushpop"), ("heapq.py", "_siftdown"), ("heapq.py", "_siftup"),
    ("statistics.py", "median"), ("statistics.py", "median_low"), ("statistics.py", "mode"),
    ("colorsys.py", "rgb_to_hls"), ("colorsys.py", "hls_to_rgb"), ("colorsys.py", "rgb_to_hsv"),
    ("colorsys.py", "hsv_to_rgb"), ("posixpath.py", "commonprefix"), ("genericpath.py", "commonprefix"),
    ("base64.py", "b64encode"), ("base64.py", "b64decode"), ("string.py", "capwords"),
    ("calendar.py", "isleap"), ("calendar.py", "leapdays"), ("keyword.py", "iskeyword"),
]
CODE_INSTRUCTIONS = [
    "Rename the function `{name}` to `{new}` and output the complete updated code.",
    "Add Python type hints to the parameters and the return value of this function. Output the complete function.",
    "Reformat this function to follow PEP 8 and keep its behaviour identical. Output the complete function.",
    "Rename every local variable in this function to a more descriptive name. Output the complete function.",
]
PASSAGE_MODULES = ["json/__init__.py", "textwrap.py", "heapq.py", "bisect.py", "shlex.py", "fnmatch.py",
                   "base64.py", "colorsys.py", "calendar.py", "statistics.py", "string.py", "argparse.py",
                   "csv.py", "getopt.py", "glob.py", "queue.py"]
PASSAGE_INSTRUCTIONS = [
    "Summarize the following passage in two sentences.",
    "List every function or class name mentioned in the following passage.",
    "Extract the first three sentences of the following passage exactly as written.",
    "What is the main purpose described in the following passage? Answer quoting the passage.",
]
CHAT = [
    "What are some good habits for staying focused while studying?",
    "Explain what a black hole is to a curious teenager.",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Why is exercise good for mental health?",
    "What should I pack for a weekend hiking trip?",
    "How do vaccines help the immune system?",
    "Suggest a simple weekly meal plan for a student on a budget.",
    "What is the difference between weather and climate?",
    "How can I become a better listener?",
    "Describe how a bill becomes a law in simple terms.",
    "What are the pros and cons of working from home?",
    "Tell me about the history of the bicycle.",
    "How do I start learning to play the guitar?",
    "Why do cats purr?",
    "What makes a good team leader?",
    "Explain photosynthesis in a few sentences.",
]
MAX_PASSAGE_CHARS = 1800


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def function_source(path: Path, qualname: str) -> str | None:
    source = path.read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == qualname:
            return ast.get_source_segment(source, node)
    return None


def code_items() -> list[dict]:
    items = []
    for i, (file, name) in enumerate(CODE_FUNCTIONS):
        code = function_source(stdlib_dir() / file, name)
        if code is None or not 5 <= code.count("\n") <= 60:
            continue
        instruction = CODE_INSTRUCTIONS[i % len(CODE_INSTRUCTIONS)].format(name=name, new=f"{name.strip('_')}_v2")
        items.append({"id": f"code-{len(items)}", "category": "code_edit", "source": f"{file}:{name}",
                      "prompt": f"{instruction}\n\n```python\n{code}\n```"})
    return items


def passage_items() -> list[dict]:
    items = []
    for i, file in enumerate(PASSAGE_MODULES):
        doc = ast.get_docstring(ast.parse((stdlib_dir() / file).read_text()))
        if not doc or len(doc) < 200:
            continue
        passage = doc[:MAX_PASSAGE_CHARS].rsplit("\n", 1)[0] if len(doc) > MAX_PASSAGE_CHARS else doc
        instruction = PASSAGE_INSTRUCTIONS[i % len(PASSAGE_INSTRUCTIONS)]
        items.append({"id": f"extract-{len(items)}", "category": "extraction", "source": f"{file} docstring",
                      "prompt": f"{instruction}\n\nPassage:\n{passage}"})
    return items


def chat_items() -> list[dict]:
    return [{"id": f"chat-{i}", "category": "chat", "source": "hand-written", "prompt": q} for i, q in enumerate(CHAT)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("spec_workloads.jsonl")))
    args = parser.parse_args()
    items = code_items() + passage_items() + chat_items()
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    with open(args.out, "w") as f:
        for item in items:
            f.write(json.dumps({**item, "python": version}) + "\n")
    counts = {c: sum(i["category"] == c for i in items) for c in ("code_edit", "extraction", "chat")}
    print(f"wrote {len(items)} prompts {counts} to {args.out}")


if __name__ == "__main__":
    main()
