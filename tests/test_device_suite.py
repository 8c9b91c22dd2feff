"""The device benchmark suite (`benchmarks/device/device_suite.py`) at smoke sizes
on the CPU, so that the code a rare GPU run depends on cannot rot between
GPU runs: every part runs its script to the end and reports figures."""

import json
import pathlib
import sys

import jax
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "device"
sys.path.insert(0, str(BENCHMARKS))
import device_suite  # noqa: E402  pylint: disable=wrong-import-position


# One test per part, so that the suite's workers share them out (the parts
# run one after another in one test took 100 s of one worker). The default
# suite runs the cheap parts, whose code (the suite's process, budget, JSON
# and table) every part shares; the others, each a benchmark's smoke run,
# with the slow tests (`pytest -m slow tests/test_device_suite.py`).
FAST_PARTS = ("kernels", "dispatch", "mixture")


@pytest.mark.parametrize(
  "part",
  [
    part.name if part.name in FAST_PARTS else pytest.param(part.name, marks=pytest.mark.slow)
    for part in device_suite.PARTS
  ],
)
def test_smoke_run_finishes_every_part_with_figures(tmp_path, monkeypatch, part):
  # Tiny sizes: each part's process is mostly compiling, so it compiles as
  # this process does (conftest.py sets LLVM's expensive passes off).
  monkeypatch.setenv(
    "JAX_DISABLE_MOST_OPTIMIZATIONS", str(int(jax.config.read("jax_disable_most_optimizations")))
  )
  status = device_suite.main(["--smoke", "--parts", part, "--out", str(tmp_path)])
  report = json.loads((tmp_path / "device_suite.json").read_text())
  table = (tmp_path / "device_suite.md").read_text()
  assert status == 0
  assert report["smoke"] and report["device"]["backend"] == "cpu"
  assert [result["name"] for result in report["parts"]] == [part]
  (result,) = report["parts"]
  assert result["status"] == "ok", (part, result.get("reason"), result.get("output", "")[-2000:])
  assert result["verdicts"], (part, result["output"][-2000:])
  assert f"| {part} | ok |" in table
  assert "skipped or failed: none" in table
  assert "jax " + report["device"]["jax"] in table


def test_a_missing_script_or_module_is_skipped_with_its_reason():
  missing_script = device_suite.Part("absent", "no_such_bench.py", (), (), 5)
  missing_module = device_suite.Part(
    "peer", "features/bench_host_calls.py", (), (), 5, needs=("no_such_module_here",)
  )
  assert device_suite.run_part(missing_script, smoke=True) == dict(
    name="absent", script="no_such_bench.py", status="skipped", reason="no_such_bench.py not found"
  )
  result = device_suite.run_part(missing_module, smoke=True)
  assert (result["status"], result["reason"]) == ("skipped", "not installed: no_such_module_here")


def test_a_part_past_its_budget_is_skipped_and_a_crash_is_failed(monkeypatch, tmp_path):
  monkeypatch.setattr(device_suite, "HERE", tmp_path)
  (tmp_path / "slow.py").write_text(
    "import time\nprint('info  started', flush=True)\ntime.sleep(60)\n"
  )
  (tmp_path / "crash.py").write_text("raise SystemExit('it broke')\n")
  monkeypatch.setattr(device_suite, "SMOKE_BUDGET", 2.0)
  slow = device_suite.run_part(device_suite.Part("slow", "slow.py", (), (), 2), smoke=True)
  assert slow["status"] == "skipped"
  assert slow["reason"] == "ran past its budget of 2 s"
  assert slow["verdicts"] == ["info  started"]
  crash = device_suite.run_part(device_suite.Part("crash", "crash.py", (), (), 2), smoke=True)
  assert (crash["status"], crash["reason"]) == ("failed", "it broke")


@pytest.mark.parametrize(
  "line, kept",
  [
    ("PASS  uniform fused: 1.2x (target >= 1x)", True),
    ("  info  DQN: 1,000 env steps/s", True),
    ("FAIL: peak 9 GiB", True),
    ("C=1000 uniform: filling", False),
    ("", False),
  ],
)
def test_verdict_lines_are_the_judged_lines(line, kept):
  assert device_suite.verdict_lines(line) == ([line.strip()] if kept else [])


def test_kernels_per_iteration_counts_the_fused_loop_body_in_compiled_hlo():
  from benchmarks.common import hlo_kernels  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  if jax.default_backend() != "cpu":
    pytest.skip("reads CPU-compiled text")

  def loop(carry, table):
    def body(carry, step):
      # Two kernels at least: a gather that cannot fuse into the reduction
      # of the sort below, and the sort itself.
      picked = table[jnp.int32(step) % table.shape[0]]
      return jnp.sort(carry * picked)[::-1], None

    return jax.lax.scan(body, carry, jnp.arange(7.0))[0]

  compiled = jax.jit(loop).lower(jnp.arange(4.0), jnp.arange(3.0)).compile().as_text()
  counted = hlo_kernels.kernels_per_iteration(compiled, 7)
  table, _ = hlo_kernels.computations(compiled)
  assert counted is not None and 2 <= counted <= 10
  # A computation the text does not hold counts 0; a text with no loop, None.
  assert hlo_kernels.kernels_in("absent", table) == 0
  assert hlo_kernels.kernels_per_iteration("HloModule m\n", 7) is None
