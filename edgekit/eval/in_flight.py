"""Reports of an evaluation `concurrency` at a time, from as many threads, so the reporter's engine decodes them
together as it does for edgekitd's clients; their records stay in the input's order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TypeVar

Item = TypeVar("Item")
Record = TypeVar("Record")


def in_order(
    record: Callable[[Item], Record],
    items: Sequence[Item],
    concurrency: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[Record]:
    """`record(item)` for every item, `concurrency` at a time (1: in this thread, one after another), in `items`'
    order. An interruption (Ctrl-C, a failing progress callback, an error `record` raised) cancels the items not
    yet started."""
    if concurrency == 1:
        out = []
        for item in items:
            out.append(record(item))
            if progress:
                progress(len(out), len(items))
        return out
    with ThreadPoolExecutor(concurrency, thread_name_prefix="edgekit-eval") as pool:
        futures = [pool.submit(record, item) for item in items]
        try:
            for done, future in enumerate(as_completed(futures), 1):
                future.result()  # a bug in one record stops the run here, not after every other item
                if progress:
                    progress(done, len(items))
            return [f.result() for f in futures]
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
