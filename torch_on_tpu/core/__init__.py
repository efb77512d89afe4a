"""What every layer stands on, and nothing that runs a torch op: the torch/torchax/jax APIs we
call but they do not promise (`_compat`), the torchax import shim, optional extras, the stack's
versions, storage faults in one sentence, byte sizes for people, and the module paths from before
the layout (`old_paths`)."""
