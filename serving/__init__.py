"""Serving side: ``profiler`` measures interference profiles on a live SGLang worker over HTTP;
``emulated_worker`` is an SGLang-like worker timed by the cost model (tests, laptops). Not built yet:
the PD router that speaks SGLang's protocol and runs ``policies.ClusterScheduler``, the decode-side
lease agent and the SGLang worker plugin. May import ``interference_model``, ``policies`` and
``envs``; ``train`` may import it."""
