"""Storage tiers (issue 44): payload leaves in pinned host memory or in files.

Every tiered kind, on every tier, draws the same samples as the device tier
under the same keys, bit for bit, over a random run of adds (chunks, masks,
episode ends, final steps) and priority updates. Then the host tier's
placement and jit, and the disk tier's faults: a full disk during an add, a
payload file truncated, changed or deleted, a second writer, a directory that
cannot be written, a tier asked of a kind without tiers, a restart.
"""

import errno
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbuf
from jaxbuf._src.storage import disk as disk_files

NUM_ENVS, CAPACITY, SAMPLE = 2, 24, 6

ITEM = {"pixels": jnp.zeros((8, 8), jnp.uint8), "vector": jnp.zeros(3, jnp.float32)}
# Frames of 64 bytes a step: the host tier's payload (rows of 64 bytes or more).
STEP = {
  "obs": {"pixels": jnp.zeros((8, 8), jnp.uint8), "position": jnp.zeros(2, jnp.float32)},
  "action": jnp.int32(0),
  "reward": jnp.float32(0),
  "terminated": jnp.bool_(False),
}

FACTORIES = {
  "uniform": (lambda storage: jaxbuf.uniform_replay(CAPACITY, storage=storage), False),
  "prioritized": (
    lambda storage: jaxbuf.prioritized_replay(CAPACITY, alpha=0.7, storage=storage),
    False,
  ),
  "sequence": (
    lambda storage: jaxbuf.sequence_replay(NUM_ENVS, CAPACITY, 3, storage=storage),
    True,
  ),
  "prioritized_sequence": (
    lambda storage: jaxbuf.prioritized_sequence_replay(NUM_ENVS, CAPACITY, 3, storage=storage),
    True,
  ),
  "frame_stack": (
    lambda storage: jaxbuf.frame_stack_replay(NUM_ENVS, CAPACITY, 3, n_step=2, storage=storage),
    True,
  ),
  "frame_stack_channels_first": (
    lambda storage: jaxbuf.frame_stack_replay(
      NUM_ENVS, CAPACITY, 3, stack_keys=("pixels",), stack_axis=0, pad="first", storage=storage
    ),
    True,
  ),
  "prioritized_frame_stack": (
    lambda storage: jaxbuf.prioritized_frame_stack_replay(
      NUM_ENVS, CAPACITY, 2, n_step=3, storage=storage
    ),
    True,
  ),
}


def _storage(tier: str, tmp_path) -> object:
  if tier == "device":
    return "device"
  if tier == "host":
    return "host"
  return jaxbuf.disk(tmp_path / "payload", min_row_bytes=1)


def _random_like(tree, shape, rng):
  def leaf(x):
    x = np.asarray(x)
    full = shape + x.shape
    if x.dtype == bool:
      return rng.random(full) < 0.2
    if np.issubdtype(x.dtype, np.integer):
      return rng.integers(0, 200, full).astype(x.dtype)
    return rng.normal(size=full).astype(x.dtype)

  return jax.tree.map(leaf, tree)


def _run(name: str, storage, seed: int = 0) -> list:
  """Adds, samples and priority updates in a fixed random order; every sample."""
  factory, streams = FACTORIES[name]
  buffer = factory(storage)
  rng = np.random.default_rng(seed)
  state = buffer.init(STEP if streams else ITEM)
  drawn = []
  for round_ in range(7):
    if streams:
      chunk = 2
      steps = _random_like(STEP, (NUM_ENVS, chunk), rng)
      keywords = {"mask": rng.random(NUM_ENVS) < 0.8}
      if round_ % 3 == 1:
        keywords["episode_end"] = rng.random((NUM_ENVS, chunk)) < 0.3
      if round_ % 3 == 2:
        keywords["episode_end"] = rng.random(NUM_ENVS) < 0.5
        keywords["final_steps"] = _random_like(STEP, (NUM_ENVS,), rng)
      state = buffer.add(state, steps, **keywords)
    else:
      state = buffer.add(state, _random_like(ITEM, (5,), rng))
    if bool(buffer.can_sample(state, SAMPLE)):
      sample = buffer.sample(state, jax.random.key(round_), SAMPLE)
      drawn.append(jax.device_get(sample))
      state = buffer.update_priorities(
        state,
        sample.indices,
        jnp.asarray(rng.random(SAMPLE) + 0.1, jnp.float32),
        sample.item_ids,
      )
  if isinstance(storage, jaxbuf._src.storage.tiers.Disk):
    storage.close()
  return drawn


