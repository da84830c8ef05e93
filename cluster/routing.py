"""Where the data-parallel router sends a request: to the replica holding its prefix.

Each replica has its own prefix cache, so a request should go where its prefix was computed.
``PrefixPolicy`` keys a request by the chained hash (``kv.hashing``, cache salt included) of its
first ``prefix_blocks`` full blocks and sends it to the replica that key is **sticky** to; a
key seen for the first time is placed by rendezvous hashing over the healthy replicas, so
placement is stable and spreads evenly. The preferred replica is overridden when it is much
busier than the least loaded one (``load > overload_factor * least + overload_slack``): the
request then goes to the least loaded replica, and the key becomes sticky there. Prompts
shorter than one block carry no reusable prefix and go to the least loaded replica.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from pagedserve.kv.hashing import BlockHasher

__all__ = ["PrefixPolicy"]


class PrefixPolicy:
    """The placement decision (see the module docstring); its caller serializes the calls
    and supplies the load, what it has in flight on each replica."""

    def __init__(self, block_size: int, *, prefix_blocks: int = 2, overload_factor: float = 2.0,
                 overload_slack: int = 16, max_sticky: int = 100_000) -> None:
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.overload_factor = overload_factor
        self.overload_slack = overload_slack
        self._hasher = BlockHasher(block_size)
        self._sticky: OrderedDict[bytes, int] = OrderedDict()
        self._max_sticky = max_sticky

    def prefix_key(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> bytes | None:
        full = min(len(prompt_token_ids) // self.block_size, self.prefix_blocks)
        if full == 0:
            return None
        hashes: list[bytes] = []
        self._hasher.extend(hashes, list(prompt_token_ids[: full * self.block_size]), cache_salt)
        return hashes[-1]

    def choose(
        self, key: bytes | None, healthy: list[int], load: Sequence[int]
    ) -> tuple[int | None, str]:
        """``(replica, reason)`` for a request of ``key`` among the ``healthy`` replicas
        (None when there are none); reason one of ``prefix``, ``new-prefix``, ``overload``,
        ``no-prefix``."""
        if not healthy:
            return None, ""
        least = min(healthy, key=lambda i: load[i])
        if key is None:
            return least, "no-prefix"
        preferred = self._sticky.get(key)
        reason = "prefix"
        if preferred is None or preferred not in healthy:
            preferred = max(healthy, key=lambda i: hashlib.sha256(key + bytes([i % 256])).digest())
            reason = "new-prefix"
        limit = self.overload_factor * load[least] + self.overload_slack
        if preferred != least and load[preferred] > limit:
            preferred, reason = least, "overload"
        self._sticky[key] = preferred
        self._sticky.move_to_end(key)
        while len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)
        return preferred, reason
