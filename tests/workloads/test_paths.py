"""Where data comes from: the checkout's data/ by default, $DECODELAB_DATA when set (a non-editable install)."""
import json

import pytest

from decodelab.workloads import paths
from decodelab.workloads.constrained import load_schemas
from decodelab.workloads.spec import load_workloads


def test_data_dir_is_the_checkouts_data_folder_by_default(monkeypatch):
    monkeypatch.delenv("DECODELAB_DATA", raising=False)
    assert paths.data_dir() == paths.repo_root() / "data"
    assert (paths.data_dir() / "spec_workloads.jsonl").is_file()


def test_decodelab_data_points_every_loader_at_another_folder(tmp_path, monkeypatch):
    (tmp_path / "spec_workloads.jsonl").write_text(json.dumps(
        {"id": "x", "category": "only_here", "source": "s", "prompt": "p"}) + "\n")
    schema = {"name": "only_here", "prompt": "p", "schema": {"type": "integer"}}
    (tmp_path / "schemas.json").write_text(json.dumps([schema]))
    monkeypatch.setenv("DECODELAB_DATA", str(tmp_path))
    assert paths.data_file("schemas.json") == tmp_path / "schemas.json"
    assert [row["category"] for row in load_workloads()] == ["only_here"]
    assert [entry["name"] for entry in load_schemas()] == ["only_here"]


def test_a_missing_parameter_file_names_the_parameter_and_the_places_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"tasks_file='nope.json' is not a file \(looked for .*nope.json"):
        paths.resolve_path("nope.json", name="tasks_file")


def test_writing_prompts_default_to_the_shipped_file():
    from decodelab.workloads.tasks import load_writing_prompts

    prompts = load_writing_prompts(n=3)
    assert len(prompts) == 3 and all(isinstance(p, str) and p for p in prompts)
