"""The decode side: pulling a handoff's blocks into this worker's cache, off the engine
thread.

The engine hands each request admitted into WAITING_FOR_REMOTE_KV to `KVPuller.start`; a
pull thread streams the blocks from the prefill worker (only an address on
--kv-transfer-peers, with this worker's credentials), writes each chunk into the request's
own blocks as it arrives (`worker.kv_transfer.blocks`: they belong to that request alone and
no step reads them until it is done) and reports through `on_done` (the engine's inbox):
success, or the reason it failed, and the request falls back to computing its prompt.
Nothing here blocks the engine's step loop.

A handoff still waiting for admission keeps its lease renewed (every third of it); one that
turns out unneeded (the prefix cache here had it) or whose request ended before its pull is
released on the prefill worker at once, so that the prefill's blocks never wait out a lease
for nothing.

Cancel: `RemotePull.cancel` (an abort) cancels the stream; the pull thread then reports
"aborted" and the engine ends the request, freeing its blocks only once no thread writes
them any more.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from llmworker.v1 import kv_transfer_pb2 as kpb
from llmworker.v1 import kv_transfer_pb2_grpc

from scheduler.request import RemoteKV, Request
from worker.auth import read_pem
from worker.config import WorkerConfig
from worker.kv_transfer import blocks
from worker.kv_transfer.handoff import Handoff, Layout
from worker.kv_transfer.messages import REASON_KEY, layout_message, layout_of
from worker.kv_transfer.stats import KVTransferStats

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
PULL_THREADS = 2
_MAX_RECEIVE = 8 << 20
_REASONS = {
    grpc.StatusCode.UNAVAILABLE: "peer_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "aborted",
    grpc.StatusCode.NOT_FOUND: "unknown",
    grpc.StatusCode.PERMISSION_DENIED: "key",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
}


class PullFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class RemotePull:
    """A decode request's handoff and its pull: `RemoteKV.handoff` (the scheduler's record
    holds the block ids)."""

    handoff: Handoff
    digest: bytes
    cancelled: bool = False
    abort_pending: bool = False  # the request ended during the pull: end it when reported
    started_at: float | None = None  # time.monotonic() of the pull's start and end
    ended_at: float | None = None
    num_bytes: int = 0
    renewed_at: float = field(default_factory=time.monotonic)  # the lease's last (re)start
    _call: grpc.Future | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def _attach(self, call: grpc.Future) -> None:
        with self._lock:
            self._call = call
            cancelled = self.cancelled
        if cancelled:
            call.cancel()


Done = Callable[[Request, bool, str], None]  # (request, ok, reason)


class KVPuller:
    def __init__(self, config: WorkerConfig, layout: Layout, caches, stats: KVTransferStats,
                 on_done: Done) -> None:
        kc, sc = config.kv_transfer, config.server
        self.layout = layout
        self.caches = caches
        self.stats = stats
        self.on_done = on_done
        self.timeout_s = kc.kv_transfer_timeout_s
        token = kc.kv_transfer_peer_token or sc.auth_token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._credentials = None
        if kc.kv_transfer_peer_ca:
            cert_path = kc.kv_transfer_peer_cert or sc.tls_cert
            key_path = kc.kv_transfer_peer_key or sc.tls_key
            self._credentials = grpc.ssl_channel_credentials(
                read_pem("--kv-transfer-peer-ca", kc.kv_transfer_peer_ca),
                read_pem("--kv-transfer-peer-key", key_path) if key_path else None,
                read_pem("--kv-transfer-peer-cert", cert_path) if cert_path else None)
        # Started now, not at the first pull (from the engine thread, whose CPU a thread
        # started there would inherit): `cpu_placement` then puts them beside the loop.
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"kv-pull-{i}", daemon=True)
                         for i in range(PULL_THREADS)]
        for t in self._workers:
            t.start()
        self._stubs: dict[str, kv_transfer_pb2_grpc.KVTransferStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()
        # Handoffs waiting for admission, renewed by the keeper thread.
        self._waiting: set[RemotePull] = set()
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name="kv-lease", daemon=True)
        self._keeper.start()

    # ----- the engine's calls (any thread) ------------------------------------------------

    def watch(self, pull: RemotePull) -> None:
        """Renew `pull`'s lease until it starts or is released."""
        with self._lock:
            self._waiting.add(pull)

    def start(self, req: Request) -> None:
        remote = req.remote_kv
        assert remote is not None and isinstance(remote.handoff, RemotePull)
        self._unwatch(remote.handoff)
        self._jobs.put(lambda: self._run(req))

    def release(self, pull: RemotePull) -> None:
        """Let the prefill free `pull`'s blocks (best effort, in the background)."""
        self._unwatch(pull)
        self._jobs.put(lambda: self._release(pull))

    def close(self) -> None:
        self._stop.set()
        for _ in self._workers:
            self._jobs.put(None)
        for t in self._workers:
            t.join(30)
        for ch in self._channels:
            ch.close()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a job reports its own failure; the thread goes on
                log.exception("KV transfer job failed")

    # ----- internals ----------------------------------------------------------------------

    def _unwatch(self, pull: RemotePull) -> None:
        with self._lock:
            self._waiting.discard(pull)

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                options = [("grpc.max_receive_message_length", _MAX_RECEIVE),
                           ("grpc.enable_retries", 0)]
                ch = (grpc.secure_channel(address, self._credentials, options)
                      if self._credentials is not None
                      else grpc.insecure_channel(address, options))
                self._channels.append(ch)
                stub = self._stubs[address] = kv_transfer_pb2_grpc.KVTransferStub(ch)
            return stub

    def _run(self, req: Request) -> None:
        remote = req.remote_kv
        assert remote is not None
        pull: RemotePull = remote.handoff
        pull.started_at = time.monotonic()
        try:
            self._pull(pull, remote)
            ok, reason = True, ""
        except PullFailed as e:
            ok, reason = False, e.reason
            if reason != "aborted":
                log.warning("KV pull failed (%s) for request %r from %s: %s; computing the "
                            "prompt here", reason, req.request_id[:64], pull.handoff.address,
                            str(e)[:200])
        except Exception as e:  # a bug here must not hang the request: it falls back
            ok, reason = False, "error"
            log.exception("KV pull for request %r failed: %s", req.request_id[:64], e)
        pull.ended_at = time.monotonic()
        if ok:
            self.stats.pulled(len(remote.block_ids), pull.num_bytes,
                              pull.ended_at - pull.started_at)
        elif reason == "aborted":
            self.stats.count("num_pulls_aborted")
        else:
            self.stats.fallback(reason)
        self.on_done(req, ok, reason)

    def _pull(self, pull: RemotePull, remote: RemoteKV) -> None:
        if pull.cancelled:
            raise PullFailed("aborted", "the request ended before its pull")
        n = len(remote.block_ids)
        request = kpb.PullBlocksRequest(
            handle=pull.handoff.handle, prompt_digest=pull.digest,
            layout=layout_message(self.layout), first_block=remote.first_block, num_blocks=n,
            max_chunk_bytes=CHUNK_BYTES)
        call = self._stub(pull.handoff.address).PullBlocks(
            request, timeout=self.timeout_s, metadata=self._metadata)
        pull._attach(call)
        covered = [0] * self.layout.num_layers  # blocks written per layer, in order
        try:
            header = None
            for resp in call:
                if header is None:
                    if not resp.HasField("header"):
                        raise PullFailed("bad_data", "the stream did not start with a header")
                    header = resp.header
                    self._check_header(header, remote)
                    continue
                if not resp.HasField("chunk"):
                    raise PullFailed("bad_data", "a second header")
                c = resp.chunk
                layer = c.layer
                if layer >= len(covered) or c.first_block != remote.first_block + covered[layer]:
                    raise PullFailed("bad_data", f"chunk for layer {layer} at block "
                                                 f"{c.first_block} out of order")
                start = covered[layer]
                if c.num_blocks < 1 or start + c.num_blocks > n:
                    raise PullFailed("bad_data", f"{c.num_blocks} blocks past the {n} wanted")
                try:
                    blocks.write(self.caches, layer, remote.block_ids[start:start + c.num_blocks],
                                 c.keys, c.values)
                except ValueError as e:
                    raise PullFailed("bad_data", str(e)) from None
                covered[layer] += c.num_blocks
                pull.num_bytes += len(c.keys) + len(c.values)
        except grpc.RpcError as e:
            code = e.code()
            reason = dict(e.trailing_metadata() or ()).get(REASON_KEY) or _REASONS.get(code, "error")
            if pull.cancelled:
                reason = "aborted"
            raise PullFailed(reason, f"{code.name}: {e.details()}") from None
        if pull.cancelled:
            raise PullFailed("aborted", "the request ended during its pull")
        if header is None or any(c != n for c in covered):
            raise PullFailed("bad_data", f"the stream ended with {sum(covered)} of "
                                         f"{n * len(covered)} block layers")

    def _check_header(self, header: kpb.PullHeader, remote: RemoteKV) -> None:
        why = self.layout.mismatch(layout_of(header.layout))
        if why is not None:
            raise PullFailed(why, f"the prefill's cache differs in {why}")
        if header.num_tokens != remote.num_tokens:
            raise PullFailed("num_tokens", f"the handoff holds {header.num_tokens} tokens, "
                                           f"this prompt {remote.num_tokens}")
        if (header.first_block, header.num_blocks) != (remote.first_block, len(remote.block_ids)):
            raise PullFailed("bad_data", "the header's blocks are not those asked for")

    def _release(self, pull: RemotePull) -> None:
        try:
            self._stub(pull.handoff.address).ReleaseBlocks(
                kpb.ReleaseBlocksRequest(handle=pull.handoff.handle), timeout=5.0,
                metadata=self._metadata)
        except grpc.RpcError as e:  # it expires there anyway
            log.info("releasing a KV handoff at %s failed: %s", pull.handoff.address,
                     e.code().name)

    def _keep(self) -> None:
        """Renew each waiting handoff's lease once a third of it has passed."""
        while not self._stop.is_set():
            with self._lock:
                waiting = list(self._waiting)
            now = time.monotonic()
            wait = 1.0
            for pull in waiting:
                lease = pull.handoff.lease_s
                due = pull.renewed_at + lease / 3
                if due > now:
                    wait = min(wait, due - now)
                    continue
                pull.renewed_at = now
                wait = min(wait, lease / 3)
                try:
                    self._stub(pull.handoff.address).RenewLease(
                        kpb.RenewLeaseRequest(handle=pull.handoff.handle, lease_s=lease),
                        timeout=5.0, metadata=self._metadata)
                except grpc.RpcError as e:
                    log.info("renewing a KV handoff's lease at %s failed: %s",
                             pull.handoff.address, e.code().name)
            self._stop.wait(wait)