# Each case compiles its kind twice (about 8 s): two run by default, the
# whole matrix with the slow tests.
FAST_CASES = {("sequence", "host"), ("prioritized", "disk")}


@pytest.mark.parametrize(
  "name, tier",
  [
    pytest.param(name, tier, marks=() if (name, tier) in FAST_CASES else pytest.mark.slow)
    for name in sorted(FACTORIES)
    for tier in ("host", "disk")
  ],
)
def test_same_samples_as_the_device_tier(name, tier, tmp_path):
  expected = _run(name, "device")
  found = _run(name, _storage(tier, tmp_path))
  assert len(found) == len(expected) > 0
  for want, got in zip(expected, found):
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_take_draws_what_sample_draws_with_the_payload_rows(tier, tmp_path):
  # Tiered kinds consume nothing, so `take` is `sample`'s draw (payload rows
  # read from the tier) and the state as it was.
  storage = _storage(tier, tmp_path)
  buffer = jaxbuf.prioritized_replay(16, storage=storage)
  state = buffer.add(buffer.init(ITEM), _random_like(ITEM, (12,), np.random.default_rng(0)))
  key = jax.random.key(3)
  peeked = jax.device_get(buffer.sample(state, key, 8))
  after, taken = buffer.take(state, key, 8)
  for a, b in zip(jax.tree.leaves(peeked), jax.tree.leaves(jax.device_get(taken))):
    np.testing.assert_array_equal(a, b)
  assert int(after.size if tier == "disk" else after.core.size) == 12
  if isinstance(storage, jaxbuf.Disk):
    storage.close()


def test_host_tier_places_payload_in_pinned_host_memory():
  buffer = jaxbuf.uniform_replay(CAPACITY, storage="host")
  state = buffer.init(ITEM)
  assert isinstance(state, jaxbuf.HostTierState)
  assert state.payload["['pixels']"].sharding.memory_kind == "pinned_host"
  assert state.payload["['pixels']"].shape == (CAPACITY, 8, 8)
  # The small leaf stays on the device, in the kind's own state.
  assert state.core.storage["vector"].shape == (CAPACITY, 3)
  assert state.core.storage["pixels"].shape == (CAPACITY, 1, 1)  # the proxy
  state = buffer.add(state, _random_like(ITEM, (5,), np.random.default_rng(0)))
  assert state.payload["['pixels']"].sharding.memory_kind == "pinned_host"
  assert int(state.size) == 5


@pytest.mark.parametrize("name", ["prioritized", "sequence"])
def test_host_tier_storage_is_the_payload_in_pinned_host_memory(name, tmp_path):
  # `state.storage` reads as the device tier's storage, the payload leaves
  # being the arrays in pinned host memory: never the row proxies (int32
  # row numbers that would pass for data).
  factory, streams = FACTORIES[name]
  host, device = factory("host"), factory("device")
  example = STEP if streams else ITEM
  rng = np.random.default_rng(5)
  states = [buffer.init(example) for buffer in (host, device)]
  for _ in range(3):
    data = _random_like(example, (NUM_ENVS, 2) if streams else (7,), rng)
    states = [buffer.add(state, data) for buffer, state in zip((host, device), states)]
  state, want = states
  pixels = (lambda tree: tree["obs"]["pixels"]) if streams else (lambda tree: tree["pixels"])
  assert pixels(state.storage).sharding.memory_kind == "pinned_host"
  assert pixels(state.storage) is state.payload["['obs']['pixels']" if streams else "['pixels']"]
  assert jax.tree.structure(state.storage) == jax.tree.structure(want.storage)
  for got, expected in zip(jax.tree.leaves(state.storage), jax.tree.leaves(want.storage)):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
  # Bookkeeping stays on the device, in the kind's own state.
  for leaf in jax.tree.leaves(state.core):
    assert leaf.sharding.memory_kind == "device"
  assert pixels(state.core.storage).dtype == jnp.int32  # the proxies, internal
  # A save and load keeps the layout (the payload shaped as the storage).
  jaxbuf.save(tmp_path / "checkpoint", state)
  loaded = jaxbuf.load(tmp_path / "checkpoint", like=host.init(example))
  np.testing.assert_array_equal(pixels(loaded.storage), pixels(want.storage))
  assert pixels(loaded.storage).sharding.memory_kind == "pinned_host"
  key = jax.random.key(1)
  for a, b in zip(
    jax.tree.leaves(host.sample(loaded, key, SAMPLE)),
    jax.tree.leaves(device.sample(want, key, SAMPLE)),
  ):
    np.testing.assert_array_equal(a, b)


