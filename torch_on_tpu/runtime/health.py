"""The processes of a multi-process run watch each other: when one dies, hangs or fails,
every other one stops within a bounded time, saying in one sentence which process (index,
host) and what it was doing.

jax's coordination service (it runs in process 0) already tracks every process by its
heartbeats: a process that sends none for `TOT_HEARTBEAT_TIMEOUT` seconds (default 20)
is dead to it. Left to itself it then kills every other process with a C++ check failure
and a stack of addresses. So the run joins in jax's recoverable mode, where the service
only records the death, and each process runs three daemon threads here:

- *liveness* asks the service which processes are alive (`get_live_nodes`, jax's own
  heartbeat verdict);
- *probe* publishes what this process is doing (`doing`) into the service's key-value
  store and reads which processes reported a failure (`failed`);
- *judge* turns what those two saw into a verdict: another process failed, stopped
  responding, or process 0 (the coordinator) stopped answering. It prints one sentence,
  records it for the launcher, and ends this process with `EXIT_PEER_FAILED`.

A process that raises (or whose recipe stops on an error) marks itself failed first, so
the others stop at once with its reason instead of waiting for a heartbeat. Process 0,
which holds the service, leaves last: the others would otherwise lose the coordinator
mid-sentence. A clean exit waits until every process finished (or failed), as jax's own
shutdown barrier does outside recoverable mode.

What is not covered: a process whose Python is stuck while its heartbeat threads run
(the others wait in a collective); process 0 dying outright (SIGKILL), where jax's client
in every other process ends it at once with its own message (the launcher names process
0 anyway).

Under `python -m torch_on_tpu.launch` (`TOT_STATUS_DIR` set) each process also keeps
`p<index>.json` there (host, pid, what it is doing, its checkpoint directory) and writes
`p<index>.fault.json` with its verdict, which is how the launcher names the faulty process.

Exit codes (docs/multihost.md): 0 finished (or preempted and saved), 1 an error in one
sentence, 2 a command-line mistake, `EXIT_MISMATCH` (3) the processes differ,
`EXIT_NO_COORDINATOR` (4) the run could not be joined, `EXIT_PEER_FAILED` (75) another
process failed and this one stopped; from the launcher also `EXIT_HUNG` (124) a process
stopped responding and was killed, 128+N a process was killed by signal N.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from torch_on_tpu.core import storage
from torch_on_tpu.errors import TorchOnTpuError, first_line

ENV_STATUS_DIR = "TOT_STATUS_DIR"
EXIT_ERROR = 1
EXIT_MISMATCH = 3
EXIT_NO_COORDINATOR = 4
EXIT_PEER_FAILED = 75
EXIT_HUNG = 124

POLL_SECONDS = 0.5
EXIT_BARRIER_SECONDS = 60  # how long a finished process waits at exit for the slowest one to finish
LAST_TO_LEAVE_SECONDS = 10  # how long process 0 keeps the coordinator up for the others to stop
_KEY = "torch_on_tpu/"
_MARKS = ("failed", "done", "stopped")
LIVENESS_SECONDS = 1.0  # how often each process asks the coordinator who is alive
JOIN_THREADS_SECONDS = 5.0  # at a clean exit, how long each watching thread gets to finish its call


class ProcessFault(TorchOnTpuError):
  """A fault of the run's processes (not of this process's own work), with its exit code."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


# ---- what this process is doing --------------------------------------------------------------

_doing = {"doing": "starting up", "since": time.time(), "background": None}
_watch: _Watch | None = None
_failed: str | None = None


def doing(text: str) -> None:
  """Records what this process is doing ("running step 12", "saving checkpoint step 10"):
  what the others (and the launcher) say if it dies or hangs now. Cheap: call it freely."""
  _doing.update(doing=text, since=time.time())
  _publish()


