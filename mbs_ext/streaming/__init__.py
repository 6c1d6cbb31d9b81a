"""Streaming: what a batch is and how it is checked and cut (:mod:`~mbs_ext.streaming.batch`),
and the ring that stages micro-batches to the device while the previous one computes
(:mod:`~mbs_ext.streaming.ring`).

Nothing is imported here: the package's modules are imported by name.
"""
