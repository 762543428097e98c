"""Remote rewards (align_anything/rewards_remote.py) against real HTTP servers on 127.0.0.1:
`serve-reward`'s server around a tiny reward model (in a thread here; the command itself in a
subprocess, slow), and small `http.server` servers that fail in the ways a network does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, free_port
from test_ppo_critic import make_reward_model

from align_anything.errors import ConfigError
from align_anything.rewards.functions import RewardError, RowsFailed, score_completions
from align_anything.rewards.remote import (
    RemoteReward,
    headers_from_env,
    remote_reward_functions,
    shown_url,
)
from align_anything.rewards.server import load_scorer, make_server

PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which is larger, 7 or 9?"}],
    "Name a colour.",  # a string is one user message
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Count to three."}],
    [{"role": "user", "content": "What is 2 + 3?"}],
]  # fmt: skip
COMPLETIONS = ["Answer: 5", "9", "Blue, I think, or maybe green.", "1, 2, 3", "Answer: 6"]
ROW_IDS = ["line 1", "line 2", "line 3", "line 4", "line 5"]


def serve(server: ThreadingHTTPServer) -> tuple[str, Callable[[], None]]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return f"http://127.0.0.1:{server.server_port}/score", stop


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reward_model(tmp_path_factory.mktemp("rm") / "final", seed=1)


@pytest.fixture(scope="module")
def rm_server(tiny_rm: Path) -> Iterator[str]:
    """serve-reward's server (batches of 2) around the tiny reward model, with a token."""
    scorer = load_scorer(str(tiny_rm), batch_size=2, max_length=512, device="cpu")
    url, stop = serve(make_server(scorer, host="127.0.0.1", port=0, token="s3cret-token"))
    yield url
    stop()


def in_process_scores(folder: Path, prompts: list, completions: list[str]) -> list[float]:
    """Each (prompt, completion) alone, unpadded, through transformers and the chat template:
    the reward model as `task=rm` trained it, independently of the server's code path."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": completion}], tokenize=True
        )
        ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
        with torch.no_grad():
            scores.append(float(model(input_ids=ids).logits[0, 0]))
    return scores


def remote(url: str, **kwargs) -> RemoteReward:
    settings = {"timeout_s": 10.0, "retries": 0, "backoff_s": 0.0, "max_rows": 64}
    return RemoteReward(url, **{**settings, **kwargs})


def score(reward: RemoteReward, count: int = 5, **fields) -> tuple[torch.Tensor, dict]:
    return score_completions(
        [("remote", reward)], [1.0], prompts=PROMPTS[:count], completions=COMPLETIONS[:count],
        fields=fields, row_ids=ROW_IDS[:count],
    )  # fmt: skip


# --------------------------------------------------------------------------- the RM server


def test_served_scores_equal_the_in_process_scores(tiny_rm: Path, rm_server: str) -> None:
    # Requests of 2 rows (3 requests), batches of 2 on the server: padding and chunking change
    # nothing; a data field (`answer`) travels along and is ignored by a reward model.
    reward = remote(rm_server, max_rows=2, headers={"Authorization": "Bearer s3cret-token"})
    total, per = score(reward, answer=[5, 9, None, 3, 5])
    expected = in_process_scores(tiny_rm, PROMPTS, COMPLETIONS)
    assert per["remote"].tolist() == pytest.approx(expected, abs=1e-5)
    assert total.tolist() == pytest.approx(expected, abs=1e-5)
    assert len({round(v, 4) for v in expected}) == 5  # a real head: the rows differ


def test_a_wrong_or_missing_token_is_refused_without_retries(rm_server: str) -> None:
    sleeps: list[float] = []
    reward = remote(rm_server, retries=3, backoff_s=1.0, sleep=sleeps.append,
                    headers={"Authorization": "Bearer wrong-token"})  # fmt: skip
    with pytest.raises(RewardError) as err:
        score(reward)
    message = str(err.value)
    assert "HTTP 401" in message and "missing or wrong bearer token" in message
    assert "lines 1, 2, 3, 4, 5 (5 completions)" in message
    assert sleeps == []  # 401 is not retried
    assert "wrong-token" not in message and "wrong-token" not in repr(reward)
    with pytest.raises(RewardError, match="HTTP 401"):
        score(remote(rm_server))


def test_headers_come_from_the_environment(monkeypatch, rm_server: str) -> None:
    monkeypatch.setenv("RM_TOKEN", "s3cret-token")
    ((name, reward),) = remote_reward_functions(
        [rm_server], timeout_s=10, retries=0, backoff_s=0, max_rows=8, headers_env="RM_TOKEN"
    )
    assert name == "remote" and "s3cret" not in repr(reward)
    assert len(reward(prompts=PROMPTS[:2], completions=COMPLETIONS[:2])) == 2
    monkeypatch.setenv("RM_HEADERS", '{"Authorization": "Bearer s3cret-token", "X-Run": "7"}')
    assert headers_from_env("RM_HEADERS") == {
        "Authorization": "Bearer s3cret-token", "X-Run": "7"
    }  # fmt: skip
    monkeypatch.delenv("RM_TOKEN")
    with pytest.raises(ConfigError, match="the environment variable RM_TOKEN is not set") as err:
        remote_reward_functions([rm_server], timeout_s=1, retries=0, backoff_s=0, max_rows=1,
                                headers_env="RM_TOKEN")  # fmt: skip
    assert "reward.remote.headers_env='RM_TOKEN'" in str(err.value)
    monkeypatch.setenv("RM_BAD", '{"Authorization": 3}')
    with pytest.raises(ConfigError, match="string values") as err:
        headers_from_env("RM_BAD")
    assert "3}" not in str(err.value)
    names = [n for n, _ in remote_reward_functions(
        [rm_server, rm_server], timeout_s=1, retries=0, backoff_s=0, max_rows=1, headers_env=None
    )]  # fmt: skip
    assert names == ["remote_0", "remote_1"]


def test_a_request_the_server_cannot_score_is_a_400_naming_the_row(rm_server: str) -> None:
    reward = remote(rm_server, headers={"Authorization": "Bearer s3cret-token"})
    with pytest.raises(RowsFailed, match=r"HTTP 400 Bad Request: prompts\[1\]: unknown role"):
        reward(prompts=[PROMPTS[0], [{"role": "robot", "content": "x"}]], completions=["a", "b"])


# --------------------------------------------------------------------------- failing servers


class Stub:
    """A real HTTP server whose answer to the k-th POST is `behaviour(k, request)`:
    (status, body bytes, seconds to wait first). It records each request's JSON body."""

    def __init__(self, behaviour: Callable[[int, dict], tuple[int, bytes, float]]) -> None:
        self.requests: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                status, data, delay = behaviour(len(stub.requests) - 1, body)
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.url, self.stop = serve(server)


