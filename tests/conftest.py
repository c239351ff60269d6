"""Shared fixtures: a tiny random Llama built in-process (fast) and the embedded model (slow)."""
import pytest
import torch

from decodelab.models import load_model, tiny_model


@pytest.fixture(scope="session")
def tiny():
    """A 4-layer random-weight Llama, vocab 256, no tokenizer."""
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct on CPU in float32 (tests using it are marked slow)."""
    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture
def chat_ids(smol):
    """Token ids of chat prompts of different lengths for the embedded model."""
    questions = ["What is the capital of France?", "Name three colours.", "Write a haiku about autumn leaves."]
    tok = smol.tokenizer
    return [
        tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False).input_ids
        for q in questions
    ]
