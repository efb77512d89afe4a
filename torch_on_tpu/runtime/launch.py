"""Local multi-process runs: N processes on this machine behave like N hosts of a pod.

    python -m torch_on_tpu.launch --nproc 2 --cpu_devices 4 -m recipes.llama3 --steps=10
    python -m torch_on_tpu.launch --nproc 2 train.py --lr=1e-3

Each process gets `TOT_COORDINATOR` (a free port on 127.0.0.1),
`TOT_NUM_PROCESSES` and `TOT_PROCESS_ID`, so the platform start-up
(`tot.setup()`, run on first use) joins them into one jax run (see
`torch_on_tpu.runtime.distributed`), and torch_on_tpu's XLA flag defaults; `--cpu_devices K` gives each
process K simulated CPU devices (`JAX_PLATFORMS=cpu` and
`--xla_force_host_platform_device_count=K` appended to `XLA_FLAGS`). Output
is relayed as it arrives, each line prefixed `[p0]`, `[p1]`, ... (a progress bar
redrawn in place too), without gloo's connection notices or C++ stack frames. Each
process says in `TOT_STATUS_DIR` (`torch_on_tpu.runtime.health`) what it is doing and its
verdict on a fault. When one process fails the launcher blames the faulty one, not
those that stopped because of it (`_blame`): it kills it if it hangs, sends the others
SIGTERM, then SIGKILL after `--grace` seconds, and exits with the faulty process's code
(124 for a hung one) and one line naming it (index, host, pid), how it ended, what it
was doing, and the newest complete checkpoint. SIGTERM/SIGINT to the launcher go to
every process (a preemption: each saves and exits 0); the launcher then exits 0 when
all of them did.

`--grace` (default 300 s) is the time between SIGTERM and SIGKILL when the
launcher is stopped: it must cover a preemption save of the whole state, so
set it from the save times a run logs, with a margin. A process still saving
when it runs out is killed and its partial step ignored (the run resumes from
the previous one). After a process failed, the others get at most 10 s: no
save can finish without it.
"""

from __future__ import annotations

import argparse
import codecs
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from torch_on_tpu.core import storage
from torch_on_tpu.runtime import health, xla_flags
from torch_on_tpu.runtime.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

_POLL_SECONDS = 0.05
DEFAULT_GRACE_SECONDS = 300.0
# After one process failed the others cannot finish a save (it needs every
# process), so they get at most this long before SIGKILL.
FAILURE_GRACE_SECONDS = 10.0
_LEAVING_SECONDS = 30.0  # a process that reported its own error is given this long to exit


class LaunchError(Exception):
  """A bad command line: printed as one line, exit status 2."""


def parse_args(argv: list[str]) -> argparse.Namespace:
  """Launcher options, then `-m module` or a script path, then the target's own arguments."""
  parser = argparse.ArgumentParser(
    prog="python -m torch_on_tpu.launch",
    description="Start N local processes that form one multi-process jax run.",
    usage="%(prog)s [--nproc N] [--cpu_devices K] [--grace S] (-m MODULE | SCRIPT) [ARGS ...]",
  )
  parser.add_argument("--nproc", type=int, default=2, help="processes to start (default 2)")
  parser.add_argument("--cpu_devices", type=int, default=None, help="simulated CPU devices per process")
  parser.add_argument(
    "--grace", type=float, default=DEFAULT_GRACE_SECONDS,
    help=f"seconds between SIGTERM and SIGKILL when stopped: time for a preemption save (default {DEFAULT_GRACE_SECONDS:.0f})",
  )
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  parser.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
  own, rest = _split_argv(argv)
  args = parser.parse_args(own)
  if args.nproc < 1:
    raise LaunchError(f"--nproc must be at least 1, got {args.nproc}.")
  if args.cpu_devices is not None and args.cpu_devices < 1:
    raise LaunchError(f"--cpu_devices must be at least 1, got {args.cpu_devices}.")
  if args.grace < 0:
    raise LaunchError(f"--grace must be zero or more seconds, got {args.grace}.")
  if args.module is None:
    if not rest:
      raise LaunchError("nothing to launch; give -m MODULE or a script path, then its arguments.")
    args.script, args.target_args = rest[0], rest[1:]
    if not Path(args.script).is_file():
      raise LaunchError(f"script '{args.script}' does not exist; give a Python file or -m MODULE.")
  else:
    args.script, args.target_args = None, rest
    if not _module_exists(args.module):
      raise LaunchError(f"module '{args.module}' is not importable from {os.getcwd()}; check the name or the directory.")
  return args


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
  """(launcher options up to and including `-m MODULE`, the rest): the target's
  own options must not be read as the launcher's."""
  valued = {"--nproc", "--cpu_devices", "--grace", "--port"}
  i = 0
  while i < len(argv):
    arg = argv[i]
    if arg == "-m":
      return argv[: i + 2], argv[i + 2 :]
    if arg in valued:
      i += 2
    elif arg.startswith("-"):
      i += 1  # --nproc=2, --help, or an unknown option argparse will name
    else:
      return argv[:i], argv[i:]
  return argv, []