def test_host_tier_runs_inside_jit_scan_and_cond_without_recompiling():
  host, device = (jaxbuf.uniform_replay(CAPACITY, storage=tier) for tier in ("host", "device"))
  traces = []

  def run(buffer, state, items, key):
    traces.append(buffer is host)

    def step(state, inputs):
      chunk, key = inputs
      state = buffer.add(state, chunk)
      drawn = buffer.sample(state, key, SAMPLE).items["pixels"].astype(jnp.int32).sum()
      # Both branches keep the state's structure, shapes and memory kinds.
      state = jax.lax.cond(state.size >= CAPACITY, buffer.clear, lambda same: same, state)
      return state, drawn

    return jax.lax.scan(step, state, (items, jax.random.split(key, 4)))

  jitted = jax.jit(run, static_argnums=0)
  rng = np.random.default_rng(1)
  for round_ in range(2):
    items = _random_like(ITEM, (4, 7), rng)
    state, drawn = jitted(host, host.init(ITEM), items, jax.random.key(round_))
    _, want = jitted(device, device.init(ITEM), items, jax.random.key(round_))
    np.testing.assert_array_equal(drawn, want)
    assert state.payload["['pixels']"].sharding.memory_kind == "pinned_host"
    assert int(state.size) == 0  # full after the 4th add, then cleared
  assert traces.count(True) == 1


def test_disk_tier_refuses_jit(tmp_path):
  storage = jaxbuf.disk(tmp_path)
  buffer = jaxbuf.uniform_replay(CAPACITY, storage=storage)
  state = buffer.init(ITEM)
  with pytest.raises(TypeError, match="outside jax.jit"):
    jax.jit(buffer.sample, static_argnums=2)(state, jax.random.key(0), 2)
  with pytest.raises(TypeError, match="outside jax.jit"):
    jax.jit(buffer.add)(state, _random_like(ITEM, (2,), np.random.default_rng(0)))
  # What touches no payload runs anywhere.
  assert not bool(jax.jit(buffer.can_sample, static_argnums=1)(state, 1))
  storage.close()


def _filled_disk_buffer(tmp_path, rows=10):
  storage = jaxbuf.disk(tmp_path / "payload")
  buffer = jaxbuf.uniform_replay(CAPACITY, storage=storage)
  state = buffer.init(ITEM)
  state = buffer.add(state, _random_like(ITEM, (rows,), np.random.default_rng(2)))
  return storage, buffer, state


def _pixels_file(storage) -> str:
  return os.path.join(storage.directory, storage.files.names["['pixels']"])


def test_disk_full_during_an_add_leaves_state_and_files_as_they_were(tmp_path, monkeypatch):
  storage, buffer, state = _filled_disk_buffer(tmp_path, rows=CAPACITY)
  state = buffer.add(state, _random_like(ITEM, (10,), np.random.default_rng(4)))  # head at 10
  before = jax.device_get(buffer.sample(state, jax.random.key(0), CAPACITY))
  with open(_pixels_file(storage), "rb") as file:
    bytes_before = file.read()
  calls = []

  def full_after_one(fd, data, offset):
    calls.append(offset)
    if len(calls) > 1:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return os.pwrite(fd, data, offset)

  monkeypatch.setattr(disk_files, "write_at", full_after_one)
  items = _random_like(ITEM, (20,), np.random.default_rng(3))
  # The add's rows wrap the ring: two runs, the second write fails.
  with pytest.raises(OSError, match="No space left on device.*Nothing was added"):
    buffer.add(state, items)
  monkeypatch.undo()
  with open(_pixels_file(storage), "rb") as file:
    assert file.read() == bytes_before
  after = jax.device_get(buffer.sample(state, jax.random.key(0), CAPACITY))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  # And the buffer goes on: the same add succeeds once there is space.
  state = buffer.add(state, items)
  assert int(state.size) == CAPACITY
  storage.close()


