"""What every buffer kind stands on: the kind protocol (`kind`), the type
aliases (`pytypes`), the random bits (`random`), the trace-time checks
(`validation`), the binding of module functions into a `Buffer` (`base`), the
ring storage of items (`ring`), the sum tree of priorities (`sum_tree`), and
the helpers built on them alone (`cond`: `cond_update`; `spaces`:
`example_from_space`). The bottom layer: its modules import only one another
(`kind`, `pytypes` and `random` nothing of jaxbuf), never another subpackage.
"""
