"""The streaming SGLang engine (`kind: sglang`, `streaming: true`: sglang.Engine on its own loop thread) on a GPU:
the engine contract, concurrent calls, then partial rollouts: a "keep" pause stops requests in flight in place,
new weights are loaded under them (load_weights, and our IPC sync path with its checksums), finish_sync retracts
them and drops the old-weight KV (engines/sglang_sched.py), and after resume their later tokens carry the new
version and are exactly the new policy's (they re-prefill under the new weights); the version boundary of every
request sits exactly at the token count the paused scheduler predicted (its pending step's token included), which
the retraction confirms; an "abort" pause hands requests back unfinished (paused in place, the scheduler drops
every request in one pass and is idle at once: flush_cache works in finish_sync). Needs SGLang 0.5.17:

    PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests NCCL_NVLS_ENABLE=0 python -m pytest -q -s -m gpu tests/gpu/test_sglang_streaming.py
"""
import json
import os
import statistics
import threading
import time

import pytest
import torch

from engine_contract import named_weights, reference_logprobs, run_contract, run_inflight_contract, two_models

pytestmark = pytest.mark.gpu
sglang = pytest.importorskip("sglang")

SPEC = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_models(tmp_path_factory.mktemp("sglang_stream_models"), SPEC)


@pytest.fixture(scope="module")
def engine(dirs):
    from rlhf_orch.engines.sglang_async import StreamingSGLangEngine
    e = StreamingSGLangEngine(name="s", model_path=dirs[0], dtype="bfloat16", mem_fraction_static=0.25,
                              disable_cuda_graph=True, context_length=1024, seed=0)
    yield e
    e.shutdown()


def _tok():
    from rlhf_orch.models import build_tokenizer
    return build_tokenizer()


def test_streaming_sglang_contract(engine, dirs):
    assert engine.capabilities.concurrent_generate and engine.capabilities.partial_rollouts
    run_contract(engine, dirs[0], dirs[1], _tok(), atol=0.05, dtype=torch.bfloat16)


def test_streaming_sglang_concurrent_calls(engine):
    """Generate calls from several threads run at once (continuous batching across them)."""
    from rlhf_orch.engines.base import SamplingParams
    p = _tok()("1+1=", add_special_tokens=False).input_ids
    out = [None] * 4

    def go(i):
        out[i] = engine.generate([p] * 2, SamplingParams(max_new_tokens=32, n=3, ignore_eos=True))
    ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert all(o is not None and len(o) == 6 and all(len(s.response_ids) == 32 for s in o) for o in out)
    assert all(len(s.logprobs) == 32 and s.token_versions == [engine.weight_version] * 32 for o in out for s in o)


def test_streaming_sglang_keeps_requests_through_a_sync(engine, dirs):
    engine.resume()
    run_inflight_contract(engine, dirs[1], dirs[0], _tok(), max_new_tokens=600, atol=0.05,
                          dtype=torch.bfloat16, start_delay_s=0.3, kv_recomputed=True)
    assert engine.runner.in_flight() == 0


