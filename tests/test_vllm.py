"""sampling.backend=vllm: the client and the trainer against a stand-in vLLM server, and (marked `vllm`) against a
real one.

The stand-in speaks the endpoints the client uses (rl/rollouts/vllm_client.py) from a thread of this process. It samples
tokens at random and reports their logprobs under ITS OWN copy of the tiny model, minus OFFSET, and loads the
weights the trainer syncs, so that the run's own old-policy logprobs t and the server's s differ by exactly OFFSET
on every token as long as the sync works: sampling/logprob_diff_mean = OFFSET, and after the first update a sync
that did not arrive shows as another value. It can also fail on a chosen request (HTTP 500, as a dead vLLM engine
answers), stop answering, or fail a weight sync.

The real-server test needs a running `branchreplay vllm-serve --model smollm2` and BRANCHREPLAY_VLLM_URL set to it
(e.g. http://127.0.0.1:8000); it is skipped otherwise.
"""

import http.server
import json
import math
import os
import threading
import time

import pytest
import safetensors.torch
import torch

from branchreplay.models import tiny_model
from branchreplay.rl.config import Config
from branchreplay.rl.run.stops import TrainingFailed
from branchreplay.rl.run.trainer import Trainer
from branchreplay.rl.rollouts.vllm_client import VLLMClient, VLLMError
from test_trainer import DATA, ByteTokenizer, byte_reward

OFFSET = 0.05  # the stand-in's logprobs are its model's minus this


