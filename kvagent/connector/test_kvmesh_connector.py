"""Tests of the connector's agent client against a real kvmesh-kvagent process.

Run: KVAGENT_BIN=/path/to/kvmesh-kvagent python3 -m unittest kvagent/connector/test_kvmesh_connector.py
"""

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from kvmesh_connector import AgentClient, AgentError, StagingRegion  # noqa: E402


def _bin():
    path = os.environ.get("KVAGENT_BIN")
    if not path:
        tgt = os.environ.get("CARGO_TARGET_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "target"))
        path = os.path.join(tgt, "debug", "kvmesh-kvagent")
    return path


class AgentProcess:
    def __init__(self, tmp):
        self.socket = os.path.join(tmp, "agent.sock")
        self.proc = subprocess.Popen(
            [_bin(), "run", "--listen", "127.0.0.1:0", "--admin", "", "--ready-json",
             "--agent-id", "py", "--socket", self.socket],
            stdout=subprocess.PIPE, env=dict(os.environ, RUST_LOG="warn"))
        self.ready = json.loads(self.proc.stdout.readline())

    def stop(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


class ConnectorClientTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.agent = AgentProcess(self.tmp.name)

    def tearDown(self):
        self.agent.stop()
        self.tmp.cleanup()

    def test_stage_send_wait_free_moves_exact_bytes(self):
        prefill = AgentClient(self.agent.socket, 5.0)
        decode = AgentClient(self.agent.socket, 5.0)
        self.assertEqual(prefill.hello()["version"], 1)
        src = StagingRegion(prefill, "prefill", 4096, 2, 8)
        dst = StagingRegion(decode, "decode", 4096, 2, 8)
        blocks = prefill.reserve(src.region, "req-py", 3)
        for layer in range(2):
            for b in blocks:
                off = src.offset(layer, b)
                src.mem[off:off + 4096] = bytes([(layer * 31 + b) % 251]) * 4096
        report = prefill.send(src.region, "req-py", blocks, "local", dst_region="decode")
        self.assertEqual(report["path"], "same_node")
        got = decode.wait("req-py", region=dst.region, deadline_s=5.0)
        for layer in range(2):
            for s, d in zip(blocks, got["blocks"]):
                a, b = src.offset(layer, s), dst.offset(layer, d)
                self.assertEqual(src.mem[a:a + 4096], dst.mem[b:b + 4096])
        decode.free(dst.region, "req-py")
        prefill.free(src.region, "req-py")
        self.assertEqual(decode.status()["leases"], 0)

    def test_errors_come_back_with_codes(self):
        c = AgentClient(self.agent.socket, 5.0)
        with self.assertRaises(AgentError) as e:
            c.wait("never-sent", deadline_s=0.2)
        self.assertEqual(e.exception.code, "timeout")
        self.assertTrue(e.exception.retryable)
        region = StagingRegion(c, "small", 1024, 1, 2)
        with self.assertRaises(AgentError) as e:
            c.reserve(region.region, "too-big", 3)
        self.assertEqual(e.exception.code, "no_room")

    def test_garbage_gets_an_error_and_the_agent_keeps_serving(self):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(5)
        raw.connect(self.agent.socket)
        junk = b"{not json"
        raw.sendall(struct.pack(">I", len(junk)) + junk)
        (n,) = struct.unpack(">I", raw.recv(4))
        reply = json.loads(raw.recv(n))
        self.assertEqual(reply["error"]["code"], "bad_request")
        self.assertEqual(AgentClient(self.agent.socket).status()["agent_id"], "py")


if __name__ == "__main__":
    unittest.main()
