"""What torch code cannot do inside a compiled program, said in one sentence naming the op.

While model or loss code is traced, four kinds of library error mean "this op
cannot run here", and each arrives as a raw jax or torchax error with a
traceback: an ATen op torchax has no lowering for (`OperatorNotFound`) or
whose torchax lowering fails on the arguments given, a
value the program has not computed yet being read on the host (an output whose
size depends on tensor values — `nonzero`, `masked_select`, `unique` — or a
Python `if` / `.item()` on a tensor: jax's tracer conversion errors), and a jax
primitive without a gradient rule. `translated()` turns each into a
`TorchOnTpuError` naming the op (from the innermost torchax lowering or torch
function in the traceback) and what to do instead — the static form where
torch has one (`nonzero_static`, `masked_fill`, `output_size=`). Other
errors pass through unchanged.
"""

from __future__ import annotations

import contextlib
import re
import traceback

from torch_on_tpu.errors import TorchOnTpuError, first_line

# Data-dependent ops → the fixed-size form to use instead.
STATIC_ALTERNATIVES = {
  "nonzero": "torch.nonzero_static(x, size=n) (padded with fill_value) or a mask with torch.where",
  "argwhere": "torch.nonzero_static(x, size=n) (padded with fill_value) or a mask with torch.where",
  "masked_select": "torch.where(mask, x, 0) or x.masked_fill(~mask, 0), which keep the shape",
  "masked_scatter": "torch.where(mask, source_arranged_like_x, x), which keeps the shape",
  "unique": "a fixed-size form: torch.sort, then a mask of where neighbours differ",
  "unique2": "a fixed-size form: torch.sort, then a mask of where neighbours differ",
  "unique_dim": "a fixed-size form: torch.sort, then a mask of where neighbours differ",
  "unique_consecutive": "a mask of where neighbours differ (x[1:] != x[:-1])",
  "index": "torch.where(mask, x, 0) instead of indexing with a boolean mask",
  "index_put": "torch.where(mask, value, x) instead of assigning through a boolean mask",
  "repeat_interleave": "repeat_interleave(..., output_size=total) with the total length known",
  "tensor_split": "split points given as a list of ints",
  "bincount": "torch.zeros(n).index_add_(0, x, weights) with a fixed number of bins n",
  "item": "the value kept as a tensor (torch.where or clamp instead of Python control flow)",
  "local_scalar_dense": "the value kept as a tensor (torch.where or clamp instead of Python control flow)",
  "equal": "(a == b).all(), a tensor",
}

_GENERIC = "a form whose output size and control flow do not depend on tensor values"


def _op_in_traceback(error: BaseException) -> str | None:
  """The innermost torchax lowering (`_aten_nonzero` → `nonzero`) or torch function that was
  running when `error` was raised."""
  frames = traceback.extract_tb(error.__traceback__)
  for frame in reversed(frames):
    path = frame.filename.replace("\\", "/")
    if "/torchax/ops/" in path:
      return re.sub(r"^_(aten_|torch_)?", "", frame.name).lstrip("_")
  for frame in reversed(frames):
    path = frame.filename.replace("\\", "/")
    if "/torch/" in path and "/torch/_" not in path and "/torch/utils/" not in path and "/torch/overrides" not in path:
      return frame.name
  return None


def _failed_torchax_lowering(error: BaseException) -> str | None:
  """The torchax lowering whose own code raised `error` (the innermost frame outside jax is
  torchax's): the outermost frame of the innermost run of torchax op frames
  (`_aten_upsample` → `upsample`), or the lowering a bad call names
  (`_aten_searchsorted() got ...`)."""
  frames = [f for f in traceback.extract_tb(error.__traceback__)]
  while frames and "/jax/" in frames[-1].filename.replace("\\", "/"):
    frames.pop()  # jax.numpy code torchax called
  if not frames or "/torchax/" not in frames[-1].filename.replace("\\", "/"):
    return None
  called = re.search(r"_aten_(\w+)\(\)", str(error))
  if called:
    return called.group(1)
  name = None
  for frame in reversed(frames):
    if "/torchax/ops/" not in frame.filename.replace("\\", "/"):
      if name is not None:
        break
      continue
    name = frame.name
  return re.sub(r"^_(aten_|torch_)?", "", name).lstrip("_") if name else None


def _aten_name(error: BaseException) -> str | None:
  match = re.search(r"aten::(\w+)", str(error))
  return match.group(1) if match else None


def translate(error: BaseException) -> TorchOnTpuError | None:
  """The one-sentence refusal for `error`, or None when it is not one of the kinds above."""
  import jax

  torchax_missing = type(error).__name__ == "OperatorNotFound"
  if torchax_missing:
    name = _aten_name(error) or _op_in_traceback(error) or "an op"
    return TorchOnTpuError(
      f"aten.{name} has no lowering in torch_on_tpu (torchax lacks one), so it cannot run inside the "
      f"compiled model; give it one with tot.override_op(torch.ops.aten.{name}.default, impl) or compute "
      f"it outside the model."
    )
  tracer_errors = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
  )
  if isinstance(error, tracer_errors):
    op = _op_in_traceback(error) or "the model"
    key = op.lstrip("_").removesuffix("_")
    return TorchOnTpuError(
      f"{op} needs tensor values on the host while the program is being compiled (its output size, or "
      f"a Python decision, depends on them), which a compiled step cannot do; use "
      f"{STATIC_ALTERNATIVES.get(key, _GENERIC)}."
    )
  message = str(error)
  lowering = _failed_torchax_lowering(error)
  if lowering is not None and not isinstance(error, NotImplementedError):
    return TorchOnTpuError(
      f"torchax's lowering of aten.{lowering} failed on these arguments ({first_line(error)}); give it "
      f"one with tot.override_op(torch.ops.aten.{lowering}.default, impl) or compute it outside the model."
    )
  if isinstance(error, NotImplementedError) and re.search(
    r"Differentiation rule|VJP not implemented|gradients are only implemented|Derivatives of", message
  ):
    op = _op_in_traceback(error) or "an op of the model"
    return TorchOnTpuError(
      f"jax cannot differentiate {op} here ({first_line(error)}); detach its inputs or compute it "
      f"outside the differentiated part of the model."
    )
  return None


@contextlib.contextmanager
def translated():
  """Context around tracing model code: the kinds of error above become one sentence."""
  try:
    yield
  except TorchOnTpuError:
    raise
  except Exception as error:  # noqa: BLE001 (only the kinds `translate` knows are replaced)
    refusal = translate(error)
    if refusal is None:
      raise
    raise refusal from None
