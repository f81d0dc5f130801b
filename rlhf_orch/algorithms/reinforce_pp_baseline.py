"""REINFORCE++-baseline as verl has it (`algorithm.name: reinforce_pp_baseline`, verl's
adv_estimator reinforce_plus_plus_baseline): centre each outcome reward within its prompt's group, broadcast it
over the sample's response tokens, whiten over every response token of the step's batch; no critic.

    c_i  = r_i - group mean           (a group of one keeps r_i, as verl)
    A_it = (c_i - mean_x) * rsqrt(var_x + 1e-8) * mask_it,   mean_x, var_x over all response tokens

(advantages.reinforce_pp_baseline_advantages). The whitened value is the same on every token of a sample, so
it is computed here as one value per sample from the samples' response lengths, on the whole step's batch (the
rollout manager), and the loss broadcasts it. `reinforce_pp` is the per-sample variant (whitening over samples,
not tokens), kept unchanged so existing runs stay exact.
"""
from __future__ import annotations

from torch import Tensor

from rlhf_orch.algorithms.advantages import reinforce_pp_baseline_advantages
from rlhf_orch.algorithms.base import Algorithm, register


@register("reinforce_pp_baseline")
class ReinforcePPBaselineVerl(Algorithm):
    # group_size 1 is allowed, as in verl: a lone sample keeps its raw reward and the batch whitening turns the
    # rewards into a signal (REINFORCE++ with gamma 1), so it is not refused like grpo's or rloo's groups of one.
    group_based = False

    def outcome_advantages(self, rewards: Tensor, group_ids: Tensor, response_lengths: Tensor | None = None) -> Tensor:
        if response_lengths is None:
            # Whitening over tokens weighs each sample by its length; without the lengths the result would
            # silently be another estimator (reinforce_pp's), so refuse.
            raise ValueError("reinforce_pp_baseline: outcome_advantages needs response_lengths (each sample's "
                             "response-token count): its whitening is over tokens")
        return reinforce_pp_baseline_advantages(rewards, group_ids, response_lengths)