def test_disk_full_at_init_names_the_file(tmp_path, monkeypatch):
  def no_space(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "posix_fallocate", no_space)
  storage = jaxbuf.disk(tmp_path)
  with pytest.raises(OSError, match="cannot allocate .*pixels"):
    jaxbuf.uniform_replay(CAPACITY, storage=storage).init(ITEM)
  assert storage.files is None


@pytest.mark.parametrize("fault", ["truncated", "changed", "deleted"])
def test_payload_file_damaged_under_the_buffer_is_never_sampled(tmp_path, fault):
  storage, buffer, state = _filled_disk_buffer(tmp_path)
  storage.sync()
  path = _pixels_file(storage)
  if fault == "truncated":
    os.truncate(path, 7)
    message = "truncated"
  elif fault == "changed":
    with open(path, "r+b") as file:
      data = bytearray(file.read())
      for row in range(10):  # every row held: any sample reads one
        data[row * 64 + 3] ^= 0xFF
      file.seek(0)
      file.write(data)
    message = "does not match its checksum"
  else:
    os.remove(path)
    message = "deleted"
  with pytest.raises(OSError, match=message):
    buffer.sample(state, jax.random.key(0), 4)
  storage.close()
  # At open, too (a restart).
  reopened = jaxbuf.disk(tmp_path / "payload")
  if fault == "changed":
    # Sizes and checksum tables are whole; the changed rows are found at read.
    buffer = jaxbuf.uniform_replay(CAPACITY, storage=reopened)
    loaded = buffer.init(ITEM)
    with pytest.raises(OSError, match="checksum"):
      buffer.sample(state, jax.random.key(1), 4)
    del loaded
  else:
    with pytest.raises(OSError, match="holds 7 bytes|missing"):
      jaxbuf.uniform_replay(CAPACITY, storage=reopened).init(ITEM)
  reopened.close()


def test_a_second_writer_is_refused(tmp_path):
  storage, buffer, state = _filled_disk_buffer(tmp_path)
  other = jaxbuf.disk(tmp_path / "payload")
  with pytest.raises(OSError, match="another buffer"):
    jaxbuf.uniform_replay(CAPACITY, storage=other).init(ITEM)
  script = textwrap.dedent(f"""
    import jax.numpy as jnp, jaxbuf
    item = {{"pixels": jnp.zeros((8, 8), jnp.uint8), "vector": jnp.zeros(3, jnp.float32)}}
    try:
      storage = jaxbuf.disk({str(tmp_path / "payload")!r})
      jaxbuf.uniform_replay({CAPACITY}, storage=storage).init(item)
    except OSError as error:
      print("refused:", error)
  """)
  result = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert "refused:" in result.stdout and "another buffer" in result.stdout, result.stderr
  storage.close()
  # Released: now it opens.
  assert jaxbuf.uniform_replay(CAPACITY, storage=other).init(ITEM) is not None
  other.close()


def test_a_directory_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
  under_a_file = tmp_path / "a_file"
  under_a_file.write_text("")
  with pytest.raises(OSError, match="cannot create the payload directory"):
    jaxbuf.uniform_replay(CAPACITY, storage=jaxbuf.disk(under_a_file / "payload")).init(ITEM)
  # Tests run as root, which may write anywhere: the permission check is
  # seen through os.access.
  monkeypatch.setattr(os, "access", lambda path, mode: False)
  with pytest.raises(OSError, match="no write permission"):
    jaxbuf.uniform_replay(CAPACITY, storage=jaxbuf.disk(tmp_path / "other")).init(ITEM)


