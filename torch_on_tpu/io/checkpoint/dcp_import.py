"""Pretrained weights in from torch.distributed.checkpoint (DCP), the format torchtitan saves: a
run's `checkpoint/step-N` directory, or the `checkpoint` directory itself (its latest step). Only
the model's tensors are read, one whole tensor at a time, then each device's block of it; the
training state torchtitan saves beside them (optimizer, lr scheduler, data loader, step) is not."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from torch_on_tpu.errors import TorchOnTpuError, first_line
from torch_on_tpu.lowering.host import torch_to_numpy
from torch_on_tpu.wrapper import state_loading

logger = logging.getLogger(__name__)

METADATA = ".metadata"
# torchtitan's checkpoint keeps the model's state_dict at the top level and its training state under these.
TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def checkpoint_directory(path: Path) -> Path | None:
  """The DCP checkpoint `path` names: itself when it holds `.metadata`, else its latest `step-N`
  that does; None when it is neither (safetensors, say)."""
  if (path / METADATA).is_file():
    return path
  steps = []
  if path.is_dir():
    for step in path.iterdir():
      number = re.fullmatch(r"step-(\d+)", step.name)
      if number and (step / METADATA).is_file():
        steps.append((int(number.group(1)), step))
  return max(steps)[1] if steps else None


def import_dcp(jm, directory: Path) -> None:
  """The model tensors of the DCP checkpoint at `directory` into `jm`, as `load_state_dict(strict=True)`
  loads them (names and shapes checked before anything is read)."""
  source = _DcpSource(directory)
  logger.warning("Reading the model's %d tensors from %s; its training state is not read.", len(source.keys()), directory)
  state_loading.load(
    jm, [source], strict=True, origin=f"the tensors of the checkpoint at {directory}",
    fix="load a checkpoint saved from this model architecture and size",
  )


class _DcpSource:
  """A DCP checkpoint's model tensors as a `state_loading.load` source; the tensor last read is kept
  while its devices' blocks are taken from it."""

  def __init__(self, directory: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    self.directory = directory
    try:
      metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # noqa: BLE001 (whatever the reader raises on a damaged file)
      raise TorchOnTpuError(
        f"{directory / METADATA} is not a readable torch.distributed.checkpoint index ({first_line(e)}); "
        "point --weights at a complete checkpoint step."
      ) from None
    self._tensors = {
      name: entry for name, entry in metadata.state_dict_metadata.items()
      if isinstance(entry, TensorStorageMetadata) and name.split(".", 1)[0] not in TRAINING_STATE
    }
    self._last: tuple[str, torch.Tensor] | None = None

  def keys(self):
    return self._tensors.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._tensors[name].size)

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    if self._last is None or self._last[0] != name:
      self._last = None  # the previous tensor goes before the next is read
      self._last = (name, self._whole(name))
    return torch_to_numpy(self._last[1][index])

  def _whole(self, name: str) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    entry = self._tensors[name]
    tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on loading without a process group
        dcp.load({name: tensor}, storage_reader=FileSystemReader(str(self.directory)), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 (a missing or truncated .distcp file)
      cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e  # (exception, trace) by rank
      raise TorchOnTpuError(
        f"Reading {name} from the checkpoint at {self.directory} failed ({first_line(cause)}); its files are "
        "incomplete or damaged: copy the step again, or point --weights at another one."
      ) from None
    return tensor

