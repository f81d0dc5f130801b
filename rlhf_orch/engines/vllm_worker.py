"""Weight-sync methods mixed into every vLLM 0.26.0 GPU worker, called through `LLM.collective_rpc`.

vLLM appends `worker_extension_cls` to its Worker class's bases (vllm/v1/worker/worker_base.py:261-287),
so these methods run inside each worker process with the worker as `self`: `self.device` is its GPU,
`self.model_runner.get_model()` the unwrapped model (no CUDA-graph wrapper), `self.vllm_config` its config.
Each worker owns one `WeightReceiver`; every tensor-parallel worker is its own rank in our broadcast
group and receives the full HF tensors, which the model's `load_weights` fuses (qkv, gate_up) and shards.

Loading goes through a `LoadReplay` (weight_sync/replay.py): the first sync runs `model.load_weights` per bucket
and records where each received tensor's bytes land (vLLM fuses q/k/v and gate/up into one parameter, which is a
plain copy into a slice of it); later syncs redo those copies with one fused copy-and-checksum kernel per bucket,
and the checksums are then of the engine's own parameters, per HF tensor. A tensor-parallel worker holds only its
slice of most tensors: its buckets get sharded plans (the slices copied by the same kernel, then the received
tensors checksummed whole, mode "received"). A bucket the recorder cannot map keeps `load_weights`, and its
checksums are of the tensors received too. Each proves the bytes arrived intact; a wrong name still fails loudly,
because vLLM's AutoWeightsLoader raises on unknown names.

Arguments arrive through vLLM's msgpack utility channel, which turns dataclasses into dicts, so the
engine sends layouts and IPC handles pickled to bytes (see docs/vllm_api_notes.md). This module must
import without vLLM (it is imported by name inside the worker) and subclasses nothing from vLLM. It
does not do layerwise reload, so quantized checkpoints are refused (see `_rlhf_check_supported`).
"""
from __future__ import annotations

import logging
import pickle
import time
from typing import Any

import torch

from rlhf_orch.types import dtype_from_name
from rlhf_orch.weight_sync.abort import AbortFlag
from rlhf_orch.weight_sync.buckets import BucketLayout, TensorSlot
from rlhf_orch.weight_sync.ipc import as_handle, open_handle
from rlhf_orch.weight_sync.receiver import ReceivedSums, WeightReceiver
from rlhf_orch.weight_sync.replay import LoadReplay
from rlhf_orch.weight_sync.transport import for_worker

logger = logging.getLogger(__name__)


