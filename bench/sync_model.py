"""Scale on paper (issue #30 item 6): a pipeline model of one weight sync after an optimizer step, checked against
this repo's single-node measurements, then run for a 70B dense and a 235B-A22B MoE model over 8 engine nodes.

What it models. The sender (trainer rank 0) packs each bucket (one HBM copy with the checksum fused in), the bucket
crosses the links, and every engine GPU loads its 1/TP slice (one HBM copy). These stages form a pipeline over the
buckets: T = fixed + sum(stages of one bucket) + (buckets - 1) * slowest stage + ring hops * hop latency. A link
stage is bytes / (link bandwidth * efficiency) + one NCCL call + a host cost per bucket (Python, events, waits).
NCCL's ring broadcast is pipelined in chunks, so forwarding GPUs cost hop latency, not bandwidth, and a node-aware
ring (NCCL groups each node's ranks) crosses each node boundary once per channel.
Topologies: `flat`, one NCCL group of trainer rank 0 plus every engine GPU (rlhf_orch today); `relay`, one
inter-node group of the sender and one GPU per engine node, which re-broadcasts each whole bucket over NVLink.
`reshard`: each engine GPU receives only its 1/TP shard (per-shard groups) instead of every byte. `rails`: trainer
GPUs of one node that each send 1/rails of every bucket through their own NIC (ZeRO-3's gather leaves the whole
bucket on every trainer rank; today only rank 0 sends). One GPU reaches the network through one NIC, so with
rails = 1 every topology pushes all the bytes through that NIC.

What it does not model: the trainer's ZeRO-3 gather of each bucket (an all-gather over the trainer's own links,
overlapped with the sync in rlhf_orch; at 8 rails it may be the bottleneck), NCCL protocol/channel tuning, NIC or
PCIe contention with other traffic, jitter between engines (the sync runs at the slowest loader's pace), engines
that span nodes (TP > GPUs per node), FP8 or other re-quantisation, and any measured multi-node figure: the NIC
bandwidth and its efficiency are assumptions, only the NVLink/HBM side is calibrated.

    python bench/sync_model.py [--nic-gbs 50 --nic-eff 0.8 --bucket-mb 256 ...]
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

MIB = 2 ** 20


@dataclass(frozen=True)
class Links:
    nvlink_gbs: float = 450.0      # H200 NVLink 4: 900 GB/s both ways, 450 each way per GPU
    nvlink_eff: float = 0.825      # -> 371 GB/s: NCCL broadcast GPU0 -> GPU1 measured 370 GB/s at 2 GiB (DESIGN.md)
    nic_gbs: float = 50.0          # 400 Gb/s InfiniBand/RoCE per GPU
    nic_eff: float = 0.8           # an assumption, not measured here
    nics_per_node: int = 8
    copy_gbs: float = 2100.0       # HBM device copy, bytes copied/s: 8B shape, 16.06 GB in 7.67 ms (RESULTS.md)
    nccl_call_us: float = 20.0     # per broadcast call: 128 MiB at 352 GB/s vs 2 GiB at 370 GB/s (DESIGN.md)
    bucket_host_ms: float = 0.15   # fitted on the TP=2 bucket-size sweep (5, 9, 17 buckets), see CALIBRATION
    sync_fixed_ms: float = 2.6     # the same fit: start, checksums after the last bucket, the engines' done reports
    hop_us: float = 10.0           # pipeline fill per ring hop (a 512 KiB chunk plus latency); negligible here


@dataclass(frozen=True)
class Setup:
    model_gb: float                # bf16 bytes / 1e9 (params x 2)
    engines: int
    tp: int = 1
    engines_per_node: int = 0      # 0: the engines share the trainer's node (NVLink only)
    bucket_mb: float = 256.0       # rlhf_orch's default weight_sync.bucket_size_mb
    buckets: int = 0               # 0: ceil(bytes / bucket); else the count a run measured
    rails: int = 1


def n_buckets(s: Setup) -> int:
    return s.buckets or max(1, math.ceil(s.model_gb * 1e9 / (s.bucket_mb * MIB)))


def received_bytes(s: Setup, reshard: bool = False) -> dict[str, float]:
    """Bytes per sync that each engine GPU, and each engine node, must take in."""
    total = s.model_gb * 1e9
    per_node = total if s.engines_per_node else 0.0    # a node hosts whole engines: it needs every shard once
    return {"per_gpu": total / s.tp if reshard else total, "per_node": per_node}


def predict(s: Setup, L: Links = Links(), topo: str = "flat", reshard: bool = False) -> dict:
    """Seconds for one sync: total, the wire-only floor, and the slowest stage's name."""
    nb = n_buckets(s)
    b = s.model_gb * 1e9 / nb
    nv, nic, cp = L.nvlink_gbs * L.nvlink_eff * 1e9, L.nic_gbs * L.nic_eff * 1e9, L.copy_gbs * 1e9
    call, host = L.nccl_call_us * 1e-6, L.bucket_host_ms * 1e-3
    gpu_bytes = b / s.tp if reshard else b
    stages = {"pack": b / cp}
    if not s.engines_per_node:             # single node: the sender's NVLink carries every byte either way
        if topo != "flat":
            raise ValueError("a relay needs engine nodes apart from the trainer")
        stages["nvlink"] = b / nv + call + host
        hops, floor_bw = s.engines * s.tp, nv
    else:
        gpn = s.engines_per_node * s.tp
        if s.tp > L.nics_per_node or gpn > L.nics_per_node:
            raise ValueError("engines spanning nodes, or more GPUs than NICs per node, are not modelled")
        nodes = math.ceil(s.engines / s.engines_per_node)
        rails = min(s.rails, gpn, L.nics_per_node)
        inter = b / (rails * nic)
        if topo == "flat":                 # one pipelined ring: the slower of the NIC and a GPU's NVLink share
            stages["wire"] = max(inter, gpu_bytes / nv) + call + host
            hops = s.engines * s.tp + rails
        elif topo == "relay":              # store-and-forward per bucket at the relay GPU(s)
            stages["inter-node"] = inter + call + host
            stages["fan-out"] = gpu_bytes / nv + call + host
            hops = nodes + rails + gpn - 1
        else:
            raise ValueError(f"unknown topology {topo!r}")
        floor_bw = min(rails * nic, nv * b / gpu_bytes)
    stages["load"] = b / s.tp / cp
    slowest = max(stages, key=stages.get)
    total = (L.sync_fixed_ms * 1e-3 + sum(stages.values()) + (nb - 1) * stages[slowest] + hops * L.hop_us * 1e-6)
    floor = s.model_gb * 1e9 / floor_bw + nb * call + hops * L.hop_us * 1e-6
    return {"s": total, "floor_s": floor, "bottleneck": slowest, "buckets": nb}


