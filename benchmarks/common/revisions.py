"""jaxbuf as it was at a git revision, beside today's, in one process.

A before/after figure is only fair when both sides run in the same process
on the same machine at the same moment (a 2-core machine's load moves from
minute to minute). `jaxbuf_at(revision)` writes the revision's `jaxbuf/`
package to a temporary folder under another name (`jaxbuf_at_<sha>`, every
`jaxbuf` module reference in its files renamed to match) and imports it, so
the two libraries share nothing but JAX. `against(module, old)` then builds
a benchmark's adapters over the old library: inside it the benchmark
module's global `jaxbuf` is the old package.

Used by the `--against REVISION` option of `peers/bench_replay_fused.py`,
`peers/bench_sequence.py` and `peers/bench_frames.py`, which time a
`jaxbuf@<revision>` contender interleaved with today's jaxbuf and print
their ratio.
"""

import contextlib
import functools
import importlib
import io
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import types
from typing import Any, Callable, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
_REFERENCE = re.compile(r"\bjaxbuf\b(?=[.\s,)]|$)", re.MULTILINE)


def jaxbuf_at(revision: str) -> types.ModuleType:
  """The `jaxbuf` package of git `revision`, imported as `jaxbuf_at_<sha>`."""
  sha = subprocess.run(
    ["git", "rev-parse", "--short=10", revision],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  name = f"jaxbuf_at_{sha}"
  if name in sys.modules:
    return sys.modules[name]
  archive = subprocess.run(
    ["git", "archive", "--format=tar", sha, "jaxbuf"], cwd=ROOT, capture_output=True, check=True
  ).stdout
  folder = pathlib.Path(tempfile.mkdtemp(prefix="jaxbuf-revision-"))
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(folder, filter="data")
  package = folder / name
  (folder / "jaxbuf").rename(package)
  for source in package.rglob("*.py"):
    source.write_text(_REFERENCE.sub(name, source.read_text()))
  sys.path.insert(0, str(folder))
  return importlib.import_module(name)


@contextlib.contextmanager
def bound(module: types.ModuleType, old: types.ModuleType) -> Iterator[None]:
  """`module.jaxbuf` is `old` inside."""
  saved = module.jaxbuf
  module.jaxbuf = old
  try:
    yield
  finally:
    module.jaxbuf = saved


def against(module: types.ModuleType, old: types.ModuleType, factory: Callable) -> Callable:
  """`factory` (an adapter maker of `module`) building over the old library."""

  @functools.wraps(factory)
  def make(*args: Any, **kwargs: Any) -> Any:
    with bound(module, old):
      return factory(*args, **kwargs)

  return make


def contender_name(revision: str) -> str:
  return f"jaxbuf@{revision}"
