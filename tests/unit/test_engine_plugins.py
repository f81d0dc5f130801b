"""Engine kinds are plug-ins (rlhf_orch/config/engines/): the registry finds every kind module, builds the config union
from them, and what a plug-in declares for the checks before Ray agrees with what its engine classes declare."""
import sys
import textwrap

import pytest
from pydantic import TypeAdapter, ValidationError

from rlhf_orch.config.engines import ENGINE_KINDS, KINDS, config_union, discover
from rlhf_orch.engines import engine_class

PLUGIN = '''
from typing import Literal
from pydantic import Field
from rlhf_orch.config.engines.base import EngineKind, EngineSection


class FooEngineConfig(EngineSection):
    kind: Literal["foo"] = Field(description="A new engine kind.")
    beams: int = Field(1, ge=1, description="Its own option.")


KIND = EngineKind("foo", FooEngineConfig, "foo_engine:FooEngine", order=5, extra="foo",
                  checks=lambda i, e, cfg: [f"engines.{i}.beams: odd"] if e.beams % 2 else [])
'''


def test_the_built_in_kinds_are_found_in_their_order():
    assert ENGINE_KINDS == ("hf", "vllm", "sglang")
    assert {k.extra for k in KINDS.values()} == {None, "vllm", "sglang"}


def test_a_new_kind_is_one_module_found_by_the_registry(tmp_path, monkeypatch):
    pkg = tmp_path / "more_kinds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "foo.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    kinds = {**KINDS, **discover("more_kinds", [str(pkg)])}
    assert list(kinds) == ["hf", "vllm", "sglang", "foo"]
    entries = TypeAdapter(list[config_union(kinds)])
    foo, hf = entries.validate_python([{"kind": "foo", "beams": 3}, {"kind": "hf"}])
    assert type(foo).__name__ == "FooEngineConfig" and foo.beams == 3 and type(hf).__name__ == "HFEngineConfig"
    assert kinds["foo"].checks(0, foo, None) == ["engines.0.beams: odd"]
    with pytest.raises(ValidationError, match="beams"):
        entries.validate_python([{"kind": "foo", "beams": 0}])
    sys.modules.pop("more_kinds.foo", None)


@pytest.mark.parametrize("name", list(KINDS))
def test_a_plugins_declarations_agree_with_its_engine_classes(name, tiny_model_dir):
    kind = KINDS[name]
    cls = engine_class(name)
    if name == "hf":   # declared per instance (its test hooks)
        plain = cls(name="e", model_path=tiny_model_dir, seed=0).capabilities
    else:   # SGLang's is a property of its tensor parallelism: its generate's part is `generation`
        plain = cls.generation if name == "sglang" else cls.capabilities
    assert plain.partial_rollouts == kind.parks_mid_request, name
    if kind.streaming_engine:
        streaming = engine_class(f"{name}-streaming")
        caps = streaming.generation if name == "sglang" else streaming.capabilities
        assert caps.partial_rollouts, name
