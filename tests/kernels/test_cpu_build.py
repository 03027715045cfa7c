"""Building the C kernels: once per cache key, whoever asks at the same time (TP workers, two
engines), and said to the user while it happens."""
import logging
import threading
import time

from nanovllm.kernels import cpu_kernels


def test_one_build_per_cache_key_under_a_lock(tmp_path, monkeypatch, caplog):
    calls = []

    def slow_build(path):
        calls.append(path)
        time.sleep(0.3)  # long enough for the other callers to be waiting on the lock
        path.write_bytes(b"library")

    monkeypatch.setattr(cpu_kernels, "build", slow_build)
    target = tmp_path / "kernels" / "cpu_kernels-key.so"
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        threads = [threading.Thread(target=cpu_kernels.build_once, args=(target,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu_kernels.build_once(target)  # already there: nothing built, nothing said
    assert calls == [target] and target.read_bytes() == b"library"
    said = [r for r in caplog.records if "compiling the CPU C kernels" in r.getMessage()]
    assert len(said) == 1 and str(target.parent) in said[0].getMessage()
