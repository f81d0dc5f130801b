"""Probe: do CUDA IPC events order two processes' streams, and what does a stream that waits on another process's
event do when that process is SIGKILLed before the GPU reached the event's record (the GPU hand-over's fault case,
weight_sync/mailbox.py)? One GPU:

    python bench/device/probe_ipc_event_kill.py

The producer queues seconds of GPU spinning, records an interprocess event after it and hands the handle over. The
consumer makes its stream wait for the event and queues a small op behind the wait. Case "order": nobody is killed,
and the consumer's op must finish only after the spin. Case "kill": the producer is killed while its spin runs.
"""
import multiprocessing as mp
import os
import signal
import sys
import time

import torch

SPIN_CYCLES = int(1e10)


def producer(q, rerecord):
    torch.cuda.init()
    ev = torch.cuda.Event(interprocess=True)
    if rerecord:              # the hand-over re-records one event per slot: an earlier, finished record first
        ev.record()
        torch.cuda.synchronize()
    q.put(bytes(ev.ipc_handle()))
    assert q_get(q) == "go"
    t0 = time.time()
    torch.cuda._sleep(SPIN_CYCLES)
    ev.record()
    q.put("recorded")
    torch.cuda.synchronize()
    q.put(f"producer: spin took {time.time() - t0:.2f} s")
    time.sleep(120)


def q_get(q):
    return q.get(timeout=120)


def case(kill: bool, rerecord: bool) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=producer, args=(q, rerecord), daemon=True)
    p.start()
    ev = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), q_get(q))
    q.put("go")
    time.sleep(0.5)          # the producer takes "go" before we read "recorded" from the same queue
    assert q_get(q) == "recorded"
    t0 = time.time()
    stream = torch.cuda.current_stream()
    stream.wait_event(ev)
    x = torch.ones(1, device="cuda")
    x += 1
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.3)
    print(f"[kill={kill} rerecord={rerecord}] 0.3 s after the wait: event done {ev.query()}, our op done {done.query()}",
          flush=True)
    if kill:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        t1 = time.time()
    while not done.query():
        if time.time() - t0 > 60:
            print("  HANG: our stream still waits after 60 s", flush=True)
            os._exit(3)
        time.sleep(0.01)
    print(f"  our op finished {time.time() - t0:.2f} s after the wait was queued"
          + (f", {time.time() - t1:.2f} s after the kill" if kill else f"; {q_get(q)}"), flush=True)
    print("  context still works:", torch.arange(4, device="cuda").sum().item() == 6, flush=True)
    if not kill:
        p.kill()
        p.join()


if __name__ == "__main__":
    torch.ones(1, device="cuda")   # our CUDA context first: its start-up must not outlast the spin
    for kill, rerecord in ((False, False), (False, True), (True, True)):
        case(kill, rerecord)
    sys.exit(0)
