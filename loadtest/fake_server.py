"""A fake OpenAI-compatible streaming server, to test the online client without a model.

    with FakeOpenAIServer() as server:
        loadtest.__main__.main(["--base-url", server.url, "--model", "m", ...])
"""
from __future__ import annotations

import asyncio
import json
import threading


class FakeOpenAIServer:
    """`/v1/completions` and `/v1/chat/completions` on 127.0.0.1 (a free port), from a thread.

    Streams `max_tokens` one-word chunks, a usage chunk and [DONE], like vLLM.

    model "fail" answers 404; model "flaky" fails every third request with 500; model
    "slow" waits 2 s before the first byte (for the request timeout).
    """

    def __init__(self):
        self.bodies: list[dict] = []
        self.num_seen = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    async def _completions(self, request):
        from aiohttp import web

        body = await request.json()
        self.bodies.append(body)
        self.num_seen += 1
        if body["model"] == "fail" or (body["model"] == "flaky" and self.num_seen % 3 == 0):
            status = 404 if body["model"] == "fail" else 500
            return web.json_response({"error": {"message": f"{body['model']}"}}, status=status)
        if body["model"] == "slow":
            await asyncio.sleep(2)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.002)
            choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            if request.path.endswith("/chat/completions"):
                choice["delta"] = {"content": f" w{i}"}
            else:
                choice["text"] = f" w{i}"
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    def _serve(self):
        from aiohttp import web

        async def start():
            app = web.Application()
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_post("/v1/chat/completions", self._completions)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)  # port 0: no collisions between runs
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
