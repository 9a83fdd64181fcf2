"""Safe prefill throughput of a decode node, learned from interference profiles.

Modules, in pipeline order: ``schema`` (the versioned profile table), ``labels`` (profile -> safe
prefill tokens/s at an ITL target), ``fit`` (conservative LightGBM with grouped CV and a conformal
shift), ``baselines`` and ``evaluate`` (the report), ``artifact`` (save / load / W&B), ``predictor``
(the fast hot-path evaluator). This package imports no other Crossflow package.
"""
