"""Which colocation hand-overs a run needs (`trainer.offload: auto`): a pure decision on measured numbers.

A colocated step has two phases on every shared GPU. While the engines generate, the GPU holds the engines
awake (weights, KV cache, workspace) and whatever the trainer keeps; while the trainer trains, it holds the
trainer at its peak and whatever the engines keep. Two moves can make room: the trainer's offload (its ZeRO
state to CPU memory during generate) and the engines' configured sleep (during train). `choose` picks the
least movement that fits every GPU in both phases, with a safety margin of max(2 GiB, 5% of the GPU):

    none:   engines_awake + trainer_peak + margin <= total      (the trainer keeps its cached blocks too)
    sleep:  engines_awake + trainer_resident + margin <= total   (generate; the trainer releases its cache)
            and engines_asleep + trainer_peak + margin <= total  (train)
    both:   otherwise: offload and sleep as configured

Offloading without sleeping is never less movement that fits: its train phase needs engines_awake + trainer_peak,
which is `none`'s condition. The figures of one GPU are bytes that add up to what the device shows: the trainer's
are its torch allocator's reserved bytes (what it holds from the device); the engines' are the rest of the
device's used memory (their weights, KV cache and workspace, plus every CUDA context on the device, the trainer's
included), so nothing is left out and nothing is counted twice.

It takes numbers only (no Ray, no torch.cuda): measuring them is driver/colocation.py's job (TrainerActor's
torch readings at three points of the first step), and so is carrying the plan out.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 2**30
MARGIN_MIN = 2 * GiB
MARGIN_FRAC = 0.05


@dataclass(frozen=True)
class GpuMemory:
    """One shared GPU, in bytes."""
    device: str
    total: float
    trainer_resident: float     # the trainer at rest, loaded, cache released: what it keeps if it does not offload
    trainer_peak: float         # the trainer's peak during a train step (reserved, so its cache included)
    engines_awake: float        # everything else on the device while the engines are awake (see the module doc)
    sleep_frees: float = 0.0    # what the configured sleep of the engines on this GPU frees

    @property
    def engines_asleep(self) -> float:
        return max(self.engines_awake - self.sleep_frees, 0.0)


@dataclass(frozen=True)
class Plan:
    """Which hand-overs run: the trainer's offload during generate, the engines' sleep during train."""
    offload: bool
    sleep: bool
    reason: str

    @property
    def name(self) -> str:
        return {(False, False): "nothing moves", (False, True): "engines sleep, trainer stays",
                (True, False): "trainer offloads, engines stay awake",
                (True, True): "trainer offloads and engines sleep"}[(self.offload, self.sleep)]

    @property
    def moves(self) -> int:
        """An order on plans by how much they move: none 0 < sleep 1 < offload 2 < both 3."""
        return 2 * self.offload + self.sleep


def margin(total: float, min_bytes: float = MARGIN_MIN, frac: float = MARGIN_FRAC) -> float:
    return max(min_bytes, frac * total)


def _gb(x: float) -> str:
    return f"{x / GiB:.1f}"


def _phase_fits(g: GpuMemory, offload: bool, sleep: bool, min_bytes: float, frac: float) -> str | None:
    """None if `g` fits both phases under this plan, else the phase that does not, with its numbers."""
    m, total = margin(g.total, min_bytes, frac), g.total
    trainer_gen = 0.0 if offload else (g.trainer_resident if sleep else g.trainer_peak)
    engines_train = g.engines_asleep if sleep else g.engines_awake
    gen = g.engines_awake + trainer_gen + m
    train = engines_train + g.trainer_peak + m
    if not (offload or sleep) and gen > total:   # one condition for both phases
        return (f"{g.device}: engines awake {_gb(g.engines_awake)} + trainer peak {_gb(g.trainer_peak)} + margin "
                f"{_gb(m)} = {_gb(gen)} GiB > {_gb(total)} GiB")
    if gen > total:
        return (f"{g.device}: generate needs engines {_gb(g.engines_awake)} + trainer {_gb(trainer_gen)} + margin "
                f"{_gb(m)} = {_gb(gen)} GiB > {_gb(total)} GiB")
    if train > total:
        return (f"{g.device}: train needs engines {_gb(engines_train)} + trainer peak {_gb(g.trainer_peak)} + margin "
                f"{_gb(m)} = {_gb(train)} GiB > {_gb(total)} GiB")
    return None


def choose(gpus: list[GpuMemory], can_offload: bool = True, can_sleep: bool = True,
           margin_min: float = MARGIN_MIN, margin_frac: float = MARGIN_FRAC) -> Plan:
    """The least movement that fits every GPU in both phases. `can_offload`/`can_sleep`: what the config allows
    (the trainer offloads under `offload: auto`; engines sleep where their `sleep_level` > 0). Without readings,
    everything as configured."""
    configured = (can_offload, can_sleep)
    if not gpus:
        return Plan(*configured, "no GPU memory readings: keeping the configured hand-overs")
    options = [(False, False)] + ([(False, True)] if can_sleep else [])
    misses = []
    for offload, sleep in options:
        miss = [r for g in gpus if (r := _phase_fits(g, offload, sleep, margin_min, margin_frac))]
        if not miss:
            head = max(gpus, key=lambda g: g.engines_awake + g.trainer_peak - g.total)
            return Plan(offload, sleep, _fits_reason(offload, sleep, head, misses, margin_min, margin_frac))
        misses.append(f"{Plan(offload, sleep, '').name} does not fit ({miss[0]})")
    left = [r for g in gpus if (r := _phase_fits(g, *configured, margin_min, margin_frac))]
    tail = f"; even that is tight ({left[0]})" if left else ""
    return Plan(*configured, "; ".join(misses) + ": moving as configured" + tail)


def _fits_reason(offload: bool, sleep: bool, g: GpuMemory, misses: list[str], min_bytes: float, frac: float) -> str:
    m = margin(g.total, min_bytes, frac)
    if not sleep:
        why = (f"engines awake {_gb(g.engines_awake)} + trainer peak {_gb(g.trainer_peak)} + margin {_gb(m)} = "
               f"{_gb(g.engines_awake + g.trainer_peak + m)} of {_gb(g.total)} GiB on {g.device}")
    else:
        why = (f"on {g.device} generate takes engines {_gb(g.engines_awake)} + trainer {_gb(g.trainer_resident)} and "
               f"train engines asleep {_gb(g.engines_asleep)} + trainer peak {_gb(g.trainer_peak)}, each + margin "
               f"{_gb(m)} of {_gb(g.total)} GiB")
    return "; ".join([*misses, f"{Plan(offload, sleep, '').name}: {why}"])


def measured_gpus(awake: list[dict] | None, asleep: list[dict] | None, after_train: list[dict] | None
                  ) -> list[GpuMemory]:
    """GpuMemory per trainer rank (one GPU each) from three readings of every rank (dicts of bytes: device, total,
    used (the whole device), reserved (the trainer's), peak_reserved), taken in the configured hand-overs of the
    first step: `awake` at the end of generate (engines awake, trainer offloaded), `asleep` after the hand-over to
    train (engines asleep, trainer loaded), `after_train` right after the step with the trainer's cache released
    (its reserved is then the trainer at rest, peak_reserved the step's peak). [] if any reading is missing."""
    if not (awake and asleep and after_train) or not len(awake) == len(asleep) == len(after_train):
        return []
    out = []
    for a, s, t in zip(awake, asleep, after_train):
        if not (a and s and t):
            return []
        engines_awake = a["used"] - a["reserved"]
        engines_asleep = s["used"] - s["reserved"]
        out.append(GpuMemory(device=t["device"], total=t["total"], trainer_resident=t["reserved"],
                             trainer_peak=max(t["peak_reserved"], t["reserved"]), engines_awake=engines_awake,
                             sleep_frees=max(engines_awake - engines_asleep, 0.0)))
    return out


def with_peak(gpus: list[GpuMemory], peak: float) -> list[GpuMemory]:
    """The same GPUs with a trainer peak of at least `peak` bytes (a later step's, the largest over ranks)."""
    return [replace(g, trainer_peak=max(g.trainer_peak, peak)) for g in gpus]
