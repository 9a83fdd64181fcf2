"""Serving side: ``pd_cluster`` is an emulated SGLang PD cluster on loopback (prefill and decode workers
that real gateways accept, run by the simulator in scaled wall time); ``replay`` replays a trace over
HTTP and measures it as SGLang's bench_serving does; ``gateways`` launches smg and sglang-router;
``emulated_worker`` is a single aggregated worker timed by the cost model; ``profiler`` measures
interference profiles on a live SGLang worker; ``sglang_plugin`` records the SGLang hook points. Not
built yet: Crossflow's own PD router and lease agents, and the plugin's hooks. May import
``interference_model``, ``policies`` and ``envs``; ``train`` may import it."""
