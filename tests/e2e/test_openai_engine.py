"""`--engine openai`: a worker in front of a real OpenAI-compatible server (vLLM's own
`api_server`, CPU build, on the tiny dummy-weight model)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from inferx.client import InferxClient
from inferx.devstack import LocalStack, ManagedProcess, free_port, read_models_file, wait_serving
from inferx.tinymodel import make_tiny_model
from tests.conftest import EXAMPLES, dump_logs, make_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def openai_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("openai-stack")
    model_dir = make_tiny_model(root / "tiny-llama")
    port = free_port()
    server = ManagedProcess(
        "vllm-api-server",
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--load-format",
            "dummy",
            "--port",
            str(port),
            "--max-model-len",
            "2048",
            "--block-size",
            "32",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--scheduling-policy",
            "priority",
            "--gpu-memory-utilization",
            "0.1",
            "--enforce-eager",
        ],
        root / "vllm-server.log",
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    server.start()
    stack = make_stack(root)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.alive(), server.log_tail()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM's API server did not start"
            time.sleep(1)
        stack.start_core()
        stack.load_models(read_models_file(EXAMPLES / "models.yaml"))
        stack.start_worker(
            "tiny-llama",
            "openai",
            ["--openai-base-url", f"http://127.0.0.1:{port}", "--model-path", "tiny", "--no-warm-up"],
        )
        wait_serving(stack.workers[0], 60)
        stack.put_chains([EXAMPLES / "chains" / "customer_service_agent.yaml"])
        yield stack
    except BaseException:
        dump_logs(stack)
        print(server.log_tail(40))
        raise
    finally:
        stack.stop()
        server.stop()


async def test_example_chain_through_an_openai_compatible_server(openai_stack: LocalStack) -> None:
    async with InferxClient(openai_stack.router_address) as client:
        runs = []
        for _ in range(2):
            events = [
                e async for e in client.run_chain("customer_service_agent", {"query": "Where is my order?"})
            ]
            runs.append(events[-1].chain_finished)
        status = await client.status()
    assert all(run.status == "ok" for run in runs), [run.error for run in runs]
    generation = {h.node_id: h for h in runs[1].hops}["response_generation"]
    assert generation.usage.prompt_tokens > 64 and generation.usage.completion_tokens >= 1
    assert generation.usage.cached_prompt_tokens >= 32  # reported by the server's prefix cache
    assert status.workers[0].engine == "openai"


def test_worker_refuses_a_model_the_server_does_not_serve(openai_stack: LocalStack) -> None:
    server_url = next(a for a in openai_stack.workers[0].argv if a.startswith("http://"))
    bad = openai_stack.start_worker(
        "other", "openai", ["--openai-base-url", server_url, "--model-path", "nope"]
    )
    assert bad.wait(60) != 0
    assert "not 'nope'" in bad.log_tail()
    openai_stack.workers.remove(bad)
