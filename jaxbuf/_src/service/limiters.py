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
(neither may move). A limiter whose window is too narrow for even one unit
and one row is refused when made; the service refuses a call that can never
run (`check_size`), and tells callers that all wait on each other, none
under way, at once (`deadlock`): sizes that could meet there (`check_sizes`
walks the lattice they generate) are not refused, since one thread alone,
or callers in another order, may never reach it.
"""

import dataclasses
import fractions
import math
from typing import Iterable, NamedTuple


_MOST_DIFFS = 100_000  # diffs walked to find the reachable ones; past it, the lattice


def _reachable_blocked(
  origin: int,
  insert_steps: list[int],
  sample_steps: list[int],
  window: tuple[int, int],
  waits: tuple[int, int],
  lattice: int,
) -> int | None:
  """A diff (scaled to an integer) reachable from `origin` by the steps,
  inserts never past `window[1]` nor samples below `window[0]`, where both
  wait (strictly between `waits`); None when there is none. Walks the
  reachable diffs; a window too wide for that takes every lattice point in
  it as reachable (refuses more, never less)."""
  low, high = window
  above, below = waits
  if (high - low) // lattice > _MOST_DIFFS:
    first = above + 1 + (origin - above - 1) % lattice  # the first lattice point > above
    return first if first < below else None
  seen, frontier = {origin}, [origin]
  while frontier:
    diff = frontier.pop()
    if above < diff < below:
      return diff
    moves = [diff + step for step in insert_steps if diff + step <= high]
    moves += [diff - step for step in sample_steps if diff - step >= low]
    for move in moves:
      if move not in seen:
        seen.add(move)
        frontier.append(move)
  return None


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

  def check_sizes(
    self,
    insert_sizes: int | Iterable[int],
    sample_sizes: int | Iterable[int],
    start: RateCounts | None = None,
  ) -> None:
    """Refuses sizes with which inserts and samples can block each other.

    The diff moves by `n * samples_per_insert` per insert of `n` units and
    by `-b` per sample of `b` rows, so from the counts at `start` it only
    takes values on the lattice those steps generate (their greatest common
    divisor apart). Sizes are refused when a lattice point lies where the
    largest insert and the largest sample both wait (module docstring):
    adds of B and samples of B under `Queue(B)` keep the diff on 0, B, ...
    and run; adds of 3 and samples of 4 under `Queue(4)` reach 3 unread,
    where neither may move.

    Args:
      insert_sizes: the sizes of the inserts used (units in one add), or
        the largest one.
      sample_sizes: the sizes of the samples used (rows in one call), or the
        largest one.
      start: the counts the diff started from (a restored service's);
        None: no counts.

    Raises:
      ValueError: a reachable diff blocks both the largest insert and the
        largest sample, or an insert could not reach `min_size`; the
        message names the sizes, the diff and the fix.
    """
    start = start or RateCounts(0, 0)
    inserts = sorted({insert_sizes} if isinstance(insert_sizes, int) else set(insert_sizes))
    samples = sorted({sample_sizes} if isinstance(sample_sizes, int) else set(sample_sizes))
    ratio = fractions.Fraction(self.samples_per_insert)
    name = self._name()
    if math.isinf(self.max_diff) or math.isinf(self.min_diff):
      return
    if inserts:
      self.check_size(insert=inserts[-1])
    if not inserts or not samples:
      return
    largest_insert, largest_sample = inserts[-1], samples[-1]
    # Scaled by q, the diff's steps and bounds are integers (floats are exact).
    steps = [n * ratio for n in inserts] + [fractions.Fraction(b) for b in samples]
    q = math.lcm(*(step.denominator for step in steps))
    q = math.lcm(q, fractions.Fraction(self.max_diff).denominator)
    q = math.lcm(q, fractions.Fraction(self.min_diff).denominator)
    q = math.lcm(q, (start.inserts * ratio).denominator)
    lattice = math.gcd(*(int(step * q) for step in steps))
    origin = int((start.inserts * ratio - start.samples) * q)
    # Inserts of the largest wait above `above`, samples of the largest below
    # `below` (scaled): both wait on the integers strictly between.
    above = int((fractions.Fraction(self.max_diff) - largest_insert * ratio) * q)
    below = int((fractions.Fraction(self.min_diff) + largest_sample) * q)
    blocked = _reachable_blocked(
      origin,
      [int(n * ratio * q) for n in inserts],
      [b * q for b in samples],
      (int(fractions.Fraction(self.min_diff) * q), int(fractions.Fraction(self.max_diff) * q)),
      (above, below),
      lattice,
    )
    if blocked is not None:
      diff = fractions.Fraction(blocked, q)
      where = (
        f"{diff} units unread"
        if self.fifo
        else f"the diff inserts * samples_per_insert - samples = {float(diff)}"
      )
      raise ValueError(
        f"{name}: adds of {inserts} units and samples of {samples} rows can block each other "
        f"forever: they can reach {where}, where an add of {largest_insert} waits (it needs "
        f"the diff at most {self.max_diff - largest_insert * self.samples_per_insert}) and a "
        f"sample of {largest_sample} waits (it needs at least "
        f"{self.min_diff + largest_sample}). Use sizes that divide one another (adds of B "
        f"and samples of B, or of B / 2), or a larger error_buffer / max_size."
      )

  def check_size(self, *, insert: int = 0, sample: int = 0) -> None:
    """Refuses a call that can never run, whatever else is called: an
    insert of `insert` units that would pass `max_diff` before `min_size`
    units are in, a sample of `sample` rows that needs a diff above
    `max_diff` (which inserts never pass). The service refuses these before
    waiting; sizes that deadlock only together it detects as they wait
    (`deadlock`).

    Raises:
      ValueError: naming the size, the limit it passes and the fix.
    """
    if math.isinf(self.max_diff) or math.isinf(self.min_diff):
      return
    ratio = fractions.Fraction(self.samples_per_insert)
    name = self._name()
    if insert and (insert - 1) * ratio > fractions.Fraction(self.max_diff) - self.min_size * ratio:
      raise ValueError(
        f"{name}: an add of {insert} units can never be inserted before min_size = "
        f"{self.min_size} units are in (it would pass max_diff = {self.max_diff}). Use adds "
        f"of at most {self._largest_first_insert()} units, or a larger error_buffer / max_size."
      )
    if sample and self.min_diff + sample > self.max_diff:
      held = "at most max_size units are unread" if self.fifo else "inserts stop there"
      raise ValueError(
        f"{name}: a sample of {sample} rows can never run: it needs the diff at least "
        f"{self.min_diff + sample}, above max_diff = {self.max_diff} ({held}). Sample at "
        f"most {int(math.floor(self.max_diff - self.min_diff))} rows, or use a larger "
        f"error_buffer / max_size."
      )

  def deadlock(
    self, counts: RateCounts, insert_sizes: Iterable[int], sample_sizes: Iterable[int]
  ) -> str:
    """What to tell callers that all wait on each other at `counts`: no
    insert of `insert_sizes` and no sample of `sample_sizes` may run, and
    none is under way to move the counts."""
    inserts, samples = sorted(set(insert_sizes)), sorted(set(sample_sizes))
    diff = counts.inserts * self.samples_per_insert - counts.samples
    where = (
      f"{diff:g} units unread"
      if self.fifo
      else f"the diff inserts * samples_per_insert - samples = {diff:g}"
    )
    return (
      f"{self._name()}: adds of {inserts} units and samples of {samples} rows block each "
      f"other forever: every caller waits on the others and none is under way, at {where} "
      f"(counts {tuple(counts)}), where an add of {inserts[0]} waits (it needs the diff at "
      f"most {self.max_diff - inserts[0] * self.samples_per_insert:g}) and a sample of "
      f"{samples[0]} waits (it needs at least {self.min_diff + samples[0]:g}). Use sizes that "
      f"divide one another (adds of B and samples of B, or of B / 2), or a larger "
      f"error_buffer / max_size."
    )

  def _name(self) -> str:
    if self.fifo:
      return f"Queue({int(self.max_diff)})"
    if math.isinf(self.min_diff):
      return f"MinSize({self.min_size})"
    return repr(self)

  def _largest_first_insert(self) -> int:
    """The largest insert that can still reach `min_size` units."""
    room = self.max_diff - self.min_size * self.samples_per_insert
    return int(math.floor(room / self.samples_per_insert)) + 1

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