def test_version_boundary_is_exact_through_an_ipc_sync(engine, dirs):
    """32 requests in flight; pause("keep"); every stream already holds exactly the tokens the paused scheduler
    generated; our IPC sync (checksummed) loads other weights under them; finish_sync evicts the old KV; after
    resume each request's first new-version token is at that count and the rest are the new policy's."""
    from rlhf_orch.engines.base import SamplingParams
    from rlhf_orch.types import ParamSpec, dtype_name
    from rlhf_orch.weight_sync import WeightSender, plan_buckets

    # after the in-flight contract the engine holds dirs[0]'s weights; move it to dirs[1]'s
    old_dir, new_dir, v = dirs[0], dirs[1], engine.weight_version + 1
    tok = _tok()
    prompts = [tok(f"{a}+{b}=", add_special_tokens=False).input_ids for a, b in zip(range(8), range(3, 11))]
    params = SamplingParams(temperature=1.0, max_new_tokens=400, n=4, ignore_eos=True)
    dev = torch.device("cuda", 0)
    weights = [(n, t.to(dev)) for n, t in named_weights(new_dir, torch.bfloat16)]
    layouts = plan_buckets([ParamSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights], 64 * 1024)
    timings = []
    for rep in range(3):
        box = {}
        worker = threading.Thread(target=lambda: box.update(out=engine.generate(prompts, params)))
        worker.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        engine.pause("keep")
        t1 = time.perf_counter()
        assert worker.is_alive(), "the requests finished before the pause: make them longer"
        counts = dict(engine.runner._counts)   # predicted: the tokens processed + the pending step's
        assert len(counts) == 32 and all(c > 0 for c in counts.values())
        time.sleep(0.2)   # the detokenizer's backlog arrives (pause() does not wait for it; resume() checks it)
        got = {rid: len(r.tokens) for rid, r in engine.runner._reqs.items()}
        assert set(got) == set(counts) and all(counts[k] - 1 <= got[k] <= counts[k] for k in got), \
            "nothing runs while paused (the pending step's token comes with the retraction)"
        target = new_dir if rep % 2 == 0 else old_dir   # alternate, so every round changes the weights
        ws = weights if rep % 2 == 0 else [(n, t.to(dev)) for n, t in named_weights(old_dir, torch.bfloat16)]
        t2 = time.perf_counter()
        engine.setup_receiver(layouts, "ipc", {}, True, 120)
        sender = WeightSender(layouts, dev, {"ipc": {"engines": ["s"]}}, timeout_s=120)
        sender.accept("ipc", "s", engine.connect(sender.offers()["ipc"]))
        res = {}
        sending = threading.Thread(target=lambda: res.update(r=sender.send(iter(ws), v, sync_id=v)))
        sending.start()
        got, _ = engine.receive(v, True)   # checked in the scheduler against the trainer's checksums
        sending.join(120)
        assert got == res["r"].checksums
        t3 = time.perf_counter()
        engine.finish_sync(v)
        t4 = time.perf_counter()
        assert engine.runner._counts == counts and engine.runner.last_pause["predicted"]
        time.sleep(0.2)
        assert {rid: len(r.tokens) for rid, r in engine.runner._reqs.items()} == counts, "the pending step arrived"
        t4b = time.perf_counter()
        engine.resume()
        t5 = time.perf_counter()
        assert engine.runner.last_pause["exact"]
        worker.join(300)
        samples = box["out"]
        assert len(samples) == 32
        cuts = []
        for s in samples:
            assert len(s.response_ids) == 400 and len(s.logprobs) == 400 and s.finish_reason == "length"
            cut = s.token_versions.index(v)
            assert s.token_versions == [v - 1] * cut + [v] * (400 - cut)
            cuts.append(cut)
        assert sorted(cuts) == sorted(counts.values()), "the version boundary is the scheduler's token count"
        prev = new_dir if rep % 2 else old_dir
        for s in samples[:2]:
            cut = s.token_versions.index(v)
            lp = torch.tensor(s.logprobs)
            ref_old = torch.tensor(reference_logprobs(prev, s.prompt_ids, s.response_ids, 1.0))
            ref_new = torch.tensor(reference_logprobs(target, s.prompt_ids, s.response_ids, 1.0))
            assert float((lp[:cut] - ref_old[:cut]).abs().mean()) < 0.05
            assert float((lp[cut:] - ref_new[cut:]).abs().mean()) < 0.05
            assert float((lp[cut:] - ref_old[cut:]).abs().mean()) > 0.05
            assert abs(float(lp[cut] - ref_new[cut])) < 0.15, "the first token after resume is the new policy's"
        timings.append({"pause_keep_s": t1 - t0, "census_s": engine.runner.last_pause["census_s"],
                        "drain_s": engine.runner.last_pause["drain_s"], "ipc_sync_s": t3 - t2,
                        "finish_sync_retract_s": t4 - t3, "retract": engine.runner.last_pause["retract"],
                        "resume_s": t5 - t4b, "kept": len(counts)})
        v += 1
    med = {k: statistics.median(t[k] for t in timings) for k in timings[0] if k != "retract"}
    print("\nSGLANG_STREAMING_TIMINGS " + json.dumps({"rounds": timings, "median": med}))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sglang_streaming_timings.json"), "w") as f:
            json.dump({"rounds": timings, "median": med}, f, indent=1)


def test_abort_many_and_sleep_refused_while_kept(engine):
    from rlhf_orch.engines.base import SamplingParams
    from rlhf_orch.errors import EngineError
    p = _tok()("5+5=", add_special_tokens=False).input_ids
    box = {}
    worker = threading.Thread(target=lambda: box.update(out=engine.generate([p] * 16, SamplingParams(
        max_new_tokens=500, n=2, ignore_eos=True))))
    worker.start()
    time.sleep(0.4)
    engine.pause("keep")
    with pytest.raises(EngineError, match="cannot sleep"):
        engine.sleep(1)
    engine.resume()
    time.sleep(0.2)
    t0 = time.perf_counter()
    engine.pause("abort")
    abort_s = time.perf_counter() - t0
    drop = engine.runner.last_pause    # in place, then the scheduler dropped what it held in one pass (no grammar)
    assert drop.get("drop") == "bulk" and 0 < drop["dropped"] <= 32, drop
    worker.join(30)
    assert not worker.is_alive()
    out = box["out"]
    assert len(out) == 32 and all(s.finish_reason == "abort" and 0 < len(s.response_ids) < 500 for s in out)
    assert all(len(s.logprobs) == len(s.response_ids) == len(s.token_versions) for s in out)
    engine.finish_sync(engine.weight_version)      # idle after the abort: flush_cache works
    engine.resume()
    print(f"\nSGLANG_ABORT_PAUSE_S {abort_s:.4f}")
    again = engine.generate([p], SamplingParams(max_new_tokens=3, n=1))
    assert again[0].finish_reason in ("stop", "length")
