"""The README's examples run and do what they say."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.skipif(not README.exists(), reason="README.md not next to the tests (installed package only)")
def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    model, expected = namespace["model"], namespace["global_vector"]
    from pyfedkern.flat import parameters_to_vector

    vec = parameters_to_vector(model)
    assert vec.shape == expected.shape
    manual = sum(w * x for w, x in zip(namespace["weights"], namespace["client_models"], strict=True))
    assert (vec - manual).abs().max() < 1e-5


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


@pytest.mark.skipif(not README.exists(), reason="README.md not next to the tests (installed package only)")
def test_readme_own_model_and_data_runs_from_python_and_the_cli(tmp_path, monkeypatch):
    """The section's file is written as it says, its Python block and its command run in that folder as written, and
    both give the same metrics."""
    section = _section("Your own model and data")
    module, python = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    (command,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    name = module.splitlines()[0].removeprefix("# ")
    (tmp_path / name).write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    exec(compile(python, "README.md", "exec"), namespace)
    metrics = namespace["metrics"]
    assert metrics[-1]["test_acc"] > metrics[0]["test_acc"] + 0.2  # it learns
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[0] == "pyfedkern"
    run = subprocess.run([sys.executable, "-m", "pyfedkern", *argv[1:], "--no-progress"], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = Path(argv[argv.index("--out") + 1])
    from_cli = [json.loads(line) for line in out.joinpath("metrics.jsonl").read_text().splitlines()]

    def numbers(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]

    assert numbers(from_cli) == numbers(metrics)
    sys.modules.pop(name.removesuffix(".py"), None)


EXPERIMENTS = README.parent / "docs" / "experiments.md"


@pytest.mark.skipif(not EXPERIMENTS.exists(), reason="docs/ not next to the tests (installed package only)")
def test_experiments_what_is_federated_examples_run():
    """docs/experiments.md's "What is federated" examples run as written (their asserts check what they say); the
    LoRA one needs the llm extra."""
    text = EXPERIMENTS.read_text()
    start = text.index("## What is federated")
    section = text[start : text.index("\n## ", start + 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 3
    for block in blocks:
        if "import peft" in block:
            pytest.importorskip("peft")
            pytest.importorskip("transformers")
        exec(compile(block, "docs/experiments.md", "exec"), {"__name__": "docs_example"})
