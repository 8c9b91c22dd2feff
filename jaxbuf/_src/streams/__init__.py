"""Replay of per-env streams of steps, sampled as windows, transitions or
whole episodes: sequence replay (`sequence`) and its prioritized form
(`prioritized_sequence`), episode (`episode`), frame-stack (`frames`) and
hindsight (`hindsight`) replay, the n-step transitions read from sampled
windows (`transitions`), flashbax's flat-buffer pairs of consecutive steps
(`pairs`), and the stream convention they all follow
(`convention`, public as `jaxbuf.streams`). Beside the kinds, from the
bottom up: the rules of their priority updates (`window_priorities`, below
`sequence`), each kind's split over devices (`device_split`, above the
kinds) and the factories that bind a kind's functions and split into a
`Buffer` (`factories`, on top). Above `core` and `items` (the prioritized
kinds use `items.prioritized`); `offline` builds on `sequence`.
"""
