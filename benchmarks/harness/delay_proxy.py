"""A transparent TCP proxy that adds a fixed delay each way: link latency where the kernel has no netem.

Run inside a host's network namespace with iptables REDIRECT rules sending that host's TCP connections (outgoing
in nat OUTPUT, incoming in nat PREROUTING) to ``--port``: each connection is relayed to its original destination
(SO_ORIGINAL_DST) from a socket marked ``--mark`` (so the rules let it through), and every chunk read on either
side is written to the other ``--delay-ms`` later, in order. Throughput is unchanged; each direction gains the
delay. Used by benchmarks/gossip.py.

    ip netns exec NS python benchmarks/harness/delay_proxy.py --port 15001 --delay-ms 50 --mark 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import time

SO_ORIGINAL_DST = 80
SO_MARK = 36


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def pump() -> None:
        while True:
            data = await reader.read(65536)
            queue.put_nowait((time.monotonic() + delay, data))
            if not data:
                return

    async def drain() -> None:
        while True:
            at, data = await queue.get()
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        await asyncio.gather(pump(), drain())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=15001)
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--mark", type=int, default=1)
    args = ap.parse_args()
    delay = args.delay_ms / 1000

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        sock = c_writer.get_extra_info("socket")
        port, packed = struct.unpack_from("!2xH4s", sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16))
        out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        out.setsockopt(socket.SOL_SOCKET, SO_MARK, args.mark)
        out.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(out, (socket.inet_ntoa(packed), port)), 10)
            s_reader, s_writer = await asyncio.open_connection(sock=out)
        except (OSError, TimeoutError):
            out.close()
            c_writer.close()
            return
        await asyncio.gather(_pipe(c_reader, s_writer, delay), _pipe(s_reader, c_writer, delay))
        for w in (c_writer, s_writer):
            w.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "0.0.0.0", args.port)
        print("READY {}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