# Measured on one 4x / 2x H200 node: trainer tensors on GPU 0, engines (vLLM 0.26.0) on the others, 512 MiB buckets
# unless named. (name, Setup, measured ms, measured floor ms, where). Floors are raw NCCL broadcasts of the bytes.
CALIBRATION = [
    ("1B into 3 engines", Setup(2.47, 3, buckets=5), 10.9, 7.47,     # floor = 10.9 / 1.46
     "shared/DESIGN.md 'Measured 2026-11-27' (10.9 ms = 1.46x the floor)"),
    ("8B into 1 engine", Setup(16.06, 1, buckets=34), 49.5, 44.6, "shared/DESIGN.md 'Measured 2026-11-27'"),
    # Old code (vLLM's load_weights, two buffers): the slowest of 3 loaders set the pace; the model has no jitter.
    ("8B into 3 engines", Setup(16.06, 3, buckets=34), 55.8, 45.5,
     "RESULTS.md 'Weight-sync fan-out into several vLLM engines (2026-11-21, nvidia-h200-x4)'"),
    ("30B-A3B into 1 engine", Setup(61.06, 1, buckets=114), 186.9, 167.4,
     "shared/DESIGN.md 'Measured 2026-11-27' (1.12x, 18,867 tensors)"),
    ("1B into TP=2, 512 MiB", Setup(2.47, 1, tp=2, buckets=5), 10.7, 7.4,
     "RESULTS.md '#32 item 1: one TP=2 engine at three bucket sizes' (fit)"),
    ("1B into TP=2, 256 MiB", Setup(2.47, 1, tp=2, buckets=9), 10.8, 7.4, "the same section (fit)"),
    ("1B into TP=2, 128 MiB", Setup(2.47, 1, tp=2, buckets=17), 12.5, 7.7, "the same section (fit)"),
    ("8B into TP=2", Setup(16.06, 1, tp=2, buckets=34), 51.5, 45.6,
     "RESULTS.md 'Item 1: replay for tensor-parallel workers (b851f33)'"),
]
# The model's floor runs 0.5-0.7 ms (~8%) under the measured 1B floors: the benchmark's raw-broadcast loop has a
# fixed cost of its own that the wire term leaves out; at 8B and above it is within 4%.

