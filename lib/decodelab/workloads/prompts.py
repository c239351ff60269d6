"""Chat prompts as token ids: the one place that applies a tokenizer's chat template."""
from __future__ import annotations


def chat_text(tokenizer, messages: list[dict]) -> str:
    """Chat messages -> the prompt text, ending with the assistant turn's opening."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids ending with the assistant turn's opening."""
    return list(tokenizer(chat_text(tokenizer, messages), add_special_tokens=False).input_ids)


def user_prompt_ids(tokenizer, question: str) -> list[int]:
    """One user turn + the assistant header, as token ids (the answer starts right after)."""
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
