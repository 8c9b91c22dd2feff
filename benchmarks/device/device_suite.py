"""The device figures in one command: every benchmark a GPU run needs, each
in its own process and time budget, one JSON and one markdown table at the end.

Each part is an existing benchmark script run with the arguments below, in a
fresh process (so a part's device memory, compiled programs and failures stay
its own), stopped at its budget. Its verdict lines (PASS, FAIL, info) become
the rows of the markdown table; its whole output is kept in the JSON. A part
whose script or peer library is missing, that failed or that ran out of time
is listed as skipped with the reason, and the suite goes on.

Parts (full sizes; `--smoke` runs the same scripts and code paths at tiny
sizes, a smoke test for the CPU that `tests/test_device_suite.py` runs):

* kernels: kernels per fused iteration of every benchmark loop, compiled
  for the device itself (`device/kernel_counts.py --on-device`), beside the
  counts compiled for an H100 without one (`benchmarks/results/kernel_counts.json`).

* replay_fused: fused add 128 + sample 256 (+ priority update) at C = 1M and
  10M, uniform and prioritized, jaxbuf against flashbax.
* sequence: sequence replay, windows of 40 over 128 envs of 7840 steps,
  jaxbuf against flashbax and the floors of `common/sequence_adapters.py`.
* launch_floor: issue 41's goals on an accelerator, every sum tree descent
  variant of each beside flashbax and the bare-array floors in one process,
  with kernels per fused iteration from the compiled HLO
  (`floors/bench_launch_floor.py`: prioritized and uniform items at 1M and 10M,
  uniform and prioritized windows, pixel stacks, HER's sample).
* loops: the demo DQN (prioritized, under each sum tree kernel variant, and
  uniform) and PPO, whole fused training loops on gymnax CartPole at 1024
  and 4096 vmapped envs, env steps/s and kernels per iteration.
* frames: a real fill of 1M 84x84 uint8 frames (peak device memory, one
  sample of 32 stacks of 4 from it), and the fused add + sample against
  flashbax's flat buffer of stacked observations at C = 200k.
* hindsight: HER sample of 256 at C = 1M against item replay's.
* mixture: `jaxbuf.mixture` in a fused loop against its parts' own samples
  (`features/bench_mixture.py`).
* dispatch: per-call cost of `add` from NumPy and `sample` from Python.
* sharded: the sharded buffer's fused loop over the visible devices against
  the plain buffer.
* storage: the host tier's sample of 256 state items at C = 1M and 100M
  against the device tier's (goal <= 2x), a 10M-frame host-tier Atari
  buffer (about 70 GB of host memory) filled and sampled, and prefetched
  pixel batches from a disk-tier buffer (`features/bench_storage.py --cases device`).

Run (on the device machine, from the repository root):
  python benchmarks/device/device_suite.py --out DIR          # within its parts' budgets, 1045 s
  # issue 41's one command (docs/gpu.md): every variant of every goal
  timeout 540 python benchmarks/device/device_suite.py --parts launch_floor loops --out DIR
  # issue 49's: the card's own kernel counts, then the launch floor timed
  timeout 330 python benchmarks/device/device_suite.py --parts kernels launch_floor --out DIR
  python benchmarks/device/device_suite.py --smoke --out DIR  # the CPU smoke run
  python benchmarks/device/device_suite.py --parts loops frames
"""

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parents[1]  # benchmarks/


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  script: str  # relative to benchmarks/
  arguments: tuple[str, ...]  # full sizes
  smoke_arguments: tuple[str, ...]
  budget_seconds: float  # full sizes; the smoke run has SMOKE_BUDGET
  needs: tuple[str, ...] = ()  # importable modules the part needs


