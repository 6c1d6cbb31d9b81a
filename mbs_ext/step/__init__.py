"""The step itself: the entry (:mod:`~mbs_ext.step.streamer`: ``MicroBatchStreamer``, ``step``,
``accumulate``), its options and input checks (:mod:`~mbs_ext.model.options`,
:mod:`~mbs_ext.model.members`), what a streamer keeps between steps (:mod:`~mbs_ext.step.cache`),
one attempt at one micro-batch size (:mod:`~mbs_ext.step.attempt`), the pass
(:mod:`~mbs_ext.step.forward_backward`), the gradient sinks (:mod:`~mbs_ext.model.grads`), the
finish (:mod:`~mbs_ext.step.finish`), undoing a step (:mod:`~mbs_ext.model.rollback`) and
BatchNorm statistics deferred over a step (:mod:`~mbs_ext.model.batchnorm`).

Nothing is imported here: the package's modules are imported by name, so that a component
(the world, the planner) can use one of them without loading the whole step.
"""
