"""Rate limiters with Reverb's meaning: when actors may insert and learners
may sample, from two counts (units inserted, rows sampled) and two
predicates. Pure host values: no locks, no waiting (the service waits).

Every limiter is Reverb's one rule with its own window. With `inserts`
units inserted and `samples` rows sampled so far, `diff = inserts *
samples_per_insert - samples`:

* sampling `b` rows is allowed once `inserts >= min_size` and
  `diff - b >= min_diff`;
* inserting `n` units is allowed while `inserts + n <= min_size` or
  `diff + n * samples_per_insert <= max_diff`.

`MinSize(m)`: samples_per_insert 1, window (-inf, inf): inserts never wait.
`SampleToInsertRatio(r, m, e)`: the window `m * r +- e`. `Queue(k)`:
samples_per_insert 1, min_size 1, window `[0, k]`: at most `k` unread units,
each sampled once.

Liveness. Inserts of `n` units and samples of `b` rows are both blocked
when the diff lies in `(max_diff - n * samples_per_insert, min_diff + b)`
(neither may move). A limiter whose window is too
narrow for even one unit and one row is refused when made, and the service
refuses a call whose size, with the largest size seen on the other side,
could block both sides (`check_sizes`).
"""

import dataclasses
import math
from typing import NamedTuple


class RateCounts(NamedTuple):
  """What a limiter decides from: units inserted and rows sampled so far."""

  inserts: int
  samples: int


