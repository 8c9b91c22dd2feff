"""Offline datasets: how Minari's and RLDS's episodes map onto jaxbuf's items
and streams (`mapping`, public as `jaxbuf.offline`), loading episodes into a
buffer in chunks (`loading`), reading them back from a state
(`held_episodes`), and the two formats (`rlds_steps`, `minari_datasets`). A
top layer: above `core` and `streams`.
"""
