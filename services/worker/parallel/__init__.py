"""Tensor parallelism (docs/parallelism.md): the communicator (comm.py), the plan hand-off
(plan_channel.py), the shard math over checkpoint tensors (shard.py), the sharded layers
swapped into a built model (layers.py), and starting and following the other ranks (ranks.py,
follower.py).

The scheduler never sees ranks: rank 0 is the worker process, which receives each plan over its
socket and forwards it to the others; every rank runs the same step and samples the same
tokens, and only rank 0 answers. With tensor_parallel_size 1 none of this runs in a step.
"""
