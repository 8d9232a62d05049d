"""One plan cache for every op. A plan is what a call needs beyond its pointers (config, launcher, grid, tensor-map
layouts, scratch sizes); its key holds everything that decides it: the op, shapes, strides, dtypes, pointer
alignment, device, options and the tuning object. Hits are one dict read (no lock); inserts take a lock and drop
the oldest plan past the bound."""
from __future__ import annotations

import threading


class PlanCache:
    def __init__(self, max_entries: int = 4096):
        self._plans: dict = {}
        self._lock = threading.Lock()
        self._max = max_entries

    def get(self, key):
        return self._plans.get(key)

    def add(self, key, plan):
        with self._lock:
            while len(self._plans) >= self._max:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan

    def items(self, op: str | None = None) -> list:
        """(key, plan) of one op's cached plans (the first item of their keys), or of all."""
        return [(k, p) for k, p in list(self._plans.items()) if op is None or k[0] == op]

    def values(self, op: str | None = None) -> list:
        return [p for _, p in self.items(op)]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


PLANS = PlanCache()
