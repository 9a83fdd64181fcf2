"""The policies people would pick instead of Crossflow, each written from its public rule.

One module per peer; importing this package registers them all (``policies/__init__`` does). Every
peer sends work to decode nodes without a lease (the ``local`` path: chunked prefill mixed into the
node's decode iterations, at a chunk size it tunes), bounded only by its own rule. Their sources,
rules and tuned values are listed in ``docs/compare.md``.
"""

from __future__ import annotations

from policies.peers import deflect, dynamo, hindsight, llmd, trtllm

__all__ = ["deflect", "dynamo", "hindsight", "llmd", "trtllm"]
