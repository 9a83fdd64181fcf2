"""Serving side: ``pd_cluster`` is an emulated SGLang PD cluster on loopback (prefill and decode workers
that real gateways accept, run by the simulator in scaled wall time); ``replay`` replays a trace over
HTTP and measures it as SGLang's bench_serving does; ``gateways`` launches smg and sglang-router;
``router`` is Crossflow's PD router and ``lease_agent`` its per-decode-worker reporters (``stack``
runs both over an emulated cluster); ``emulated_worker`` is a single aggregated worker timed by the
cost model; ``profiler`` measures interference profiles on a live SGLang worker; ``sglang_plugin`` is
the SGLang worker plugin. May import
``interference_model``, ``policies`` and ``envs``; ``train`` may import it."""
