"""Serving side (not built yet): the PD router that speaks SGLang's protocol and runs the same
``policies.ClusterScheduler`` and ledger, the decode-side lease agent, the SGLang worker plugin for
local prefill, an SGLang-compatible emulated worker, and the real-GPU profiler. It may import
``interference_model``, ``policies`` and ``envs``; ``train`` may import it."""
