"""sampling.backend=vllm: the client and the trainer against a stand-in vLLM server, and (marked `vllm`) against a
real one.

The stand-in speaks the endpoints the client uses (rl/rollouts/vllm/client.py) from a thread of this process. It samples
tokens at random and reports their logprobs under ITS OWN copy of the tiny model, minus OFFSET, and loads the
weights the trainer syncs, so that the run's own old-policy logprobs t and the server's s differ by exactly OFFSET
on every token as long as the sync works: sampling/logprob_diff_mean = OFFSET, and after the first update a sync
that did not arrive shows as another value. It can also fail on a chosen request (HTTP 500, as a dead vLLM engine
answers), stop answering, or fail a weight sync.

The real-server test needs a running `branchreplay vllm-serve --model smollm2` and BRANCHREPLAY_VLLM_URL set to it
(e.g. http://127.0.0.1:8000); it is skipped otherwise.
"""

import http.server
import itertools
import json
import math
import os
import shutil
import threading
import time

import pytest
import safetensors.torch
import torch

from branchreplay.rl.config import Config
from branchreplay.rl.rollouts.vllm.client import VLLMClient, VLLMError
from branchreplay.rl.run.stops import TrainingFailed
from branchreplay.rl.run.trainer import Trainer
from branchreplay.tiny_models import tiny_model
from test_rl_run_trainer import DATA, ByteTokenizer, byte_reward, generate, train_on

OFFSET = 0.05  # the stand-in's logprobs are its model's minus this