def background(describe) -> None:
  """Work going on behind `doing`: a function saying what ("writing checkpoint step 10")
  while it lasts and None after, asked whenever the activity is published; None: none."""
  _doing["background"] = describe
  _publish()


def activity(record: dict | None = None) -> str:
  """'running step 12 (writing checkpoint step 10 meanwhile)', for this process or from
  a record another one published."""
  record = _record() if record is None else record
  text = record.get("doing") or "doing something unknown"
  return f"{text} ({record['background']} meanwhile)" if record.get("background") else text


def _record() -> dict:
  describe = _doing["background"]
  try:
    behind = describe() if describe is not None else None
  except Exception:  # noqa: BLE001 (a checkpointer being closed: nothing behind any more)
    behind = None
  return {"doing": _doing["doing"], "since": _doing["since"], "background": behind}


def failed(sentence: str) -> None:
  """Marks this process failed with `sentence`: the others stop at once, naming it. The
  recipes call it before exiting on an error; an uncaught exception does it by itself."""
  global _failed
  if _failed is not None:
    return
  _failed = sentence
  _write_status(fault={"faulty": _index(), "how": "failed", "sentence": sentence})
  if _watch is not None:
    _watch.mark("failed", sentence)


def abort(sentence: str) -> None:
  """Ends this process now with `sentence` (exit 1), the others told first: for a fault
  found off the main thread while the main thread waits for the others (a background
  checkpoint write that failed on this process only)."""
  failed(sentence)
  try:
    sys.stdout.flush()
  except Exception:  # noqa: BLE001
    pass
  os.write(2, f"error: {sentence}\n".encode())
  if _watch is not None and _watch.index == 0:
    _watch.wait_for_the_others(exclude=set())
  os._exit(EXIT_ERROR)


def refuse(sentence: str, faulty: int) -> None:
  """Every process refuses the run together, over a difference each of them saw
  (`fingerprint`): none leaves before all know, so none mistakes another's exit for a fault."""
  global _failed
  _failed = sentence
  _write_status(fault={"faulty": faulty, "how": "differs", "sentence": sentence})
  exchange("refused", faulty, timeout_s=60)


def refuse_alone(sentence: str) -> None:
  """This process cannot take part at all (e.g. it could not join): the launcher's record."""
  _write_status(fault={"faulty": _index(), "how": "could not join", "sentence": sentence})


def _publish() -> None:
  if _watch is None:
    _write_status()
  else:  # the probe thread publishes it to the others, then to the launcher: both hear the same
    _watch.wake.set()


def _index() -> int:
  return _watch.index if _watch is not None else int(os.environ.get("TOT_PROCESS_ID", "0") or 0)


def _write_status(fault: dict | None = None, doing: dict | None = None) -> None:
  """The launcher's view of this process: `p<i>.json`, and `p<i>.fault.json` for a verdict;
  `doing`: the activity record the others were told (default: the current one)."""
  directory = os.environ.get(ENV_STATUS_DIR)
  if not directory:
    return
  index = _index()
  doing = _record() if doing is None else doing
  record = {
    "index": index, "host": socket.gethostname(), "pid": os.getpid(), "activity": activity(doing),
    "since": doing["since"], "checkpoints": str(storage.checkpoint_directory() or ""),
  }
  name = f"p{index}.fault.json" if fault else f"p{index}.json"
  path = Path(directory) / name
  tmp = path.with_name(f".{name}.tmp")
  try:
    tmp.write_text(json.dumps({**record, **(fault or {}), "time": time.time()}))
    tmp.replace(path)
  except OSError:
    pass  # best effort: the launcher then says less


# ---- the watch ------------------------------------------------------------------------------


def start(client, index: int, count: int, heartbeat_timeout: float) -> None:
  """Starts watching the other processes (after `jax.distributed` joined them); once."""
  global _watch
  if _watch is not None or count < 2:
    return
  _watch = _Watch(client, index, count, heartbeat_timeout)
  hello = exchange("hello", {"host": socket.gethostname(), "pid": os.getpid()})
  _watch.hosts, _watch.pids = [v["host"] for v in hello], [v["pid"] for v in hello]
  _watch.start()


