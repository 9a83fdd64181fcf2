"""Inter-token latencies without keeping every iteration: exact mean and counts, quantiles to 0.05 %.

A long replay runs tens of millions of decode iterations; storing each one's time (and the tokens it
produced) for the ITL quantiles cost 3.65 GB for a million requests. ``ItlHistogram`` keeps instead:

* the token-weighted sum of iteration times in integer nanoseconds and the token count, so the mean
  is exact to the nanosecond and independent of the order iterations are added in;
* a histogram with logarithmic buckets: an iteration of ``v`` ns lands in the bucket of its top
  ``MANTISSA_BITS`` bits, so every value in a bucket is within ``2 ** -(MANTISSA_BITS - 1)`` of the
  bucket's low edge, and a quantile answered with the bucket's midpoint is within
  ``QUANTILE_RELATIVE_ERROR`` (0.05 %) of the exact weighted quantile
  (``tests/test_itl.py`` checks this bound against an exact computation).

Scalars and numpy arrays go through the same integer arithmetic, so adding a jump of identical
iterations at once or one by one gives identical results.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MANTISSA_BITS = 11
"""Bits of an iteration's nanosecond count that pick its bucket."""
QUANTILE_RELATIVE_ERROR = 2.0**-MANTISSA_BITS
"""Bound on ``|answered - exact| / exact`` for every quantile (bucket half-width over its low edge)."""
_SHIFT_BITS = 32


def to_ns(seconds: float) -> int:
    """Seconds to whole nanoseconds, rounding half to even (as ``numpy.rint``)."""
    return round(seconds * 1e9)


def bucket_of(value_ns: int) -> int:
    """The bucket key of one value in nanoseconds (values below 1 ns share bucket 0)."""
    if value_ns <= 0:
        return 0
    shift = max(0, value_ns.bit_length() - MANTISSA_BITS)
    return (shift << _SHIFT_BITS) | (value_ns >> shift)


def buckets_of(values_ns: np.ndarray) -> np.ndarray:
    """``bucket_of`` for an int64 array (identical results: exponents from ``frexp`` are exact)."""
    v = np.maximum(values_ns, 0)
    _, exponent = np.frexp(v.astype(np.float64))
    shift = np.maximum(exponent.astype(np.int64) - MANTISSA_BITS, 0)
    keys = (shift << _SHIFT_BITS) | (v >> shift)
    return np.where(v > 0, keys, 0)


def _bucket_end_ns(key: int) -> int:
    """The first nanosecond value above a bucket."""
    shift, top = key >> _SHIFT_BITS, key & ((1 << _SHIFT_BITS) - 1)
    return (top + 1) << shift


def bucket_value_s(key: int) -> float:
    """The midpoint of a bucket, in seconds."""
    shift, top = key >> _SHIFT_BITS, key & ((1 << _SHIFT_BITS) - 1)
    if key == 0:
        return 0.0
    return ((top << shift) + ((1 << shift) - 1) / 2.0) * 1e-9


