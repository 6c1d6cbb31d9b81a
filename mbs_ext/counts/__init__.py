"""Counts and losses: how a loss function is called and what it averages over
(:mod:`~mbs_ext.counts.loss`), where each micro-batch's count comes from
(:mod:`~mbs_ext.counts.sources`), how counts weigh micro-batches and settle into the exact
mini-batch loss (:mod:`~mbs_ext.counts.normalize`), and the losses that couple rows
(:mod:`~mbs_ext.counts.cached`: gradient caching; :mod:`~mbs_ext.step.streamable`: the check
that says whether a loss adds up over rows).

Nothing is imported here: the package's modules are imported by name.
"""
