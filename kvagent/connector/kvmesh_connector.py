"""kvmesh KV connector for vLLM (v1 connector API), backed by the node's kvmesh-kvagent.

Load it without patching vLLM:

    --kv-transfer-config '{"kv_connector": "KvmeshConnector",
                           "kv_connector_module_path": "kvmesh_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvmesh/kvagent.sock",
                                                         "staging_blocks": 256}}'

How it moves KV: the worker registers a host staging region (a sealed memfd) with the local
agent. At the end of prefill the worker copies a finished request's blocks into staging blocks
it reserved and asks the agent to send them to the decode node's agent; the scheduler holds the
engine's blocks until the send completes. At the start of decode the worker waits for the
transfer to arrive in its own staging region, copies the blocks into the engine's KV cache and
frees the staging blocks.

The proxy (kvmesh sidecar) puts these keys in the request's ``kv_transfer_params``:
prefill leg ``{"kvmesh_transfer_id": T, "kvmesh_dest_agent": "host:port"}``; decode leg gets
back what prefill returned: ``{"kvmesh_transfer_id": T, "kvmesh_num_tokens": N}``.

``AgentClient`` (the local API client) has no vLLM dependency and is tested on its own.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

API_VERSION = 1
MAX_FRAME = 1 << 20


class AgentError(Exception):
    """An error the agent answered with (``code`` is the stable error code)."""

    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class AgentClient:
    """A client of the kvagent local API: u32 big-endian length + JSON, memfds via SCM_RIGHTS."""

    def __init__(self, path: str, deadline_s: float = 30.0):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(deadline_s + 2.0)
        self._sock.connect(path)
        self._deadline = deadline_s
        self._next = 1
        self._lock = threading.Lock()

    def close(self) -> None:
        self._sock.close()

    def call(self, op: str, fd: Optional[int] = None, deadline_s: Optional[float] = None, **fields: Any) -> dict:
        deadline = self._deadline if deadline_s is None else deadline_s
        with self._lock:
            rid = self._next
            self._next += 1
            body = dict(fields, op=op, v=API_VERSION, id=rid, deadline_ms=int(deadline * 1000))
            data = json.dumps(body).encode()
            frame = struct.pack(">I", len(data)) + data
            self._sock.settimeout(deadline + 2.0)
            if fd is None:
                self._sock.sendall(frame)
            else:
                sent = socket.send_fds(self._sock, [frame], [fd])
                if sent < len(frame):
                    self._sock.sendall(frame[sent:])
            reply = self._read_frame()
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise AgentError(err.get("code", "unknown"), err.get("message", ""), bool(err.get("retryable")))
        return reply

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("kvagent closed the connection")
            buf += chunk
        return bytes(buf)

    def _read_frame(self) -> dict:
        (n,) = struct.unpack(">I", self._read_exact(4))
        if n > MAX_FRAME:
            raise ConnectionError(f"reply frame of {n} bytes")
        return json.loads(self._read_exact(n))

    def hello(self) -> dict:
        return self.call("hello")

    def register(self, name: str, fd: int, block_bytes: int, layers: int, blocks: int) -> int:
        layout = {"block_bytes": block_bytes, "layers": layers, "blocks": blocks}
        return self.call("register", fd=fd, name=name, layout=layout)["region"]

    def reserve(self, region: int, transfer: str, blocks: int) -> list[int]:
        return self.call("reserve", region=region, transfer=transfer, blocks=blocks)["blocks"]

    def send(self, region: int, transfer: str, blocks: list[int], peer: str,
             dst_region: Optional[str] = None, deadline_s: Optional[float] = None) -> dict:
        return self.call("send", deadline_s=deadline_s, region=region, transfer=transfer,
                         blocks=blocks, peer=peer, dst_region=dst_region)

    def wait(self, transfer: str, region: Optional[int] = None, deadline_s: Optional[float] = None) -> dict:
        return self.call("wait", deadline_s=deadline_s, transfer=transfer, region=region)

    def free(self, region: int, transfer: str) -> None:
        self.call("free", region=region, transfer=transfer)

    def status(self) -> dict:
        return self.call("status")


class StagingRegion:
    """A sealed memfd mapped here and registered with the agent (layer-major blocks)."""

    def __init__(self, client: AgentClient, name: str, block_bytes: int, layers: int, blocks: int):
        self.block_bytes, self.layers, self.blocks = block_bytes, layers, blocks
        size = block_bytes * layers * blocks
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.mem = mmap.mmap(self.fd, size)
        self.region = client.register(name, self.fd, block_bytes, layers, blocks)

    def offset(self, layer: int, block: int) -> int:
        return (layer * self.blocks + block) * self.block_bytes


# ---------------------------------------------------------------------------------------------
# The vLLM connector. Only defined when vLLM is importable, so AgentClient works without it.
# ---------------------------------------------------------------------------------------------
try:  # pragma: no cover - exercised only inside vLLM
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except Exception:  # noqa: BLE001 - vLLM absent: the client above still works
    KVConnectorBase_V1 = None

if KVConnectorBase_V1 is not None:  # pragma: no cover

    @dataclass
    class _Move:
        req_id: str
        transfer: str
        block_ids: list[int]
        peer: Optional[str] = None

    @dataclass
    class KvmeshMetadata(KVConnectorMetadata):
        sends: list = field(default_factory=list)
        loads: list = field(default_factory=list)

    def _params(request) -> dict:
        return getattr(request, "kv_transfer_params", None) or {}

    class KvmeshConnector(KVConnectorBase_V1):
        """Scheduler- and worker-side hooks; see the module docstring for the flow."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            self._socket = extra.get("socket", "/run/kvmesh/kvagent.sock")
            self._staging_blocks = int(extra.get("staging_blocks", 256))
            self._deadline = float(extra.get("deadline_s", 30.0))
            self._block_size = vllm_config.cache_config.block_size
            self._engine = f"vllm-{os.getpid()}"
            # scheduler side
            self._pending_sends: list[_Move] = []
            self._pending_loads: list[_Move] = []
            # worker side
            self._caches: dict[str, Any] = {}
            self._staging: Optional[StagingRegion] = None
            self._client: Optional[AgentClient] = None
            self._done_send: set = set()
            self._done_recv: set = set()
            self._done_lock = threading.Lock()
            self._threads: list[threading.Thread] = []

        # ---- scheduler side ----
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            p = _params(request)
            if not p.get("kvmesh_transfer_id") or not p.get("kvmesh_num_tokens"):
                return 0, False
            # The last token is recomputed locally so decode has logits to sample from.
            full = (int(p["kvmesh_num_tokens"]) - 1) // self._block_size * self._block_size
            return max(0, full - num_computed_tokens), True

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            p = _params(request)
            if num_external_tokens <= 0 or not p.get("kvmesh_transfer_id"):
                return
            ids = blocks.get_block_ids()[0]
            n = num_external_tokens // self._block_size
            self._pending_loads.append(_Move(request.request_id, p["kvmesh_transfer_id"], list(ids[:n])))

        def build_connector_meta(self, scheduler_output):
            meta = KvmeshMetadata(sends=self._pending_sends, loads=self._pending_loads)
            self._pending_sends, self._pending_loads = [], []
            return meta

        def request_finished(self, request, block_ids):
            p = _params(request)
            tid, dest = p.get("kvmesh_transfer_id"), p.get("kvmesh_dest_agent")
            if not tid or not dest or not block_ids:
                return False, None
            n = request.num_prompt_tokens // self._block_size
            self._pending_sends.append(_Move(request.request_id, tid, list(block_ids[:n]), dest))
            # Hold the blocks until the worker reports the send finished (get_finished).
            return True, {"kvmesh_transfer_id": tid, "kvmesh_num_tokens": request.num_prompt_tokens}

        # ---- worker side ----
        def register_kv_caches(self, kv_caches):
            self._caches = dict(kv_caches)
            first = next(iter(self._caches.values()))
            num_blocks = self._num_blocks(first)
            block_bytes = first.numel() * first.element_size() // num_blocks
            self._client = AgentClient(self._socket, self._deadline)
            self._staging = StagingRegion(self._client, self._engine, block_bytes, len(self._caches),
                                          self._staging_blocks)

        def _num_blocks(self, t) -> int:
            cfg = getattr(self, "_kv_cache_config", None)
            if cfg is not None and getattr(cfg, "num_blocks", None):
                return int(cfg.num_blocks)
            return int(t.shape[1] if t.shape[0] == 2 else t.shape[0])

        def _block(self, t, block: int):
            dim = 1 if t.shape[0] == 2 and t.shape[1] == self._num_blocks(t) else 0
            return t.select(dim, block)

        def _staging_view(self, layer: int, sblock: int):
            s = self._staging
            return torch.frombuffer(s.mem, dtype=torch.uint8, count=s.block_bytes, offset=s.offset(layer, sblock))

        def start_load_kv(self, forward_context, **kwargs):
            meta = self._get_connector_metadata()
            for move in getattr(meta, "loads", []):
                self._spawn(self._load, move)

        def _load(self, move: _Move):
            client = AgentClient(self._socket, self._deadline)
            try:
                got = client.wait(move.transfer, region=self._staging.region)
                for li, t in enumerate(self._caches.values()):
                    for dst, src in zip(move.block_ids, got["blocks"]):
                        blk = self._block(t, dst)
                        blk.copy_(self._staging_view(li, src).view(blk.dtype).view(blk.shape))
                client.free(got["region"], move.transfer)
            finally:
                client.close()
                with self._done_lock:
                    self._done_recv.add(move.req_id)

        def wait_for_layer_load(self, layer_name):
            return None

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            return None

        def wait_for_save(self):
            meta = self._get_connector_metadata()
            for move in getattr(meta, "sends", []):
                self._spawn(self._send, move)

        def _send(self, move: _Move):
            client = AgentClient(self._socket, self._deadline)
            staged = False
            try:
                sblocks = client.reserve(self._staging.region, move.transfer, len(move.block_ids))
                staged = True
                for li, t in enumerate(self._caches.values()):
                    for src, sb in zip(move.block_ids, sblocks):
                        blk = self._block(t, src).contiguous()
                        self._staging_view(li, sb).copy_(blk.view(-1).view(torch.uint8))
                client.send(self._staging.region, move.transfer, sblocks, move.peer)
            finally:
                if staged:
                    client.free(self._staging.region, move.transfer)
                client.close()
                with self._done_lock:
                    self._done_send.add(move.req_id)

        def _spawn(self, fn, move):
            self._threads = [t for t in self._threads if t.is_alive()]
            t = threading.Thread(target=fn, args=(move,), daemon=True, name=f"kvmesh-{move.req_id}")
            t.start()
            self._threads.append(t)

        def get_finished(self, finished_req_ids):
            with self._done_lock:
                sent, recv = self._done_send, self._done_recv
                self._done_send, self._done_recv = set(), set()
            return (sent or None), (recv or None)
