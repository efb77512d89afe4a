"""What a run reads and writes: data in, checkpoints in and out, exports for transformers and
peft, and the checksums that guard them."""
