"""Storage tiers under faults (issue 50): the disk tier's files allocated at
init, a kill between syncs, stale checkpoints and states, a spec shared by
two buffers, damaged or deleted manifests, prefetching while adding.

Every disk-tier test checks rows against a model: an item's `serial` (a
small leaf, on the device) says what its `pixels` (the payload, on disk)
hold, so a row that pairs one item's device leaves with another's disk
leaves is seen.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxbuf
from jaxbuf._src.storage import directory as directories
from jaxbuf._src.storage import disk as disk_files
from jaxbuf._src.storage import manifest as records

CAPACITY, BATCH = 32, 8
ITEM = {"pixels": jnp.zeros((8, 8), jnp.uint8), "serial": jnp.int32(0)}


def items(first: int, count: int) -> dict:
  serial = np.arange(first, first + count, dtype=np.int32)
  pixels = (serial[:, None] * 37 + np.arange(64)) % 256
  return {"pixels": pixels.astype(np.uint8).reshape(count, 8, 8), "serial": serial}


def assert_rows_match_their_items(batch) -> None:
  """Every row's pixels are its own item's (never another item's)."""
  serial = np.asarray(batch.items["serial"])
  want = ((serial[:, None] * 37 + np.arange(64)) % 256).astype(np.uint8).reshape(-1, 8, 8)
  mixed = (np.asarray(batch.items["pixels"]) != want).any(axis=(1, 2))
  assert not mixed.any(), f"{mixed.sum()} rows mix two items: serials {serial[mixed]}"


def opened(directory, **options):
  """A new disk tier and buffer on `directory` (a restart)."""
  storage = jaxbuf.disk(directory, **options)
  return storage, jaxbuf.uniform_replay(CAPACITY, storage=storage)


def filled(directory, count=CAPACITY, **options):
  storage, buffer = opened(directory, **options)
  return storage, buffer, buffer.add(buffer.init(ITEM), items(0, count))


def pixels_file(storage) -> str:
  return os.path.join(storage.directory, "pixels.rows")


# --- Files allocated at init (a disk too small fails there) ------------------


@pytest.fixture
def small_filesystem(tmp_path):
  """A real 256 KiB tmpfs mounted for the test (needs root and a mount
  namespace that allows it; skipped otherwise)."""
  mount_point = tmp_path / "tmpfs"
  mount_point.mkdir()
  mounted = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
    capture_output=True,
    text=True,
    timeout=30,
  )
  if mounted.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not permitted'})")
  try:
    yield mount_point
  finally:
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def _wide_buffer(storage, capacity):
  return jaxbuf.uniform_replay(capacity, storage=storage)


WIDE = {"pixels": jnp.zeros((32, 32), jnp.uint8)}  # 1 KiB a row


def test_a_disk_too_small_fails_at_init_naming_bytes_needed_and_free(small_filesystem):
  directory = small_filesystem / "payload"
  storage = jaxbuf.disk(directory)
  with pytest.raises(
    OSError, match=r"need 1,0\d\d,\d\d\d bytes .* has 2\d\d,\d\d\d bytes free"
  ) as raised:
    _wide_buffer(storage, 1024).init(WIDE)  # 1 MiB of rows on 256 KiB
  assert raised.value.errno == errno.ENOSPC
  assert "sparse=True" in str(raised.value)
  assert storage.files is None
  assert not list(directory.glob("*.rows"))  # nothing half made holds the space
  # A buffer that fits: its file allocated whole at init, before any add.
  storage = jaxbuf.disk(directory)
  _wide_buffer(storage, 128).init(WIDE)
  rows_file = directory / "pixels.rows"
  assert rows_file.stat().st_size == 128 * 1024
  assert rows_file.stat().st_blocks * 512 >= 128 * 1024  # allocated, not sparse
  storage.close()


