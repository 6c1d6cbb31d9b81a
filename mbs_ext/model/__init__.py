"""The model's floor: what every part of a step uses about the model and its options, below
streaming, counts, memory, the world and the step (docs/design.md, "Floors").

:mod:`~mbs_ext.model.options` (``StepOptions``: every option, its default and its check),
:mod:`~mbs_ext.model.members` (the parameters, buffers and device, the grad-mode, optimizer and
scaler checks), :mod:`~mbs_ext.model.grads` (the gradient sinks over the fused op),
:mod:`~mbs_ext.model.rollback` (snapshots that undo a step), and BatchNorm over a step
(:mod:`~mbs_ext.model.batchnorm` and the statistics rows it defers into).

Nothing is imported here: the package's modules are imported by name.
"""
