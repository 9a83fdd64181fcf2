"""The SGLang 0.5.23 worker plugin for decode-local prefill, and its checks without a GPU.

* ``hooks``: the entry point (``sglang.srt.plugins``: ``crossflow``) and the hooks it installs
  through SGLang's ``HookRegistry``;
* ``local_prefill``: the per-scheduler state the hooks share, every decision made by ``policies``;
* ``wire``: what a router or lease agent sends and reads (the ``do_local_prefill`` marker, lease
  updates over ``/set_internal_state``, ``NodeState`` in ``/server_info``);
* ``snapshot`` and ``contract``: what the plugin relies on in SGLang, checked against the committed
  ``sglang_0.5.23_hooks.json`` (extracted from the wheel with ``ast``) in every test run;
* ``lookalike``: a look-alike of the 0.5.23 decode scheduler to run the hooks on without a GPU.

Nothing here imports SGLang until SGLang calls ``hooks.load`` (see docs/serving.md).
"""
