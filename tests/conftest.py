"""Shared fixtures: a tiny random Llama built in-process (fast) and the embedded model (slow)."""
import pytest
import torch

from decodelab.core.models import load_model, tiny_model


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


class SmokeRuns:
    """Each notebook's smoke run, executed at most once per test session into one results root.

    Tests of a notebook's invariants and of the results contract share the run; the report test
    builds the real report from the same root. A failed run is re-raised to every test asking for it.
    """

    def __init__(self, root):
        self.root = root
        self._done: dict = {}

    def __call__(self, name: str):
        """The run directory of `name`'s smoke run (executing it the first time)."""
        from decodelab.suite import runner

        if name not in self._done:
            try:
                self._done[name] = runner.execute(name, "smoke", root=self.root, progress=False, log=lambda *_: None)
            except Exception as error:  # noqa: BLE001 - cached and re-raised to every asker
                self._done[name] = error
        outcome = self._done[name]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def metrics(self, name: str) -> dict:
        return self._json(name, "metrics.json")

    def params(self, name: str) -> dict:
        return self._json(name, "params.json")

    def _json(self, name: str, file: str) -> dict:
        import json

        return json.loads((self(name) / file).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def smoke_runs(tmp_path_factory):
    """`smoke_runs(name)` -> run dir; `smoke_runs.metrics(name)` -> its metrics.json (see SmokeRuns)."""
    return SmokeRuns(tmp_path_factory.mktemp("smoke-results"))


@pytest.fixture(scope="module")
def metrics(request, smoke_runs):
    """metrics.json of the smoke run of the notebook named by the test module's NAME."""
    return smoke_runs.metrics(request.module.NAME)


@pytest.fixture(scope="module")
def params(request, smoke_runs):
    """params.json of the smoke run of the notebook named by the test module's NAME."""
    return smoke_runs.params(request.module.NAME)