def _module_exists(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(base: dict, index: int, count: int, port: int, cpu_devices: int | None) -> dict:
  """The environment of process `index`: the launcher's plus the run description."""
  env = dict(base)
  env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
  env[ENV_NUM_PROCESSES] = str(count)
  env[ENV_PROCESS_ID] = str(index)
  env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, not at exit
  if cpu_devices is not None:
    xla_flags.simulate_cpu_devices(cpu_devices, env, cpu_only=True)
  return env


# Lines the processes print that say nothing to the user: jax's CPU collectives (gloo)
# announce every connection between processes.
NOISE_PREFIXES = ("[Gloo] ",)
# Nor do these (a C++ log line arrives whole, in one write): a C++ check failure's stack
# (addresses), and the coordination service's warning that it runs in the recoverable
# mode torch_on_tpu.runtime.health asks for.
NOISE_PATTERNS = (
  re.compile(r"(?m)^[ \t]*@[ \t]+0x[0-9a-f]+.*$|\*\*\* Check failure stack trace: \*\*\*"),
  re.compile(r"[IWEF]\d{4} [\d:.]+ +\d+ coordination_service\.cc:\d+\] \[\d+\] Using experimental recoverable task feature"),
)
# jax's message when its coordination service ends a process because another one failed.
_JAX_FATAL = "Terminating process because the JAX distributed service detected fatal errors"


class _Console:
  r"""Where every process's output goes, as it arrives: each line, and each redraw of a
  progress bar (which starts with `\r`, not a newline), prefixed `[p<index>] `; notices
  starting with a `NOISE_PREFIXES` entry dropped. A line one process left open (a bar) is
  ended before another process writes."""

  def __init__(self, out):
    self.out = out
    self.lock = threading.Lock()
    self.open_line = None  # the process whose line is on screen without its end
    self.cut: set[int] = set()  # processes whose open line was ended for another's output
    self.last_lines: dict[int, str] = {}  # each process's last non-empty line, for the failure message
    self.fatal: set[int] = set()  # the processes jax's coordination service ended (for another's fault)

  def relay(self, index: int, stream) -> None:
    """Copies one process's output stream until it closes (run in a thread per process)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    line = _Line(index)
    for chunk in iter(lambda: stream.read1(65536), b""):
      for piece in re.split(r"([\r\n])", decoder.decode(chunk)):
        if piece in ("\r", "\n"):
          self._write(index, line.end(piece))
          if _JAX_FATAL in line.text:
            self.fatal.add(index)
          if line.visible.strip():
            self.last_lines[index] = line.visible.strip()
          line = _Line(index)
        elif piece:
          self._write(index, line.add(piece))
    self._write(index, line.end(""))
    stream.close()

  def _write(self, index: int, text: str) -> None:
    if not text:
      return
    with self.lock:
      if self.open_line not in (None, index):
        self.out.write("\n")
        self.cut.add(self.open_line)
      if index in self.cut:  # the rest of a line another process's output cut: on a line of its own, prefixed
        self.cut.discard(index)
        prefix = f"[p{index}] "
        text = "" if text == "\n" else text if text.startswith(("\r", prefix)) else prefix + text
        if not text:
          return
      self.out.write(text)
      self.out.flush()
      self.open_line = None if text.endswith(("\n", "\r")) else index


class _Line:
  """One line of one process's output as it arrives: what to write of it, when. A noise notice
  may start mid-line (C++ writes it after a progress bar that has no line end yet): the line is
  written up to it, and the notice dropped with its own line end."""

  def __init__(self, index: int):
    self.prefix = f"[p{index}] "
    self.text = ""
    self.written = 0  # characters of `text` already written
    self.noise_at = None  # where a noise notice starts in `text`

  @property
  def visible(self) -> str:
    return self.text if self.noise_at is None else self.text[: self.noise_at]

  def add(self, piece: str) -> str:
    """The text to write now that `piece` arrived (held back while it may still turn out to be noise)."""
    self.text += piece
    if self.noise_at is None:
      hits = [i for i in (self.text.find(p, self.written) for p in NOISE_PREFIXES) if i >= 0]
      hits += [m.start() for m in (p.search(self.text, self.written) for p in NOISE_PATTERNS) if m]
      self.noise_at = min(hits) if hits else None
    if self.noise_at is not None:
      return self._upto(self.noise_at)
    maybe = max((n for p in NOISE_PREFIXES for n in range(1, len(p)) if self.text.endswith(p[:n])), default=0)
    return self._upto(len(self.text) - maybe)

  def end(self, terminator: str) -> str:
    r"""The text to write as the line ends with `terminator` (`\n`, `\r`, or "" at the stream's end)."""
    if self.noise_at is not None:
      return self._upto(self.noise_at)  # the notice's line end is its own: a bar before it stays open
    if not self.text:  # an empty line; or the start of a bar's redraw, whose text gets the prefix
      return (self.prefix if terminator == "\n" else "") + terminator
    return self._upto(len(self.text)) + terminator

  def _upto(self, end: int) -> str:
    if end <= self.written:
      return ""
    rest = ("" if self.written else self.prefix) + self.text[self.written : end]
    self.written = end
    return rest


def describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


def run(args: argparse.Namespace, out=None) -> int:
  """Starts the processes, relays their output, stops all when one fails; the exit status."""
  out = out or sys.stdout
  port = args.port or free_port()
  target = ["-m", args.module] if args.module else [args.script]
  command = [sys.executable, *target, *args.target_args]
  console = _Console(out)
  procs, pumps = [], []
  given = os.environ.get(health.ENV_STATUS_DIR)  # a tool watching the run names its own
  status = _Status(given or tempfile.mkdtemp(prefix="tot-launch-"))
  base = {
    **os.environ,
    "XLA_FLAGS": xla_flags.with_defaults(os.environ.get("XLA_FLAGS", "")),  # torch_on_tpu's defaults
    health.ENV_STATUS_DIR: str(status.directory),  # where each process says what it does, and its verdicts
  }
  for index in range(args.nproc):
    env = process_env(base, index, args.nproc, port, args.cpu_devices)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    procs.append(proc)
    pump = threading.Thread(target=console.relay, args=(index, proc.stdout), daemon=True)
    pump.start()
    pumps.append(pump)

  faulty = None  # (index, code) of the process to blame; code None: it runs but stopped responding
  interrupted = None

  def on_signal(signum, frame):
    nonlocal interrupted
    interrupted = signum

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    first_exit = None
    while faulty is None and interrupted is None:
      codes = [p.poll() for p in procs]
      if first_exit is None and any(c not in (None, 0) for c in codes):
        first_exit = time.monotonic()
      faulty = _blame(codes, console.fatal, status, time.monotonic() - first_exit if first_exit else 0.0)
      if all(c is not None for c in codes):
        break
      time.sleep(_POLL_SECONDS)
    if faulty is not None and faulty[1] is None:
      procs[faulty[0]].kill()  # hung: nothing to save, and SIGTERM waits for a stopped process
    if faulty is not None or interrupted is not None:
      _stop(procs, args.grace if faulty is None else min(args.grace, FAILURE_GRACE_SECONDS))
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for pump in pumps:
    pump.join(timeout=5)
  try:
    if interrupted is not None:
      name = signal.Signals(interrupted).name
      failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0), None)
      if failed is None:
        print(f"launch: got {name}; all {args.nproc} processes stopped cleanly (exit 0).", file=sys.stderr)
        return 0
      print(f"launch: got {name}; {status.describe(*failed, console.last_lines)}.", file=sys.stderr)
      return _exit_status(failed[1])
    if faulty is not None:
      index, code = faulty
      exit_status = health.EXIT_HUNG if code is None else _exit_status(code)
      if code is None:
        stopped = f"killed it and stopped the other {args.nproc - 1}"
      else:
        stopped = f"stopped the other {args.nproc - 1}"
      kept = status.kept(index)
      print(
        f"launch: {status.describe(index, code, console.last_lines)}; {stopped}{'; ' + kept if kept else ''}; exit {exit_status}.",
        file=sys.stderr, flush=True,
      )
      return exit_status
    return 0
  finally:
    if not given:
      shutil.rmtree(status.directory, ignore_errors=True)


