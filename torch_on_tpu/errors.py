"""The one exception type the bridge raises for user mistakes.

Every message is a single sentence that names the offending thing (parameter,
shape, axis, path) and what to do. Entry points (recipes, tools) print it and
exit non-zero instead of showing a traceback.
"""


class TorchOnTpuError(ValueError):
  """A user-facing configuration or input error with a one-sentence message."""