class StandIn:
    """A vLLM server stand-in on 127.0.0.1 (a free port). `fail_on`: the completion request number (1-based) that
    answers HTTP 500; `hang_on`: the one that never answers; `fail_sync_on`: the weight sync (1-based) that answers
    HTTP 500; `served`: the model name it reports; `model`: its model (the tiny Llama by default)."""

    def __init__(self, served="tiny:llama", tokenizer=None, fail_on=None, hang_on=None, fail_sync_on=None,
                 model=None):
        self.model = (model or tiny_model("llama", seed=0)).eval()
        self.served, self.tokenizer = served, tokenizer or ByteTokenizer()
        self.fail_on, self.hang_on, self.fail_sync_on = fail_on, hang_on, fail_sync_on
        self.requests = self.syncs = 0
        self.bodies = []  # every completion request's body
        self.adapters = {}  # LoRA: name -> the model with that adapter (peft)
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
                elif self.path == "/v1/load_lora_adapter":
                    import copy

                    from peft import PeftModel

                    base = copy.deepcopy(stand_in.model)
                    stand_in.adapters[body["lora_name"]] = PeftModel.from_pretrained(base, body["lora_path"]).eval()
                    stand_in.syncs += 1
                    self.answer(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
                elif self.path == "/v1/unload_lora_adapter":
                    del stand_in.adapters[body["lora_name"]]
                    self.answer(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
                else:
                    with stand_in.lock:  # handler threads run side by side
                        stand_in.requests += 1
                        number = stand_in.requests
                        stand_in.bodies.append(body)
                    if number == stand_in.hang_on:
                        time.sleep(30)
                    if number == stand_in.fail_on:
                        self.send_response(500)
                        self.end_headers()
                        self.wfile.write(b'{"error": {"message": "EngineCore encountered an issue"}}')
                        return
                    self.answer(stand_in.complete(body))

            def answer(self, payload):  # JSON, or words as vLLM's LoRA endpoints answer
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
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
        for i in range(body["n"]):  # as vLLM: a completion ends early only with a stop token
            n = int(torch.randint(1, body["max_tokens"] + 1, (1,), generator=generator)) if i % 2 == 0 else \
                body["max_tokens"]
            ids = torch.randint(3, 256, (n,), generator=generator).tolist()
            if n < body["max_tokens"]:
                ids[-1] = body["stop_token_ids"][0]
            model = self.adapters[body["model"]] if body["model"] in self.adapters else self.model
            assert body["model"] in self.adapters or not self.adapters, "a request names an unloaded adapter"
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
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


def _config(tmp_path, url, model: dict | None = None, **sampling):
    return Config.from_dict({
        "model": {"spec": "tiny:llama", **(model or {})},
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


def test_branching_samples_each_shared_prefix_once_then_continues_it(stand_in, tmp_path):
    """sampling.branching [[0, 2], [3, 2]]: 2 completions of each prompt up to 3 tokens, then each continued 2 ways
    as a request whose prompt is the prompt plus that prefix (one for a prefix that did not end); the pairs share
    their 3 tokens, and the server's logprobs line up with the run's (logprob_diff = OFFSET)."""
    server = stand_in()
    trainer = _trainer(_config(tmp_path, server.url, branching=[[0, 2], [3, 2]]))
    batch = generate(trainer, 1)
    prompts = {tuple(p) for p in batch.prompt_ids}
    level0 = [b for b in server.bodies if tuple(b["prompt"]) in prompts]
    forks = [b for b in server.bodies if tuple(b["prompt"]) not in prompts]
    assert len(level0) == len(prompts) and all(b["n"] == 2 and b["max_tokens"] == 3 for b in level0)
    going = 0  # level-0 streams that did not end within 3 tokens: one request each, n = 2, up to 3 more tokens
    for prompt_ids, group in zip(batch.prompt_ids, batch.samples, strict=True):
        assert len(group) == 4
        for a, b in ((group[0], group[1]), (group[2], group[3])):
            assert a.completion_ids[:3] == b.completion_ids[:3] and b.parent is not None
            if not (a.completion_ids[-1] == 2 and len(a.completion_ids) <= 3):  # a prefix that went on: a request
                going += 1
                assert prompt_ids + a.completion_ids[:3] in [f["prompt"] for f in forks]
            else:  # ended before the fork: copied as it is
                assert a.completion_ids == b.completion_ids
        assert group[2].parent is None
    assert going >= 1 and len(forks) == going and all(f["n"] == 2 and f["max_tokens"] == 3 for f in forks)
    server.bodies.clear()
    run = trainer.fit()
    rows = [r for r in _metrics(run) if "sampling/logprob_diff_mean" in r]
    assert rows and all(r["sampling/logprob_diff_mean"] == pytest.approx(OFFSET, abs=1e-5) for r in rows)


def test_lora_syncs_the_adapter_alone_and_samples_with_it(stand_in, tmp_path):
    """model.lora_r: the run's base weights once (the server held another model's: a server an earlier run
    trained), then after each update the adapter (not the model) loaded under a new name, the previous one
    unloaded, and the requests name it: the server's logprobs then follow the trained adapter (logprob_diff =
    OFFSET at step 2, after an update moved the adapter's B off zero)."""
    pytest.importorskip("peft", reason="LoRA is the peft extra")
    server = stand_in(model=tiny_model("llama", seed=1))  # other base weights than the run's
    run = _trainer(_config(tmp_path, server.url, model={"lora_r": 4, "lora_alpha": 8.0})).fit()
    assert server.syncs == 3 and len(server.adapters) == 1  # base, adapter at the start, after step 1
    assert all(b["model"].startswith("policy-") for b in server.bodies)
    rows = [r for r in _metrics(run) if "sampling/logprob_diff_mean" in r]
    assert rows and rows[-1]["step"] == 2
    assert rows[-1]["sampling/logprob_diff_mean"] == pytest.approx(OFFSET, abs=1e-5)


def test_multi_turn_asks_every_trajectorys_next_turn_together(stand_in, tmp_path, monkeypatch):
    """A multi-turn task (test_rl_agent.py's Counter, turn_branching [2, 2]) with the server: one round of requests per
    turn for every item's trajectories together (2 items, then their 4 first replies, ...), each request's prompt
    the conversation so far (which extends an earlier request's: the server's prefix cache holds it); the
    trajectories are the run's rollouts, and the server's logprobs line up with the run's after a sync."""
    import copy

    from branchreplay.rl.rollouts.vllm import backend
    from test_rl_agent import ITEMS, Counter, make_config
    from test_rl_agent_environments import TurnTokenizerWithDecode, _chatty_model

    model = _chatty_model()
    server = stand_in(model=copy.deepcopy(model), tokenizer=TurnTokenizerWithDecode())
    rounds = []
    turn = backend.sample_trees
    monkeypatch.setattr(backend, "sample_trees", lambda client, requests, *a: rounds.append(requests) or
                        turn(client, requests, *a))
    config = make_config(tmp_path, sampling={"backend": "vllm", "vllm_url": server.url, "temperature": 0.7})
    trainer = Trainer(config, model=model, tokenizer=TurnTokenizerWithDecode(), train_data=ITEMS,
                      eval_data=ITEMS[:3], env=Counter())
    batch = generate(trainer, 1)
    assert len(rounds[0]) == 2 and all(schedule == {0: 2} for _, schedule in rounds[0])  # one per item
    assert len(rounds[1]) >= 2 and len(rounds) >= 3  # the replies that got an answer, all together
    for earlier, later in itertools.pairwise(rounds):
        assert all(any(ids[:len(e)] == e for e, _ in earlier) for ids, _ in later)
    flat = [t for g in batch.trajectories for t in g]
    assert 4 <= len(flat) <= 8 and max(t.turns for t in flat) >= 2  # a first reply cut short is not continued
    for group, trajectories in zip(batch.rollouts, batch.trajectories, strict=True):
        for r, t in zip(group, trajectories, strict=True):
            assert r.token_ids.tolist() == t.conversation.ids
    run = trainer.fit()
    rows = [r for r in _metrics(run) if "sampling/logprob_diff_mean" in r]
    assert rows and all(r["sampling/logprob_diff_mean"] == pytest.approx(OFFSET, abs=1e-5) for r in rows)


@pytest.mark.slow
def test_truncated_importance_sampling_scales_the_policy_term(stand_in, tmp_path):
    """TRL's token_truncate: min(exp(t - s), cap) per token, here exp(OFFSET) = 1.051 capped at 1.02 on every token:
    the first step's loss and gradient norm (before clipping) are 1.02 x the uncorrected ones."""
    metrics = {}
    for cap in (None, 1.02):
        trainer = _trainer(_config(tmp_path / str(cap), stand_in().url, vllm_importance_sampling_cap=cap))
        metrics[cap] = train_on(trainer, generate(trainer, 1))
    assert metrics[1.02]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.02)
    assert "sampling/importance_sampling_ratio/mean" not in metrics[None]
    for key in ("loss", "grad_norm"):
        assert metrics[1.02][key] == pytest.approx(1.02 * metrics[None][key], rel=1e-5), key


@pytest.mark.slow
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


def test_the_weights_file_is_overwritten_in_place_and_removed(tmp_path):
    """The sync's file: the second write overwrites the first's tensors in place (same folder; the server reads
    the new values, a tied weight included), a state of other shapes gets a new file, close removes it, and the
    folder of a process that no longer runs is removed when the next one is made."""
    from branchreplay.rl.rollouts.vllm.weights_file import PREFIX, WeightsFile, owned

    model = tiny_model("llama", seed=0)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one storage under two names
    weights = WeightsFile()
    folder = weights.write(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert weights.write(model.state_dict()) == folder
    loaded = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    scratch = os.path.dirname(folder)
    stale = os.path.join(scratch, owned(PREFIX).replace(f"-{os.getpid()}-", "-999999999-") + "x")
    elsewhere = os.path.join(scratch, f"{PREFIX}another-host-999999999-x")  # a container sharing /dev/shm
    os.makedirs(stale)
    os.makedirs(elsewhere)
    assert weights.write({"w": torch.ones(3)}) != folder and not os.path.exists(folder)
    assert not os.path.exists(stale) and os.path.exists(elsewhere)
    os.rmdir(elsewhere)
    shutil.rmtree(weights.folder)  # removed under the run (e.g. systemd's RemoveIPC): written again
    folder = weights.write({"w": torch.ones(3)})
    assert torch.equal(safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))["w"], torch.ones(3))
    weights.close()
    assert weights.folder is None


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
    with pytest.raises(ValueError, match="vllm does not run algorithm=dpo"):
        Config.from_dict({"algorithm": "dpo", "dpo": {"dataset": "pairs.jsonl"}, "sampling": {"backend": "vllm"}})
    with pytest.raises(ValueError, match="algorithm=reinforce_pp"):
        Config.from_dict({"algorithm": "reinforce_pp", "sampling": {"backend": "vllm",
                                                                    "vllm_importance_sampling_cap": 2.0}})
    with pytest.raises(ValueError, match="GSPO's sequence-level"):
        Config.from_dict({"sampling": {"backend": "vllm", "vllm_importance_sampling_cap": 2.0},
                          "grpo": {"importance_sampling_level": "sequence"}})


REAL = {  # the settings of each real-server case, over a short GRPO run of SmolLM2
    "single-turn": {},
    "branching": {"sampling": {"branching": [[0, 2], [6, 2]]}},
    "multi-turn": {"agent": {"environment": "calculator", "max_turns": 2, "max_tool_output_tokens": 32},
                   "sampling": {"turn_branching": [2, 2]},  # the verifier's reward: more groups, so that one trains
                   "grpo": {"prompts_per_step": 6}},
    "lora": {"model": {"lora_r": 8, "lora_alpha": 16.0}, "grpo": {"learning_rate": 2e-3}},  # the server: --lora-rank
}


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("BRANCHREPLAY_VLLM_URL"),
                    reason="needs a running `branchreplay vllm-serve --model smollm2 --lora-rank 8` at "
                           "BRANCHREPLAY_VLLM_URL")
@pytest.mark.parametrize("case", REAL)
def test_real_vllm_server_matches_the_trainer_before_and_after_a_sync(tmp_path, case):
    """SmolLM2 on a real vLLM server: the server's logprobs equal the run's own (float32: within 1e-4 nats on
    average) at step 1 and, after the first weight (or adapter) sync, at step 2 (a stale tied LM head showed 1.5e-3
    here): single-turn, with a branching schedule, multi-turn with the calculator, and LoRA."""
    data = {"sampling": {"backend": "vllm", "vllm_url": os.environ["BRANCHREPLAY_VLLM_URL"], "max_new_tokens": 24},
            "task": {"reward": "test_models_lora:length_reward"},  # spread in every group: all train
            "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-4},
            "train": {"steps": 2, "output_dir": str(tmp_path / "run"), "eval_steps": -1}}
    for section, values in REAL[case].items():
        data[section] = {**data.get(section, {}), **values}
    if case == "multi-turn":
        del data["task"]  # the environment scores the trajectories
    run = Trainer(Config.from_dict(data)).fit()
    rows = [r for r in _metrics(run) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    rows = [r for r in rows if "sampling/logprob_diff_mean" in r]  # a step where no group trains has none
    assert rows
    for r in rows:
        print(f"{case} step {r['step']}: logprob_diff_mean {r['sampling/logprob_diff_mean']:.1e}, weight sync "
              f"{r['time/weight_sync_s']:.2f} s")
        assert r["sampling/logprob_diff_mean"] < 1e-4, r["sampling/logprob_diff_mean"]


def test_rollouts_drawn_ahead_by_the_server_use_the_weights_of_one_step_before(stand_in, tmp_path):
    """grpo.max_staleness 1: the sampler process drives the server, pushing each version's weights once before it
    asks: version 0 draws steps 1 and 2, version 1 step 3. The server's logprobs are the old ones (TRL's
    AsyncGRPOTrainer), so the first step's ratio is exp(OFFSET) on every token."""
    server = stand_in()
    config = _config(tmp_path, server.url)
    config.grpo.max_staleness, config.train.steps = 1, 3
    rows = _metrics(_trainer(config).fit())
    assert [r["sample/staleness_max"] for r in rows] == [0, 1, 1] and server.syncs == 2
    assert rows[0]["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(OFFSET), rel=1e-5)


def test_a_server_that_dies_under_rollouts_ahead_ends_the_run_with_a_checkpoint(stand_in, tmp_path):
    """The sampler process's request fails (HTTP 500 on step 2's first group, drawn while step 1 trains): the run
    ends at step 2 with the vLLM sampler named and step 1's checkpoint kept."""
    config = _config(tmp_path, stand_in(fail_on=3).url, vllm_timeout_s=2.0)
    config.grpo.max_staleness, config.train.steps = 1, 3
    with pytest.raises(TrainingFailed, match=r"step 2: the vLLM sampler failed.*--resume"):
        _trainer(config).fit()
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()
