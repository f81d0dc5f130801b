"""dashboards/rlhf_orch.json: the reader of its PromQL names (tests/dashboard_promql.py) on tiny dashboards, and the
names it uses that a CPU run cannot export (CUDA memory, evaluation) checked against the gauge naming rule. That every
other name is exported by a real run is tests/integration/test_dashboard_metrics.py."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboard_promql import dashboard_metrics, not_exported, promql_metrics
from rlhf_orch.metrics.sinks import gauge_name

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "rlhf_orch.json"

TINY = {
    "templating": {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus"},
        {"name": "exp", "type": "query", "query": {"query": 'label_values(ray_tiny_step{job="ray"}, experiment)'}},
    ]},
    "panels": [
        {"type": "timeseries", "targets": [{"expr": 'max by (experiment) (ray_tiny_reward{experiment=~"$exp"})'}]},
        {"type": "row", "panels": [   # a collapsed row keeps its panels inside it
            {"type": "stat", "targets": [
                {"expr": 'rate(ray_tiny_tokens_total{a="{not_a_name}"}[$__rate_interval] offset 5m) * 1e3'},
                {"expr": '{__name__=~"ray_tiny_mem_.+_gb", experiment=~"$exp"} / on(x) group_left ray_tiny_total_gb'},
            ]}]},
    ],
}


def _exprs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == "expr" else _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def test_dashboard_promql_parses(tmp_path):
    """Every expression through Prometheus' own parser (promtool, from the prometheus package), Grafana's variables
    filled in as Grafana would."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    exprs = [e.replace("$experiment", ".*").replace("$__rate_interval", "1m")
             for e in _exprs(json.loads(DASHBOARD.read_text()))]
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    out = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in out.stdout, out.stdout + out.stderr


def test_names_and_patterns_of_a_tiny_dashboard():
    names, patterns = dashboard_metrics(TINY)
    assert names == {"ray_tiny_step", "ray_tiny_reward", "ray_tiny_tokens_total", "ray_tiny_total_gb"}
    assert patterns == {"ray_tiny_mem_.+_gb"}


def test_promql_reader_skips_functions_keywords_labels_and_variables():
    names, patterns = promql_metrics('sum without (le) (histogram_quantile(0.9, rate(x_bucket{k=~"a|b"}[5m:1m]))) '
                                     '> bool 0.5 and on() vector(1) unless {__name__="exact"}')
    assert names == {"x_bucket", "exact"} and patterns == set()


def test_a_name_or_pattern_that_is_not_exported_is_reported():
    exported = {"ray_tiny_step", "ray_tiny_reward", "ray_tiny_tokens_total", "ray_tiny_total_gb", "ray_tiny_mem_gpu0_gb"}
    assert not_exported(TINY, exported) == []
    assert not_exported(TINY, exported - {"ray_tiny_reward"}) == ["ray_tiny_reward"]
    assert not_exported(TINY, exported - {"ray_tiny_mem_gpu0_gb"}) == ["{__name__=~'ray_tiny_mem_.+_gb'}"]
    typo = json.loads(json.dumps(TINY).replace("ray_tiny_reward", "ray_tiny_rewrad"))
    assert not_exported(typo, exported) == ["ray_tiny_rewrad"]
    assert not_exported(typo, exported, ignore=lambda n: n.endswith("rewrad")) == []


def test_dashboard_names_follow_the_gauge_naming_rule():
    """Names a CPU test run cannot export: Ray's `ray_` prefix + gauge_name(key) of the keys the code writes."""
    names, patterns = dashboard_metrics(json.loads(DASHBOARD.read_text()))
    assert names and all(n.startswith("ray_rlhf_orch_") for n in names)
    assert "ray_" + gauge_name("step") in names
    for key in ("mem/trainer_peak_gb_max", "eval/reward_mean", "eval/pass@1", "eval/pass@k"):   # trainer.py, evaluation.py
        assert "ray_" + gauge_name(key) in names, key
    (pattern,) = patterns
    for key in ("mem/train/gpu0_used_gb", "mem/generate/gpu3_used_gb"):   # driver/colocation.py Colocation.memory
        assert re.fullmatch(pattern, "ray_" + gauge_name(key)), key


def test_dashboard_panels_are_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["targets"], p["title"]
            assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]
            assert all('experiment=~"$experiment"' in t["expr"] for t in p["targets"]), p["title"]
    cells = set()   # no two panels overlap on Grafana's 24-column grid
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & cell, p["title"]
        cells |= cell