def pack_arg(obj: Any) -> bytes:
    """Pickle an argument for collective_rpc (msgpack carries bytes unchanged)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack_arg(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return pickle.loads(bytes(obj))
    return obj


def _as_layouts(obj: Any) -> list[BucketLayout]:
    """Layouts from pickled bytes, BucketLayout objects, or the dicts msgpack makes of them."""
    out = []
    for lay in _unpack_arg(obj):
        if isinstance(lay, dict):
            slots = tuple(TensorSlot(s["name"], s["dtype"], tuple(s["shape"]), s["offset"], s["nbytes"])
                          for s in lay["slots"])
            lay = BucketLayout(lay["index"], lay["nbytes"], slots)
        out.append(lay)
    return out


class WeightSyncWorkerExtension:
    """Mixed into vLLM's Worker. Names start with `rlhf_`/`_rlhf_`: vLLM asserts no clash with Worker's."""

    # ---- state (plain instance attributes; vLLM never calls an __init__ of the extension) ----------
    def _rlhf_state(self) -> dict:
        st = getattr(self, "_rlhf_st", None)
        if st is None:
            st = self._rlhf_st = {"receiver": None, "received": self._rlhf_received()}
        return st

    def _rlhf_received(self) -> ReceivedSums:
        """model.load_weights per bucket, and checksums of the tensors it received (mode "received")."""
        return ReceivedSums(lambda named: self._rlhf_model().load_weights(named))

    def _rlhf_model(self) -> torch.nn.Module:
        # get_model() unwraps CUDAGraphWrapper/UBatchWrapper (gpu_model_runner.py:3288); V2 runner returns it as is.
        return self.model_runner.get_model()

    def _rlhf_check_supported(self) -> None:
        # Plain (bf16/fp16/fp32) linears and embeddings do nothing after loading on CUDA (linear.py:214,
        # vocab_parallel_embedding.py:61), so load_weights alone is complete; quantized layers are not.
        if self.vllm_config.quant_config is not None:
            raise RuntimeError("rlhf_orch weight sync loads checkpoint-format weights with model.load_weights and "
                               "does not run vLLM's layerwise reload; quantized models are not supported")

    # ---- called through collective_rpc -------------------------------------------------------------
    def rlhf_device_id(self) -> str:
        return "gpu-" + str(torch.cuda.get_device_properties(self.device).uuid)

    def rlhf_checksums_mode(self) -> str:
        return "received"

    def rlhf_setup_receiver(self, layouts: Any, transport: str, spec: dict, verify: bool, timeout_s: float,
                            replay: bool = True, abort_flag: str | None = None) -> float:
        """Build this worker's receiver and open its side of `transport` (a group member as the spec's rank + TP
        rank). Returns seconds."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        t0 = time.perf_counter()
        self._rlhf_check_supported()
        st = self._rlhf_state()
        if st["receiver"] is not None:
            st["receiver"].close()
        params = dict(self._rlhf_model().named_parameters())   # the same Parameter objects for the engine's life
        st["receiver"] = WeightReceiver(_as_layouts(layouts), self.device, st["received"].load,
                                        st["received"].checksums,
                                        LoadReplay(lambda: params, bool(replay),
                                                   sharded=get_tensor_model_parallel_world_size() > 1))
        if abort_flag:   # mapped once: the actor unlinks the file after the first setup
            if st.get("abort_path") != abort_flag:
                st["abort"], st["abort_path"] = AbortFlag.attach(abort_flag), abort_flag
            st["receiver"].abort_flag = st["abort"]
        spec = for_worker(spec, get_tensor_model_parallel_rank())
        st["receiver"].open(str(transport), spec, float(timeout_s))
        logger.info("worker on %s opened its %s side of the weight sync%s", self.device, transport,
                    f" as rank {spec['rank']}" if "rank" in spec else "")
        return time.perf_counter() - t0

    def _rlhf_receiver(self) -> WeightReceiver:
        rec = self._rlhf_state()["receiver"]
        if rec is None:
            raise RuntimeError("weight receiver not set up: call rlhf_setup_receiver first")
        return rec

    def rlhf_connect(self, offer: Any) -> Any:
        """Setup's second round: the trainer rank's offer (ipc: its ring buffers' handles) -> our answer (ipc: our
        mailbox's handle; broadcast: None)."""
        return self._rlhf_receiver().connect(_unpack_arg(offer))

    def rlhf_receive(self, sync_id: int, verify: bool) -> tuple[list[int], dict[str, float]]:
        """Every bucket of one sync over this worker's transport (the colocated stream or the broadcast group), each
        tensor checked against the trainer's checksum where they travel with the buckets."""
        return self._rlhf_receiver().receive(int(sync_id), bool(verify))

    def rlhf_set_replay(self, enabled: bool) -> None:
        """Switch load replay on or off for later syncs (the benchmark compares both in one run)."""
        self._rlhf_receiver().set_replay(bool(enabled))

    def rlhf_replay_status(self) -> dict:
        return self._rlhf_receiver().replay.status()

    def rlhf_abort_stream(self) -> None:
        self._rlhf_receiver().abort_stream()

    def rlhf_load_weights(self, named: Any) -> int:
        """Load pickled [(name, cpu tensor)] in one load_weights call (tests, small models); returns count."""
        self._rlhf_check_supported()
        named = [(n, t.to(self.device)) for n, t in _unpack_arg(named)]
        received = self._rlhf_state()["received"]
        received.load(named)
        received.checksums([n for n, _ in named])   # its host read also waits for the copies
        return len(named)

    def rlhf_checksums(self, names: list[str]) -> list[int]:
        """Checksums of the most recently received tensors of `names` (recorded when they were verified)."""
        rec = self._rlhf_state()["receiver"]
        sums = {**self._rlhf_state()["received"].sums, **(rec.last_sums if rec is not None else {})}
        missing = [n for n in names if n not in sums]
        if missing:
            raise RuntimeError(f"no received checksum for {missing[:5]} (sync with verify=True first)")
        return [sums[n] for n in names]

    # ---- the per-parameter paths users run today, for `bench/weight_sync.py --naive` ------------------------
    def rlhf_receive_one(self, name: str, dtype: str, shape: list[int]) -> None:
        """The naive path users run today: one call and one broadcast per parameter, then load_weights."""
        t = torch.empty(tuple(shape), dtype=dtype_from_name(dtype), device=self.device)
        self._rlhf_receiver().group.broadcast(t)
        with torch.no_grad():
            self._rlhf_model().load_weights([(name, t)])

    def rlhf_receive_one_ipc(self, name: str, handle: Any, dtype: str, shape: list[int]) -> None:
        """The naive colocated path: one call and one fresh CUDA IPC handle per parameter."""
        t = open_handle(as_handle(_unpack_arg(handle))).view(dtype_from_name(dtype)).view(tuple(shape))
        with torch.no_grad():
            self._rlhf_model().load_weights([(name, t)])
        torch.cuda.synchronize(self.device)

    def rlhf_close(self) -> None:
        st = self._rlhf_state()
        if st["receiver"] is not None:
            st["receiver"].close()
        st.update(receiver=None, received=self._rlhf_received())