class ItlHistogram:
    """Token-weighted inter-token latencies (see the module docstring)."""

    __slots__ = ("_counts", "tokens", "weighted_ns")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.weighted_ns = 0
        """Sum over iterations of (iteration time in ns) x (tokens it produced)."""
        self.tokens = 0
        """Tokens that waited an inter-token latency (first tokens excluded)."""

    def add(self, seconds: float, tokens: int) -> None:
        """One iteration of ``seconds`` that produced ``tokens`` tokens."""
        if tokens <= 0:
            return
        ns = to_ns(seconds)
        key = bucket_of(ns)
        self._counts[key] = self._counts.get(key, 0) + tokens
        self.weighted_ns += ns * tokens
        self.tokens += tokens

    def add_many(
        self,
        seconds: np.ndarray | Sequence[float],
        tokens: int,
        *,
        ascending: bool = False,
        ns: np.ndarray | None = None,
        ns_sum: int | None = None,
    ) -> None:
        """Several iterations, each producing ``tokens`` tokens. ``ascending``: the times do not
        decrease (a jump of identical decode iterations), so buckets are counted by search. ``ns``:
        the times already in integer nanoseconds (``np.rint(seconds * 1e9)`` as int64), and
        ``ns_sum`` their sum, when the caller has them."""
        if tokens <= 0 or len(seconds) == 0:
            return
        if ns is None:
            ns = np.rint(np.asarray(seconds, dtype=np.float64) * 1e9).astype(np.int64)
        c = self._counts
        if ascending:
            first, last = bucket_of(int(ns[0])), bucket_of(int(ns[-1]))
            if first == last:
                c[first] = c.get(first, 0) + len(ns) * tokens
            elif not self._add_ascending_span(ns, tokens, first, last):
                start = 0
                key = first
                while True:
                    stop = len(ns) if key == last else int(ns.searchsorted(_bucket_end_ns(key), "left"))
                    if stop > start:
                        c[key] = c.get(key, 0) + (stop - start) * tokens
                    if key == last:
                        break
                    start = stop
                    key = bucket_of(int(ns[start]))
        else:
            keys, counts = np.unique(buckets_of(ns), return_counts=True)
            for key, n in zip(keys.tolist(), counts.tolist(), strict=True):
                c[key] = c.get(key, 0) + n * tokens
        self.weighted_ns += (int(ns.sum()) if ns_sum is None else ns_sum) * tokens
        self.tokens += len(ns) * tokens

    _SPAN_BUCKETS = 32
    """``add_many``'s one-search path takes ascending values spanning at most this many buckets (a
    decode jump's times grow by a fraction of a per cent; a wider span is counted bucket by bucket)."""

    def _add_ascending_span(self, ns: np.ndarray, tokens: int, first: int, last: int) -> bool:
        """Count ascending ``ns`` whose buckets run from ``first`` to ``last`` with one search for
        every bucket edge between them (the same counts as searching edge by edge); ``False`` (nothing
        counted) when they span more than ``_SPAN_BUCKETS`` buckets."""
        keys, edges = [first], []
        key = first
        while key != last:
            if len(keys) > self._SPAN_BUCKETS:
                return False
            edge = _bucket_end_ns(key)
            edges.append(edge)
            key = bucket_of(edge)
            keys.append(key)
        stops = ns.searchsorted(edges, "left").tolist()
        stops.append(len(ns))
        c, start = self._counts, 0
        for key, stop in zip(keys, stops, strict=True):
            if stop > start:
                c[key] = c.get(key, 0) + (stop - start) * tokens
                start = stop
        return True

    def merge(self, other: ItlHistogram) -> None:
        for key, n in other._counts.items():
            self._counts[key] = self._counts.get(key, 0) + n
        self.weighted_ns += other.weighted_ns
        self.tokens += other.tokens

    @property
    def mean_s(self) -> float:
        return self.weighted_ns / self.tokens * 1e-9 if self.tokens else float("nan")

    def quantiles_s(self, qs: Sequence[float]) -> list[float]:
        """Token-weighted quantiles (inverted CDF, as ``envs.metrics.weighted_quantiles``)."""
        if not self.tokens:
            return [float("nan") for _ in qs]
        keys = sorted(self._counts)
        cum = np.cumsum([self._counts[k] for k in keys])
        out = []
        for q in qs:
            i = int(np.searchsorted(cum, q * cum[-1], side="left"))
            out.append(bucket_value_s(keys[min(i, len(keys) - 1)]))
        return out

    def values_and_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """Bucket midpoints (s) and their token counts, ascending: a compact ITL distribution."""
        keys = sorted(self._counts)
        return (
            np.array([bucket_value_s(k) for k in keys], dtype=np.float64),
            np.array([self._counts[k] for k in keys], dtype=np.float64),
        )


__all__ = ["QUANTILE_RELATIVE_ERROR", "ItlHistogram", "bucket_of", "buckets_of", "to_ns"]
