"""The SGLang worker plugin for decode-local prefill (not written yet) and its checks without a GPU.

``snapshot`` extracts, from SGLang 0.5.23's wheel and without importing it, the signatures and ``self``
attributes of the scheduler methods the plugin will hook; the committed ``sglang_0.5.23_hooks.json``
is what the plugin is checked against in every test run (see docs/serving.md for what each hook will
receive and must do). Imports nothing from SGLang.
"""
