"""The step itself (floor 7, above everything it sequences): the entry
(:mod:`~mbs_ext.step.streamer`: ``MicroBatchStreamer``, ``step``, ``accumulate``), what a streamer
keeps between steps (:mod:`~mbs_ext.step.cache`), one attempt at one micro-batch size
(:mod:`~mbs_ext.step.attempt`), the pass (:mod:`~mbs_ext.step.forward_backward`), the finish
(:mod:`~mbs_ext.step.finish`), the first step's count check (:mod:`~mbs_ext.step.count_check`),
and what runs steps for a loss: ``CachedLoss`` (:mod:`~mbs_ext.step.cached`) and
``check_streamable`` (:mod:`~mbs_ext.step.streamable`). Options, the model's members, gradient
sinks, rollback and BatchNorm are one floor down (:mod:`mbs_ext.model`).

Nothing is imported here: the package's modules are imported by name, so that a component
can use one of them without loading the whole step.
"""
