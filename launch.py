"""rlhf_orch entry point: the whole RL loop, top to bottom.

    python launch.py --config configs/tiny_cpu.yaml [section.key=value | ~section.key ...]
    rlhf-orch train --config configs/tiny_cpu.yaml [...]      (the same; `rlhf-orch check` stops before Ray)
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python launch.py --config configs/tiny_cpu.yaml

Story: validate everything -> allocate -> build actors -> (warm start) -> initial sync -> per step:
take the step's batch from the rollout manager (generated and scored as groups
finish, see actors/rollout_manager.py) -> train -> sync -> (evaluate: eval.every) -> log/checkpoint. With
rollout.max_staleness 0 the manager starts a step's groups only after the previous sync: the synchronous loop
exactly. With k >= 1 the engines keep generating for later steps while the trainer trains, and each sync runs
while the trainer trains the next step (weight_sync.overlap, driver/overlap.py). Colocated runs hand each shared GPU
from trainer to engines before generate and back after it (driver/colocation.py); metrics, plots, the timeline and a
checkpoint are written in `finally`, so a failed run still leaves them readable. summary.json is written before Ray
stops, and the run ends with a short report of it (rlhf_orch/report.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from rlhf_orch.cli import parse_run_args   # shared with `rlhf-orch`; argparse only, so --help stays instant
from rlhf_orch.config import load_config
from rlhf_orch.errors import (CheckpointError, ConfigError, RLHFOrchError, RunStopped, TrainerError, WeightSyncError,
                              is_actor_death)
from rlhf_orch.metrics import PhaseTimer
from rlhf_orch.metrics.advice import StalenessAdvisor   # no torch under rlhf_orch/metrics
from rlhf_orch.models import BUILTIN_PREFIX, ensure_model_dir
from rlhf_orch.report import end_of_run     # pathlib only
from rlhf_orch.resources import local_fit_problem
from rlhf_orch.rewards.check import check_reward_function
from rlhf_orch.run_dir import RunLock, claim_run_dir, job_output_override, ray_job_id, upload_records
from rlhf_orch.storage import Store, run_uri   # pyarrow only once a Store is made
from rlhf_orch.torch_ext import prepare_extensions_dir
# Modules that bring torch, transformers or Ray in are imported inside the functions that need them, so that
# `--help` and a usage error answer at once (each such import says so where it is not obvious).

logger = logging.getLogger("rlhf_orch.launch")


def prepare(argv):
    """Everything that can fail on bad input, before Ray or any actor starts."""
    # The arguments first, with nothing heavy imported: `--help` and a usage error answer at once.
    args = parse_run_args(argv)
    from transformers import AutoTokenizer
    from rlhf_orch.data import PromptDataset   # torch (and transformers above): after the arguments parse
    from rlhf_orch.data.prepare import rows_for
    # In a Ray job a relative output_dir would be Ray's temporary copy of the working dir: moved before loading
    # (loading creates the folder). Elsewhere nothing changes.
    extra, why = job_output_override(args.config, args.overrides, dict(os.environ), os.getcwd())
    if why:
        logger.info("%s", why)
    cfg = load_config(args.config, [*args.overrides, extra] if extra else args.overrides)
    run_dir = Path(cfg.experiment.output_dir) / cfg.experiment.name
    logger.info("outputs of this run: %s", run_dir.resolve())
    problem = local_fit_problem(cfg)   # a local Ray that cannot hold the placement group; a cluster's is checked once joined
    if problem:
        raise ConfigError(problem)
    rows = rows_for(cfg)   # the rows config loading read and checked, with the data section's keys and chat template
    model_path = cfg.model.path
    if model_path.startswith(BUILTIN_PREFIX):
        model_path = str(ensure_model_dir(model_path.removeprefix(BUILTIN_PREFIX), cfg.model.tiny,
                                          Path(cfg.experiment.output_dir) / "models", cfg.experiment.seed).resolve())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = PromptDataset(rows, tokenizer, cfg.data.max_prompt_tokens, cfg.experiment.seed)
    check_reward_function(cfg.reward, dataset.rows,   # two rows, placeholder responses: finite floats or one error line
                          lambda text: tokenizer(text, add_special_tokens=False).input_ids)
    prepare_extensions_dir(cfg.trainer.device)   # DeepSpeed's op builds: versioned folder, stale locks, first-build note
    return cfg, run_dir, model_path, tokenizer, dataset


def rl_step(cluster, cfg, step: int) -> tuple[dict, dict]:
    """One RL step; returns its flat metrics and the batch metadata. Engines hold version step-1 on entry."""
    timer = PhaseTimer()
    with timer.phase("step"):
        with timer.phase("to_generate"):    # colocation: trainers offload, engines wake (else no-op)
            coloc = cluster.to_generate(step - 1)
        # Engines hold version step-1: the manager admits what max_staleness allows (with 0: this step's groups,
        # exactly the synchronous loop; with k >= 1 most were generated while the trainer trained) and waits.
        with timer.phase("generate"):       # the step's groups, generated and scored
            meta, shards = cluster.next_batch(step)
        with timer.phase("to_train"):       # colocation: engines sleep, trainers reload
            coloc.update(cluster.to_train())
        with timer.phase("train"):
            # From here the trainers may hold this step's update: a checkpoint labelled step-1 would resume on
            # it (run() then writes no final checkpoint; a SIGTERM waits for the step's end, see _on_sigterm).
            _IN_STEP.append(step)
            train = cluster.train(meta, shards)
        with timer.phase("sync"):           # weight_sync.overlap: only staging here, the transfer runs under the next step
            sync_metrics = cluster.sync_step(step)
    m = {**meta["metrics"], **train, **sync_metrics, **coloc, **timer.metrics()}
    # The trainer's idle time: waiting for the batch, then for the sync beyond its own packing or staging (pauses,
    # transfers; overlapped: what the train step did not hide of the previous sync).
    own = m.get("sync/stage_s", 0.0) if m.get("sync/overlapped") else m.get("sync/pack_s", 0.0)
    m["perf/trainer_idle_s"] = m["perf/generate_s"] + max(0.0, m["perf/sync_s"] - own)
    m["perf/trainer_idle_frac"] = m["perf/trainer_idle_s"] / max(m["perf/step_s"], 1e-9)
    m["rollout/logprob_diff_mean"] = train["train/logprob_diff_sum"] / max(train["train/tokens"], 1.0)
    m["rollout/logprob_diff_max"] = train["train/logprob_diff_max"]
    alarm = cfg.weight_sync.mismatch_alarm
    if alarm and m["rollout/logprob_diff_max"] > alarm:
        raise WeightSyncError(f"engine/trainer logprobs differ by {m['rollout/logprob_diff_max']:.4f} "
                              f"> weight_sync.mismatch_alarm {alarm} after sync v{step - 1}")
    return m, meta


def _recovered(faults: list[dict], step: int) -> None:
    """Each fault (and run restart) gets the seconds from it to the first step completed after it (issue #34)."""
    now = time.time()
    for f in faults:
        if "t" in f and "next_step_s" not in f and now > f["t"]:
            f.update(next_step_s=round(now - f["t"], 3), next_step=step)


def _last_sync(cluster) -> dict:
    """The overlapped sync still under way when a run stops, finished ({} if it fails: it is not counted verified)."""
    try:
        return cluster.overlap.last()
    except Exception as e:   # the stop goes on: checkpoint, plots, summary
        logger.warning("the last weight sync did not finish: %s", str(e).splitlines()[0])
        return {}


def save_checkpoint(cluster, step: int, rollout_state: dict) -> None:
    """A periodic checkpoint. If it cannot be written (disk full, permissions, a trainer error) the run goes on
    while an earlier good checkpoint exists, with the true cause logged; with none it stops."""
    from rlhf_orch.checkpoint import find_good   # torch
    try:
        cluster.checkpoint(step, rollout_state)
    except (CheckpointError, TrainerError, OSError) as e:
        if is_actor_death(e):
            raise
        good, _ = find_good(cluster.checkpoints.dir)
        if good is None:
            raise
        logger.error("checkpoint of step %d failed: %s; going on (the latest good checkpoint is %s)", step,
                     str(e).splitlines()[0], good)


def save_snapshot(cluster, step: int, rollout_state: dict) -> dict:
    """The step snapshot of `step` (fault_tolerance.step_snapshots), and its cost as metrics. One that cannot be
    written (RAM full, a trainer error) is logged and skipped: the periodic checkpoints still hold."""
    try:
        cost = cluster.checkpoint(step, rollout_state, snapshot=True)
        return {"checkpoint/snapshot_s": cost["s"], "checkpoint/snapshot_gb": cost["gb"]}
    except (CheckpointError, TrainerError, OSError) as e:
        if is_actor_death(e):
            raise
        logger.error("step snapshot of step %d failed: %s; going on", step, str(e).splitlines()[0])
        return {}


def run(cfg, run_dir: Path, model_path: str, tokenizer, dataset, summary: dict | None = None, eval_set=None,
        restarts: list[dict] | None = None) -> dict:
    """The run; fills `summary` (also when it fails: ledger, faults, where it resumed from, the last evaluation)
    and returns it. `eval_set`: rlhf_orch.evaluation.eval_set_for's (made here when not given and eval is on)."""
    import torch
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    # Ray and torch (these modules import them) only once a run starts: `launch.py --help` answers at once
    from driver.cluster import Cluster
    from rlhf_orch.rollout_utils import reward_summary, warm_start_pairs
    from rlhf_orch.checkpoint import CheckpointPolicy
    from rlhf_orch.evaluation import eval_set_for, last_eval
    from rlhf_orch.trainer.batch import build_sft_batch

    seed, last = cfg.experiment.seed, cfg.experiment.steps
    policy = CheckpointPolicy(cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_every_minutes)
    random.seed(seed), torch.manual_seed(seed)
    cluster, sinks, records = None, None, []
    rollout_state = None    # the rollout manager's state after the last *completed* step: what a checkpoint holds
    verified, syncs, tail = 0, 0, None
    quiet_bar = contextlib.ExitStack()
    summary = {} if summary is None else summary
    eval_set = eval_set if eval_set is not None else eval_set_for(cfg, tokenizer)   # None: evaluation off
    try:
        cluster = Cluster.start(cfg, run_dir, model_path, dataset, tokenizer.pad_token_id,   # Ray, all actors, sinks
                                bool(restarts))
        sinks = cluster.outputs.sinks
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigterm)   # ray.init put its own (sys.exit) in place of ours
        summary["resume_notes"] = cluster.checkpoints.resume_notes   # filled by find_good at start and by restore()
        resumed = cluster.restore() if cfg.resume else None         # trainer state, engine RNGs
        if resumed:
            records = list(cluster.outputs.history)
        elif cfg.trainer.warm_start_steps:
            rng = random.Random(seed)
            enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids
            for _ in tqdm(range(cfg.trainer.warm_start_steps), desc="warm start", file=sys.stderr):
                pairs = warm_start_pairs(dataset.rows, 64, cfg.trainer.warm_start_real_answers, rng)
                batch = build_sft_batch([enc(p) for p, _ in pairs], [enc(a) + [tokenizer.eos_token_id] for _, a in pairs],
                                        tokenizer.pad_token_id)
                cluster.trainers.step("sft_step", batch)
        cluster.snapshot_reference(bool(resumed))
        start = resumed["step"] + 1 if resumed else 1
        summary["resumed_from"] = start - 1 if resumed else None
        summary["last_step"] = start - 1   # the last completed step (a restart record's steps_redone)
        if restarts and "resumed_from" not in restarts[-1]:   # this segment is the restart's: where it went on from
            restarts[-1].update(resumed_from=start - 1,
                                steps_redone=max(0, (restarts[-1].get("last_step") or 0) - (start - 1)))
        sync_metrics = cluster.sync(start - 1)                       # engines start from the trainer's weights
        syncs, verified = 1, int(sync_metrics["sync/checksum_ok"] == 1.0)
        logger.info("initial sync: %.1f MB in %.3fs (%s)", sync_metrics["sync/bytes"] / 1e6,
                    sync_metrics["sync/total_s"], cluster.plan)
        cluster.start_rollouts(start, start - 1, resumed)
        quiet_bar.enter_context(logging_redirect_tqdm())   # log lines above the progress bar, not glued onto it
        bar = tqdm(range(start, last + 1), initial=start - 1, total=last, desc=cfg.algorithm.name.upper(), file=sys.stderr)
        snap: dict = {}   # the cost of the step snapshot written after the previous step, in this step's record
        r = cfg.rollout   # the run's section: launch serves every step with it (only a benchmark changes it)
        advisor = StalenessAdvisor(r.max_staleness, extra_lag=r.token_lag_bound() - r.max_staleness)
        for step in bar:
            m, meta = rl_step(cluster, cfg, step)
            m.update(snap)
            records.append({"step": step, **m})
            advice = advisor.observe(m)
            if advice:   # once per run: the staleness bound, not the engines, holds the trainer back
                logger.warning("%s", advice)
                summary.setdefault("advice", []).append(advice)
            summary["last_step"] = step
            _recovered(cluster.faults + (restarts or []), step)
            cluster.log_rollouts(step, meta)
            rollout_state = meta["state"]   # the data cursor and untrained draws after this step
            cluster.step_boundary()         # the engines' RNGs as this step leaves them (what its checkpoint holds)
            _IN_STEP.clear()
            if _STOPPING:                   # a SIGTERM came while this step trained: it is complete now
                sinks.write(step, m)
                raise RunStopped(f"stopped by signal {signal.Signals(_STOPPING[0]).name} (after step {step})")
            try:
                if eval_set is not None and eval_set.due(step, last):   # the engines hold this step's weights
                    ev = cluster.evaluate(eval_set, step)
                    m.update(ev)
                    records[-1].update(ev)
            finally:
                sinks.write(step, m)        # also when the evaluation failed: the step itself completed
            bar.set_postfix(reward=f"{m['rollout/reward_mean']:.3f}", kl=f"{m.get('train/kl', 0.0):.4f}",
                            step_s=f"{m['perf/step_s']:.2f}", sync_s=f"{m['perf/sync_s']:.3f}")
            if cfg.experiment.log_samples_every and step % cfg.experiment.log_samples_every == 0:
                prompt, response, reward = meta["example"]
                logger.info("step %d sample: %r -> %r (reward %.2f)", step, prompt, response, reward)
            if policy.due(step) and step < last:   # the last step's checkpoint is written by close()
                save_checkpoint(cluster, step, rollout_state)
                policy.mark_done()
                snap = {}
            elif cfg.fault_tolerance.step_snapshots and step < last:
                snap = save_snapshot(cluster, step, rollout_state)
        tail = cluster.overlap.last()   # the last step's sync, if it overlapped (its step's record is written)
        return summary
    finally:
        quiet_bar.close()
        if tail is None and cluster is not None and isinstance(sys.exc_info()[1], (RunStopped, KeyboardInterrupt)):
            tail = _last_sync(cluster)   # a stopped run reports complete counts too (its sync under way finishes)
        summary.update(reward_summary([r["rollout/reward_mean"] for r in records]))
        # A checksum mismatch raises, so a finished run has verified every sync unless weight_sync.verify is off.
        # Step syncs of the whole run (records span earlier segments after a resume) plus this start's initial one;
        # with weight_sync.overlap a step's record holds the previous step's sync, and the last one is `tail`.
        summary.update(syncs=syncs + len(records),
                       verified_syncs=verified + sum(int(r.get("sync/checksum_ok") == 1.0) for r in records + [tail or {}]))
        if cluster is not None:   # by slot: a replaced engine ("dedicated.r1") under its slot's name
            summary["transports"] = {cluster.slots.get(n, {}).get("base", n): t for n, t in (cluster.plan or {}).items()}
            summary["nodes"] = {"at_start": getattr(cluster, "nodes_at_start", {}), "at_end": cluster.locate()}   # each actor's Ray node
        if _IN_STEP:   # failed after this step began training: no checkpoint may label its update as the step before
            logger.warning("final checkpoint skipped: the trainers may already hold step %d's update, which did not "
                           "complete; a resume starts from the latest periodic checkpoint", _IN_STEP[0])
            rollout_state = None
            _IN_STEP.clear()   # not under way any more: a later SIGTERM stops at once
        if cluster is not None:
            # A kill while the final checkpoint is written (a job's grace period running out) must still leave a
            # readable summary: this one says the run was ending; _supervise's complete one replaces it.
            _write_summary(run_dir, {**summary, "status": "ending", "faults": list(cluster.faults),
                                     "run_restarts": list(restarts or [])})
            cluster.close(records, rollout_state)
            summary["ledger"] = cluster.final_ledger   # every prompt drawn: trained, filtered, or still queued
            summary["faults"] = cluster.faults         # engines that died, when, and how long recovery took
        if last_eval(records):
            summary["eval"] = last_eval(records)       # the last evaluation: its step and eval/ metrics


