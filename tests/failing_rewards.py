"""Reward functions for failure tests (importable by Ray workers as tests.failing_rewards).

They count calls per process: the reward worker's count starts at 0, whatever launch.py's pre-launch check (two
calls with placeholder responses, in the driver) did to the driver's own count."""
_calls = {"n": 0}


def fails_on_second_step(response: str, row: dict) -> float:
    """Scores step 1 (128 samples) normally, then raises like a buggy user reward would."""
    _calls["n"] += 1
    if _calls["n"] > 128:
        raise KeyError("answer_v2")
    return 1.0 if response.strip() == row["answer"] else 0.0


def kills_an_engine_on_second_step(response: str, row: dict) -> float:
    """Scores step 1, then kills the run's dedicated engine actor (a real death, as an OOM or a node loss)."""
    _calls["n"] += 1
    if _calls["n"] == 129:
        import ray
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("-engine-dedicated"))
        ray.kill(ray.get_actor(name, namespace=next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                                                    if a["name"] == name)))
    return 1.0 if response.strip() == row["answer"] else 0.0
