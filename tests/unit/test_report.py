"""The end-of-run report (rlhf_orch/report.py): what a person reads at the end of a run."""
from rlhf_orch.report import end_of_run


def test_a_finished_run_reports_its_numbers_and_every_output(tmp_path):
    (tmp_path / "plots").mkdir()
    for name in ("reward.png", "sync.png", "timeline.png", "staleness.png", "phase_times.png"):
        (tmp_path / "plots" / name).write_bytes(b"png")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step600\n")
    summary = {"status": "finished", "steps": 600, "wall_s": 123.4, "reward_first": 0.138, "reward_last": 0.865,
               "syncs": 601, "verified_syncs": 601, "faults": [{"replacement": "dedicated.r1"}, {"replacement": None}],
               "run_restarts": [{}], "eval": {"step": 600, "eval/pass@1": 0.5, "eval/reward_mean": 0.75}}
    lines = end_of_run(summary, tmp_path)
    text = "\n".join(lines)
    assert lines[0] == "run finished after 600 steps in 123 s"
    assert "0.138 -> 0.865" in text and "weight syncs verified: 601 of 601" in text
    assert "last evaluation (step 600): reward 0.750, pass@1 0.500" in text
    assert "faults: 2 (1 replaced in place), run restarts: 1" in text
    assert "checkpoints/step600" in text and "metrics.jsonl" in text and "summary.json" in text
    assert "plots/: phase_times.png, reward.png, staleness.png, sync.png, timeline.png" in text   # all five
    assert all(len(line) < 200 for line in lines)   # no 900-character line


def test_a_stopped_run_says_why_and_lists_what_it_left(tmp_path):
    lines = end_of_run({"status": "stopped", "error": "stopped by signal SIGTERM (after step 6)", "steps": 6,
                        "syncs": 7, "verified_syncs": 7}, tmp_path)
    assert lines[0] == "run stopped after 6 steps: stopped by signal SIGTERM (after step 6)"
    assert "weight syncs verified: 7 of 7" in lines and lines[-1] == f"outputs in {tmp_path}:"