_STOPPING: list[int] = []   # signals received: only the first one stops the run
_IN_STEP: list[int] = []    # the step whose training has started and which has not completed yet


def _on_sigterm(signum, frame):
    # `ray job stop` and a cluster's preemption send SIGTERM: stop where we are; run()'s finally saves the last
    # completed step's checkpoint, the plots and the timeline, and main() writes summary.json. A later SIGTERM
    # must not cut that short (an exception raised inside the clean-up would skip summary.json): the sender's
    # SIGKILL after its grace period is the hard stop.
    _STOPPING.append(signum)
    if len(_STOPPING) > 1:
        logger.warning("signal %s again: still saving the stopped run", signal.Signals(signum).name)
        return
    if _IN_STEP:   # the trainers may already hold this step's update: stop once the step is complete (its sync)
        logger.warning("signal %s: stopping once step %d completes (its training has started)",
                       signal.Signals(signum).name, _IN_STEP[0])
        return
    raise RunStopped(f"stopped by signal {signal.Signals(signum).name}")


def preflight(argv):
    """Every check before Ray starts (main's, and `rlhf-orch check`'s): prepare(), then the evaluation prompts.
    Returns (cfg, run_dir, model_path, tokenizer, dataset, eval_set); raises RLHFOrchError on bad input."""
    cfg, run_dir, model_path, tokenizer, dataset = prepare(argv)
    from rlhf_orch.evaluation import eval_set_for   # torch
    eval_set = eval_set_for(cfg, tokenizer)   # the evaluation prompts, read and checked before Ray (None: off)
    return cfg, run_dir, model_path, tokenizer, dataset, eval_set


