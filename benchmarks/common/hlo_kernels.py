"""Kernels per iteration of a fused loop, counted in XLA's compiled HLO text.

`jax.jit(f).lower(...).compile().as_text()` is the program after XLA's
fusion passes: each `fusion`, `custom-call` (a Pallas kernel, a library
call), `copy`, unfused `gather` or `scatter` of it is one kernel launch on a
GPU (one loop nest on the CPU). The count is of the body of the loop that
runs a fused loop's iterations, so a reader sees launches, not guesses.
"""

import itertools
import re

# HLO instructions that launch nothing: plumbing of values and buffers.
NOT_LAUNCHED = frozenset(
  "parameter get-tuple-element tuple constant bitcast after-all opt-barrier "
  "partition-id replica-id copy-done".split()
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.*)$")
# A computation's header is the one unindented line that opens a block.
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _opcode_and_attributes(right: str) -> tuple[str, str]:
  """The opcode and the rest of an instruction, after `name = `."""
  end = right.index(" ")
  if right.startswith("("):  # a tuple shape: up to its balanced closing parenthesis
    depths = itertools.accumulate({"(": 1, ")": -1}.get(character, 0) for character in right)
    end = next(index for index, depth in enumerate(depths) if depth == 0) + 1
  rest = right[end:].strip()
  return rest.split("(", 1)[0].strip(), rest


def computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
  """Each computation's (opcode, rest of line) instructions, and the entry's name."""
  found: dict[str, list[tuple[str, str]]] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith("HloModule"):
      current = header.group(2)
      found[current] = []
      entry = current if header.group(1) else entry
      continue
    instruction = _INSTRUCTION.match(line)
    if current is not None and instruction:
      found[current].append(_opcode_and_attributes(instruction.group(1)))
  return found, entry


def _called(rest: str, attribute: str) -> list[str]:
  match = re.search(rf"{attribute}=\{{?([%\w.\-, ]+)\}}?", rest)
  if not match:
    return []
  return [name.strip().lstrip("%") for name in match.group(1).split(",") if name.strip()]


def kernels_in(name: str, table: dict[str, list[tuple[str, str]]]) -> int:
  """Launches of one pass through computation `name`: a fusion or a custom
  call (a Pallas kernel, a library call) is one; a nested loop counts its
  body and condition once; a call counts what it calls; a conditional its
  largest branch."""
  count = 0
  for opcode, rest in table.get(name, []):
    if opcode in NOT_LAUNCHED:
      continue
    if opcode == "while":
      count += sum(kernels_in(c, table) for c in _called(rest, "body") + _called(rest, "condition"))
    elif opcode in ("call", "async-start"):
      count += sum(kernels_in(c, table) for c in _called(rest, "to_apply") + _called(rest, "calls"))
    elif opcode == "conditional":
      branches = _called(rest, "branch_computations") or (
        _called(rest, "true_computation") + _called(rest, "false_computation")
      )
      count += max((kernels_in(c, table) for c in branches), default=0)
    else:
      count += 1
  return count


def kernels_per_iteration(hlo_text: str, iterations: int) -> int | None:
  """Kernels one iteration of a fused loop launches: those of the body of
  the loop that runs `iterations` times (XLA's known trip count; else the
  largest loop), wherever the entry computation calls it from."""
  table, _ = computations(hlo_text)
  loops = [rest for body in table.values() for opcode, rest in body if opcode == "while"]
  if not loops:
    return None
  counted = [rest for rest in loops if f'"known_trip_count":{{"n":"{iterations}"}}' in rest]
  bodies = [_called(rest, "body")[0] for rest in (counted or loops)]
  return max(kernels_in(body, table) for body in bodies)
