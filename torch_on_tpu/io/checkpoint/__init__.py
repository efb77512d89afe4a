"""Checkpoints: orbax training state, and safetensors for the PyTorch world.

Training runs get preempted and pods fail, so a run saves its whole state with
orbax (asynchronous, atomic, keep-last-N) and resumes bit-exactly; pretrained
weights come in from a safetensors directory under the model's original
`state_dict` names (scan-stacked layers included: they are read per original
layer name). Exports back out are `torch_on_tpu/io/export.py`.

    ckpt = Checkpointer("runs/a/ckpt", save_every=500, keep=3)
    restored = ckpt.restore(abstract_state(state, mesh, params=jm.params))  # None: fresh run
    with PreemptionGuard() as guard:
      for step in range(start, steps):
        state = train_step(state, batch)
        stop = guard.should_stop(step + 1)
        if stop or step + 1 == steps or ckpt.should_save(step + 1):
          ckpt.save(step + 1, state, data=loader.state(), config=run_config, force=True)
        if stop:
          break                                              # and exit 0; a relaunch resumes
    ckpt.close()                                             # waits for the last save

The training state is any pytree of jax arrays (params, buffers, optax state,
step, RNG key); by convention its `"params"` and `"buffers"` entries are the
`ShardedModule`'s params and buffers dicts, which is what `tools/convert.py`
reads. With `model=jm`, layers that `jm` holds stacked (scan) are stored under
their original per-layer names, in params and in every dict keyed like them
(optimizer moments), so a run resumes with scan on or off. Data-iterator state and the resolved run
config are JSON dicts saved next to it. Weights never go through pickle.

One file per job: `training_state.py` (orbax), `preemption.py` (the SIGTERM
guard), `state_entries.py` (a model's state_dict as entries, shared with the
export), `safetensors_import.py` (weights in).
"""

from torch_on_tpu.io.checkpoint.preemption import PreemptionGuard
from torch_on_tpu.io.checkpoint.safetensors_import import import_pretrained, import_safetensors
from torch_on_tpu.io.checkpoint.training_state import BUFFERS_KEY, PARAMS_KEY, Checkpointer, Restored, abstract_state

__all__ = ["BUFFERS_KEY", "PARAMS_KEY", "Checkpointer", "PreemptionGuard", "Restored", "abstract_state", "import_pretrained", "import_safetensors"]