def _blame(codes: list, fatal: set, status: "_Status", waited: float = 0.0) -> tuple[int, int | None] | None:
  """The process to blame once one failed, or None while none has: one that died or exited
  with an error of its own (a process that reports another's fault, exit
  `health.EXIT_PEER_FAILED`, or that jax ended for another's fault, is not it); else the one
  the others' verdicts name, else process 0, whose coordinator the others lost. Code
  None: it still runs, so it hangs; but one not seen to hang (it failed with an error,
  or no verdict was written) first gets `_LEAVING_SECONDS` after the first exit
  (`waited`) to exit by itself."""
  exited = {i: c for i, c in enumerate(codes) if c not in (None, 0)}
  if not exited:
    return None
  verdicts = status.faults()
  differs = [v["faulty"] for v in verdicts.values() if v.get("how") == "differs"]
  if differs:
    return None if _still_leaving(differs[0], codes, waited) else (differs[0], codes[differs[0]])
  own = [i for i, c in exited.items() if c != health.EXIT_PEER_FAILED and not (c == -signal.SIGABRT and i in fatal)]
  if own:
    index = min(own, key=lambda i: (codes[i] >= 0, i))  # a process killed by a signal first
    return index, codes[index]
  named = [(v["faulty"], v.get("how")) for i, v in sorted(verdicts.items()) if v.get("faulty") != i]
  index, how = named[0] if named else (0, None)
  if how not in ("unresponsive", "coordinator") and _still_leaving(index, codes, waited):
    return None  # not seen to hang (it failed with an error, or nothing was said): its own exit says more
  return index, codes[index]


