"""DeepSeek-V3's multi-token prediction: how many depths a model predicts, and torchtitan's own
`MTPLoss` over its outputs."""

from __future__ import annotations

from torch_on_tpu.models.torchtitan.configs import is_torchtitan

MTP_SCALE = 0.3  # torchtitan's MTPLoss.Config.mtp_scale


def mtp_depths(model) -> int:
  """How many tokens past the next one a torchtitan model (or its config) predicts
  (DeepSeek-V3 built with `num_mtp_layers`): its forward then returns a list, the main logits
  and one per depth. 0 for every other model."""
  return len(getattr(model, "mtp_layers", None) or ()) if is_torchtitan(model) else 0


def mtp_loss(outputs, labels, positions, *, scale: float = MTP_SCALE):
  """torchtitan's own `MTPLoss` of a multi-token-prediction model's outputs: the main
  cross-entropy plus `scale` × the mean over depths of the cross-entropy against the labels
  rolled by the depth within each packed document (`roll_mtp_sequence`, from `positions`),
  normalised as torchtitan's trainer normalises it, by the count of valid main labels (with
  `grad_accum`, per microbatch: the step's mean of them is torchtitan's whole-batch division
  where the microbatches hold as many valid labels, as the recipe's packed rows, with none
  ignored, do). A train step's `loss_fn` reads `labels` and `positions` from its labels pytree:

      loss_fn = lambda outputs, y: mtp_loss(outputs, y["labels"], y["positions"])
      step(inputs, {"labels": labels, "positions": positions})
  """
  from torchtitan.components.loss import IGNORE_INDEX
  from torchtitan.models.deepseek_v3.mtp import MTPLoss

  loss, _ = MTPLoss(MTPLoss.Config(mtp_scale=scale))(
    list(outputs), labels, (labels != IGNORE_INDEX).sum(), positions=positions
  )
  return loss