# 8 engine nodes of 8 H200 each; the trainer on nodes of its own. 70B (140 GB) does not fit TP=1 on an H200.
SCALE = [
    ("70B dense", "8 x TP8 (1/node)", Setup(140.0, 8, tp=8, engines_per_node=1)),
    ("70B dense", "16 x TP4 (2/node)", Setup(140.0, 16, tp=4, engines_per_node=2)),
    ("235B-A22B", "8 x TP8 (1/node)", Setup(470.0, 8, tp=8, engines_per_node=1)),
]
VARIANTS = [("flat", False), ("relay", False), ("flat", True), ("relay", True)]
VARIANT_NAMES = ["flat", "relay", "flat+reshard", "relay+reshard"]

# Published figures. None is this setup (8 nodes, one NIC out of the trainer), so they bracket, not validate.
PUBLISHED = [
    ("checkpoint-engine: Qwen3-235B-A22B BF16, 8xH800 TP8, broadcast from host memory on one node", "6.22 s",
     "https://github.com/MoonshotAI/checkpoint-engine/blob/415c3205fdf8d3e0bf39deec87db9d73b1c64bba/README.md"
     " (an earlier README and PyPI 0.4.3rc0: 6.75 s)"),
    ("checkpoint-engine: Kimi-K2 (1T) FP8, 256xH20, 16 TP16 instances, broadcast", "16.04 s (README: 'about 20s'"
     " over thousands of GPUs)", "https://github.com/MoonshotAI/checkpoint-engine (same README)"),
    ("NeMo-RL v0.3 refit: DeepSeek-V3, train EP64PP8 -> generate TP64, colocated CUDA IPC", "47.2 s (was 692.5 s;"
     " speed of light 3.3 s)", "https://nvidia-nemo.github.io/blog/2025/08/12/nemo-rl-refit-performance"),
    ("slime: Qwen3-30B-A3B, colocated, 8xH100", "7 s (was 60 s)", "https://hebiao064.github.io/rl-weight-sync"),
    ("SGLang P2P RDMA (Mooncake): Kimi-K2 1T, vs its NCCL broadcast", "7.2 s (NCCL broadcast 53 s)",
     "https://lmsys.org/blog/2026-04-29-p2p-update"),
    ("Perplexity RDMA WRITE: Kimi-K2 1T, 256 training GPUs (BF16) -> 128 inference GPUs (FP8)", "1.3 s",
     "https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds"),
    ("70B dense, disaggregated over a network", "no published figure found", "-"),
]


def _links(a: argparse.Namespace) -> Links:
    return Links(nvlink_gbs=a.nvlink_gbs, nvlink_eff=a.nvlink_eff, nic_gbs=a.nic_gbs, nic_eff=a.nic_eff,
                 nics_per_node=a.nics_per_node, copy_gbs=a.copy_gbs, bucket_host_ms=a.bucket_host_ms,
                 sync_fixed_ms=a.sync_fixed_ms, hop_us=a.hop_us)