def test_a_sparse_disk_tier_allocates_as_it_writes_and_a_full_disk_fails_an_add(
  small_filesystem,
):
  storage = jaxbuf.disk(small_filesystem / "payload", sparse=True)
  buffer = _wide_buffer(storage, 1024)
  state = buffer.init(WIDE)  # 1 MiB of rows, accepted: sparse
  rows_file = small_filesystem / "payload" / "pixels.rows"
  assert rows_file.stat().st_size == 1024 * 1024
  assert rows_file.stat().st_blocks * 512 < 64 * 1024
  chunk = {"pixels": np.full((64, 32, 32), 7, np.uint8)}
  added = 0
  with pytest.raises(OSError, match="No space left on device.*Nothing was added"):
    for _ in range(16):
      state = buffer.add(state, chunk)
      added += 64
  assert 0 < added < 1024 and int(state.size) == added  # the state before the failed add
  batch = buffer.sample(state, jax.random.key(0), 16)
  assert (np.asarray(batch.items["pixels"]) == 7).all()
  storage.close()


def test_allocation_checks_free_space_first_and_falls_back_to_writing_zeros(tmp_path, monkeypatch):
  # Without a small file system: the free-space probe and fallocate faked.
  monkeypatch.setattr(directories, "free_bytes", lambda directory: 1000)
  storage = jaxbuf.disk(tmp_path / "payload")
  with pytest.raises(OSError, match=r"need 2,\d\d\d bytes .* has 1,000 bytes free"):
    jaxbuf.uniform_replay(CAPACITY, storage=storage).init(ITEM)
  assert not list((tmp_path / "payload").glob("*.rows"))
  monkeypatch.undo()
  calls = []

  def unsupported(fd, offset, length):
    calls.append(length)
    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

  monkeypatch.setattr(os, "posix_fallocate", unsupported)
  storage, buffer, state = filled(tmp_path / "zeros")
  assert calls == [CAPACITY * 64]
  assert os.stat(pixels_file(storage)).st_blocks * 512 >= CAPACITY * 64
  assert_rows_match_their_items(buffer.sample(state, jax.random.key(0), BATCH))
  storage.close()
  # Sharded: the blocks of every device checked together, before any is made.
  monkeypatch.setattr(directories, "free_bytes", lambda directory: 1000)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  sharded = jaxbuf.sharded(
    jaxbuf.uniform_replay(CAPACITY, storage=jaxbuf.disk(tmp_path / "blocks")), mesh, axis="data"
  )
  with pytest.raises(OSError, match=f"{jax.device_count()} devices' blocks.*1,000 bytes free"):
    sharded.init(ITEM)
  assert not list((tmp_path / "blocks").rglob("*.rows"))


def test_a_tier_that_would_hold_nothing_is_refused_at_init(tmp_path):
  # Every leaf under min_row_bytes stays on the device: a disk tier asked
  # for would write a manifest and no payload (77 bytes for a buffer of
  # 1,056), so init says so, naming the leaf and the setting that moves it.
  small = {"obs": jnp.zeros(8, jnp.float32), "action": jnp.int32(0), "reward": jnp.float32(0)}
  storage = jaxbuf.disk(tmp_path / "payload")
  with pytest.raises(
    ValueError,
    match=r"would hold nothing: .* the largest that may move, \['obs'\], holds 32 bytes a "
    r"row. jaxbuf.disk\(directory, min_row_bytes=32\) moves it",
  ):
    jaxbuf.uniform_replay(24, storage=storage).init(small)
  assert storage.files is None and not (tmp_path / "payload").exists()
  with pytest.raises(ValueError, match=r"storage='host' would hold nothing: .* storage='device'"):
    jaxbuf.uniform_replay(24, storage="host").init(small)
  storage = jaxbuf.disk(tmp_path / "payload", min_row_bytes=32)
  jaxbuf.uniform_replay(24, storage=storage).init(small)
  assert (tmp_path / "payload" / "obs.rows").stat().st_size == 24 * 32
  storage.close()


# --- A kill between syncs: every row that verifies is kept ----------------------