PARTS = (
  Part(
    # Kernels per fused iteration compiled for the card itself, to check
    # against the deviceless H100/H200 counts (issue 49).
    "kernels",
    "device/kernel_counts.py",
    ("--on-device", "--groups", "items", "windows", "streams", "selection", "training"),
    ("--on-device", "--groups", "items"),
    240,
  ),
  Part(
    "replay_fused",
    "peers/bench_replay_fused.py",
    ("--capacities", "1000000", "10000000", "--libraries", "jaxbuf", "flashbax"),
    ("--quick", "--capacities", "1000", "--libraries", "jaxbuf", "flashbax"),
    100,
    ("flashbax",),
  ),
  Part(
    "sequence",
    "peers/bench_sequence.py",
    ("--periods", "20", "--no-memory"),
    ("--quick",),
    75,
    ("flashbax",),
  ),
  Part(
    "launch_floor",
    "floors/bench_launch_floor.py",
    (),
    ("--smoke",),
    300,
    ("flashbax",),
  ),
  Part(
    "loops",
    "features/bench_loops.py",
    ("--num-envs", "1024", "4096", "--kernel-variants", "xla", "pallas_descent", "pallas"),
    ("--quick", "--num-envs", "2"),  # the Pallas kernels: launch_floor's smoke
    120,
    ("gymnax",),
  ),
  Part(
    "frames",
    "peers/bench_frames.py",
    (
      "--cases",
      "fill",
      "speed",
      "--fill-capacity",
      "1000000",
      "--speed-capacity",
      "200000",
      "--repeats",
      "5",
    ),
    (
      "--cases",
      "fill",
      "speed",
      "--fill-capacity",
      "800",
      "--speed-capacity",
      "800",
      "--repeats",
      "1",
    ),
    75,
    ("flashbax",),
  ),
  Part(
    "hindsight",
    "peers/bench_hindsight.py",
    ("--no-sb3", "--capacity", "1000000", "--repeats", "10"),
    ("--no-sb3", "--capacity", "2000", "--repeats", "1"),
    45,
  ),
  Part("mixture", "features/bench_mixture.py", (), ("--quick",), 30),
  Part(
    "dispatch",
    "features/bench_host_calls.py",
    ("--calls", "500", "--repeats", "5"),
    ("--calls", "3", "--repeats", "1"),
    30,
  ),
  Part(
    "sharded",
    "features/bench_sharded.py",
    ("--cases", "overhead"),
    ("--cases", "overhead", "--quick"),
    30,
  ),
  Part(
    "storage",
    "features/bench_storage.py",
    ("--cases", "device", "--directory", "/tmp/jaxbuf-storage", "--batches", "50"),
    ("--cases", "device", "--quick", "--directory", "/tmp/jaxbuf-storage-smoke"),
    240,
  ),
)
SMOKE_BUDGET = 300.0
VERDICT_WORDS = ("PASS", "FAIL", "info", "n/a")


def missing_modules(modules: tuple[str, ...]) -> list[str]:
  import importlib.util  # pylint: disable=import-outside-toplevel

  return [name for name in modules if importlib.util.find_spec(name) is None]


def verdict_lines(output: str) -> list[str]:
  """The PASS / FAIL / info lines a script printed, stripped."""
  lines = []
  for line in output.splitlines():
    words = line.strip().split(maxsplit=1)
    if words and words[0].rstrip(":") in VERDICT_WORDS:
      lines.append(line.strip())
  return lines


def run_part(part: Part, smoke: bool) -> dict[str, Any]:
  """Runs one part in a fresh process; its status ("ok", "failed" or
  "skipped", with a reason), seconds, whole output and verdict lines."""
  result: dict[str, Any] = dict(name=part.name, script=part.script)
  script = HERE / part.script
  absent = missing_modules(part.needs)
  if not script.exists():
    return dict(result, status="skipped", reason=f"{part.script} not found")
  if absent:
    return dict(result, status="skipped", reason=f"not installed: {', '.join(absent)}")
  arguments = part.smoke_arguments if smoke else part.arguments
  budget = SMOKE_BUDGET if smoke else part.budget_seconds
  command = [sys.executable, str(script), *arguments]
  result["command"] = " ".join(["python", f"benchmarks/{part.script}", *arguments])
  # JAX's default 32-bit mode, whatever the caller's: every figure and
  # peer is defined in it (a JAX_ENABLE_X64=1 test run stays a test of the
  # suite's code, not of other programs).
  environment = {name: value for name, value in os.environ.items() if name != "JAX_ENABLE_X64"}
  start = time.perf_counter()
  try:
    completed = subprocess.run(
      command,
      capture_output=True,
      text=True,
      timeout=budget,
      check=False,
      cwd=HERE.parent,
      env=environment,
    )
    output, status = (
      completed.stdout + completed.stderr,
      ("ok" if completed.returncode == 0 else "failed"),
    )
  except subprocess.TimeoutExpired as expired:
    output = "".join(
      stream.decode() if isinstance(stream, bytes) else (stream or "")
      for stream in (expired.stdout, expired.stderr)
    )
    status = "skipped"
    result["reason"] = f"ran past its budget of {budget:.0f} s"
  result.update(
    status=status,
    seconds=round(time.perf_counter() - start, 1),
    output=output,
    verdicts=verdict_lines(output),
  )
  if status == "failed":
    result["reason"] = failure_line(output)
  return result