def test_a_tier_asked_of_a_kind_without_tiers_names_those_with(tmp_path):
  with pytest.raises(
    ValueError, match="episode_replay: storage='host' is not supported.*uniform_replay"
  ):
    jaxbuf.episode_replay(NUM_ENVS, CAPACITY, 4, storage="host")
  with pytest.raises(ValueError, match="hindsight_replay.*frame_stack_replay"):
    jaxbuf.hindsight_replay(
      NUM_ENVS, CAPACITY, lambda a, d: jnp.zeros(a.shape[:-1]), storage=jaxbuf.disk(tmp_path)
    )
  with pytest.raises(ValueError, match="storage must be 'device', 'host' or jaxbuf.disk"):
    jaxbuf.uniform_replay(CAPACITY, storage="ssd")
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  with pytest.raises(TypeError, match="storage='host' cannot be split.*jaxbuf.disk"):
    jaxbuf.sharded(jaxbuf.uniform_replay(CAPACITY, storage="host"), mesh, axis="data")


def test_reopen_after_a_restart_without_copying(tmp_path):
  storage, buffer, state = _filled_disk_buffer(tmp_path)
  jaxbuf.save(tmp_path / "checkpoint", state)
  storage.sync()
  want = jax.device_get(buffer.sample(state, jax.random.key(5), 8))
  inode = os.stat(_pixels_file(storage)).st_ino
  storage.close()

  reopened = jaxbuf.disk(tmp_path / "payload")
  buffer = jaxbuf.uniform_replay(CAPACITY, storage=reopened)
  state = jaxbuf.load(tmp_path / "checkpoint", like=buffer.init(ITEM))
  assert os.stat(_pixels_file(reopened)).st_ino == inode  # the same file, not a copy
  got = jax.device_get(buffer.sample(state, jax.random.key(5), 8))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)
  reopened.close()


def test_files_of_another_layout_are_refused(tmp_path):
  storage, _, _ = _filled_disk_buffer(tmp_path)
  storage.close()
  other = jaxbuf.disk(tmp_path / "payload")
  with pytest.raises(ValueError, match="another layout"):
    jaxbuf.uniform_replay(CAPACITY * 2, storage=other).init(ITEM)
  assert other.files is None


def test_prefetcher_draws_the_same_batches_and_passes_errors(tmp_path):
  storage, buffer, state = _filled_disk_buffer(tmp_path)
  keys = [jax.random.key(step) for step in range(3)]
  with jaxbuf.Prefetcher(buffer.sample) as prefetcher:
    prefetcher.submit(state, keys[0], 4)
    for step in range(3):
      batch = prefetcher.result(timeout=120)
      want = buffer.sample(state, keys[step], 4)
      np.testing.assert_array_equal(batch.items["pixels"], want.items["pixels"])
      if step < 2:
        prefetcher.submit(state, keys[step + 1], 4)
    with pytest.raises(RuntimeError, match="nothing was submitted"):
      prefetcher.result(timeout=1)
    os.remove(_pixels_file(storage))
    prefetcher.submit(state, keys[0], 4)
    with pytest.raises(OSError, match="deleted"):
      prefetcher.result(timeout=120)
  storage.close()


def test_a_minari_dataset_streams_into_a_disk_buffer(tmp_path, monkeypatch):
  # from_minari reads and adds episode by episode, chunk by chunk: the disk
  # tier writes each chunk's rows, so a dataset bigger than RAM never is in it.
  gymnasium = pytest.importorskip("gymnasium")
  minari = pytest.importorskip("minari")
  from minari.data_collector import EpisodeBuffer

  monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
  rng = np.random.default_rng(0)
  episodes = [
    EpisodeBuffer(
      observations=rng.normal(size=(length + 1, 32)).astype(np.float32),
      actions=rng.integers(0, 2, length),
      rewards=rng.normal(size=length),
      terminations=np.arange(length) == length - 1,
      truncations=np.zeros(length, bool),
    )
    for length in (7, 9, 11)
  ]
  with warnings.catch_warnings():  # Minari's advice on provenance fields
    warnings.simplefilter("ignore", UserWarning)
    dataset = minari.create_dataset_from_buffers(
      "test/storage-v0",
      episodes,
      observation_space=gymnasium.spaces.Box(-9, 9, (32,), np.float32),
      action_space=gymnasium.spaces.Discrete(2),
    )
  device = jaxbuf.uniform_replay(CAPACITY)
  want = jaxbuf.from_minari(
    dataset,
    device,
    device.init(jaxbuf.offline_example(dataset, device)),
    chunk_size=8,
    round_floats=True,
  )
  storage = jaxbuf.disk(tmp_path / "payload")
  buffer = jaxbuf.uniform_replay(CAPACITY, storage=storage)
  state = buffer.init(jaxbuf.offline_example(dataset, buffer))
  state = jaxbuf.from_minari(dataset, buffer, state, chunk_size=8, round_floats=True)
  assert state.storage.obs.shape == (CAPACITY, 1)  # a proxy: the rows are on disk
  for a, b in zip(
    jax.tree.leaves(device.sample(want, jax.random.key(0), 16)),
    jax.tree.leaves(buffer.sample(state, jax.random.key(0), 16)),
  ):
    np.testing.assert_array_equal(a, b)
  storage.close()


