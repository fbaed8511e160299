"""The named LoRA adapters a worker serves, and which of them sit in host memory.

    name --load()--> registered (path, key) --acquire()/release()--> refs (requests in the engine)
                     weights in host memory: an LRU of at most --max-cpu-loras
                     (an idle adapter past the limit is dropped; the next request reloads it)

A request names an adapter at the door; the engine acquires it when the request enters the
scheduler and releases it when the request ends (finished, aborted or failed), so `refs`
counts requests in the engine. An adapter with refs is never evicted and cannot be unloaded
(`LoraInUseError`). More adapters than --max-cpu-loras in use at once all stay resident
(none is dropped under a running request); the LRU shrinks back as they go idle.

Each registration has a `key` (name and a registration number): the prefix cache hashes
it with the tokens, so an adapter unloaded and loaded again under the same name from other
weights never meets blocks the first one computed; the same registration reloaded after an
LRU eviction keeps its key and its cached blocks. Thread-safe: the door, the admin RPCs and
the engine thread all call in.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from worker.lora.adapter import LoraAdapter, load_adapter
from worker.models.llama import LlamaConfig


class UnknownLoraError(ValueError):
    """A request or admin call named an adapter that is not loaded."""


class LoraInUseError(RuntimeError):
    """An unload of an adapter that running or queued requests use."""


@dataclass
class _Entry:
    name: str
    path: str
    key: str
    adapter: LoraAdapter | None  # None: evicted from host memory, reloaded on next use
    rank: int
    refs: int = 0
    num_requests: int = 0  # requests that acquired it, ever (the per-adapter request count)


@dataclass(frozen=True)
class LoraInfo:
    name: str
    path: str
    rank: int
    resident: bool  # weights in host memory now
    num_running: int  # requests in the engine using it
    num_requests: int  # requests served with it since it was loaded


class LoraRegistry:
    def __init__(self, model: LlamaConfig, max_lora_rank: int, max_cpu_loras: int) -> None:
        assert max_lora_rank >= 1 and max_cpu_loras >= 1
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, _Entry] = OrderedDict()  # resident ones, oldest first
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self.num_loads = 0  # reads from disk (first loads and reloads after eviction)

    # ----- admin -----

    def load(self, name: str, path: str) -> LoraInfo:
        """Register `path` under `name`, reading and checking it now (LoraAdapterError)."""
        if not name or len(name) > 256 or any(c.isspace() for c in name):
            raise ValueError(f"LoRA adapter name {name[:64]!r} must be 1 to 256 characters "
                             "without spaces")
        with self._lock:
            if name in self._entries:
                raise ValueError(f"LoRA adapter {name[:64]!r} is already loaded; unload it first")
        adapter = self._read(name, path)  # outside the lock: requests go on meanwhile
        with self._lock:
            if name in self._entries:
                raise ValueError(f"LoRA adapter {name[:64]!r} is already loaded; unload it first")
            entry = _Entry(name, str(Path(path)), f"{name}#{next(self._numbers)}", adapter,
                           adapter.rank)
            self._entries[name] = entry
            self._lru[name] = entry
            self._evict()
            return self._info(entry)

    def unload(self, name: str) -> None:
        """Forget `name` and drop its weights; refused while requests use it."""
        with self._lock:
            entry = self._entry(name)
            if entry.refs:
                raise LoraInUseError(f"LoRA adapter {name[:64]!r} is in use by {entry.refs} "
                                     "request(s); unload it when they have finished")
            del self._entries[name]
            self._lru.pop(name, None)
            entry.adapter = None

    def infos(self) -> list[LoraInfo]:
        with self._lock:
            return [self._info(e) for e in self._entries.values()]

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    # ----- requests -----

    def key(self, name: str) -> str:
        """The prefix-cache key of `name`'s current registration (UnknownLoraError)."""
        with self._lock:
            return self._entry(name).key

    def warm(self, name: str) -> None:
        """Have `name`'s weights in host memory (read from disk if evicted): the door calls
        this off the event loop so that the engine thread seldom reads a file."""
        self._resident(name, None)

    def acquire(self, key: str) -> LoraAdapter:
        """The weights of registration `key`, counted in use until `release`; raises
        UnknownLoraError when that registration was unloaded meanwhile."""
        adapter = self._resident(key.rsplit("#", 1)[0], key, take=True)
        assert adapter is not None
        return adapter

    def release(self, adapter: LoraAdapter) -> None:
        with self._lock:
            entry = self._entries.get(adapter.name)
            if entry is None or entry.adapter is not adapter:
                return  # cannot happen while refs > 0 (no unload, no eviction); be safe
            assert entry.refs > 0, f"{adapter.name}: release without acquire"
            entry.refs -= 1
            self._evict()

    def in_use(self) -> dict[str, int]:
        """Adapter name -> requests in the engine using it (those with any)."""
        with self._lock:
            return {e.name: e.refs for e in self._entries.values() if e.refs}

    # ----- inside -----

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            loaded = ", ".join(sorted(self._entries))[:200] or "none"
            raise UnknownLoraError(f"unknown LoRA adapter {name[:64]!r} (loaded: {loaded})")
        return entry

    def _resident(self, name: str, key: str | None, take: bool = False) -> LoraAdapter | None:
        with self._lock:
            entry = self._entry(name)
            if key is not None and entry.key != key:
                raise UnknownLoraError(f"LoRA adapter {name[:64]!r} was unloaded and loaded "
                                       "again while this request waited")
            if entry.adapter is None:
                # Evicted: read it again (under the lock: one read even if many ask at once).
                entry.adapter = self._read(entry.name, entry.path)
            self._lru[name] = entry
            self._lru.move_to_end(name)
            if take:
                entry.refs += 1
                entry.num_requests += 1
            adapter = entry.adapter
            self._evict()
            return adapter

    def _read(self, name: str, path: str) -> LoraAdapter:
        self.num_loads += 1
        return load_adapter(name, path, self.model, self.max_lora_rank)

    def _evict(self) -> None:
        """Drop idle adapters' weights, least recently used first, down to max_cpu_loras."""
        excess = len(self._lru) - self.max_cpu_loras
        for name in [n for n, e in self._lru.items() if not e.refs][:max(0, excess)]:
            self._lru.pop(name).adapter = None

    @staticmethod
    def _info(e: _Entry) -> LoraInfo:
        return LoraInfo(e.name, e.path, e.rank, e.adapter is not None, e.refs, e.num_requests)
