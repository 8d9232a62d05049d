"""The host caches a cached call goes through: plans, launch-argument tuples, plan-key dtypes (CPU only)."""
import copy
import pickle
import threading

from cudart_kernels.runtime import dtypes as dt
from cudart_kernels.runtime.launch import ArgsMemo
from cudart_kernels.runtime.plans import PlanCache


def test_plan_cache_is_bounded_and_drops_the_oldest():
    cache = PlanCache(max_entries=3)
    for i in range(5):
        assert cache.add(("op", i), f"plan {i}") == f"plan {i}"
    assert len(cache) == 3 and cache.get(("op", 0)) is None and cache.get(("op", 4)) == "plan 4"
    assert [k for k, _ in cache.items("op")] == [("op", 2), ("op", 3), ("op", 4)] and cache.items("other") == []


def test_plan_cache_under_threads_keeps_its_bound():
    cache = PlanCache(max_entries=50)

    def work(t):
        for i in range(500):
            key = ("op", t, i % 80)
            if cache.get(key) is None:
                cache.add(key, i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) <= 50


def test_args_memo_returns_the_same_tuple_and_is_bounded():
    memo = ArgsMemo(max_entries=2)
    first = memo.add((1, 2), ("map", 1, 2))
    assert memo.get((1, 2)) is first and memo.get((2, 1)) is None
    memo.add((3, 4), ("map", 3, 4))
    memo.add((5, 6), ("map", 5, 6))
    assert memo.get((1, 2)) is None and memo.get((5, 6)) == ("map", 5, 6)


def test_dtypes_are_singletons_through_pickle_and_copy():
    for d in dt.ALL:
        assert pickle.loads(pickle.dumps(d)) is d and copy.deepcopy(d) is d and copy.copy(d) is d
        assert dt.as_dtype(d.name) is d and hash(d) == hash(dt.as_dtype(d.name))
    assert dt.bfloat16 != dt.float16