def answer(body: dict) -> bytes:
    """Reward = the completion's length (so rows are easy to check)."""
    return json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()


@pytest.fixture
def stub() -> Iterator[Callable[..., Stub]]:
    made: list[Stub] = []

    def make(behaviour: Callable[[int, dict], tuple[int, bytes, float]]) -> Stub:
        made.append(Stub(behaviour))
        return made[-1]

    yield make
    for server in made:
        server.stop()


def test_a_server_that_fails_twice_then_answers(stub) -> None:
    server = stub(lambda k, body: (503, b'{"error": "warming up"}', 0) if k < 2
                  else (200, answer(body), 0))  # fmt: skip
    sleeps: list[float] = []
    reward = remote(server.url, retries=2, backoff_s=0.5, sleep=sleeps.append)
    assert reward(prompts=PROMPTS[:2], completions=COMPLETIONS[:2]) == [9.0, 1.0]
    assert len(server.requests) == 3
    assert sleeps == [0.5, 1.0]  # backoff_s, then twice it


def test_a_server_that_keeps_failing_gives_one_message(stub) -> None:
    server = stub(lambda k, body: (503, b'{"error": "overloaded, try later"}', 0))
    reward = remote(server.url, retries=2, backoff_s=0.0)
    with pytest.raises(RewardError) as err:
        score(reward, count=2)
    assert str(err.value) == (
        f"reward 'remote' on lines 1, 2 (2 completions): POST {server.url}: HTTP 503 Service "
        "Unavailable: overloaded, try later (gave up after 3 attempts; the timeout is 10 s)"
    )
    assert len(server.requests) == 3


def test_a_timeout_is_retried_then_reported(stub) -> None:
    server = stub(lambda k, body: (200, answer(body), 1.0))
    reward = remote(server.url, timeout_s=0.2, retries=1)
    start = time.perf_counter()
    with pytest.raises(RewardError) as err:
        score(reward, count=1)
    assert "no answer within 0.2 s (gave up after 2 attempts" in str(err.value)
    assert "reward 'remote' on line 1 (1 completion)" in str(err.value)
    assert len(server.requests) == 2 and time.perf_counter() - start < 1.5


