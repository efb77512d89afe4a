"""The one exception type the bridge raises for user mistakes.

Every message is a single sentence that names the offending thing (parameter,
shape, axis, path) and what to do. Entry points (recipes, tools) print it and
exit non-zero instead of showing a traceback.
"""


class TorchOnTpuError(ValueError):
  """A user-facing configuration or input error with a one-sentence message."""


def first_line(error: BaseException) -> str:
  """`Type: the first line of its message` (at most 200 characters): how a library's
  error is quoted inside one of our sentences."""
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
