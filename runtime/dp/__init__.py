"""Data parallelism (``--dp N``): N independent pipelines behind one router (issue #14)."""
