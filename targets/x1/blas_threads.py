"""BLAS thread pools held at one thread while the emulator runs (see `BlasThreads` for why)."""

from __future__ import annotations


class BlasThreads:
    """Holds the BLAS pools at `threads` during a run and puts back what they had (a context manager).

    Why: the emulator is single-threaded by design and compared with ONNX Runtime at one intra-op thread; its
    matrices are small, and OpenBLAS's worker threads spin-wait, so on a busy machine a threaded 200x64x128
    sgemm takes milliseconds instead of tens of microseconds. The numerics do not depend on the thread count.
    It talks to the libraries' own get/set calls (about a microsecond) rather than `ThreadpoolController.limit`
    (about ten): a report makes one run per token."""

    def __init__(self, libs: list, threads: int):
        self.libs, self.threads = libs, threads

    def __enter__(self) -> list[int]:
        prev = [lib.get_num_threads() for lib in self.libs]
        for lib, n in zip(self.libs, prev):
            if n != self.threads:
                lib.set_num_threads(self.threads)
        return prev

    def restore(self, prev: list[int]) -> None:
        for lib, n in zip(self.libs, prev):
            if n != self.threads:
                lib.set_num_threads(n)


def blas_limiter(threads: int | None) -> BlasThreads | None:
    """The BLAS thread holder for `threads` (None, no threadpoolctl or no BLAS found: None, pools unchanged)."""
    if threads is None:
        return None
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    return BlasThreads(libs, threads) if libs else None
