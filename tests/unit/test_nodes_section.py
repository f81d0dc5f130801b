"""The `nodes` section (rlhf_orch/config/nodes.py): label selectors per role, refused before Ray when they cannot
mean anything (colocation across nodes, unknown engine names, bad selector syntax), and matched against the labels
of a cluster's nodes as Ray matches them."""
import pytest

from rlhf_orch.config.loader import load_config
from rlhf_orch.config.nodes import bundle_selectors, matches, unmatched
from rlhf_orch.config.schema import ExperimentConfig
from rlhf_orch.errors import ConfigError

ENGINES = [{"kind": "hf", "name": "coloc", "placement": "colocated"},
           {"kind": "hf", "name": "gen", "placement": "dedicated", "count": 2},
           {"kind": "hf", "name": "solo", "placement": "dedicated"}]


def _cfg(nodes: dict, **extra) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"engines": ENGINES, "nodes": nodes, **extra})


def test_defaults_change_nothing():
    cfg = _cfg({})
    assert cfg.nodes.strategy == "PACK"
    assert bundle_selectors(cfg) == [{}] * 5 and not any(bundle_selectors(cfg))   # 2 ranks + 3 dedicated engines
    assert unmatched(cfg, [{}]) == []


def test_bundle_selectors_follow_the_bundle_order_with_per_engine_overrides():
    cfg = _cfg({"trainer": {"rlhf-role": "trainer"}, "engines": {"rlhf-role": "rollout"},
                "per_engine": {"solo": {"rlhf-node": "c"}}})
    assert bundle_selectors(cfg) == [{"rlhf-role": "trainer"}] * 2 + [{"rlhf-role": "rollout"}] * 2 + [{"rlhf-node": "c"}]


def test_selector_matching_follows_rays_operators():
    node = {"rlhf-role": "rollout", "zone": "b"}
    assert matches({}, node) and matches({"rlhf-role": "rollout"}, node) and not matches({"rlhf-role": "trainer"}, node)
    assert matches({"zone": "in(a, b)"}, node) and not matches({"zone": "!in(a,b)"}, node)
    assert matches({"zone": "!c"}, node) and not matches({"zone": "!b"}, node)
    assert matches({"gpu": "!h100"}, node) and not matches({"gpu": "h100"}, node)   # a missing label is "not equal"


def test_unmatched_names_the_field_and_the_labels_the_cluster_has():
    cfg = _cfg({"trainer": {"rlhf-role": "trainer"}, "per_engine": {"solo": {"rlhf-node": "z"}}})
    lines = unmatched(cfg, [{"rlhf-role": "trainer", "ray.io/node-id": "x"}, {"rlhf-node": "b"}])
    assert lines == ["nodes.per_engine.solo: no node of the Ray cluster has labels {'rlhf-node': 'z'} (the nodes' "
                     "labels: rlhf-node=b, rlhf-role=trainer); start nodes with `ray start --labels` to match, or "
                     "change nodes.per_engine.solo"]


@pytest.mark.parametrize("nodes, extra, field, words", [
    ({"per_engine": {"coloc": {"rlhf-node": "b"}}}, {}, "nodes.per_engine.coloc", "colocation across nodes"),
    ({"per_engine": {"nope": {"a": "b"}}}, {}, "nodes.per_engine.nope", "no engine entry has that name"),
    ({"critic": {"a": "b"}}, {"algorithm": {"name": "ppo"}}, "nodes.critic", "critic.placement: separate"),
    ({"reference": {"a": "b"}}, {}, "nodes.reference", "reference.placement: separate"),
    ({"trainer": {"a": "in(b"}}, {}, "nodes.trainer", "not a Ray label selector value"),
    ({"trainer": {"bad key!": "b"}}, {}, "nodes.trainer", "not a Ray label name"),
    ({"strategy": "RANDOM"}, {}, "nodes.strategy", "PACK"),
])
def test_bad_nodes_settings_are_refused_before_ray_with_the_field(tmp_path, nodes, extra, field, words):
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"engines": ENGINES, "nodes": nodes, **extra}))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), [])
    assert field in str(e.value) and words in str(e.value), str(e.value)
