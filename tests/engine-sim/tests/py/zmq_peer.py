"""A libzmq (pyzmq) peer for zmq_interop.rs: the other end of the simulator's
KV-event sockets, as vLLM's consumers write it.

usage: zmq_peer.py sub-bind TOPIC          SUB bound on an OS port of 127.0.0.1
       zmq_peer.py sub-connect EP TOPIC    SUB connected to EP
       zmq_peer.py dealer EP START         one replay request ["", START] to a ROUTER
       zmq_peer.py pub-connect EP TOPIC PAYLOAD_HEX
                                           PUB connected to EP, [TOPIC, seq, PAYLOAD]
                                           every 20 ms, seq from 0

Writes one JSON line per happening on stdout: {"bound": EP}, {"connected": EP},
{"frames": [hex, ...]} for each message received. Reads commands from stdin:
"rebind" (sub-bind: close the socket and bind the same port again, as a
restarted consumer does); end of input stops it. Every mode stops after
LIFETIME seconds whatever happens.
"""
import json
import os
import sys
import time

import zmq

LIFETIME = 60.0
deadline = time.monotonic() + LIFETIME
ctx = zmq.Context()


def say(**kv):
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


def frames(msg):
    say(frames=[f.hex() for f in msg])


def sub(topic):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, topic.encode())
    return s


def bind_again(ep, topic):
    # The old listener closes asynchronously: retry, bounded, until the port is free.
    for _ in range(200):
        s = sub(topic)
        try:
            s.bind(ep)
            return s
        except zmq.ZMQError:
            s.close()
            time.sleep(0.01)
    raise SystemExit(f"could not bind {ep} again")


class Stdin:
    """Lines from stdin without blocking (polled beside the sockets)."""

    def __init__(self):
        self.fd = sys.stdin.fileno()
        self.buf = b""
        self.closed = False

    def lines(self):
        data = os.read(self.fd, 4096)
        if not data:
            self.closed = True
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        return [d.decode().strip() for d in done]


def serve(s, on_command):
    """Reports what `s` receives until stdin closes or the lifetime ends."""
    stdin = Stdin()
    while time.monotonic() < deadline and not stdin.closed:
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        poller.register(stdin.fd, zmq.POLLIN)
        ready = dict(poller.poll(100))
        if ready.get(s):
            frames(s.recv_multipart())
        if ready.get(stdin.fd):
            for line in stdin.lines():
                s = on_command(s, line)


def main(mode, *args):
    if mode == "sub-bind":
        (topic,) = args
        s = sub(topic)
        s.bind("tcp://127.0.0.1:*")
        ep = s.getsockopt(zmq.LAST_ENDPOINT).decode()
        say(bound=ep)

        def command(s, line):
            if line == "rebind":
                s.close()
                s = bind_again(ep, topic)
                say(bound=ep)
            return s

        serve(s, command)
    elif mode == "sub-connect":
        ep, topic = args
        s = sub(topic)
        s.connect(ep)
        say(connected=ep)
        serve(s, lambda s, _line: s)
    elif mode == "dealer":
        ep, start = args
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(ep)
        d.send_multipart([b"", int(start).to_bytes(8, "big")])
        while time.monotonic() < deadline and d.poll(5000):
            msg = d.recv_multipart()
            frames(msg)
            if len(msg) == 4 and msg[2] == b"\xff" * 8:
                break
    elif mode == "pub-connect":
        ep, topic, payload = args
        p = ctx.socket(zmq.PUB)
        p.setsockopt(zmq.LINGER, 0)
        p.connect(ep)
        say(connected=ep)
        stdin, seq = Stdin(), 0
        while time.monotonic() < deadline and not stdin.closed:
            p.send_multipart([topic.encode(), seq.to_bytes(8, "big"), bytes.fromhex(payload)])
            seq += 1
            if zmq.select([stdin.fd], [], [], 0.02)[0]:
                stdin.lines()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(*sys.argv[1:])
