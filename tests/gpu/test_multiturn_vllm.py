"""Multi-turn trajectories and agent functions on vLLM (issue #29's GPU test): the built-in calculator agent makes
MultiTurn's trajectories exactly (greedy), every model turn is the ids vLLM returned for it, observations are
masked and carry no logprob, and the engine's logprobs of the model's tokens match an independent forward of the
whole trajectory (so the trainer would score exactly what vLLM sampled). Needs vLLM 0.26.0 (staged on the device).

    python -m pytest -q -m gpu tests/gpu/test_multiturn_vllm.py
"""
import os

import pytest
import torch

from engine_contract import reference_logprobs, two_models

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")   # as tests/gpu/test_vllm_engine.py says why

from rlhf_orch.engines.base import SamplingParams  # noqa: E402
from rlhf_orch.engines.vllm import VLLMEngine  # noqa: E402
from rlhf_orch.models import build_tokenizer  # noqa: E402
from rlhf_orch.rollout import agents  # noqa: E402
from rlhf_orch.rollout.agent import AgentRunner  # noqa: E402
from rlhf_orch.rollout.multiturn import MultiTurn  # noqa: E402

SPEC = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
LIMITS = dict(max_turns=3, max_total_tokens=40, max_observation_tokens=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = two_models(tmp_path_factory.mktemp("mt_models"), SPEC)[0]
    engine = VLLMEngine(name="v", model_path=model_dir, dtype="bfloat16", gpu_memory_utilization=0.25,
                        enforce_eager=True, enable_sleep_mode=False, max_model_len=64, seed=0, kv_cache_memory_gb=1)
    yield engine, model_dir
    getattr(engine, "shutdown", lambda: None)()


def test_agent_and_multiturn_trajectories_on_vllm(setup):
    engine, model_dir = setup
    tok = build_tokenizer()
    returned = []

    def generate(prompts, params):
        out = engine.generate(prompts, params)
        returned.append([list(s.response_ids) for s in out])
        return out

    answer = lambda text: "=19 "   # every turn answered: trajectories run to max_turns or the token budget
    encode = lambda text: tok.encode(text, add_special_tokens=False)
    prompts = [encode(t) for t in ("12+7=", "3*4=", "40+2=")]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, n=1)
    want = MultiTurn(engine.generate, answer, encode, lambda ids: tok.decode(ids, skip_special_tokens=True),
                     **LIMITS).generate(prompts, params)
    got = AgentRunner(generate, agents.calculator, tok, {"calculator": answer}, LIMITS["max_turns"],
                      LIMITS["max_total_tokens"], LIMITS["max_observation_tokens"], 5.0).generate(prompts, params,
                                                                                                  [{}] * 3)
    for a, b in zip(got, want):
        assert (a.response_ids, a.loss_mask) == (b.response_ids, b.loss_mask)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=0.05)
    for k, s in enumerate(got):
        turns, obs, cur = [], [], None
        for t, m in zip(s.response_ids, s.loss_mask):
            if cur is None or cur[0] != m:
                cur = (m, [])
                (turns if m else obs).append(cur[1])
            cur[1].append(t)
        assert turns == [returned[i][k] for i in range(len(turns))] and len(turns) >= 2
        assert all(o == encode("=19 ") for o in obs)
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if m == 0)
        # the engine's logprob of every model token equals an independent forward of the whole trajectory
        ref = reference_logprobs(model_dir, s.prompt_ids, s.response_ids, 1.0)
        model = [(lp, r) for lp, r, m in zip(s.logprobs, ref, s.loss_mask) if m]
        assert max(abs(lp - r) for lp, r in model) < 0.1, model
