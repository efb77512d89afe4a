"""`ShardedModule`, what the user holds: the torch model's tensors as sharded jax arrays, born
sharded with the model's own init, its layer stack scanned, and op overrides for user scripts."""
