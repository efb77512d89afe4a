"""torch ops as jax: what a traced torch program becomes. ATen lowerings torchax lacks (`aten`),
the op table and its per-trace overrides, custom autograd Functions, refusals in one sentence,
in-program index checks, host transfers, remat policies, the grouped matmul and float8 matmuls."""