CHILD = textwrap.dedent("""
  import sys, time
  import numpy as np, jax.numpy as jnp, jaxbuf
  directory, checkpoint = sys.argv[1], sys.argv[2]
  item = {"pixels": jnp.zeros((8, 8), jnp.uint8), "serial": jnp.int32(0)}
  def items(first, count):
    serial = np.arange(first, first + count, dtype=np.int32)
    pixels = (serial[:, None] * 37 + np.arange(64)) % 256
    return {"pixels": pixels.astype(np.uint8).reshape(count, 8, 8), "serial": serial}
  storage = jaxbuf.disk(directory)
  buffer = jaxbuf.uniform_replay(CAPACITY, storage=storage)
  state = buffer.add(buffer.init(item), items(0, CAPACITY))
  jaxbuf.save(checkpoint, state)
  storage.sync()
  print("synced", flush=True)
  for add in range(5):  # 20 rows rewritten after the sync, of 32
    state = buffer.add(state, items(CAPACITY + 4 * add, 4))
    print("added", add + 1, flush=True)
  time.sleep(120)
""").replace("CAPACITY", str(CAPACITY))


def _run_until_killed(directory, checkpoint, kill_after: int) -> int:
  """Runs the child; SIGKILLs it once it has reported `kill_after` adds
  after its sync (the next add is then under way). Returns the adds it reported."""
  reported = 0
  lines: list[str] = []
  with subprocess.Popen(
    [sys.executable, "-c", CHILD, str(directory), str(checkpoint)],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  ) as child:
    timer = threading.Timer(240, child.kill)  # never hangs
    timer.start()
    try:
      assert child.stdout is not None
      for line in child.stdout:
        lines.append(line)
        if line.startswith("added"):
          reported = int(line.split()[1])
          if reported >= kill_after:
            os.kill(child.pid, signal.SIGKILL)
            break
    finally:
      timer.cancel()
      child.kill()
      child.wait(timeout=60)
  assert reported >= kill_after, "".join(lines)
  return reported


