"""The baseline arm: Hugging Face ``generate`` behind ``/v1/completions``.

    python -m tandem.bench.hf_baseline [--model DIR] [--port 8100]

One request at a time (a single generation thread; the rest wait in line),
streamed as server-sent events, with the OpenAI fields the benchmark uses:
``prompt`` as text or token ids, ``max_tokens``, ``temperature``, ``top_p``,
``seed``, ``ignore_eos``, ``stream`` and ``stream_options.include_usage``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

ROOT = Path(__file__).resolve().parents[2]


class HFGenerator:
    """A model and tokenizer from a Tandem model directory (the bundled GGUF
    converts to one), run with ``model.generate`` in float32 on the CPU."""

    def __init__(self, model: str | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from engine.loader.resolve import resolve_model_dir
        from engine.tokenizer import Tokenizer

        model_dir = resolve_model_dir(model)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = Tokenizer(model_dir)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = self.model.config.vocab_size

    def generate(self, prompt: list[int], max_tokens: int, temperature: float, top_p: float,
                 seed: int | None, ignore_eos: bool, emit: Callable[[int], None],
                 cancelled: threading.Event) -> str:
        """Calls ``emit`` with each new token id; returns the finish reason."""
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        class Streamer(BaseStreamer):
            prompt_seen = False

            def put(self, value) -> None:
                if not self.prompt_seen:  # generate() first echoes the prompt
                    self.prompt_seen = True
                    return
                for token in value.reshape(-1).tolist():
                    emit(token)

            def end(self) -> None:
                pass

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool)

        greedy = temperature == 0
        config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=not greedy,
            temperature=None if greedy else temperature, top_p=None if greedy else top_p,
            top_k=None, eos_token_id=None if ignore_eos else self.eos_token_id,
            pad_token_id=self.eos_token_id if self.eos_token_id is not None else 0,
        )
        if seed is not None:
            torch.manual_seed(seed)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      generation_config=config, streamer=Streamer(),
                                      stopping_criteria=StoppingCriteriaList([Cancelled()]))
        return "length" if out.shape[1] - len(prompt) >= max_tokens else "stop"


def build_app(gen: HFGenerator, name: str):
    app = FastAPI(title="Hugging Face baseline")
    # NOTE: one thread: requests queue for it, as with a naive server.
    executor = ThreadPoolExecutor(max_workers=1)

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}},
                            status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "hf"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            prompt = gen.tokenizer.encode(prompt)
        elif not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return error("prompt must be a non-empty string or list of token ids")
        if any(not 0 <= t < gen.vocab_size for t in prompt):
            return error("prompt token id outside the vocabulary")
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(1.0 if body.get("temperature") is None else body["temperature"])
        top_p = float(1.0 if body.get("top_p") is None else body["top_p"])
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        cancelled = threading.Event()
        job = loop.run_in_executor(executor, gen.generate, prompt, max_tokens, temperature,
                                   top_p, body.get("seed"), bool(body.get("ignore_eos")),
                                   lambda t: loop.call_soon_threadsafe(queue.put_nowait, t),
                                   cancelled)
        job.add_done_callback(lambda _: queue.put_nowait(None))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def event(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish}]}

        async def deltas() -> AsyncIterator[str | dict]:
            """Text as it becomes whole, then {finish, completion_tokens}."""
            ids: list[int] = []
            text = ""
            while (token := await queue.get()) is not None:
                ids.append(token)
                full = gen.tokenizer.decode(ids)
                if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                    continue
                delta, text = full[len(text):], full
                yield delta
            yield {"finish": await job, "completion_tokens": len(ids)}

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": n,
                    "total_tokens": len(prompt) + n}

        if not body.get("stream"):
            parts, end = [], {}
            async for d in deltas():
                if isinstance(d, str):
                    parts.append(d)
                else:
                    end = d
            return {**event("".join(parts), end["finish"]),
                    "usage": usage(end["completion_tokens"])}

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse():
            try:
                async for d in deltas():
                    if isinstance(d, str):
                        yield json.dumps(event(d, None))
                        continue
                    yield json.dumps(event('', d['finish']))
                    if include_usage:
                        last = {**event("", None), "choices": [],
                                "usage": usage(d["completion_tokens"])}
                        yield json.dumps(last)
                yield "[DONE]"
            finally:
                cancelled.set()  # the client went away: stop generating

        return EventSourceResponse(sse(), sep="\n", ping=0)

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Hugging Face generate() behind /v1/completions")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    args = p.parse_args(argv)
    import uvicorn

    gen = HFGenerator(args.model)
    name = "SmolLM2-135M-Instruct" if args.model is None else Path(args.model).name
    uvicorn.run(build_app(gen, name), host=args.host, port=args.port, log_level="warning")


@contextmanager
def hf_server(model: str | None, host: str, port: int, timeout_s: float = 300.0,
              env: dict[str, str] | None = None) -> Iterator[str]:
    """Start the baseline in its own process; yields its URL once it answers."""
    import httpx

    cmd = [sys.executable, "-m", "tandem.bench.hf_baseline", "--host", host,
           "--port", str(port), *(["--model", model] if model else [])]
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
        p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(ROOT), start_new_session=True)
        url = f"http://{host}:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the HF baseline failed to start:\n{log.read()[-4000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


if __name__ == "__main__":
    main()
