"""Replay of independent items: `uniform_replay` (`uniform`) and
`prioritized_replay` (`prioritized`), each item sampled on its own from the
ring storage. Above `core` and importing nothing else; the stream kinds and
`jaxbuf.sharded` build on `prioritized`.
"""
