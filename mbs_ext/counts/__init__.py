"""Counts and losses (floor 4): how a loss function is called and what it averages over
(:mod:`~mbs_ext.counts.loss`), where each micro-batch's count comes from
(:mod:`~mbs_ext.counts.sources`), how counts weigh micro-batches and settle into the exact
mini-batch loss (:mod:`~mbs_ext.counts.normalize`, :mod:`~mbs_ext.counts.ledger`), and whether a
loss averages over the count given (:mod:`~mbs_ext.counts.agreement`). The losses that couple rows
run steps of their own and live with the step (:mod:`~mbs_ext.step.cached`,
:mod:`~mbs_ext.step.streamable`).

Nothing is imported here: the package's modules are imported by name.
"""
