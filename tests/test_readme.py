"""The README's Python example runs and does what it says."""

import re
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