@pytest.mark.parametrize("kill_after", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_kill_between_syncs_keeps_every_row_that_verifies(tmp_path, kill_after):
  directory, checkpoint = tmp_path / "payload", tmp_path / "checkpoint"
  reported = _run_until_killed(directory, checkpoint, kill_after)
  storage, buffer = opened(directory)
  with pytest.warns(UserWarning, match=r"did not sync again .* rows no longer match") as caught:
    like = buffer.init(ITEM)
  lost = storage.lost_rows()
  # The child may have gone on past the add it reported: the rows written
  # after the sync, in order, are lost (the rows of an add cut short by the
  # kill: those written), and no other.
  np.testing.assert_array_equal(lost, np.arange(len(lost)))
  assert 4 * reported <= len(lost) <= 20
  assert f"{len(lost)} rows" in str(caught[0].message)
  state = jaxbuf.load(checkpoint, like=like)  # saved with the last sync
  drawn = set()
  for step in range(40):
    batch = buffer.sample(state, jax.random.key(step), 16)
    assert_rows_match_their_items(batch)
    drawn.update(np.asarray(batch.indices).tolist())
  assert drawn == set(range(CAPACITY)) - set(lost.tolist())  # every kept row, no lost one
  # The buffer goes on: adds overwrite the lost rows (the oldest), which
  # are then sampled with their new items; the lost rows left stay lost
  # across a sync and a reopen.
  state = buffer.add(state, items(1000, 8))
  assert set(storage.lost_rows().tolist()) == set(lost.tolist()) - set(range(8))
  storage.sync()
  jaxbuf.save(tmp_path / "checkpoint2", state)
  storage.close()
  storage, buffer = opened(directory)
  state = jaxbuf.load(tmp_path / "checkpoint2", like=buffer.init(ITEM))
  assert set(storage.lost_rows().tolist()) == set(lost.tolist()) - set(range(8))
  batch = buffer.sample(state, jax.random.key(99), 64)
  assert_rows_match_their_items(batch)
  assert not set(np.asarray(batch.indices).tolist()) & set(storage.lost_rows().tolist())
  storage.close()


def test_a_long_run_between_syncs_keeps_a_short_journal(tmp_path, monkeypatch):
  # Closing without a sync is what a kill leaves: the rows written since
  # the sync are checked at the next open.
  monkeypatch.setattr(disk_files, "_JOURNAL_BYTES", 256)
  storage, buffer, state = filled(tmp_path / "payload")
  storage.sync()
  jaxbuf.save(tmp_path / "checkpoint", state)
  for add in range(60):  # rows 0..19 rewritten again and again
    state = buffer.add(state, items(CAPACITY + 4 * add, 4))
    if add % 5 == 4:
      state = buffer.clear(state)
  assert os.path.getsize(tmp_path / "payload" / records.JOURNAL) <= 256 + 16
  storage.close()
  storage, buffer = opened(tmp_path / "payload")
  with pytest.warns(UserWarning, match="20 rows no longer match"):
    state = jaxbuf.load(tmp_path / "checkpoint", like=buffer.init(ITEM))
  np.testing.assert_array_equal(storage.lost_rows(), np.arange(20))
  assert_rows_match_their_items(buffer.sample(state, jax.random.key(0), 64))
  storage.close()


def test_a_full_disk_while_journaling_adds_nothing_and_keeps_the_journal_whole(
  tmp_path, monkeypatch
):
  storage, buffer, state = filled(tmp_path / "payload")
  storage.sync()
  jaxbuf.save(tmp_path / "checkpoint", state)
  state = buffer.add(state, items(CAPACITY, 4))  # rows 0..3, journaled
  real_write = os.write

  def half_written(fd, data):  # the journal's record cut short by a full disk
    return real_write(fd, data[: len(data) // 2])

  monkeypatch.setattr(os, "write", half_written)
  with pytest.raises(OSError, match="No space left on device.*Nothing was added"):
    buffer.add(state, items(CAPACITY + 4, 4))
  monkeypatch.undo()
  assert os.path.getsize(tmp_path / "payload" / records.JOURNAL) == 16  # one whole record
  state = buffer.add(state, items(CAPACITY + 4, 4))  # rows 4..7: the buffer goes on
  assert_rows_match_their_items(buffer.sample(state, jax.random.key(0), 64))
  storage.close()  # no sync: the journal says which rows to check
  storage, buffer = opened(tmp_path / "payload")
  with pytest.warns(UserWarning, match="8 rows no longer match"):
    buffer.init(ITEM)
  np.testing.assert_array_equal(storage.lost_rows(), np.arange(8))
  storage.close()


def test_a_new_run_over_old_files_never_pairs_with_the_old_checkpoint(tmp_path):
  # A fresh state over files written before (a new run in the old
  # directory): the files count each row's laps on, so a checkpoint of the
  # first run never matches the rows the second run wrote.
  storage, buffer, state = filled(tmp_path / "payload")
  jaxbuf.save(tmp_path / "first", state)
  storage.sync()
  storage.close()
  storage, buffer = opened(tmp_path / "payload")
  fresh = buffer.add(buffer.init(ITEM), items(5000, 10))  # rows 0..9 again
  assert_rows_match_their_items(buffer.sample(fresh, jax.random.key(0), 64))
  storage.sync()
  storage.close()
  storage, buffer = opened(tmp_path / "payload")
  first = jaxbuf.load(tmp_path / "first", like=buffer.init(ITEM))
  with pytest.raises(OSError, match="10 of the 32 rows it holds are not in the files"):
    buffer.sample(first, jax.random.key(0), BATCH)
  storage.close()


# --- A checkpoint older (or newer) than the files ---------------------------------


def test_a_checkpoint_older_than_the_last_sync_is_refused_or_recovered(tmp_path):
  storage, buffer, state = filled(tmp_path / "payload")
  jaxbuf.save(tmp_path / "older", state)
  storage.sync()
  state = buffer.add(state, items(CAPACITY, 12))  # rows 0..11 rewritten
  jaxbuf.save(tmp_path / "newer", state)
  storage.sync()
  storage.close()

  storage, buffer = opened(tmp_path / "payload")
  older = jaxbuf.load(tmp_path / "older", like=buffer.init(ITEM))
  for call in (
    lambda: buffer.sample(older, jax.random.key(0), BATCH),
    lambda: buffer.add(older, items(500, 2)),
  ):
    with pytest.raises(OSError, match=r"12 of the 32 rows it holds are not in the files") as raised:
      call()
    assert raised.value.errno == errno.ESTALE and "storage.recover(state)" in str(raised.value)
  with pytest.warns(UserWarning, match=r"recover: 12 rows .* dropped"):
    dropped = storage.recover(older)
  np.testing.assert_array_equal(dropped, np.arange(12))
  drawn = set()
  for step in range(20):
    batch = buffer.sample(older, jax.random.key(step), 16)
    assert_rows_match_their_items(batch)
    assert (np.asarray(batch.items["serial"]) < CAPACITY).all()  # the older items only
    drawn.update(np.asarray(batch.indices).tolist())
  assert drawn == set(range(12, CAPACITY))
  storage.close()

  # The checkpoint of the last sync loads as it was saved.
  storage, buffer = opened(tmp_path / "payload")
  newer = jaxbuf.load(tmp_path / "newer", like=buffer.init(ITEM))
  batch = buffer.sample(newer, jax.random.key(1), 64)
  assert_rows_match_their_items(batch)
  assert len(storage.lost_rows()) == 0
  storage.close()


# --- One jaxbuf.disk() per buffer ---------------------------------------------------


def test_one_disk_given_to_two_buffers_is_refused_at_the_second_init(tmp_path):
  storage, first, state = filled(tmp_path / "payload")
  second = jaxbuf.uniform_replay(CAPACITY, storage=storage)
  with pytest.raises(ValueError, match="holds the payload files of another buffer, which is open"):
    second.init(ITEM)
  batch = first.sample(state, jax.random.key(0), BATCH)  # the first buffer's own rows
  assert_rows_match_their_items(batch)
  # Closed, the spec may serve a new buffer; the first one's states then
  # refuse to read its files.
  storage.close()
  other = second.add(second.init(ITEM), items(700, 4))
  with pytest.raises(ValueError, match="now holds the payload files of another buffer"):
    first.sample(state, jax.random.key(0), BATCH)
  assert_rows_match_their_items(second.sample(other, jax.random.key(0), BATCH))
  storage.close()


# --- A damaged manifest, a deleted one ----------------------------------------------


def _damage(path, damage):
  manifest = json.loads(path.read_text())
  if damage == "truncated":
    path.write_text(path.read_text()[:40])
  elif damage == "missing field":
    del manifest["tables"]
    path.write_text(json.dumps(manifest))
  elif damage == "wrong type":
    manifest["rows"] = "32"
    path.write_text(json.dumps(manifest))
  elif damage == "not an object":
    path.write_text(json.dumps([manifest]))
  elif damage == "leaf not an object":
    manifest["leaves"]["['pixels']"] = ["pixels.rows"]
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
  "damage, words",
  [
    ("truncated", "not valid JSON (40 bytes: truncated or damaged)"),
    ("missing field", "the manifest has no field 'tables'"),
    ("wrong type", "field 'rows' is '32', not a int"),
    ("not an object", "it holds a list, not an object"),
    ("leaf not an object", "leaf \"['pixels']\" is a list, not an object"),
  ],
)
def test_a_damaged_manifest_names_the_file_and_what_is_wrong(tmp_path, damage, words):
  storage, _, _ = filled(tmp_path / "payload")
  storage.close()
  manifest_path = tmp_path / "payload" / records.MANIFEST
  _damage(manifest_path, damage)
  storage = jaxbuf.disk(tmp_path / "payload")
  with pytest.raises(OSError) as raised:
    jaxbuf.uniform_replay(CAPACITY, storage=storage).init(ITEM)
  message = str(raised.value)
  assert f"{manifest_path}: malformed manifest" in message and words in message, message
  assert storage.files is None


def test_a_deleted_manifest_is_never_a_silent_truncation(tmp_path):
  storage, buffer, state = filled(tmp_path / "payload")
  jaxbuf.save(tmp_path / "checkpoint", state)
  storage.sync()
  storage.close()
  rows_before = (tmp_path / "payload" / "pixels.rows").read_bytes()
  (tmp_path / "payload" / records.MANIFEST).unlink()
  storage = jaxbuf.disk(tmp_path / "payload")
  refused = r"holds payload files \['pixels.rows', 'tables-1'\] but no manifest.json.*Nothing"
  with pytest.raises(OSError, match=refused):
    jaxbuf.uniform_replay(CAPACITY, storage=storage).init(ITEM)
  assert (tmp_path / "payload" / "pixels.rows").read_bytes() == rows_before

  # An emptied directory makes new files; the checkpoint of the old ones
  # is then refused, never sampled as zeros.
  for path in (tmp_path / "payload").iterdir():
    path.unlink()
  storage, buffer = opened(tmp_path / "payload")
  state = jaxbuf.load(tmp_path / "checkpoint", like=buffer.init(ITEM))
  with pytest.raises(OSError, match="32 of the 32 rows it holds are not in the files"):
    buffer.sample(state, jax.random.key(0), BATCH)
  storage.close()


def test_an_init_that_did_not_finish_is_made_again(tmp_path, monkeypatch):
  # Killed (here: failed) while making the files: what it left is its own.
  def killed(*args):
    raise KeyboardInterrupt

  monkeypatch.setattr(records, "write", killed)
  storage = jaxbuf.disk(tmp_path / "payload")
  with pytest.raises(KeyboardInterrupt):
    jaxbuf.uniform_replay(CAPACITY, storage=storage).init(ITEM)
  monkeypatch.undo()
  with open(tmp_path / "payload" / "pixels.rows", "wb") as file:
    file.write(b"left over")
  storage, buffer, state = filled(tmp_path / "payload")
  assert_rows_match_their_items(buffer.sample(state, jax.random.key(0), BATCH))
  assert not (tmp_path / "payload" / directories.CREATING).exists()
  storage.close()


def test_files_of_the_older_format_open_and_sync_to_the_new_one(tmp_path):
  # Format 1 (jaxbuf before issue 50): a `.crc` table per leaf, no laps; its
  # states' proxies are `row + 1`, which lap 0 is.
  storage, buffer, state = filled(tmp_path / "payload")
  jaxbuf.save(tmp_path / "checkpoint", state)
  storage.sync()
  want = jax.device_get(buffer.sample(state, jax.random.key(4), BATCH))
  storage.close()
  directory = tmp_path / "payload"
  manifest = json.loads((directory / records.MANIFEST).read_text())
  tables = (directory / manifest["tables"]["file"]).read_bytes()
  crc = tables[: 4 * CAPACITY]
  (directory / "pixels.crc").write_bytes(crc)
  import hashlib

  old = {key: manifest[key] for key in ("rows", "leaves")}
  old.update(format=records.FORMAT_1, checksums={"['pixels']": hashlib.sha256(crc).hexdigest()})
  (directory / records.MANIFEST).write_text(json.dumps(old))
  (directory / manifest["tables"]["file"]).unlink()
  (directory / records.JOURNAL).unlink()

  storage, buffer = opened(directory)
  state = jaxbuf.load(tmp_path / "checkpoint", like=buffer.init(ITEM))
  got = jax.device_get(buffer.sample(state, jax.random.key(4), BATCH))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(a, b)
  storage.sync()
  assert json.loads((directory / records.MANIFEST).read_text())["format"] == records.FORMAT
  assert not (directory / "pixels.crc").exists()
  storage.close()


# --- Prefetching while adding; older states --------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_a_prefetch_while_the_loop_adds_returns_the_submitted_states_rows(tmp_path, enabled):
  # The guide's loop: submit, add (overwriting rows the draw may read),
  # result. A device-tier twin given the same adds and keys says what each
  # batch must be, bit for bit.
  storage, buffer, state = filled(tmp_path / "payload")
  device = jaxbuf.uniform_replay(CAPACITY)
  twin = device.add(device.init(ITEM), items(0, CAPACITY))
  rng = np.random.default_rng(0)
  serial = CAPACITY
  with jaxbuf.Prefetcher(buffer.sample, enabled=enabled) as prefetcher:
    for step in range(40 if enabled else 12):
      key = jax.random.key(step)
      prefetcher.submit(state, key, BATCH)
      want = jax.device_get(device.sample(twin, key, BATCH))
      if rng.random() < 0.5:
        time.sleep(rng.random() * 2e-3)  # the draw before or during the add
      count = int(rng.choice([2, 5]))  # two add shapes: two compilations
      state = buffer.add(state, items(serial, count))
      twin = device.add(twin, items(serial, count))
      serial += count
      batch = prefetcher.result(timeout=120)
      assert_rows_match_their_items(batch)
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(batch))):
        np.testing.assert_array_equal(a, b)
    prefetcher.submit(state, jax.random.key(0), BATCH)  # closed before its result
  # Old rows are kept only while a read needs them; every reservation ended.
  assert storage.files._retained == {} and not storage.files._readers
  storage.close()


