"""Our dependencies' messages that tell a user nothing are gone from a run's output, each silenced by
the module that emits it and its text: the same module's other messages still print."""

import subprocess
import sys

SCRIPT = """
import logging
import torch_on_tpu
logging.basicConfig()
torchax_log = logging.getLogger("torchax.tensor")
torchax_log.warning("In-place to .data modifications still results a copy on TPU")  # as torchax says it
torchax_log.warning("another torchax message")
import torchao  # its GPU-only extensions fail to load on import, and torch warns of its Enum constants
logging.getLogger("torchao").warning("another torchao message")
"""


def test_dependency_noise_is_filtered_by_module_and_text_only():
  done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  out = done.stdout + done.stderr
  assert "In-place to .data" not in out, out
  assert "Failed to load" not in out and "is an Enum subclass" not in out, out
  assert "another torchax message" in out and "another torchao message" in out, out
