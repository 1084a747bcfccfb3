"""WaitedCondition: notify_all reaches every waiter, and costs nothing with none."""

from __future__ import annotations

import threading

import pytest

from sbp_spark.server.conditions import WaitedCondition


def test_notify_all_wakes_every_waiter() -> None:
    cond = WaitedCondition()
    ready = threading.Barrier(4)
    state = {"go": False}
    woken: list[int] = []

    def waiter(i: int) -> None:
        ready.wait()
        with cond:
            while not state["go"]:
                cond.wait(10)
            woken.append(i)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    ready.wait()
    while True:  # until all three are inside wait()
        with cond:
            if cond._waiting == 3:
                state["go"] = True
                cond.notify_all()
                break
    for t in threads:
        t.join(10)
    assert sorted(woken) == [0, 1, 2]
    assert cond._waiting == 0


def test_wait_that_times_out_is_no_longer_counted() -> None:
    cond = WaitedCondition()
    with cond:
        assert cond.wait(0.01) is False
        assert cond._waiting == 0
        cond.notify_all()  # nobody waits: nothing to do, and no error


def test_notify_all_needs_the_lock_when_someone_waits() -> None:
    cond = WaitedCondition()
    started = threading.Event()

    def waiter() -> None:
        with cond:
            started.set()
            cond.wait(5)

    t = threading.Thread(target=waiter)
    t.start()
    started.wait(5)
    with cond:  # the waiter is now inside wait()
        pass
    with pytest.raises(RuntimeError):  # as threading.Condition: the lock must be held
        cond.notify_all()
    with cond:
        cond.notify_all()
    t.join(5)
    assert not t.is_alive()
