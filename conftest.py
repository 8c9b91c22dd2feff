"""Doctest and test session settings: four fake CPU devices, strict rank promotion."""

import glob
import os
import shutil
import tempfile

# Must be set before JAX initialises its backends.
# The test extra installs the CUDA plugin and libtpu, for the deviceless
# compiles of tests/test_kernel_counts.py. On a machine with no accelerator
# JAX would try both at every start (an error logged, and libtpu's lock
# taken by one process at a time): the CPU alone is asked for instead, and
# the counts compile for their targets all the same. A GPU or TPU machine
# keeps JAX's own choice.
if "JAX_PLATFORMS" not in os.environ and not (
  glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
):
  os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

# The notebooks of notebooks/ (run by nbmake, their kernels inheriting this
# environment) read JAXBUF_NOTEBOOK_SMALL in their first cell: the suite runs
# them at small sizes (about ten seconds each); unset, they run at the sizes
# whose outputs the documentation shows. The quickstart has no small mode.
os.environ.setdefault("JAXBUF_NOTEBOOK_SMALL", "1")

# One on-disk cache of compiled programs for this run of the suite (JAX's
# persistent compilation cache), shared by the xdist workers and the
# processes tests start (they inherit the environment): a program one of
# them compiled is loaded by the others instead of compiled again. A fresh
# directory each run, removed at its end (`pytest_unconfigure`); tracing is
# unchanged, so the tests that count traces and compilations within a
# process see what they would without it. A cache the caller set is kept.
_OWN_COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_COMPILATION_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxbuf-tests-compiled-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import hypothesis  # noqa: E402
import pytest  # noqa: E402
import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# The suite's time is mostly compiling. JAX's "most optimizations off" turns
# off the backend's (LLVM's) expensive passes only: XLA's HLO passes
# (fusion, donation, copy elimination), which the compiled-text tests read,
# run as always, and every result is the same program's. About a sixth less
# time; `JAX_DISABLE_MOST_OPTIMIZATIONS=0 pytest` runs fully optimized. Set
# here, for the tests' own process only: the processes the suite starts (the
# notebook's kernel, which trains DQN for a while) run fully optimized.
if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
  jax.config.update("jax_disable_most_optimizations", True)

hypothesis.settings.register_profile(
  "ci",
  # 20 random programs per property: the suite within its 15 minutes on 2
  # cores (`--hypothesis-profile` or a local profile asks for more).
  max_examples=20,
  deadline=None,
  derandomize=True,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile("ci")


@pytest.fixture(params=[False, True], ids=["x32", "x64"])
def x64_mode(request):
  """Runs a test twice: with 32-bit defaults, and inside `jax.enable_x64(True)`.

  jaxbuf must behave the same whether or not a user turns on 64-bit mode, so
  tests that feed NumPy or Python data of default dtypes use this fixture
  (`pytestmark = pytest.mark.usefixtures("x64_mode")`), and the default suite
  covers both without a second run under `JAX_ENABLE_X64=1`.
  """
  with jax.enable_x64(request.param):
    yield request.param


# The doctests of `jaxbuf.from_minari` and `jaxbuf.to_minari` record their
# own tiny Minari datasets (no dataset hub is reachable from the test
# machines).
_MINARI_DOCTESTS = "jaxbuf/_src/offline/minari_datasets.py::"


# The quickstart trains DQN to its goal (about a minute; it has no small
# mode): a long learning run, with the slow tests (`pytest -m slow
# notebooks/quickstart.ipynb`). Every other notebook runs in the suite.
_SLOW_NOTEBOOKS = ("notebooks/quickstart.ipynb::",)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
  for item in items:
    if item.nodeid.startswith(_SLOW_NOTEBOOKS):
      item.add_marker(pytest.mark.slow)
    if _MINARI_DOCTESTS in item.nodeid:
      # Minari warns about each optional metadata field left out (author,
      # description, eval_env, ...); the examples leave them out to stay short.
      item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning:minari"))


@pytest.fixture(autouse=True)
def _minari_doctests_write_to_a_scratch_directory(request):
  """Those doctests write their datasets under a fresh temporary directory
  (MINARI_DATASETS_PATH), not ~/.minari."""
  if _MINARI_DOCTESTS in request.node.nodeid:
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(request.getfixturevalue("tmp_path")))


def pytest_unconfigure(config):
  # The controller (not an xdist worker) made the cache; it removes it.
  if _OWN_COMPILATION_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