def test_an_older_state_sampled_after_a_newer_add_refuses_rather_than_mix(tmp_path):
  storage, buffer, older = filled(tmp_path / "payload")
  newer = buffer.add(older, items(CAPACITY, 20))
  refused = 0
  for step in range(20):
    try:
      batch = buffer.sample(older, jax.random.key(step), BATCH)
    except OSError as error:
      assert error.errno == errno.ESTALE and "not in the payload files" in str(error)
      refused += 1
      continue
    assert_rows_match_their_items(batch)  # drew only rows not rewritten
    assert (np.asarray(batch.indices) >= 20).all()
  assert refused >= 15
  assert_rows_match_their_items(buffer.sample(newer, jax.random.key(0), 64))
  storage.close()


def test_a_prefetch_in_a_thread_while_another_thread_adds(tmp_path):
  # Reads and writes in two threads at once: every batch whole and of the
  # submitted state's items, whatever the interleaving.
  storage, buffer, state = filled(tmp_path / "payload")
  states = [state]
  lock = threading.Lock()
  stop = threading.Event()
  errors = []

  def writer():
    serial = CAPACITY
    try:
      while not stop.is_set():
        with lock:  # each add on the newest state (one state lineage)
          states.append(buffer.add(states[-1], items(serial, 3)))
        serial += 3
    except BaseException as error:  # reported below
      errors.append(error)

  thread = threading.Thread(target=writer, daemon=True)
  thread.start()
  try:
    with jaxbuf.Prefetcher(buffer.sample) as prefetcher:
      for step in range(40):
        with lock:  # the newest state, reserved before the next add
          prefetcher.submit(states[-1], jax.random.key(step), BATCH)
        batch = prefetcher.result(timeout=120)
        assert_rows_match_their_items(batch)
  finally:
    stop.set()
    thread.join(timeout=120)
  assert not thread.is_alive() and not errors, errors
  assert len(states) > 1
  storage.close()


