"""Storage tiers: a buffer's payload in pinned host memory or in files
(issue 44). The disk tier's files, lock and prefetch thread are host code."""