def main(argv: list[str] | None = None) -> int:
    d = Links()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default, unit in [("nvlink-gbs", d.nvlink_gbs, "GB/s per GPU each way"),
                                ("nvlink-eff", d.nvlink_eff, "fraction NCCL reaches"),
                                ("nic-gbs", d.nic_gbs, "GB/s per GPU NIC (400 Gb/s = 50)"),
                                ("nic-eff", d.nic_eff, "fraction NCCL reaches"),
                                ("copy-gbs", d.copy_gbs, "GB/s HBM copy"),
                                ("bucket-host-ms", d.bucket_host_ms, "host cost per bucket"),
                                ("sync-fixed-ms", d.sync_fixed_ms, "fixed cost per sync"),
                                ("hop-us", d.hop_us, "per ring hop")]:
        ap.add_argument("--" + name, type=float, default=default, help=f"{unit} (default {default})")
    ap.add_argument("--nics-per-node", type=int, default=d.nics_per_node)
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size of the scale table (MiB)")
    ap.add_argument("--rails", type=int, nargs="+", default=[1, 8], help="trainer-node GPUs sending (scale table)")
    a = ap.parse_args(argv)
    L = _links(a)

    print("Parameters")
    print(f"  NVLink {L.nvlink_gbs:g} GB/s x {L.nvlink_eff:g} = {L.nvlink_gbs * L.nvlink_eff:.0f} GB/s; NIC "
          f"{L.nic_gbs:g} GB/s x {L.nic_eff:g} = {L.nic_gbs * L.nic_eff:.0f} GB/s, {L.nics_per_node} per node; "
          f"HBM copy {L.copy_gbs:g} GB/s")
    print(f"  per NCCL call {L.nccl_call_us:g} us, host per bucket {L.bucket_host_ms:g} ms, fixed per sync "
          f"{L.sync_fixed_ms:g} ms, per ring hop {L.hop_us:g} us; scale-table buckets {a.bucket_mb:g} MiB")

    print("\nCalibration: one node (H200, NVLink), model vs measured (ms)")
    print(f"  {'case':24} {'bkts':>4} {'floor':>6} {'meas':>6} {'ratio':>5} | {'sync':>6} {'meas':>6} {'ratio':>5}"
          "  source")
    for name, s, meas, meas_floor, src in CALIBRATION:
        p = predict(s, L)
        print(f"  {name:24} {p['buckets']:4d} {p['floor_s'] * 1e3:6.1f} {meas_floor:6.1f} "
              f"{p['floor_s'] * 1e3 / meas_floor:5.2f} | {p['s'] * 1e3:6.1f} {meas:6.1f} {p['s'] * 1e3 / meas:5.2f}"
              f"  {src}")

    print(f"\nScale: 8 engine nodes x 8 H200, trainer apart; predicted seconds per sync ({a.bucket_mb:g} MiB buckets)")
    print(f"  {'model':10} {'engines':18} {'rails':>5} {'floor':>7} " + " ".join(f"{v:>15}" for v in VARIANT_NAMES)
          + "  bottleneck (flat)")
    for model, layout, s in SCALE:
        for rails in a.rails:
            ps = [predict(replace(s, bucket_mb=a.bucket_mb, rails=rails), L, topo, rs) for topo, rs in VARIANTS]
            print(f"  {model:10} {layout:18} {rails:5d} {ps[0]['floor_s']:7.3f} "
                  + " ".join(f"{p['s']:15.3f}" for p in ps) + f"  {ps[0]['bottleneck']}")
    print("  rails 1 = rlhf_orch today (only trainer rank 0 sends). Neither a relay nor resharding changes what each"
          " node\n  must take in (every byte, once), so they tie the flat ring; the number of sending NICs is the"
          " lever.")

    print("\nPublished weight-update times (for scale; different hardware, placement and precision)")
    for what, number, src in PUBLISHED:
        print(f"  {what}: {number}\n      {src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