# --- Draws that fall on lost rows, every tiered kind -------------------------------


def encoded(serial: np.ndarray) -> np.ndarray:
  """uint8 `[..., 8, 8]` frames that hold `serial` (int32 16 times)."""
  serial = np.asarray(serial, np.int32)
  return np.repeat(serial[..., None], 16, -1).view(np.uint8).reshape(serial.shape + (8, 8))


def decoded(frames: np.ndarray) -> np.ndarray:
  """The serial each frame `[..., 8, 8]` holds (0: padding); raises on a torn frame."""
  words = np.ascontiguousarray(frames).reshape(frames.shape[:-2] + (64,)).view(np.int32)
  assert (words == words[..., :1]).all(), "a frame of two rows"
  return words[..., 0]


STEP = {
  "obs": jnp.zeros((8, 8), jnp.uint8),
  "action": jnp.int32(0),  # the serial, on the device
  "reward": jnp.float32(0),
  "terminated": jnp.bool_(False),
}
KINDS = {
  "uniform": (lambda storage: jaxbuf.uniform_replay(CAPACITY, storage=storage), False),
  "prioritized": (
    lambda storage: jaxbuf.prioritized_replay(CAPACITY, alpha=1.0, storage=storage),
    False,
  ),
  "sequence": (lambda storage: jaxbuf.sequence_replay(2, CAPACITY, 3, storage=storage), True),
  "frame_stack": (lambda storage: jaxbuf.frame_stack_replay(2, CAPACITY, 3, storage=storage), True),
}


