"""pyproject.toml and environment.yml install the same stack; CI runs the README's test command."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}  # PyPI name -> conda-forge name


def names(requirements):
    return {re.split(r"[ <>=!;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_names = names(project["dependencies"]) | names(project["optional-dependencies"]["test"]) | names(
        project["optional-dependencies"]["triton"])
    conda = []
    in_deps = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.startswith("dependencies:"):
            in_deps = True
        elif in_deps and re.match(r"^  - [A-Za-z]", line):
            conda.append(line.split("#")[0].strip()[2:].strip())
    conda_names = names(conda) - {"python", "pip", "pip:"}
    assert conda_names == {CONDA_NAMES.get(n, n) for n in pip_names}
    assert "-e ." in (ROOT / "environment.yml").read_text()


def test_torch_range_admits_2_13():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(d for d in deps if d.startswith("torch"))
    lo, hi = re.findall(r">=([\d.]+)", torch_req)[0], re.findall(r"<([\d.]+)", torch_req)[0]
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(lo) <= (2, 13) < as_tuple(hi)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./course test" in readme and "./course lab" in readme
    assert re.search(r"^\./course test\s*$", ci, re.M)
    assert "torch==2.13.0" in (ROOT / "course").read_text()
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "bash .ci/run" in workflow
