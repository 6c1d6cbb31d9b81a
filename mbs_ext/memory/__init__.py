"""Memory planning: ``micro_batch_size="auto"`` (:mod:`~mbs_ext.memory.planner`), the probes
that measure a micro-batch's peak (:mod:`~mbs_ext.memory.probe`), and out-of-memory back-off
(:mod:`~mbs_ext.memory.backoff`).

Nothing is imported here: the package's modules are imported by name.
"""