def _steps(first: int, count: int) -> dict:
  serial = first + np.arange(2)[:, None] * 1000 + np.arange(count)[None, :]
  return {
    "obs": encoded(serial),
    "action": serial.astype(np.int32),
    "reward": np.zeros((2, count), np.float32),
    "terminated": np.zeros((2, count), bool),
  }


# The stream kinds compile for longer: with the slow tests.
@pytest.mark.parametrize(
  "name",
  [pytest.param(name, marks=pytest.mark.slow if KINDS[name][1] else ()) for name in sorted(KINDS)],
)
def test_draws_that_fall_on_lost_rows_are_drawn_again(tmp_path, name):
  make, streams = KINDS[name]

  def data(first, count):
    if streams:
      return _steps(first, count)
    serial = np.arange(first, first + count, dtype=np.int32)
    return {
      "obs": encoded(serial),
      "action": serial,
      "reward": np.zeros(count, np.float32),
      "terminated": np.zeros(count, bool),
    }

  storage = jaxbuf.disk(tmp_path / "payload")
  buffer = make(storage)
  state = buffer.add(buffer.init(STEP), data(1, 16 if streams else CAPACITY))  # full
  jaxbuf.save(tmp_path / "checkpoint", state)
  storage.sync()
  buffer.add(state, data(100, 5 if streams else 10))  # the oldest rewritten,
  storage.close()  # and no sync: what a kill leaves
  storage = jaxbuf.disk(tmp_path / "payload")
  buffer = make(storage)
  with pytest.warns(UserWarning, match=f"{10} rows no longer match"):
    state = jaxbuf.load(tmp_path / "checkpoint", like=buffer.init(STEP))
  lost = storage.lost_rows()
  serials = np.asarray(state.storage["action"]).reshape(-1)
  lost_serials = set(serials[lost].tolist())
  if name == "prioritized":  # priorities 1..4: drawn in proportion, over the rows kept
    state = buffer.update_priorities(
      state, jnp.arange(CAPACITY), jnp.asarray(1.0 + np.arange(CAPACITY) % 4, jnp.float32)
    )
  counts = np.zeros(CAPACITY)
  for step in range(40):
    batch = buffer.sample(state, jax.random.key(step), 64)
    frames = np.asarray(batch.items.obs if name == "frame_stack" else batch.items["obs"])
    if name == "frame_stack":
      frames = np.moveaxis(frames, -1, 1)  # [S, K, 8, 8]
    found = decoded(frames)
    assert not set(found.reshape(-1).tolist()) & lost_serials, "a lost row was read"
    if not streams:
      np.testing.assert_array_equal(found, np.asarray(batch.items["action"]))
      np.add.at(counts, np.asarray(batch.indices), 1)
    elif name == "sequence":  # windows of consecutive steps of one env
      np.testing.assert_array_equal(found, np.asarray(batch.items["action"]))
      np.testing.assert_array_equal(np.diff(found, axis=1), 1)
  if not streams:
    kept = np.setdiff1d(np.arange(CAPACITY), lost)
    assert counts[lost].sum() == 0
    weights = np.ones(CAPACITY) if name == "uniform" else 1.0 + np.arange(CAPACITY) % 4
    expected = counts.sum() * weights[kept] / weights[kept].sum()
    statistic = ((counts[kept] - expected) ** 2 / expected).sum()
    assert statistic < stats.chi2.ppf(1 - 1e-4, len(kept) - 1), statistic
  storage.close()
