"""`k3 serve` against the official `openai` client and raw HTTP, on 127.0.0.1 only, with bounded requests and time."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
AUTH = {"Authorization": "Bearer sekret", "Content-Type": "application/json"}
PROMPT = "To be, or not to be, that is the question"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", timeout=60, max_retries=0)


def _metric(server, name: str) -> float:
    text = server.request("GET", "/metrics")[2]
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_models_completion_and_chat(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.choices[0].text == again.choices[0].text and done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.prompt_tokens == len(PROMPT.encode()) and 1 <= done.usage.completion_tokens <= 8
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, reasoning_effort="low")
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=7, n=2).choices
               for _ in range(2)]
    assert [c.text for c in sampled[0]] == [c.text for c in sampled[1]]  # a seed makes sampling reproducible
    assert len(sampled[0]) == 2


def test_streaming_matches_the_whole_answer(client):
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_echo_logprobs_score_the_prompt(client, server):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs."""
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == PROMPT and len(lp.tokens) == len(PROMPT.encode())
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    g = greedy.choices[0].logprobs
    for chosen, top in zip(g.token_logprobs, g.top_logprobs):
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_16_parallel_streams_equal_sequential(client):
    prompts = [PROMPT[: 5 + 2 * i] for i in range(16)]

    def stream(prompt):
        parts = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join(p.choices[0].text for p in parts if p.choices)
    sequential = [client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text
                  for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        parallel = list(pool.map(stream, prompts))
    assert parallel == sequential


def test_prefix_cache_reuses_and_answers_the_same(client, server):
    system = {"role": "system", "content": "You are a careful assistant. " * 6}
    answers = []
    for question in ("What is K3?", "What is K3?", "And KDA?"):
        answers.append(client.chat.completions.create(model="tiny", messages=[system, {"role": "user",
                                                      "content": question}], max_tokens=6, temperature=0))
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens > 0
    assert answers[2].usage.prompt_tokens_details.cached_tokens >= 32 * 5  # the shared system prompt's chunks
    assert _metric(server, "k3_prefix_cache_hit_rate") > 0


def test_stop_strings_end_the_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    clean = [i for i in range(2, len(full) - 1) if "\ufffd" not in full[i: i + 2]]
    if not clean:
        pytest.fail(f"no two whole characters in the greedy continuation {full!r} to stop on")
    stop = full[clean[0]: clean[0] + 2]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(p.choices[0].text for p in streamed if p.choices) == cut.text


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    ({"prompt": PROMPT, "max_tokens": "5"}, 400, "max_tokens: Input should be a valid integer"),
    ({"prompt": PROMPT, "max_tokens": 2000}, 400, "exceed the context of 1024"),
    ({"prompt": "x" * 1100}, 400, "exceed the context of 1024"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": PROMPT, "presence_penalty": 0.5}, 400, "presence_penalty is not supported"),
    ({"prompt": [[1, 2], [999999]]}, 400, "outside the vocabulary"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ([1, 2], 400, "must be a JSON object"),
])
def test_bad_completion_requests(server, body, status, message):
    got, _, answer = server.request("POST", "/v1/completions", body if isinstance(body, (bytes, dict))
                                    else json.dumps(body).encode(), AUTH)
    assert got == status and message in answer["error"]["message"], answer


def test_bad_chat_requests(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    for body, message in [({"messages": []}, "messages: List should have at least 1 item"),
                          ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
                          ({"messages": [{"role": "user", "content": [image]}]}, "text-only"),
                          ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                           "tools"),
                          ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs logprobs")]:
        status, _, answer = server.request("POST", "/v1/chat/completions", body, AUTH)
        assert status == 400 and message in answer["error"]["message"], answer


def test_auth_and_body_limit(server):
    body = {"prompt": PROMPT, "max_tokens": 1}
    assert server.request("POST", "/v1/completions", body)[0] == 401
    status, headers, answer = server.request("POST", "/v1/completions", body, {"Authorization": "Bearer nope"})
    assert status == 401 and answer["error"]["type"] == "authentication_error" and headers.get("www-authenticate") == "Bearer"
    assert server.request("GET", "/v1/models")[0] == 401
    assert server.request("GET", "/health")[0] == 200  # liveness and metrics need no key
    huge = json.dumps({"prompt": "x" * (17 << 20)}).encode()
    status, _, answer = server.request("POST", "/v1/completions", huge, AUTH)
    assert status == 413 and "over the limit" in answer["error"]["message"]


def test_disconnect_frees_the_row(server):
    conn = server.connect()
    conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 900, "temperature": 0,
                                                        "stream": True}), AUTH)
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    before = _metric(server, "k3_generation_tokens_total")
    conn.close()
    deadline = time.monotonic() + 30
    while _metric(server, "k3_running") + _metric(server, "k3_prefilling") > 0:
        assert time.monotonic() < deadline, "the disconnected stream still holds its row"
        time.sleep(0.1)
    assert _metric(server, "k3_generation_tokens_total") - before < 900


def test_busy_server_answers_429_and_sigterm_finishes_the_stream(checkpoint, start_server):
    server = start_server(checkpoint, "--max-batch", "1", "--max-queue", "0", "--grace", "60")
    try:
        conn = server.connect()
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 300, "temperature": 0,
                                                            "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        status, headers, answer = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 429 and headers.get("retry-after") == "1" and "busy" in answer["error"]["message"]
        server.proc.send_signal(signal.SIGTERM)
        rest = response.read().decode()  # the running stream is let finish
        assert rest.rstrip().endswith("data: [DONE]")
        assert server.proc.wait(timeout=60) == 0
        with pytest.raises(OSError):
            server.request("GET", "/health", timeout=2)
    finally:
        server.kill()


def test_serve_refuses_a_missing_checkpoint(tmp_path):
    import subprocess
    import sys

    missing = subprocess.run([sys.executable, "-m", "k3", "serve", str(tmp_path / "nope")], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_serve_refuses_a_taken_port(checkpoint):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "k3", "serve", checkpoint, "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def _png_data_uri(size=(40, 30), color=(200, 30, 30)) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_vision_checkpoint_takes_images(vl_checkpoint, start_server):
    server = start_server(vl_checkpoint, "--model-name", "vl")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)

        def ask(url, text="caption:"):
            return client.chat.completions.create(model="vl", max_tokens=5, temperature=0, logprobs=True, messages=[
                {"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": url}}]}])
        red, blue = ask(_png_data_uri()), ask(_png_data_uri(color=(20, 40, 220)))
        assert red.choices[0].message.role == "assistant" and red.usage.completion_tokens >= 1
        assert ask(_png_data_uri()).choices[0].message.content == red.choices[0].message.content
        first = [r.choices[0].logprobs.content[0].logprob for r in (red, blue)]
        assert first[0] != pytest.approx(first[1], abs=1e-6)  # the pixels reach the model (same size, same text)
        for url, message in [("data:image/png;base64,AAAA", "cannot decode the image"),
                             ("data:image/png;base64,@@", "base64 is invalid"),
                             ("https://example.com/cat.png", "only data: URIs")]:
            with pytest.raises(openai.BadRequestError, match=message):
                ask(url)
    finally:
        server.kill()
