"""Reliability runs against a real `llm-worker serve` process (issue 8).

Each scenario starts its own worker on loopback, drives it with many concurrent gRPC
streams, checks the invariants the worker promises, and returns a JSON-able record (its
configuration, the counts, the checks and whether each held). `RELIABILITY.md` is rendered
from those records (``python -m clients.reliability report``), never typed by hand.

Scenarios (``python -m clients.reliability run NAME ...``):

=============  ==================================================================
storm          N streams cancelled at random points among witness streams whose
               greedy outputs were recorded alone first: every block comes back,
               the witnesses' outputs are unchanged
overload       Poisson arrivals at k x the measured capacity, three priorities, a
               small KV cache (so the cache runs out: preemption) and a short
               waiting queue, some clients cancelling: sent = completed + refused
               + cancelled, every refusal RESOURCE_EXHAUSTED, nothing else
sigterm        SIGTERM while streams run: new calls UNAVAILABLE, the in-flight
               ones finish or end within the grace, exit code 0, nothing hangs
fault          one model step fails under load (a fault injected through
               `benchmarks.faulty_worker`, the worker's own process with a patched
               runner; this package only starts it): its requests end INTERNAL, the
               rest complete, the worker stays SERVING, no block is leaked
slow_reader    clients that stop reading mid-stream while others run: the others
               finish unharmed, the stalled ones get their whole output (coalesced)
               when they resume, or are freed when they disconnect
deadline       deadlines that expire mid-generation under load: DEADLINE_EXCEEDED,
               blocks freed, the others complete
soak           steady load for a bounded time: per-window p99 TTFT, the worker's
               RSS, open file descriptors and threads stay flat; gauges end at zero
=============  ==================================================================

Like the benchmarks, this imports only the stubs and the standard library on the client
side; the fault launcher alone imports the worker (it runs inside the worker process).
"""
