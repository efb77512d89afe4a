"""Training on a `ShardedModule`: the compiled step, its loss, the memory plan, LoRA, metrics,
generation and the training loop."""