def _still_leaving(index: int, codes: list, waited: float) -> bool:
  """A process every other one saw fail (or refused) is given time to exit by itself."""
  return codes[index] is None and waited < _LEAVING_SECONDS


class _Status:
  """What the processes write into `TOT_STATUS_DIR` (`torch_on_tpu.runtime.health`): each one's
  host, pid, activity and checkpoint directory, and each verdict on a fault."""

  def __init__(self, directory: str):
    self.directory = Path(directory)

  def _read(self, name: str) -> dict:
    try:
      return json.loads((self.directory / name).read_text())
    except (OSError, ValueError):
      return {}

  def process(self, index: int) -> dict:
    return self._read(f"p{index}.json")

  def faults(self) -> dict[int, dict]:
    """Every verdict written so far, by the index of the process that wrote it."""
    found = {}
    for path in self.directory.glob("p*.fault.json"):
      record = self._read(path.name)
      if "faulty" in record:
        found[int(path.name[1:].split(".")[0])] = record
    return found

  def describe(self, index: int, code: int | None, last_lines: dict) -> str:
    """'process 1 (host h, pid 7) was killed by SIGKILL while saving checkpoint step 20'."""
    me = self.process(index)
    verdicts = self.faults()
    own = verdicts.get(index, {})
    who = f"process {index}" + (f" (host {me['host']}, pid {me['pid']})" if me.get("host") else "")
    how = "stopped responding" if code is None else describe_exit(code)
    text = f"{who} {how}"
    noticer = next((i for i, v in sorted(verdicts.items()) if i != index and v.get("faulty") == index), None)
    # a hung process: what the one that noticed saw it doing (the same words, where the two differ by a step)
    doing = verdicts[noticer].get("activity") if noticer is not None and code is None else None
    doing = doing or me.get("activity")
    if doing and own.get("how") not in ("differs", "could not join"):
      text += f" while {doing}"
    if own.get("sentence"):
      return f"{text}: {own['sentence'].rstrip('.')}"
    if noticer is not None and code is None:
      silent = verdicts[noticer].get("silent")
      return f"{text} (process {noticer} noticed" + (f" after {silent:.0f} s without a sign of it)" if silent else ")")
    last = last_lines.get(index)
    return text + (f" (its last line: {last[:300]!r})" if last and code is not None and code > 0 else "")

  def kept(self, index: int) -> str | None:
    """Which checkpoint a relaunch resumes from, when the processes named their directory."""
    directory = next((r.get("checkpoints") for r in (self.process(index), *self._all()) if r.get("checkpoints")), None)
    if not directory:
      return None
    own = self.faults().get(index, {}).get("sentence", "")
    return None if "complete checkpoint" in own else storage.kept(directory)  # said once, by the process

  def _all(self) -> list[dict]:
    return [self._read(p.name) for p in sorted(self.directory.glob("p*.json")) if ".fault." not in p.name]


def _exit_status(code: int) -> int:
  """A process's return code as a shell exit status (killed by signal N: 128 + N)."""
  return code if code > 0 else 128 - code


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
  """SIGTERM to every running process, SIGKILL to those still running after `grace` seconds."""
  for p in procs:
    if p.poll() is None:
      p.terminate()
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    time.sleep(_POLL_SECONDS)
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def main(argv: list[str] | None = None) -> int:
  try:
    args = parse_args(sys.argv[1:] if argv is None else argv)
  except LaunchError as e:
    print(f"launch: {e}", file=sys.stderr)
    return 2
  return run(args)


if __name__ == "__main__":
  sys.exit(main())
