"""Tensor parallelism: one model over N ranks, each holding its share of every layer's heads.

layers.py holds the parallel modules (row-parallel linear, vocabulary-parallel embedding and LM
head, a norm over heads spread across ranks), shard.py how each family's weights are split by
head at load time, ranks.py the processes: rank 0 runs the scheduler and the engine (all the
bookkeeping) and every call of its ModelRunner runs on every rank's runner, each over its shard;
entries.py how a worker's entries travel between processes: one bundle of every rank's slice.
"""