def exchange(name: str, value, timeout_s: float = 300.0) -> list:
  """Every process's `value` (JSON-able), by process index; every process must call it
  with the same `name`, in the same order. A single process gets `[value]`."""
  if _watch is None:
    return [value]
  return _watch.exchange(name, value, timeout_s)


def describe(index: int) -> str:
  """'process 1 (host worker-1, pid 4242)'."""
  if _watch is None or not _watch.hosts:
    return f"process {index}"
  return f"process {index} (host {_watch.hosts[index]}, pid {_watch.pids[index]})"


class _Watch:
  def __init__(self, client, index: int, count: int, heartbeat_timeout: float):
    self.client, self.index, self.count = client, index, count
    self.heartbeat = heartbeat_timeout
    # A frozen coordinator: jax's client ends the process after about 0.7 heartbeat timeouts.
    self.coordinator_silence = max(2.0, 0.5 * heartbeat_timeout)
    self.hosts: list[str] = []
    self.pids: list[int] = []
    self.wake = threading.Event()
    self.lock = threading.Lock()
    self.stopping = False
    self.finishing = False
    self.closed = False  # set at a clean exit: the threads return, joined before the interpreter ends
    self.threads: list[threading.Thread] = []
    self.exchanges: dict[str, int] = {}
    self.missing: set[int] = set()
    self.marks: dict[str, dict[int, str]] = {kind: {} for kind in _MARKS}
    self.marks_read = 0.0
    self.probe_sent = self.probe_answered = time.monotonic()
    self.coordinator_lost: str | None = None
    self.published = None
    self.seen: dict[int, str] = {}  # the activity another process last published, when read for a verdict

  # -- the key-value store
  def kv_set(self, key: str, value: str) -> None:
    try:
      self.client.key_value_set(_KEY + key, value, allow_overwrite=True)
    except Exception:  # noqa: BLE001 (the coordinator is gone: the judge says so)
      pass

  def all_marks(self) -> dict[str, dict[int, str]]:
    """Every process's marks ("failed", "done", "stopped"), in one listing."""
    marks = {kind: {} for kind in _MARKS}
    for key, value in self.client.key_value_dir_get(f"{_KEY}mark/"):
      kind, index = key.rsplit("/", 2)[1:]
      marks.setdefault(kind, {})[int(index)] = value
    return marks

  def mark(self, kind: str, value: str = "1") -> None:
    self.kv_set(f"mark/{kind}/{self.index}", value)

  def exchange(self, name: str, value, timeout_s: float) -> list:
    n = self.exchanges[name] = self.exchanges.get(name, 0) + 1
    key = f"{_KEY}exchange/{name}/{n}"
    self.client.key_value_set(f"{key}/{self.index}", json.dumps(value))
    try:
      self.client.wait_at_barrier(key, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001
      raise ProcessFault(
        f"Not every process of the run reached '{name}' within {timeout_s:.0f} s ({first_line(e)}); "
        f"check that every process runs the same command.", EXIT_MISMATCH,
      ) from None
    values = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in self.client.key_value_dir_get(f"{key}/")}
    return [values[i] for i in range(self.count)]

  # -- the threads
  def start(self) -> None:
    self.start_threads()
    atexit.register(self._at_exit)  # after jax's own clean-up was registered: runs before it
    _install_excepthook()

  def start_threads(self) -> None:
    for target in (self._liveness, self._probe, self._judge):
      thread = threading.Thread(target=target, daemon=True, name=f"tot-health-{target.__name__[1:]}")
      thread.start()
      self.threads.append(thread)

  def _liveness(self) -> None:
    everyone = list(range(self.count))
    while not (self.stopping or self.finishing or self.closed):
      try:
        live = self.client.get_live_nodes(everyone)
      except Exception:  # noqa: BLE001 (no coordinator: the probe thread sees it too)
        time.sleep(POLL_SECONDS)
        continue
      self.missing = set(everyone) - set(live)
      time.sleep(LIVENESS_SECONDS)

  def _probe(self) -> None:
    """Publishes this process's activity when it changed (woken by `doing`); reads every
    mark at most every `POLL_SECONDS` (one listing: a pod's coordinator serves them all)."""
    while not (self.stopping or self.closed):
      self.probe_sent = time.monotonic()
      try:
        doing = _record()
        record = json.dumps(doing)
        if record != self.published:
          self.client.key_value_set(f"{_KEY}doing/{self.index}", record, allow_overwrite=True)
          self.published = record
          _write_status(doing=doing)
        if time.monotonic() - self.marks_read >= POLL_SECONDS:
          self.marks, self.marks_read = self.all_marks(), time.monotonic()
      except Exception as e:  # noqa: BLE001
        self.coordinator_lost = first_line(e)
      self.probe_answered = time.monotonic()
      self.wake.wait(POLL_SECONDS)
      self.wake.clear()

  def _judge(self) -> None:
    while not (self.stopping or self.closed):
      time.sleep(POLL_SECONDS / 2)
      verdict = self._verdict()
      if verdict is not None:
        self._stop(*verdict)

  def _verdict(self) -> tuple[int, str, str, float] | None:
    """(the faulty process, how, the sentence, seconds nothing was heard from it) or None;
    None once this process finished its work (it leaves with exit 0 whatever the others do)."""
    if self.finishing:
      return None
    failed = {i: s for i, s in self.marks["failed"].items() if i != self.index}
    if failed:
      i, sentence = min(failed.items())
      return i, "failed", f"{describe(i).capitalize()} stopped with an error: {sentence.rstrip('.')}", 0.0
    silent = time.monotonic() - self.probe_sent if self.probe_sent > self.probe_answered else 0.0
    if self.index != 0 and (silent > self.coordinator_silence or self.coordinator_lost):
      why = f"answered nothing for {silent:.0f} s" if not self.coordinator_lost else f"is gone ({self.coordinator_lost})"
      return 0, "coordinator", f"{describe(0).capitalize()}, which holds the run's coordinator, {why}", silent
    gone = sorted(self.missing - set(self.marks["done"]) - {self.index})
    if gone:
      i = gone[0]
      late = self._failure_of(i)  # it may have failed just before leaving
      if late is not None:
        return i, "failed", f"{describe(i).capitalize()} stopped with an error: {late.rstrip('.')}", 0.0
      return i, "unresponsive", (
        f"{describe(i).capitalize()} stopped responding while {self._activity_of(i)} (no heartbeat for "
        f"{self.heartbeat:.0f} s, TOT_HEARTBEAT_TIMEOUT)"
      ), self.heartbeat
    return None

  def _failure_of(self, i: int) -> str | None:
    try:
      return self.client.key_value_try_get(f"{_KEY}mark/failed/{i}")
    except Exception:  # noqa: BLE001 (not found)
      return None

  def _activity_of(self, i: int) -> str:
    try:
      self.seen[i] = activity(json.loads(self.client.key_value_try_get(f"{_KEY}doing/{i}")))
    except Exception:  # noqa: BLE001
      return "doing something unknown (it published nothing)"
    return self.seen[i]

  def _stop(self, faulty: int, how: str, sentence: str, silent: float) -> None:
    """Ends this process: one sentence, the launcher's record, process 0 last."""
    with self.lock:
      if self.stopping or _failed is not None:
        return
      self.stopping = True
    sentence = f"{sentence}; {describe(self.index)} stops too (exit {EXIT_PEER_FAILED}): {storage.kept()}."
    # what the faulty process was seen doing, for the launcher to say the same
    seen = {"activity": self.seen[faulty]} if faulty in self.seen else {}
    _write_status(fault={"faulty": faulty, "how": how, "sentence": sentence, "silent": silent, **seen})
    try:
      sys.stdout.flush()
    except Exception:  # noqa: BLE001
      pass
    os.write(2, f"error: {sentence}\n".encode())
    if how != "coordinator":
      self.mark("stopped")
      if self.index == 0:
        self.wait_for_the_others(exclude={faulty})
    os._exit(EXIT_PEER_FAILED)

  def wait_for_the_others(self, exclude: set[int]) -> None:
    """Process 0 holds the coordinator: it waits (bounded) until every other process left."""
    deadline = time.monotonic() + LAST_TO_LEAVE_SECONDS
    others = set(range(1, self.count)) - exclude
    while time.monotonic() < deadline:
      try:
        marks = self.all_marks()
        live = self.client.get_live_nodes(list(range(self.count)))
        left = set(marks["stopped"]) | set(marks["done"]) | (set(range(self.count)) - set(live))
      except Exception:  # noqa: BLE001
        return
      if others <= left:
        return
      time.sleep(POLL_SECONDS / 2)

  def _at_exit(self) -> None:
    if self.stopping:
      return
    self.finishing = True
    if _failed is None:
      _doing.update(doing="leaving, its work done", since=time.time())
    try:
      self._leave()
    finally:
      self._join_threads()
      _write_status()

  def _join_threads(self) -> None:
    """Ends the three threads before the interpreter does: a daemon thread still inside a
    call to the coordinator when Python finalizes is torn down mid-C++ and aborts the whole
    process (`FATAL: exception not rethrown`, SIGABRT) after it finished its work."""
    self.closed = True
    self.wake.set()
    for thread in self.threads:
      thread.join(timeout=JOIN_THREADS_SECONDS)

  def _leave(self) -> None:
    """Marks this process done and waits (bounded) for the others; process 0 leaves last."""
    if _failed is not None:
      if self.index == 0:
        self.wait_for_the_others(exclude=set())
      return
    self.mark("done")
    # Like jax's shutdown barrier outside recoverable mode, but one that a process that
    # failed meanwhile (it will never be done) does not hold up.
    deadline = time.monotonic() + EXIT_BARRIER_SECONDS
    while time.monotonic() < deadline:
      try:
        marks = self.all_marks()
      except Exception:  # noqa: BLE001 (no coordinator any more: nothing left to protect)
        return
      if set(marks["done"]) | set(marks["failed"]) | set(marks["stopped"]) >= set(range(self.count)):
        break
      time.sleep(POLL_SECONDS / 2)
    if self.index == 0:
      deadline = time.monotonic() + LAST_TO_LEAVE_SECONDS
      while time.monotonic() < deadline:
        try:
          if set(self.client.get_live_nodes(list(range(self.count)))) <= {0}:
            return
        except Exception:  # noqa: BLE001
          return
        time.sleep(0.1)


# ---- errors of the main thread ---------------------------------------------------------------

_PEER_LOSS = ("connection closed", "connection reset", "broken pipe", "gloo", "unavailable", "deadline_exceeded", "barrier")


def _looks_like_a_lost_peer(error: BaseException) -> bool:
  """A collective or coordination error: the judge decides within a heartbeat timeout."""
  return type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and any(
    phrase in str(error).lower() for phrase in _PEER_LOSS
  )


def _install_excepthook() -> None:
  previous = sys.excepthook

  def hook(exc_type, error, tb):
    watch = _watch
    if watch is not None and not watch.stopping and _looks_like_a_lost_peer(error):
      deadline = time.monotonic() + watch.heartbeat + 5 * POLL_SECONDS
      while time.monotonic() < deadline:  # the judge ends the process with the real reason
        time.sleep(POLL_SECONDS / 2)
    failed(first_line(error))
    previous(exc_type, error, tb)

  sys.excepthook = hook