class StandIn:
    """A vLLM server stand-in on 127.0.0.1 (a free port). `fail_on`: the completion request number (1-based) that
    answers HTTP 500; `hang_on`: the one that never answers; `fail_sync_on`: the weight sync (1-based) that answers
    HTTP 500; `served`: the model name it reports."""

    def __init__(self, served="tiny:llama", tokenizer=None, fail_on=None, hang_on=None, fail_sync_on=None):
        self.model = tiny_model("llama", seed=0).eval()
        self.served, self.tokenizer = served, tokenizer or ByteTokenizer()
        self.fail_on, self.hang_on, self.fail_sync_on = fail_on, hang_on, fail_sync_on
        self.requests = self.syncs = 0
        self.lock = threading.Lock()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer({"data": [{"id": stand_in.served, "root": stand_in.served, "max_model_len": 2048}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/tokenize":
                    self.answer({"tokens": stand_in.tokenizer(body["prompt"], add_special_tokens=False).input_ids})
                elif self.path == "/collective_rpc" and stand_in.syncs + 1 == stand_in.fail_sync_on:
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "reload_weights: size mismatch"}}')
                elif self.path == "/collective_rpc":
                    state = safetensors.torch.load_file(os.path.join(body["kwargs"]["weights_path"],
                                                                     "model.safetensors"))
                    stand_in.model.load_state_dict(state)
                    stand_in.syncs += 1
                    self.answer({"results": [None]})
                elif self.path == "/reset_prefix_cache":
                    self.answer({"success": True})
                else:
                    with stand_in.lock:  # handler threads run side by side
                        stand_in.requests += 1
                        number = stand_in.requests
                    if number == stand_in.hang_on:
                        time.sleep(30)
                    if number == stand_in.fail_on:
                        self.send_response(500)
                        self.end_headers()
                        self.wfile.write(b'{"error": {"message": "EngineCore encountered an issue"}}')
                        return
                    self.answer(stand_in.complete(body))

            def answer(self, payload):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def complete(self, body):
        prompt, choices = body["prompt"], []
        generator = torch.Generator().manual_seed(sum(prompt))  # requests arrive in any order: seeded by the prompt
        for i in range(body["n"]):
            n = int(torch.randint(1, body["max_tokens"] + 1, (1,), generator=generator))
            ids = torch.randint(3, 256, (n,), generator=generator).tolist()
            if n < body["max_tokens"] and i % 2 == 0:
                ids[-1] = body["stop_token_ids"][0]
            with torch.no_grad():
                logits = self.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
                logprobs = torch.log_softmax(logits / body["temperature"], -1)
                logprobs = logprobs.gather(1, torch.tensor(ids)[:, None])[:, 0] - OFFSET
            choices.append({"index": i, "token_ids": ids, "finish_reason": "stop",
                            "logprobs": {"token_logprobs": logprobs.tolist()}})
        return {"choices": choices}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in():
    servers = []

    def start(**kwargs):
        servers.append(StandIn(**kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _config(tmp_path, url, **sampling):
    return Config.from_dict({
        "model": {"spec": "tiny:llama"},
        "sampling": {"temperature": 0.7, "max_new_tokens": 6, "backend": "vllm", "vllm_url": url, **sampling},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-2, "lr_scheduler": "constant"},
        "train": {"steps": 2, "output_dir": str(tmp_path / "run"), "save_steps": 0, "eval_steps": -1},
    })


def _trainer(config):
    return Trainer(config, model=tiny_model("llama", seed=0), tokenizer=ByteTokenizer(), train_data=DATA,
                   eval_data=DATA[:4], reward_fn=byte_reward)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_samples_with_the_server_syncs_weights_and_logs_the_mismatch(stand_in, tmp_path):
    server = stand_in()
    run = _trainer(_config(tmp_path, server.url)).fit()
    rows = [r for r in _metrics(run) if "reward" in r]
    assert len(rows) == 2 and server.syncs == 2  # the start (a resume may hold other weights), after step 1
    assert "sampling/logprob_diff_mean" in rows[1]  # after the first sync (a step where no group trains has none)
    for r in (r for r in rows if "sampling/logprob_diff_mean" in r):  # its synced model's minus OFFSET, exactly
        assert r["sampling/logprob_diff_mean"] == pytest.approx(OFFSET, abs=1e-5)
        assert r["sampling/mismatch_kl"] == pytest.approx(math.exp(OFFSET) - OFFSET - 1, rel=1e-3)
        assert r["time/weight_sync_s"] > 0 and r["sampling/logprob_diff_max"] >= OFFSET - 1e-5
    assert rows[1]["grad_norm"] > 0


def test_truncated_importance_sampling_scales_the_policy_term(stand_in, tmp_path):
    """TRL's token_truncate: min(exp(t - s), cap) per token, here exp(OFFSET) = 1.051 capped at 1.02 on every token:
    the first step's loss and gradient norm (before clipping) are 1.02 x the uncorrected ones."""
    metrics = {}
    for cap in (None, 1.02):
        trainer = _trainer(_config(tmp_path / str(cap), stand_in().url, vllm_importance_sampling_cap=cap))
        metrics[cap] = trainer.update(trainer.generate(1))
    assert metrics[1.02]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.02)
    assert "sampling/importance_sampling_ratio/mean" not in metrics[None]
    for key in ("loss", "grad_norm"):
        assert metrics[1.02][key] == pytest.approx(1.02 * metrics[None][key], rel=1e-5), key


def test_a_server_that_dies_stops_answering_or_fails_a_sync_ends_the_run_with_a_checkpoint(stand_in, tmp_path):
    for name, kwargs in (("dies", {"fail_on": 3}), ("hangs", {"hang_on": 3}),  # step 2's first group
                         ("sync-fails", {"fail_sync_on": 2})):  # the sync after step 1
        server = stand_in(**kwargs)
        config = _config(tmp_path / name, server.url, vllm_timeout_s=2.0)
        start = time.perf_counter()
        with pytest.raises(TrainingFailed, match=r"step 2: the vLLM sampler failed.*--resume"):
            _trainer(config).fit()
        assert time.perf_counter() - start < 25  # no hang
        assert (tmp_path / name / "run" / "checkpoints" / "step-000001").is_dir()


def test_connect_refuses_no_server_another_model_and_another_vocabulary(stand_in):
    class OtherTokenizer(ByteTokenizer):
        def __call__(self, text, add_special_tokens=False):
            return type("Encoding", (), {"input_ids": [5] * len(text)})

    with pytest.raises(VLLMError, match="no vLLM server answers.*branchreplay vllm-serve --model tiny:llama"):
        VLLMClient.connect("http://127.0.0.1:9", "tiny:llama", ByteTokenizer())
    with pytest.raises(VLLMError, match="serves org/other, but this run trains tiny:llama"):
        VLLMClient.connect(stand_in(served="org/other").url, "tiny:llama", ByteTokenizer())
    with pytest.raises(VLLMError, match="another vocabulary"):
        VLLMClient.connect(stand_in(tokenizer=OtherTokenizer()).url, "tiny:llama", ByteTokenizer())


def test_vllm_settings_it_cannot_run_are_refused_by_name(tmp_path):
    base = {"sampling": {"backend": "vllm"}}
    with pytest.raises(ValueError, match="vllm does not run sampling.branching"):
        Config.from_dict({"sampling": {"backend": "vllm", "branching": [[0, 2], [3, 4]]}})
    with pytest.raises(ValueError, match="LoRA"):
        Config.from_dict({**base, "model": {"lora_r": 8}})
    with pytest.raises(ValueError, match="algorithm=reinforce_pp"):
        Config.from_dict({"algorithm": "reinforce_pp", "sampling": {"backend": "vllm",
                                                                    "vllm_importance_sampling_cap": 2.0}})
    with pytest.raises(ValueError, match="GSPO's sequence-level"):
        Config.from_dict({"sampling": {"backend": "vllm", "vllm_importance_sampling_cap": 2.0},
                          "grpo": {"importance_sampling_level": "sequence"}})


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("BRANCHREPLAY_VLLM_URL"),
                    reason="needs a running `branchreplay vllm-serve --model smollm2` at BRANCHREPLAY_VLLM_URL")
def test_real_vllm_server_matches_the_trainer_before_and_after_a_sync(tmp_path):
    """SmolLM2 on a real vLLM server: the server's logprobs equal the run's own (float32: within 1e-4 nats on
    average) at step 1 and, after the first weight sync, at step 2 (a stale tied LM head showed 1.5e-3 here)."""
    config = Config.from_dict({"sampling": {"backend": "vllm", "vllm_url": os.environ["BRANCHREPLAY_VLLM_URL"],
                                            "max_new_tokens": 24},
                               "task": {"reward": "test_lora:length_reward"},  # spread in every group: all train
                               "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-4},
                               "train": {"steps": 2, "output_dir": str(tmp_path / "run"), "eval_steps": -1}})
    run = Trainer(config).fit()
    rows = [r for r in _metrics(run) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sampling/logprob_diff_mean"] < 1e-4, r["sampling/logprob_diff_mean"]