def _number(value: float, name: str, *, at_least: float, infinite: bool = False) -> float:
  """`value` as a float, refused when NaN, too small, or infinite (unless allowed)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{name} must be a number; given {value!r} ({type(value).__name__}).")
  value = float(value)
  if math.isnan(value) or value < at_least or (math.isinf(value) and not infinite):
    bound = f">= {at_least}" + ("" if infinite else " and finite")
    raise ValueError(f"{name} must be {bound}; given {value}.")
  return value


def _count(value: int, name: str, *, at_least: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
    raise ValueError(f"{name} must be an int >= {at_least}; given {value!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class RateLimiter:
  """Reverb's rate limiter: the window the diff stays in (module docstring).

  The public limiters are `MinSize`, `SampleToInsertRatio` and `Queue`;
  this base holds the rule they share.
  """

  samples_per_insert: float
  min_size: int
  min_diff: float
  max_diff: float
  fifo: bool = False  # Queue: rows drawn oldest unread first, each once

  def can_insert(self, counts: RateCounts, units: int) -> bool:
    """Whether `units` more may be inserted now."""
    inserts = counts.inserts + units
    if inserts <= self.min_size:
      return True
    return inserts * self.samples_per_insert - counts.samples <= self.max_diff

  def can_sample(self, counts: RateCounts, rows: int) -> bool:
    """Whether `rows` more may be sampled now."""
    if counts.inserts < self.min_size:
      return False
    return counts.inserts * self.samples_per_insert - counts.samples - rows >= self.min_diff

  def check_sizes(self, insert_units: int, sample_rows: int) -> None:
    """Refuses sizes that could block inserts and samples at once.

    Args:
      insert_units: the largest insert (units in one add).
      sample_rows: the largest sample (rows in one call).

    Raises:
      ValueError: some reachable diff blocks both an insert of
        `insert_units` and a sample of `sample_rows` (module docstring), or
        an insert of `insert_units` could not reach `min_size`.
    """
    if math.isinf(self.max_diff) or math.isinf(self.min_diff):
      return
    ratio = self.samples_per_insert
    above = self.max_diff - insert_units * ratio  # inserts blocked above this diff
    below = self.min_diff + sample_rows  # samples blocked below this diff
    if ratio.is_integer():  # the diff is an integer: only integers between count
      both_blocked = math.floor(above) + 1 <= math.ceil(below) - 1
    else:
      both_blocked = above < below
    starved = (insert_units - 1) * ratio > self.max_diff - self.min_size * ratio
    if both_blocked or starved:
      raise ValueError(
        f"{self!r}: adds of {insert_units} units and samples of {sample_rows} rows could "
        f"block each other forever (the window max_diff - min_diff = "
        f"{self.max_diff - self.min_diff} is too narrow for them). Use smaller adds or "
        f"samples, or a larger error_buffer / max_size."
      )

  def restored(self, counts: RateCounts) -> RateCounts:
    """The counts to restore a checkpoint's `counts` with, never blocked.

    The rule (Reverb#103 restored a limiter that blocked both sides): the
    counts are kept when one unit may be inserted or one row sampled;
    otherwise the sample count is raised until one unit may be inserted
    (as if the learner had sampled that much more; actors go on first).
    Counts saved by a service never need it; a checkpoint restored under
    another limiter may.
    """
    if self.can_insert(counts, 1) or self.can_sample(counts, 1):
      return counts
    samples = math.ceil((counts.inserts + 1) * self.samples_per_insert - self.max_diff)
    return RateCounts(counts.inserts, max(counts.samples, samples))


def MinSize(min_size: int) -> RateLimiter:  # noqa: N802 (Reverb's name; a limiter class)
  """Samples wait until `min_size` units were inserted; inserts never wait.

  Args:
    min_size: units inserted before the first sample, an int >= 1.

  >>> import jaxbuf
  >>> jaxbuf.MinSize(100).can_sample(jaxbuf.RateCounts(99, 0), 32)
  False
  """
  min_size = _count(min_size, "MinSize: min_size", at_least=1)
  return RateLimiter(1.0, min_size, -math.inf, math.inf)


def SampleToInsertRatio(  # noqa: N802 (Reverb's name; a limiter class)
  samples_per_insert: float, min_size: int, error_buffer: float
) -> RateLimiter:
  """Keeps rows sampled per unit inserted near `samples_per_insert`.

  Args:
    samples_per_insert: the target replay ratio, > 0 and finite.
    min_size: units inserted before the first sample, an int >= 1.
    error_buffer: how far `inserts * samples_per_insert - samples` may
      stray from `min_size * samples_per_insert` either way, at least
      `max(1, samples_per_insert)` (else no insert and sample could both
      ever run); add room for the batch sizes used (`check_sizes`).

  >>> import jaxbuf
  >>> limiter = jaxbuf.SampleToInsertRatio(4.0, min_size=10, error_buffer=64.0)
  >>> limiter.can_sample(jaxbuf.RateCounts(inserts=10, samples=0), 32)
  True
  """
  what = "SampleToInsertRatio"
  ratio = _number(samples_per_insert, f"{what}: samples_per_insert", at_least=0.0)
  if ratio == 0:
    raise ValueError(f"{what}: samples_per_insert must be > 0; given 0.0.")
  min_size = _count(min_size, f"{what}: min_size", at_least=1)
  error = _number(error_buffer, f"{what}: error_buffer", at_least=0.0, infinite=True)
  if error < max(1.0, ratio):
    raise ValueError(
      f"{what}: error_buffer must be at least max(1, samples_per_insert) = "
      f"{max(1.0, ratio)}, else inserts and samples can block each other forever; "
      f"given {error}."
    )
  center = min_size * ratio
  return RateLimiter(ratio, min_size, center - error, center + error)


def Queue(max_size: int) -> RateLimiter:  # noqa: N802 (Reverb's name; a limiter class)
  """FIFO: at most `max_size` unread units; each unit is sampled once.

  Inserts wait while `max_size` units are unread; samples wait until as
  many unread units as rows are held.

  Args:
    max_size: unread units held at most, an int >= 1.

  >>> import jaxbuf
  >>> jaxbuf.Queue(4).can_insert(jaxbuf.RateCounts(inserts=4, samples=0), 1)
  False
  """
  max_size = _count(max_size, "Queue: max_size", at_least=1)
  return RateLimiter(1.0, 1, 0.0, float(max_size), fifo=True)