def failure_line(output: str) -> str:
  """The exception line of a failed part's output (JAX prints a note about
  its filtered frames after it), else its last line."""
  lines = output.strip().splitlines() or ["no output"]
  raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line)]
  return (raised or lines)[-1]


def describe_device() -> dict[str, Any]:
  """Device, driver, CUDA, jax and jaxlib, read in a child process so that
  this process never holds device memory the parts need."""
  probe = (
    "import json, jax, jaxlib; d = jax.devices();"
    "print(json.dumps(dict(backend=jax.default_backend(),"
    " devices=[x.device_kind for x in d], jax=jax.__version__,"
    " jaxlib=jaxlib.__version__)))"
  )
  environment = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  completed = subprocess.run(
    [sys.executable, "-c", probe], capture_output=True, text=True, check=False, env=environment
  )
  description: dict[str, Any] = dict(
    python=platform.python_version(), host=platform.node(), cpu=cpu_name(), cores=os.cpu_count()
  )
  if completed.returncode == 0:
    description.update(json.loads(completed.stdout.strip().splitlines()[-1]))
  else:
    description["jax_error"] = completed.stderr.strip().splitlines()[-1:]
  description.update(nvidia_versions())
  return description


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as cpuinfo:
      for line in cpuinfo:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def nvidia_versions() -> dict[str, str]:
  """Driver and CUDA versions from nvidia-smi; empty without one."""
  try:
    header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False).stdout
    query = subprocess.run(
      ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
      capture_output=True,
      text=True,
      check=False,
    ).stdout.strip()
  except OSError:
    return {}
  found = {}
  if query:
    name, driver, memory = (field.strip() for field in query.splitlines()[0].split(","))
    found.update(gpu=name, driver=driver, gpu_memory=memory)
  if "CUDA Version:" in header:
    found["cuda"] = header.split("CUDA Version:")[1].split()[0]
  return found


def markdown(device: dict[str, Any], parts: list[dict[str, Any]], smoke: bool) -> str:
  lines = [
    f"### Device suite{' (smoke run)' if smoke else ''}",
    "",
    f"device: {device.get('gpu') or ', '.join(device.get('devices', []))}"
    f" ({device.get('backend', '?')}), driver {device.get('driver', '-')}, "
    f"CUDA {device.get('cuda', '-')}, jax {device.get('jax', '?')}, jaxlib "
    f"{device.get('jaxlib', '?')}; host {device['cpu']}, {device['cores']} "
    f"cores, python {device['python']}",
    "",
    "| part | status | s | figure |",
    "| --- | --- | --- | --- |",
  ]
  for part in parts:
    figures = part.get("verdicts") or [part.get("reason", "")]
    for index, figure in enumerate(figures):
      head = (
        (part["name"], part["status"], str(part.get("seconds", "-")))
        if index == 0
        else ("", "", "")
      )
      lines.append("| " + " | ".join((*head, figure.replace("|", "/"))) + " |")
  skipped = [f"{part['name']} ({part['reason']})" for part in parts if part["status"] != "ok"]
  lines += ["", "skipped or failed: " + ("; ".join(skipped) or "none")]
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--smoke", action="store_true", help="tiny sizes: the same code paths, on the CPU"
  )
  parser.add_argument(
    "--parts", nargs="+", choices=[p.name for p in PARTS], help="run only these parts"
  )
  parser.add_argument(
    "--out", default=None, help="folder for device_suite.json and device_suite.md"
  )
  args = parser.parse_args(argv)
  chosen = [part for part in PARTS if not args.parts or part.name in args.parts]
  device = describe_device()
  print(json.dumps(device), flush=True)
  results = []
  for part in chosen:
    print(f"== {part.name}", flush=True)
    result = run_part(part, args.smoke)
    print(
      f"   {result['status']} {result.get('seconds', '')} s {result.get('reason', '')}", flush=True
    )
    for line in result.get("verdicts", []):
      print(f"   {line}", flush=True)
    results.append(result)
  table = markdown(device, results, args.smoke)
  report = dict(device=device, smoke=args.smoke, parts=results)
  print(
    json.dumps(
      {key: value for key, value in report.items() if key != "parts"}
      | {"parts": [{k: v for k, v in part.items() if k != "output"} for part in results]}
    )
  )
  print(table)
  if args.out:
    folder = pathlib.Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "device_suite.json").write_text(json.dumps(report, indent=1))
    (folder / "device_suite.md").write_text(table)
  return 1 if any(part["status"] == "failed" for part in results) else 0


if __name__ == "__main__":
  sys.exit(main())
