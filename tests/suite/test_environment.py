"""environment.yml (conda) lists the same dependencies as pyproject.toml (pip)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def normalize(requirement: str) -> str:
    """'Foo_Bar[x]>=1.0; python_version>"3"' -> 'foo-bar' (PEP 503 name normalization)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {normalize(r): r.replace(" ", "") for r in reqs}


def environment_requirements() -> dict[str, str]:
    spec = yaml.safe_load((ROOT / "environment.yml").read_text())
    reqs = []
    for dep in spec["dependencies"]:
        if isinstance(dep, dict):
            reqs += dep.get("pip", [])
        elif normalize(dep) not in ("python", "pip"):
            reqs.append(dep)
    return {normalize(r): r.replace(" ", "") for r in reqs}


def test_environment_yml_is_a_conda_spec():
    spec = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert spec["name"] == "decodelab"
    assert "conda-forge" in spec["channels"]
    assert any(isinstance(d, str) and d.replace(" ", "").startswith("python=3.11") for d in spec["dependencies"])
    assert "pip" in spec["dependencies"]
    assert any(isinstance(d, dict) and d.get("pip") for d in spec["dependencies"])


def test_environment_yml_lists_the_pyproject_dependencies():
    assert sorted(environment_requirements()) == sorted(pyproject_requirements())


def test_version_bounds_agree():
    assert environment_requirements() == pyproject_requirements()