def test_a_wrong_count_fails_at_once_naming_the_rows_of_that_request(stub) -> None:
    # max_rows 2: requests of rows 1-2, 3-4, 5; the second answers one reward too few.
    def behaviour(k: int, body: dict) -> tuple[int, bytes, float]:
        rewards = [1.0] * len(body["completions"])
        return 200, json.dumps({"rewards": rewards[: 1 if k == 1 else None]}).encode(), 0

    server = stub(behaviour)
    reward = remote(server.url, max_rows=2, retries=3)
    with pytest.raises(RewardError) as err:
        score(reward, answer=[1, 2, 3, 4, 5])
    assert f"reward 'remote' on lines 3, 4 (2 completions): POST {server.url}: answered 1 " \
           "rewards for the 2 completions sent" in str(err.value)  # fmt: skip
    assert len(server.requests) == 2  # not retried
    # Each request carried its own rows of every list.
    assert server.requests[1] == {"prompts": PROMPTS[2:4], "completions": COMPLETIONS[2:4],
                                  "answer": [3, 4]}  # fmt: skip


def test_a_dead_url() -> None:
    url = f"http://127.0.0.1:{free_port()}/score"
    sleeps: list[float] = []
    with pytest.raises(RewardError) as err:
        score(remote(url, retries=1, backoff_s=2.0, sleep=sleeps.append), count=2)
    message = str(err.value)
    assert message.startswith(f"reward 'remote' on lines 1, 2 (2 completions): POST {url}: cannot "
                              "connect (")  # fmt: skip
    assert "Connection refused" in message and "gave up after 2 attempts" in message
    assert sleeps == [2.0]


def test_answers_that_are_not_rewards(stub) -> None:
    server = stub(lambda k, body: (200, b"<html>proxy error</html>", 0))
    with pytest.raises(RewardError, match=r"the answer is not JSON \('<html>proxy error</html>'\)"):
        score(remote(server.url, retries=2), count=1)
    assert len(server.requests) == 1
    server = stub(lambda k, body: (200, b'{"scores": [1.0]}', 0))
    with pytest.raises(RewardError, match=r"no list 'rewards' \(found \['scores'\]\)"):
        score(remote(server.url), count=1)
    server = stub(lambda k, body: (200, b'{"rewards": ["high"]}', 0))
    with pytest.raises(
        RewardError,
        match=f"'remote' on line 1 .*: POST {server.url}: reward 1 "
        'of the answer is "high" \\(a str, not a number\\)',
    ):
        score(remote(server.url), count=1)


def test_null_is_no_opinion(stub) -> None:
    server = stub(lambda k, body: (200, b'{"rewards": [0.5, null]}', 0))
    total, per = score(remote(server.url), count=2)
    assert total[0] == 0.5 and torch.isnan(total[1]) and torch.isnan(per["remote"][1])


def test_credentials_in_a_url_are_never_shown(stub) -> None:
    server = stub(lambda k, body: (500, b"", 0))
    url = server.url + "?api_key=k3y"
    assert shown_url(url) == server.url + "?…"
    with pytest.raises(RewardError) as err:
        score(remote(url), count=1)
    assert "k3y" not in str(err.value) and f"POST {server.url}?…: HTTP 500" in str(err.value)
    assert server.requests  # the query string itself was sent
    with pytest.raises(ConfigError, match="carries credentials") as refused:
        remote(server.url.replace("http://", "http://user:pa55word@"))
    assert "pa55word" not in str(refused.value)
    with pytest.raises(ConfigError, match="is not an http"):
        remote("ftp://127.0.0.1/score")


# --------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_serve_reward_command(tiny_rm: Path) -> None:
    """`python -m align_anything serve-reward` serves the scores of the in-process model, asks
    for the token, never prints it, and stops on SIGTERM."""
    env = {**os.environ, "SERVE_TOKEN": "tok-123456"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "align_anything", "serve-reward", str(tiny_rm), "--port", "0",
         "--token-env", "SERVE_TOKEN", "--batch-size", "3"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving reward model"), line + proc.stderr.read()
        url = line.split(" on ")[1].split(" ")[0] + "score"
        reward = remote(url, headers={"Authorization": "Bearer tok-123456"})
        got = reward(prompts=PROMPTS, completions=COMPLETIONS)
        assert got == pytest.approx(in_process_scores(tiny_rm, PROMPTS, COMPLETIONS), abs=1e-5)
        with pytest.raises(RewardError, match="HTTP 401"):
            score(remote(url), count=1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "tok-123456" not in line + out + err
    assert "POST /score 5 rows -> 200" in err and "POST /score 0 rows -> 401" in err
