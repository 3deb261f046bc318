"""The worked example of docs/architecture.md: a new method in one module plus one registry line."""

from __future__ import annotations

import re
import types
from pathlib import Path

from engine_helpers import tiny_config, tiny_params
from specjax.drafters import registry
from specjax.drafters.base import BuildContext
from specjax.engine import Engine

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def example_module() -> types.ModuleType:
    """The first Python block under "Adding a method", executed as a module."""
    section = DOC.read_text().split("### Adding a method", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("echo_example")
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    return module


def test_the_documented_method_registers_and_decodes_exactly(monkeypatch):
    echo = example_module()
    monkeypatch.setitem(registry.METHODS, echo.METHOD.name, echo.METHOD)  # the one registry line
    spec = registry.MethodSpec.parse("echo:3")
    assert spec.label == "echo:3" and registry.MethodSpec.parse("echo").num_spec == 2
    config = tiny_config(num_layers=2)
    params = tiny_params(config, seed=0, scale=30.0)
    drafter = spec.info.build(spec, BuildContext(config, params, None, None))
    prompts = [[5, 5, 5, 5, 6], [7, 8, 9]]
    echoed = Engine(config, params, drafter, max_len=64).generate(prompts, max_new_tokens=24)
    assert echoed.tokens == Engine(config, params, max_len=64).generate(prompts, max_new_tokens=24).tokens
    assert echoed.accepted_hist.shape == (2, 4)