def test_host_tier_state_saves_and_loads(tmp_path):
  buffer = jaxbuf.uniform_replay(CAPACITY, storage="host")
  state = buffer.add(buffer.init(ITEM), _random_like(ITEM, (9,), np.random.default_rng(6)))
  want = jax.device_get(buffer.sample(state, jax.random.key(2), 5))
  jaxbuf.save(tmp_path / "checkpoint", state)
  loaded = jaxbuf.load(tmp_path / "checkpoint", like=buffer.init(ITEM))
  assert loaded.payload["['pixels']"].sharding.memory_kind == "pinned_host"
  got = jax.device_get(buffer.sample(loaded, jax.random.key(2), 5))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)
  loaded = buffer.add(loaded, _random_like(ITEM, (2,), np.random.default_rng(7)))
  assert int(loaded.size) == 11


@pytest.mark.parametrize("name", ["prioritized", pytest.param("sequence", marks=pytest.mark.slow)])
def test_sharded_disk_tier_keeps_each_devices_rows_in_its_own_files(name, tmp_path):
  devices = jax.device_count()  # 4 fake CPU devices in the tests
  mesh = jax.make_mesh((devices,), ("data",))
  make = {
    "prioritized": lambda storage: jaxbuf.prioritized_replay(32, storage=storage),
    "sequence": lambda storage: jaxbuf.sequence_replay(devices, 32, 2, storage=storage),
  }[name]
  storage = jaxbuf.disk(tmp_path / "payload", min_row_bytes=16)
  on_disk, on_device = (
    jaxbuf.sharded(make(tier), mesh, axis="data") for tier in (storage, "device")
  )
  example = STEP if name == "sequence" else ITEM
  states = [buffer.init(example) for buffer in (on_disk, on_device)]
  rng = np.random.default_rng(8)
  for round_ in range(3):
    data = _random_like(example, (devices, 3) if name == "sequence" else (12,), rng)
    states = [buffer.add(state, data) for buffer, state in zip((on_disk, on_device), states)]
    got, want = (
      jax.device_get(buffer.sample(state, jax.random.key(round_), 8))
      for buffer, state in zip((on_disk, on_device), states)
    )
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      np.testing.assert_array_equal(a, b)
  # Device d's rows are in directory/device-<d>, and only there.
  for device in range(devices):
    (block,) = (tmp_path / "payload" / f"device-{device}").glob("*pixels.rows")
    assert block.stat().st_size == 32 // devices * 64
    assert block.read_bytes().strip(b"\0"), device  # written to
  storage.close()


def test_host_tier_refuses_a_device_tier_state_naming_both_types():
  host, device = jaxbuf.uniform_replay(8, storage="host"), jaxbuf.uniform_replay(8)
  state = device.add(device.init(jnp.int32(0)), jnp.arange(3, dtype=jnp.int32))
  key = jax.random.key(0)
  for call in (
    lambda: host.take(state, key, 2),
    lambda: host.sample(state, key, 2),
    lambda: host.add(state, jnp.arange(2, dtype=jnp.int32)),
    lambda: host.can_sample(state, 2),
  ):
    with pytest.raises(TypeError, match="expected a HostTierState, given a ReplayState"):
      call()
  assert int(state.size) == 3  # intact
