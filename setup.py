"""torch_on_tpu: train unmodified PyTorch models on TPU (and GPU/CPU) through JAX.

Exact versions for a reproducible machine live in constraints.txt; the ranges
here are what the code is written against.
"""

from setuptools import find_packages, setup

setup(
  name="torch_on_tpu",
  version="0.1.0",
  description="Train unmodified PyTorch models on TPU, GPU and CPU through JAX and torchax.",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  python_requires=">=3.11",
  packages=find_packages(include=["torch_on_tpu", "torch_on_tpu.*", "recipes", "recipes.*"]),
  install_requires=[
    "torch>=2.11",
    "torchax==0.0.13",
    "jax>=0.10",
    "optax>=0.2.8",
    "orbax-checkpoint",
    "safetensors",
    "tqdm",
    "psutil",
    "numpy",
  ],
  # Heavy libraries only some features use (torch_on_tpu/core/extras.py says which, and
  # names the extra when one is missing). `all` is what the recipes and tests use.
  extras_require={
    # torchtitan 0.3.0 imports triton unconditionally. Not fla-core, which its Qwen3.5 imports: wherever it is
    # installed transformers calls its CUDA kernels for Qwen3.5 and Qwen3-Next, on CPU too, so an export could
    # not generate here; the bridge runs its own Gated DeltaNet, and core/fla_standins.py lets the import pass.
    "torchtitan": ["torchtitan==0.3.0", "triton"],
    "hf": ["transformers>=5", "peft"],  # HF models, LoRA
    "data": ["tokenizers", "datasets", "pyarrow"],  # tokenizer training, HF datasets, parquet
    "logging": ["tensorboard", "matplotlib", "wandb"],  # TensorBoard scalars, the training plot, Weights & Biases
    "recipes": ["fire"],
    "float8": ["torchao==0.18.0"],  # float8 training (torch_on_tpu.lowering.float8): torchao's Float8Linear
    # compile for a TPU slice without one (torch_on_tpu.parallel.targets): libtpu's compile-only client, the
    # version jax 0.10's own tpu extra pins; quiet and shared where no TPU chips are (torch_on_tpu.runtime.libtpu)
    "targets": ["libtpu==0.0.42.*"],
    "all": [
      "torchtitan==0.3.0", "triton", "transformers>=5", "peft", "tokenizers", "datasets", "pyarrow",
      "tensorboard", "matplotlib", "wandb", "fire", "torchao==0.18.0", "libtpu==0.0.42.*",
    ],
    "cpu": ["jax[cpu]"],
    "tpu": ["jax[tpu]"],
    "cuda": ["jax[cuda12]"],
    "test": ["pytest", "pytest-timeout", "pytest-xdist", "expecttest"],  # expecttest: torch.testing._internal (the op_db sweep)
  },
)
