"""kvmesh KV connector for vLLM (v1 connector API, checked against vLLM 0.32), backed by the node's
kvmesh-kvagent.

Load it without patching vLLM (the directory of this file on PYTHONPATH):

    --kv-transfer-config '{"kv_connector": "KvmeshConnector",
                           "kv_connector_module_path": "kvmesh_connector",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": "/run/kvmesh/kvagent.sock",
                                                         "staging_blocks": 256,
                                                         "deadline_s": 30}}'

How it moves KV: the worker registers a host staging region (a sealed memfd) with the local agent,
with the engine's block geometry (bytes of one block of one layer's KV tensor, layers, blocks).
The KV tensors themselves are not registered: vLLM allocates them before any connector hook runs
and binds them into the attention layers, so they cannot be re-homed into a memfd the agent could
map; the connector copies a request's blocks into (prefill) or out of (decode) the staging region.

* Prefill (the request carries ``kvmesh_transfer_id`` and ``kvmesh_dest_agent``): when the request
  finishes, the scheduler keeps its blocks (``request_finished`` returns True) and returns
  ``{"kvmesh_transfer_id": T, "kvmesh_num_tokens": N}`` as the response's ``kv_transfer_params``.
  At the next step the worker copies every prompt block (the partial last one included) into
  staging blocks it reserved and asks the agent to send them to the destination agent; the blocks
  are released when the send ends (``get_finished``), whether it worked or not.
* Decode (the request carries what prefill returned): the scheduler reports every prompt token not
  already cached locally as external and asynchronous, so the request waits for its KV; the worker
  waits for the transfer to arrive in its staging region, copies the blocks into the engine's
  newly allocated blocks, frees the staging blocks and reports the load finished. A failed load
  (the transfer did not arrive within ``deadline_s``) is reported in ``failed_recving``: with
  ``"kv_load_failure_policy": "recompute"`` vLLM then computes the prompt itself; with vLLM 0.32's
  default (``"fail"``) the request fails.

The proxy (kvmesh sidecar, ``--pd-connector kvagent``) puts ``kvmesh_transfer_id`` and
``kvmesh_dest_agent`` (the decode node's agent) in the prefill leg and passes prefill's
``kv_transfer_params`` to the decode leg verbatim.

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
# Written against vLLM 0.32's KVConnectorBase_V1 (checked for real by tests/tests/vllm_kvagent.rs).
# ---------------------------------------------------------------------------------------------
try:  # pragma: no cover - exercised only inside vLLM
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.logger import init_logger
except Exception:  # noqa: BLE001 - vLLM absent: the client above still works
    KVConnectorBase_V1 = None

if KVConnectorBase_V1 is not None:  # pragma: no cover
    from concurrent.futures import ThreadPoolExecutor

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    except ImportError:  # older vLLM: only get_finished
        KVConnectorTransferResults = None
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        CacheHitSource = None

    logger = init_logger("kvmesh_connector")

    def _cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @dataclass
    class _Send:
        """Prefill side: send these engine blocks (the prompt's, in order) to ``peer``."""
        req_id: str
        transfer: str
        block_ids: list
        peer: str

    @dataclass
    class _Load:
        """Decode side: load transferred blocks ``skip..`` into these engine blocks."""
        req_id: str
        transfer: str
        block_ids: list
        skip: int

    @dataclass
    class KvmeshMetadata(KVConnectorMetadata):
        sends: list = field(default_factory=list)
        loads: list = field(default_factory=list)

    def _params(request) -> dict:
        return getattr(request, "kv_transfer_params", None) or {}

    def _is_decode_leg(p: dict) -> bool:
        """The decode leg carries what prefill returned: an id and a token count, no destination."""
        return bool(p.get("kvmesh_transfer_id")) and bool(p.get("kvmesh_num_tokens")) \
            and not p.get("kvmesh_dest_agent")

    class KvmeshConnector(KVConnectorBase_V1):
        """Scheduler- and worker-side hooks; see the module docstring for the flow.

        Why a staging copy instead of registering the KV cache itself: vLLM allocates its KV cache
        tensors (torch, anonymous private memory) before any connector hook runs and binds them into
        the attention layers, so they cannot be re-homed into a memfd the agent could map. The worker
        therefore registers its own memfd of the same block geometry and copies a request's blocks
        in (prefill) or out (decode); on CPU that copy is a memcpy far faster than the network leg.
        """

        if CacheHitSource is not None:
            _cache_hit_source = CacheHitSource.P2P

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            self._socket = extra.get("socket", "/run/kvmesh/kvagent.sock")
            self._staging_blocks = int(extra.get("staging_blocks", 256))
            self._deadline = float(extra.get("deadline_s", 30.0))
            self._block_size = vllm_config.cache_config.block_size
            self._engine = extra.get("region_name") or f"vllm-{os.getpid()}"
            # scheduler side
            self._pending_sends: list = []
            self._pending_loads: list = []
            # worker side
            self._caches: dict = {}
            self._dim = 0
            self._staging: Optional[StagingRegion] = None
            self._client: Optional[AgentClient] = None
            self._done_send: set = set()
            self._done_recv: set = set()
            self._failed_recv: set = set()
            self._done_lock = threading.Lock()
            self._pool: Optional[ThreadPoolExecutor] = None

        # ---- scheduler side ----
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            p = _params(request)
            if not _is_decode_leg(p) or p.get("_kvmesh_loading"):
                return 0, False
            n = min(int(p["kvmesh_num_tokens"]), request.num_prompt_tokens)
            count = n - num_computed_tokens
            # Every prompt token comes from the transfer (vLLM recomputes the last one itself to
            # sample from); the load runs between steps, so the answer is asynchronous.
            return (count, True) if count > 0 else (0, False)

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            p = _params(request)
            if num_external_tokens <= 0 or not _is_decode_leg(p):
                return
            ids = list(blocks.get_block_ids()[0])
            prompt = request.num_prompt_tokens
            local_blocks = (prompt - num_external_tokens) // self._block_size
            want = ids[local_blocks:_cdiv(prompt, self._block_size)]
            self._pending_loads.append(_Load(request.request_id, p["kvmesh_transfer_id"], want, local_blocks))
            p["_kvmesh_loading"] = True  # one load per request, even if it is scheduled again

        def build_connector_meta(self, scheduler_output):
            meta = KvmeshMetadata(sends=self._pending_sends, loads=self._pending_loads)
            self._pending_sends, self._pending_loads = [], []
            return meta

        def request_finished(self, request, block_ids):
            p = _params(request)
            tid, dest = p.get("kvmesh_transfer_id"), p.get("kvmesh_dest_agent")
            if not tid or not dest or not block_ids:
                return False, None
            from vllm.v1.request import RequestStatus
            if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                return False, None  # aborted: nothing to hand over, free at once
            n = _cdiv(request.num_prompt_tokens, self._block_size)
            self._pending_sends.append(_Send(request.request_id, tid, list(block_ids[:n]), dest))
            # Hold the blocks until the worker reports the send finished (get_finished).
            return True, {"kvmesh_transfer_id": tid, "kvmesh_num_tokens": request.num_prompt_tokens}

        # ---- worker side ----
        def register_kv_caches(self, kv_caches):
            self._caches = dict(kv_caches)
            first = next(iter(self._caches.values()))
            num_blocks = self._num_blocks(first)
            if first.shape[0] == num_blocks:
                self._dim = 0
            elif first.dim() > 1 and first.shape[1] == num_blocks:
                self._dim = 1
            else:
                raise ValueError(f"kvmesh: no block dimension of {num_blocks} in KV shape {tuple(first.shape)}")
            block_bytes = first.select(self._dim, 0).numel() * first.element_size()
            self._client = AgentClient(self._socket, self._deadline)
            self._staging = StagingRegion(self._client, self._engine, block_bytes, len(self._caches),
                                          self._staging_blocks)
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvmesh")
            logger.info("kvmesh: registered staging region %s with the agent at %s: %d layers, %d blocks "
                        "of %d bytes (KV shape %s)", self._staging.region, self._socket, len(self._caches),
                        self._staging_blocks, block_bytes, tuple(first.shape))

        def _num_blocks(self, t) -> int:
            cfg = getattr(self, "_kv_cache_config", None)
            if cfg is not None and getattr(cfg, "num_blocks", None):
                return int(cfg.num_blocks)
            return int(t.shape[1] if t.shape[0] == 2 else t.shape[0])

        def _staging_view(self, layer: int, sblock: int):
            s = self._staging
            return torch.frombuffer(s.mem, dtype=torch.uint8, count=s.block_bytes, offset=s.offset(layer, sblock))

        def start_load_kv(self, forward_context, **kwargs):
            if not self.has_connector_metadata():
                return
            for move in getattr(self._get_connector_metadata(), "loads", []):
                self._pool.submit(self._load, move)

        def _load(self, move):
            client = None
            ok = False
            try:
                client = AgentClient(self._socket, self._deadline)
                got = client.wait(move.transfer, region=self._staging.region)
                staged = got["blocks"][move.skip:move.skip + len(move.block_ids)]
                if len(staged) != len(move.block_ids):
                    raise RuntimeError(f"{len(got['blocks'])} blocks arrived, {move.skip + len(move.block_ids)} needed")
                for li, t in enumerate(self._caches.values()):
                    for dst, src in zip(move.block_ids, staged):
                        blk = t.select(self._dim, dst)
                        blk.copy_(self._staging_view(li, src).view(blk.dtype).view(blk.shape))
                client.free(got["region"], move.transfer)
                ok = True
                logger.debug("kvmesh: loaded %d blocks of %s", len(staged), move.transfer)
            except Exception as e:  # noqa: BLE001 - reported to the scheduler, which recomputes
                logger.warning("kvmesh: load of transfer %s failed: %s", move.transfer, e)
            finally:
                if client is not None:
                    client.close()
                with self._done_lock:
                    self._done_recv.add(move.req_id)
                    if not ok:
                        self._failed_recv.add(move.req_id)

        def wait_for_layer_load(self, layer_name):
            return None

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            return None

        def wait_for_save(self):
            if not self.has_connector_metadata():
                return
            for move in getattr(self._get_connector_metadata(), "sends", []):
                self._pool.submit(self._send, move)

        def _send(self, move):
            client = None
            staged = False
            try:
                client = AgentClient(self._socket, self._deadline)
                sblocks = client.reserve(self._staging.region, move.transfer, len(move.block_ids))
                staged = True
                for li, t in enumerate(self._caches.values()):
                    for src, sb in zip(move.block_ids, sblocks):
                        blk = t.select(self._dim, src).contiguous()
                        self._staging_view(li, sb).copy_(blk.view(-1).view(torch.uint8))
                rep = client.send(self._staging.region, move.transfer, sblocks, move.peer, deadline_s=self._deadline)
                logger.debug("kvmesh: sent %d blocks of %s to %s: %s", len(sblocks), move.transfer, move.peer, rep)
            except Exception as e:  # noqa: BLE001 - the decode side times out and recomputes
                logger.warning("kvmesh: send of transfer %s to %s failed: %s", move.transfer, move.peer, e)
            finally:
                try:
                    if staged:
                        client.free(self._staging.region, move.transfer)
                except Exception as e:  # noqa: BLE001
                    logger.warning("kvmesh: freeing staging blocks of %s: %s", move.transfer, e)
                if client is not None:
                    client.close()
                with self._done_lock:
                    self._done_send.add(move.req_id)

        def _take(self):
            with self._done_lock:
                sent, recv, failed = self._done_send, self._done_recv, self._failed_recv
                self._done_send, self._done_recv, self._failed_recv = set(), set(), set()
            return sent, recv, failed

        def get_finished(self, finished_req_ids):
            sent, recv, _ = self._take()
            return (sent or None), (recv or None)

        if KVConnectorTransferResults is not None:
            def get_transfer_results(self, finished_req_ids):
                sent, recv, failed = self._take()
                return KVConnectorTransferResults(finished_sending=sent, finished_recving=recv,
                                                  failed_recving=failed)

        def shutdown(self):
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            if self._client is not None:
                self._client.close()
