"""The on-disk cubin cache: keys, atomic writes, concurrent compilers, corruption recovery."""
import logging
import multiprocessing as mp
import os

import pytest

from cudart_kernels.runtime import compiler

SRC, ENTRY, DEFS = "quantize.cu", "quantize_per_token", {"IN_KIND": "KIND_FP16"}


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDART_KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    compiler.clear_memory_cache()
    yield tmp_path / "cache"
    compiler.clear_memory_cache()


def _entries(d):
    return sorted(p for p in d.glob("*.cubin"))


def test_first_compile_logs_then_hits_disk(empty_cache, caplog):
    with caplog.at_level(logging.INFO, logger="cudart_kernels"):
        a = compiler.compile_kernel(SRC, ENTRY, DEFS)
    assert not a.from_disk
    assert any("compiled quantize_per_token" in r.getMessage() for r in caplog.records)
    assert len(_entries(empty_cache)) == 1
    assert not list(empty_cache.glob("*.tmp"))  # the temp file was renamed, not left behind
    compiler.clear_memory_cache()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cudart_kernels"):
        b = compiler.compile_kernel(SRC, ENTRY, DEFS)
    assert b.from_disk and b.cubin == a.cubin and b.report == a.report
    assert not caplog.records


def test_key_covers_defines_and_arch(empty_cache):
    a = compiler.compile_kernel(SRC, ENTRY, DEFS, "sm_90a")
    b = compiler.compile_kernel(SRC, ENTRY, {"IN_KIND": "KIND_FP32"}, "sm_90a")
    c = compiler.compile_kernel(SRC, ENTRY, DEFS, "sm_90")
    assert len({a.key, b.key, c.key}) == 3
    assert len(_entries(empty_cache)) == 3


def test_key_covers_included_files(empty_cache, monkeypatch, tmp_path):
    root = tmp_path / "ptx"
    (root / "common").mkdir(parents=True)
    (root / "k.cu").write_text('#include "common/h.cuh"\nextern "C" __global__ void k(int* p) { *p = V; }\n')
    (root / "common" / "h.cuh").write_text("#define V 1\n")
    monkeypatch.setattr(compiler, "ptx_dir", lambda: root)
    a = compiler.compile_kernel("k.cu", "k")
    (root / "common" / "h.cuh").write_text("#define V 2\n")
    compiler.clear_memory_cache()
    b = compiler.compile_kernel("k.cu", "k")
    assert a.key != b.key and not b.from_disk


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_entry_is_rebuilt(empty_cache, damage, caplog):
    good = compiler.compile_kernel(SRC, ENTRY, DEFS)
    (path,) = _entries(empty_cache)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(os.urandom(len(data)))
    compiler.clear_memory_cache()
    with caplog.at_level(logging.WARNING, logger="cudart_kernels"):
        again = compiler.compile_kernel(SRC, ENTRY, DEFS)
    assert not again.from_disk and again.cubin == good.cubin
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    assert compiler._read_entry(path)[1] == good.cubin  # rebuilt in place, valid again
    compiler.clear_memory_cache()
    assert compiler.compile_kernel(SRC, ENTRY, DEFS).from_disk


def _compile_in_child(cache, barrier, results):
    os.environ["CUDART_KERNELS_CACHE_DIR"] = cache
    compiler.clear_memory_cache()
    barrier.wait()  # start together
    c = compiler.compile_kernel(SRC, ENTRY, DEFS)
    results.put((len(c.cubin), c.key, c.from_disk))


def test_four_processes_compile_a_kernel_once(empty_cache):
    """Four processes on one empty cache: one compiles (a lock per entry), the others wait and read its entry."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(empty_cache), barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    got = [results.get(timeout=5) for _ in procs]
    assert len({g[:2] for g in got}) == 1
    assert sorted(g[2] for g in got) == [False, True, True, True]  # compiled once, read from disk three times
    assert len(_entries(empty_cache)) == 1 and not list(empty_cache.glob("*.tmp"))
    compiler.clear_memory_cache()
    assert compiler.compile_kernel(SRC, ENTRY, DEFS).from_disk


def _cache_warnings(caplog):
    return [r for r in caplog.records if "kernel cache" in r.getMessage()]


def test_unusable_cache_dir_warns_once_and_runs_from_memory(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("CUDART_KERNELS_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(compiler, "_cache_warned", set())
    compiler.clear_memory_cache()
    try:
        with caplog.at_level(logging.WARNING, logger="cudart_kernels"):
            a = compiler.compile_kernel(SRC, ENTRY, DEFS)
            b = compiler.compile_kernel(SRC, ENTRY, {"IN_KIND": "KIND_BF16"})
        assert a.cubin and b.cubin and not a.from_disk and not b.from_disk
        assert len(_cache_warnings(caplog)) == 1  # one warning, not one per kernel
        assert compiler.compile_kernel(SRC, ENTRY, DEFS) is a  # served from memory
    finally:
        compiler.clear_memory_cache()


def test_corrupt_entry_in_read_only_cache(empty_cache, monkeypatch, caplog):
    good = compiler.compile_kernel(SRC, ENTRY, DEFS)
    (path,) = _entries(empty_cache)
    path.write_bytes(b"garbage")
    compiler.clear_memory_cache()
    monkeypatch.setattr(compiler, "_cache_warned", set())

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    # (chmod does not stop root: the read-only file system is simulated where the cache deletes and writes)
    monkeypatch.setattr(type(path), "unlink", read_only)
    monkeypatch.setattr(compiler.tempfile, "mkstemp", read_only)
    with caplog.at_level(logging.WARNING, logger="cudart_kernels"):
        again = compiler.compile_kernel(SRC, ENTRY, DEFS)
    assert again.cubin == good.cubin and not again.from_disk
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    assert len(_cache_warnings(caplog)) == 1
    assert path.read_bytes() == b"garbage"  # left alone
