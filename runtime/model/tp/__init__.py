"""Tensor parallelism inside a pipeline stage (docs/tp.md): which slice of every tensor a TP rank
holds (:mod:`.shard`), the TP group's collectives (:mod:`.comm`) and the sharded stage (:mod:`.stage`)."""