def main(argv=None) -> int:
    logging.basicConfig(level=os.environ.get("RLHF_ORCH_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg, run_dir, model_path, tokenizer, dataset, eval_set = preflight(argv)
    except RLHFOrchError as e:
        for line in str(e).splitlines():
            sys.stderr.write(f"error: {line}\n")
        return 2
    try:   # one live run per run folder; held across in-process restarts, dropped by the kernel if we are killed
        lock = RunLock(run_dir, cfg.experiment.name).acquire()
    except RLHFOrchError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    try:   # under the lock: a fresh run never writes over an earlier run's outputs (refused, or experiment.overwrite)
        claim_run_dir(run_dir, cfg.resume, cfg.experiment.overwrite)
    except RLHFOrchError as e:
        lock.release()
        sys.stderr.write(f"error: {e}\n")
        return 2
    try:
        return _supervise(cfg, run_dir, model_path, tokenizer, dataset, eval_set)
    finally:
        lock.release()


def _supervise(cfg, run_dir: Path, model_path: str, tokenizer, dataset, eval_set) -> int:
    """The run with its automatic restarts from the latest checkpoint; writes summary.json; returns the exit code."""
    from rlhf_orch.checkpoint import checkpoint_dir, find_good, snapshot_dir   # torch
    from driver.ray_session import stop_ray   # imports Ray (seconds): not at the top, so --help stays instant
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    _STOPPING.clear()   # a fresh run in this process (tests call main() more than once)
    _EARLIER.clear()
    t0, restarts, faults, rc = time.time(), [], [], 0
    while True:
        summary: dict = {}
        try:
            run(cfg, run_dir, model_path, tokenizer, dataset, summary, eval_set, restarts)
            summary["status"] = "finished"
            break
        except (RunStopped, KeyboardInterrupt) as e:
            summary.update(status="stopped", error=str(e) or "stopped by Ctrl-C (SIGINT)")
            sys.stderr.write(f"{e}: the last completed step is checkpointed in {run_dir}\n")
            rc = 1
            break
        except RLHFOrchError as e:
            # A dead trainer rank, reward worker or manager: restart from the latest good checkpoint (a dead
            # coordinator is replaced in place, driver/recovery.py).
            if is_actor_death(e) and len(restarts) < cfg.fault_tolerance.max_run_restarts and not _STOPPING:
                restarts.append({"t": time.time(), "error": str(e).splitlines()[0][:500],
                                 "last_step": summary.get("last_step"), "lost": _lost(summary)})
                faults.extend(summary.get("faults", []))
                if cfg.fault_tolerance.step_snapshots:   # the restart's Checkpoints.find picks between the two
                    source = "its latest step snapshot or checkpoint"
                else:   # (find_good hashes the checkpoint's files: only where the message names it)
                    good, _ = find_good(checkpoint_dir(run_dir))
                    source = (f"its checkpoint {good}" if good else
                              "step 1: no checkpoint yet (trainer.checkpoint_every / checkpoint_every_minutes)")
                logger.error("run failed (%s); restarting it by itself (restart %d of %d, fault_tolerance."
                             "max_run_restarts) from %s", str(e).splitlines()[0], len(restarts),
                             cfg.fault_tolerance.max_run_restarts, source)
                cfg = cfg.model_copy(update={"resume": True})   # the dataset here was never drawn from: same order
                stop_ray()
                continue
            lost = restarts[-1].get("lost") if restarts else None
            where = (f" (a restart after losing node(s) {sorted({n[:12] for n in lost.values()})}, which held "
                     f"{', '.join(sorted(lost))}: add nodes with the labels of the nodes section and run again with "
                     "resume=true)") if lost else ""
            sys.stderr.write(f"error: {type(e).__name__}: {e}{where}\nmetrics and checkpoints so far are in {run_dir}\n")
            summary.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0]}{where}")
            rc = 1
            break
    summary["faults"] = faults + summary.get("faults", [])
    summary["run_restarts"] = restarts
    snaps = snapshot_dir(run_dir, cfg.fault_tolerance.snapshot_dir) if cfg.fault_tolerance.step_snapshots else None
    if snaps is not None and snaps.exists():
        if summary.get("status") == "failed":   # `resume: true` continues from it while this machine keeps it
            logger.warning("the last step snapshot stays in %s (RAM): a resume continues from it; delete the folder "
                           "to free the memory", snaps)
        else:   # finished or stopped: the final checkpoint holds the last completed step
            shutil.rmtree(snaps, ignore_errors=True)
    job = ray_job_id(dict(os.environ), os.getcwd())
    if job is not None:   # `ray job submit`: which submission this was (its id also names the default folder)
        summary["ray_job"] = job
    summary["wall_s"] = round(time.time() - t0, 1)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_summary(run_dir, summary)
        if cfg.experiment.storage_uri:   # the run's records beside its checkpoints (uploaded as they were written)
            upload_records(Store(run_uri(cfg.experiment.storage_uri, cfg.experiment.name)), run_dir)
        for line in end_of_run(summary, run_dir):   # its digest; summary.json is the complete record
            logger.info("%s", line)
    finally:
        stop_ray()   # after summary.json: a SIGTERM while Ray stops its processes ends this driver at once
    return rc


def _lost(summary: dict) -> dict:
    """{actor: node id} of the actors that answered at the start of the failed segment and not at its end: on a
    cluster, a lost node shows as every actor it held (the restart waits for nodes that match their labels)."""
    nodes = summary.get("nodes", {})
    return {who: where["node_id"] for who, where in nodes.get("at_start", {}).items()
            if where and nodes.get("at_end", {}).get(who, where) is None}


_EARLIER: dict[str, dict] = {}   # summary.json as an earlier process left it, read once per run folder


def _write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json of this run, merged over an earlier run's (a resumed run keeps its fault history). The earlier
    one is read before this run first writes there, so its own provisional summary (the "ending" one, written before
    the final checkpoint) is never merged in."""
    path = run_dir / "summary.json"
    if str(path) not in _EARLIER:
        try:
            _EARLIER[str(path)] = json.loads(path.read_text()) if path.exists() and summary.get("resumed_from") else {}
        except (OSError, json.JSONDecodeError):
            _EARLIER[str(path)] = {}
    old = _EARLIER[str(path)]
    for key in ("faults", "run_restarts"):
        if old.get(key):
            summary[key] = old[key] + summary.get(key, [])
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
