"""Selection and eviction rules beyond uniform and prioritized replay, as
pure functions over the ring, its item ids and the sum tree: queues
(`queue`), a sample budget per item (`budget`), heap selection on priority
(`heap`) and keep-the-best eviction (`keep_best`)."""
