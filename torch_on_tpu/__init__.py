"""torch_on_tpu: train unmodified PyTorch models on TPU, GPU and CPU through JAX."""

from torch_on_tpu import _compat, xla_flags

xla_flags.apply_defaults()  # XLA reads XLA_FLAGS once, when jax's backend starts
if not _compat.started_as_light_tool():  # the doctor and launcher start without torchax
  # The torchax shim must run before anything imports torchax.
  _torchax = _compat.import_torchax()

  from torch_on_tpu import lowerings  # noqa: E402
  from torch_on_tpu.distributed import initialize_distributed  # noqa: E402

  initialize_distributed()  # joins a multi-process run before torchax's env starts jax's backend
  lowerings.register(_torchax.default_env())

  from torch_on_tpu.errors import TorchOnTpuError  # noqa: E402
  from torch_on_tpu.generate import generate  # noqa: E402
  from torch_on_tpu.mesh import make_mesh  # noqa: E402
  from torch_on_tpu.module import JittableModule, to_cpu  # noqa: E402
  from torch_on_tpu.ops import override_op  # noqa: E402
  from torch_on_tpu.scan import ScannedModule  # noqa: E402
  from torch_on_tpu.train import TrainState, TrainStep, make_train_step  # noqa: E402
  from torch_on_tpu.trainer import Trainer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
  "JittableModule",
  "ScannedModule",
  "TorchOnTpuError",
  "TrainState",
  "TrainStep",
  "Trainer",
  "generate",
  "initialize_distributed",
  "make_mesh",
  "make_train_step",
  "override_op",
  "to_cpu",
]
