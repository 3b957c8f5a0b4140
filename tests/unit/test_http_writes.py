"""The HTTP servers send a response's headers with its body (inferx.httpserve): one
write on the socket where uvicorn makes two, and nothing held past the loop's turn."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from inferx.httpserve import EmbeddedHttpServer, _CoalescingTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


async def test_headers_and_body_go_out_as_one_write() -> None:
    real = FakeTransport()
    transport = _CoalescingTransport(real)  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert real.writes == [] and transport.get_write_buffer_size() == 19  # held for the body
    transport.write(b"body")
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    assert transport.get_extra_info("peername") == "info:peername"  # the rest is the transport's


async def test_a_lone_write_goes_out_at_the_end_of_the_turn() -> None:
    real = FakeTransport()
    transport = _CoalescingTransport(real)  # type: ignore[arg-type]
    transport.write(b"data: 1\n\n")
    assert real.writes == []
    await asyncio.sleep(0)
    assert real.writes == [b"data: 1\n\n"]


async def test_a_close_sends_what_was_written_first() -> None:
    real = FakeTransport()
    transport = _CoalescingTransport(real)  # type: ignore[arg-type]
    transport.write(b"last")
    transport.close()
    assert real.writes == [b"last"] and real.closed
    await asyncio.sleep(0)
    assert real.writes == [b"last"]  # not twice


async def test_whole_and_streamed_responses_arrive_intact_on_a_kept_alive_connection() -> None:
    async def whole(request):
        return JSONResponse({"n": int(request.query_params["n"])})

    async def pieces():
        for i in range(5):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0.001)

    async def streamed(request):
        return StreamingResponse(pieces(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/whole", whole), Route("/streamed", streamed)])
    server = EmbeddedHttpServer(app, "127.0.0.1", 0)
    address = await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as client:
            for n in range(20):  # one connection, kept alive
                assert (await client.get("/whole", params={"n": n})).json() == {"n": n}
                reply = await client.get("/streamed")
                assert reply.text == "".join(f"data: {i}\n\n" for i in range(5))
    finally:
        await server.stop()
