"""A reference held apart (rlhf_orch/trainer/reference.py) against the one inside the policy rank, on one real
DeepSpeed rank (gloo, in a fresh process: DeepSpeed keeps process-group state a second trainer in one process trips on).

Two processes with the same history (a supervised step, so the reference is not the model's start, then the
snapshot and two train steps): one keeps the reference inside the rank, the other writes it with
`snapshot_reference(keep=False)` (no copy kept) and loads it in a FrozenReference. The logprobs are equal, padded and
on packed token-budget micro-batches, and the train step fed them (TrainBatch.ref_logprobs) updates the policy
exactly as the step with its own copy does."""
import multiprocessing
import socket

import pytest
import torch

KW = dict(zero_stage=2, lr=1e-2, algorithm={"name": "grpo", "kl_coef": 0.5, "group_size": 2})


def _batch(n: int = 6):
    from rlhf_orch.trainer import build_sft_batch
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 50, (2 + i % 3,), generator=g).tolist() for i in range(n)]
    answers = [torch.randint(4, 50, (3 + i % 2,), generator=g).tolist() for i in range(n)]
    b = build_sft_batch(prompts, answers, 0)
    b.advantages = torch.linspace(-1, 1, n)
    return b


def _trainer(model_dir, extra):
    import os
    from rlhf_orch.trainer.deepspeed_trainer import DeepSpeedTrainer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    return DeepSpeedTrainer(model_dir, 0, 1, device="cpu", **KW, **extra)


def _run(model_dir: str, tmp: str, extra: dict, apart: bool, result: str) -> None:
    """In a fresh process: a supervised step (so the reference is not the model's start), the snapshot, the
    reference logprobs and one train step, with the reference apart (`apart`) or inside the rank."""
    from rlhf_orch.trainer.reference import FrozenReference
    tr = _trainer(model_dir, extra)
    try:
        batch = _batch()
        tr.sft_step(batch, float(batch.response_mask.sum()))
        path = f"{tmp}/reference-{int(apart)}.pt"
        tr.snapshot_reference(path, keep=not apart)
        held = tr.ref_model is not None
        if apart:
            fwd = {k: extra.get(k, 0) for k in ("micro_batch_size", "max_tokens_per_micro_batch", "logprob_chunk_tokens")}
            ref = FrozenReference(model_dir, path, packing=extra.get("packing", False), **fwd).logprobs(batch)
            batch.ref_logprobs = ref
        else:
            ref = tr.reference_logprobs(batch)
        tr.train_step(batch, float(batch.response_mask.sum()))       # KL 0 here: the policy is the reference
        m = tr.train_step(batch, float(batch.response_mask.sum()))   # KL > 0: the reference steers the update
        torch.save({"held": held, "ref": ref, "m": m, "after": dict(tr.engine.module.state_dict())}, result)
    finally:
        torch.distributed.destroy_process_group()


def _in_process(target, *args):
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0, f"the trainer process exited with {proc.exitcode} (its traceback is in the captured stderr)"


@pytest.mark.parametrize("extra", [{}, {"max_tokens_per_micro_batch": 12, "packing": True, "logprob_chunk_tokens": 5}],
                         ids=["padded", "packed"])
def test_a_reference_apart_equals_the_one_inside_the_policy(tmp_path, tiny_model_dir, extra):
    _in_process(_run, tiny_model_dir, str(tmp_path), extra, False, str(tmp_path / "own.pt"))
    _in_process(_run, tiny_model_dir, str(tmp_path), extra, True, str(tmp_path / "apart.pt"))
    own, apart = torch.load(tmp_path / "own.pt"), torch.load(tmp_path / "apart.pt")
    assert own["held"] and not apart["held"], "snapshot_reference(keep=False) must keep no copy in the policy rank"
    assert own["ref"].abs().sum() > 0 and torch.equal(apart["ref"], own["ref"])
    assert own["m"]["train/kl"] > 0
    assert apart["m"]["train/kl"] == own["m"]["train/kl"] and apart["m"]["train/loss"] == own["m"]["train/loss"]
    for k, v in own["after"].items():
        assert torch.equal(apart["after"][k], v), k
