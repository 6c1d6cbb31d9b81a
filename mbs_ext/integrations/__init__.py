"""Streaming inside the frameworks people train with: ``mbs_ext.integrations.lightning`` and
``mbs_ext.integrations.transformers``. Each imports its framework on first use only; ``import
mbs_ext`` never imports a framework."""
