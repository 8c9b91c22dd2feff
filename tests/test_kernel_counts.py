"""Kernels per fused iteration on the H100 target stay at or under their
recorded counts (issue 49), so no change adds GPU launches unseen.

`benchmarks/device/kernel_counts.py` compiles every fused benchmark loop for
an H100 without a GPU (a deviceless compile, the CUDA plugin of the
`compile-targets` extra) and counts the launches of one iteration. The
counts it recorded are in `benchmarks/results/kernel_counts.json`; a count
above its record fails here, naming the loop. A count below it passes: the
record is then stale, and rerunning the script (its command in its
docstring) records the new one. The goals are judged too.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "kernel_counts.json"

if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
  pytest.skip(
    "the CUDA plugin is not installed (pip install -e '.[compile-targets]')",
    allow_module_level=True,
  )

sys.path.insert(0, str(ROOT))
from benchmarks.device import kernel_counts  # noqa: E402

# The groups the suite compiles (the goals' loops, about 40 s on 2 cores);
# the streams, the training loops and the deepest trees, which take longer,
# with the slow tests (`pytest -m slow tests/test_kernel_counts.py`).
GROUPS = ("items", "windows", "selection")
SLOW_GROUPS = ("streams", "levels", "training")


def _recorded() -> dict:
  return json.loads(RECORD.read_text())["counts"]["h100"]


def _check(groups: tuple[str, ...]) -> None:
  counted = kernel_counts.count_all(("h100",), groups)
  if "selection" in groups and "items" not in groups:  # its goals are against uniform items
    counted["h100"]["uniform items"] = _recorded()["uniform items"]
  recorded = _recorded()
  over = []
  for name, figures in counted["h100"].items():
    assert "error" not in figures, f"{name}: {figures['error']}"
    assert name in recorded, f"{name} has no recorded count: rerun kernel_counts.py --json"
    if figures["kernels"] > recorded[name]["kernels"]:
      over.append(f"{name}: {figures['kernels']} kernels, recorded {recorded[name]['kernels']}")
  assert not over, "more kernels per iteration than recorded:\n" + "\n".join(over)
  failed = [line for line in kernel_counts.judge(counted).lines if line.startswith("FAIL")]
  assert not failed, failed


def test_the_record_meets_every_goal():
  lines = kernel_counts.judge({"h100": _recorded()}).lines
  assert lines and not [line for line in lines if not line.startswith("PASS")], lines


# A test per group, so that the suite's workers share them out.
@pytest.mark.parametrize("group", GROUPS)
def test_no_loop_launches_more_kernels_than_recorded(group):
  _check((group,))


@pytest.mark.slow
@pytest.mark.parametrize("group", SLOW_GROUPS)
def test_no_training_loop_or_deep_tree_launches_more_kernels_than_recorded(group):
  _check((group,))
