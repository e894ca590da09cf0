"""vLLM as the rollout engine: the server command (`branchreplay vllm-serve`) and the trainer's client.

vLLM pins its own torch and transformers, so it runs in its own virtual environment (`make vllm`: `.venv-vllm`) and
process, as vLLM's OpenAI-compatible server with its development endpoints on (VLLM_SERVER_DEV_MODE=1). The trainer
talks to it over HTTP, standard library only (`VLLMClient` lists the endpoints it calls). Prefix caching is on, so a
group's G requests prefill their shared prompt once. A server that is not there, dies or stops answering raises
`VLLMError` (after `timeout_s`), never hangs the run; the trainer then checkpoints and stops.
Measurements: docs/notes/sampler.md.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import http.client
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .weights_file import ADAPTER_PREFIX, WeightsFile, owned, remove_stale, scratch_folder

PROBE_TEXT = "The quick brown fox counts 12 + 30 = 42 tokens."
"""A text whose ids must be the same under the server's tokenizer and the trainer's (a vocabulary check)."""


MAX_IN_FLIGHT = 256
"""Requests one `complete` call keeps in flight at most (one thread each)."""


class VLLMError(OSError):
    """The vLLM server is unreachable, answered with an error, serves another model or vocabulary, or failed to
    load the synced weights (an OSError: the command line reports it as one line)."""


def serve_command(model_dir: str, host: str = "127.0.0.1", port: int = 8000, python: str = ".venv-vllm/bin/python",
                  max_model_len: int | None = None, dtype: str = "float32", kv_cache_gib: float = 4.0,
                  lora_rank: int | None = None) -> list[str]:
    """The command line of a vLLM server for `model_dir` (a Hugging Face folder): prefix caching on, logprobs after
    temperature, in `dtype` (float32 on CPUs without bf16 units, where bf16 runs slower), with `kv_cache_gib` GiB
    of KV cache (on CPU vLLM otherwise reserves 92% of the machine's memory, which the trainer needs too);
    `lora_rank`: LoRA adapters of rank up to it, loaded at run time (a run with model.lora_r syncs its adapter)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", host,
               "--port", str(port), "--dtype", dtype, "--enable-prefix-caching",
               "--logprobs-mode", "processed_logprobs", "--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30)),
               "--generation-config", "vllm"]  # not the model's generation_config.json sampling defaults
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if lora_rank:
        command += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
    return command


def serve_environment(threads: int | None = None) -> dict[str, str]:
    """The server's environment: development endpoints on (weight reload, prefix-cache reset, LoRA adapters loaded
    at run time); on CPU, its OpenMP threads bound to cores 0..threads-1 (vLLM keeps a core for itself by
    default)."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    cores = threads or os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    return env


@dataclass
class VLLMClient:
    """A connection to one vLLM server. Create it with `connect`.

    url: e.g. "http://127.0.0.1:8000". model: the served model's name (its folder). timeout_s: how long one request
    may take before the server counts as not answering (seconds). The endpoints it calls:

        GET  /v1/models                          the served model (its folder) and max_model_len: checked at connect
        POST /tokenize                           a probe text's ids, compared with the trainer's tokenizer at connect
        POST /v1/completions                     prompt token ids, n samples, return_token_ids, logprobs=0: each
                                                 sample's token ids and the sampled tokens' logprobs, after
                                                 temperature (the server runs with --logprobs-mode processed_logprobs);
                                                 a branching schedule is a request per fork (`sampling.py`)
        POST /collective_rpc reload_weights      after each optimizer update: the policy's weights, written as one
                                                 safetensors file in a folder the server can read (overwritten in
                                                 place each update: `weights_file.py`), loaded in place
        POST /reset_prefix_cache                 then: cached prefixes were computed with the old weights
        POST /v1/load_lora_adapter               LoRA (model.lora_r > 0): the adapter alone, under a new name each
                                                 update, the previous one unloaded (`sync_adapter`)
    """

    url: str
    model: str
    timeout_s: float = 600.0
    max_model_len: int | None = None
    adapter: str | None = None  # the LoRA adapter requests name (`sync_adapter`), None for the model's own weights
    adapter_dir: str | None = None  # its folder, kept while the server may read it
    weights: WeightsFile = field(default_factory=WeightsFile)  # the weight-sync file (`sync_weights`)

    @classmethod
    def connect(cls, url: str, model_dir: str, tokenizer, timeout_s: float = 600.0) -> VLLMClient:
        """Check that the server at `url` serves `model_dir` with the trainer's vocabulary.

        Raises VLLMError: nothing answers at `url` (with the command that starts a server), the server serves
        another model, or its tokenizer gives other ids for `PROBE_TEXT` (another vocabulary)."""
        url = url.rstrip("/")
        try:
            served = _request(f"{url}/v1/models", None, timeout_s=10.0)["data"][0]
        except VLLMError as e:
            raise VLLMError(f"no vLLM server answers at {url} ({e}); start one with: branchreplay vllm-serve --model "
                            f"{model_dir}") from e
        root = served.get("root") or served["id"]
        if _resolved(root) != _resolved(model_dir):
            raise VLLMError(f"the vLLM server at {url} serves {root}, but this run trains {model_dir}: start "
                            f"`branchreplay vllm-serve --model {model_dir}` (or point sampling.vllm_url elsewhere)")
        client = cls(url, served["id"], timeout_s, served.get("max_model_len"))
        theirs = client.post("/tokenize", {"model": client.model, "prompt": PROBE_TEXT,
                                           "add_special_tokens": False})["tokens"]
        ours = tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
        if list(theirs) != list(ours):
            raise VLLMError(f"the vLLM server at {url} tokenizes {PROBE_TEXT!r} as {theirs[:12]}..., this run's "
                            f"tokenizer as {ours[:12]}...: another vocabulary; serve this run's model folder")
        return client

    def post(self, path: str, body: dict | None = None, answer: str = "json") -> dict:
        """POST `body` as JSON to `path`; the JSON answer ({} for an empty one), or {"text": ...} with
        answer="text" (the LoRA endpoints answer in words). Raises VLLMError."""
        return _request(self.url + path, body if body is not None else {}, self.timeout_s, answer)

    def complete(self, requests: list[tuple[list[int], int, int]], temperature: float, top_p: float, top_k: int,
                 eos_ids: set[int]) -> list[list[tuple[list[int], list[float], bool]]]:
        """Each request (prompt token ids, n, max_tokens) sampled n times, all requests in flight together so that
        the server batches them: per request, per completion (token ids, ending with the EOS when one was sampled;
        float logprobs of those ids after temperature, nats; cut, True when no EOS came within max_tokens). The
        requests carry no seed: vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") on seeded
        requests batched together, so vLLM's samples are not reproducible run to run. Raises VLLMError, and
        ValueError when a prompt plus its max_tokens is longer than the server's max_model_len."""
        with concurrent.futures.ThreadPoolExecutor(min(max(len(requests), 1), MAX_IN_FLIGHT)) as pool:
            return list(pool.map(lambda r: self._sample_one(r[0], r[1], temperature, top_p, top_k, r[2], eos_ids),
                                 requests))

    def _sample_one(self, prompt_ids, n, temperature, top_p, top_k, max_new_tokens, eos_ids):
        if self.max_model_len and len(prompt_ids) + max_new_tokens > self.max_model_len:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus the tokens to sample ({max_new_tokens}, "
                             "sampling.max_new_tokens or what is left of it) is more than the vLLM server's "
                             f"max_model_len ({self.max_model_len}): lower sampling.max_new_tokens or restart the "
                             "server with a larger --max-model-len")
        answer = self.post("/v1/completions", {
            "model": self.adapter or self.model, "prompt": prompt_ids, "n": n, "max_tokens": max_new_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else -1,
            "logprobs": 0, "return_token_ids": True, "stop_token_ids": sorted(eos_ids), "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            # explicit, or vLLM takes them from the model's generation_config: another policy than the trainer's
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0})
        out = []
        try:
            choices = [(list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]])
                       for c in sorted(answer["choices"], key=lambda c: c["index"])]
        except (KeyError, TypeError, ValueError) as e:
            raise VLLMError(f"the vLLM server's completion answer lacks token ids or logprobs ({e!r})") from e
        for ids, logprobs in choices:
            if len(logprobs) != len(ids):
                raise VLLMError(f"the vLLM server returned {len(ids)} token ids but {len(logprobs)} logprobs")
            out.append((ids, logprobs, not (ids and ids[-1] in eos_ids)))
        if len(out) != n:
            raise VLLMError(f"the vLLM server returned {len(out)} completions for n={n}")
        return out

    def sync_weights(self, state: dict, keep: bool = True) -> float:
        """Load `state` (the model's `state_dict()`, tied weights included: vLLM's CPU backend keeps its own copy of
        a tied LM head, which a file without `lm_head.weight` leaves stale) into the server's model in place, then
        drop its prefix cache (the cached prefixes' K/V were computed with the old weights); returns the seconds it
        took. The file (`weights_file.WeightsFile`: in memory where there is room, written once and then
        overwritten in place; `keep=False` removes it after this sync) is on this machine, which the server must
        be able to read (a server on another machine needs a shared filesystem). Raises VLLMError when the server
        fails to load it."""
        start = time.perf_counter()
        try:
            try:
                folder = self.weights.write(state)
            except OSError as e:  # a full or missing folder: the run stops as when the server fails
                raise VLLMError(f"writing the weights for the vLLM server failed: {e}") from e
            self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
            if not self.post("/reset_prefix_cache").get("success", True):
                raise VLLMError("the vLLM server could not reset its prefix cache after the weight update (requests "
                                "still running?): its cached prefixes would use the old weights")
        finally:
            if not keep:
                self.weights.close()
        return time.perf_counter() - start


    def sync_adapter(self, model, state: dict) -> float:
        """LoRA: the adapter of `model` (a peft model) with the weights in `state` (its `state_dict()`, or the
        unsharded one) written as a peft folder (adapter_config.json, adapter_model.safetensors: a few MB, where
        `sync_weights` writes the whole model) to a new temporary folder, the server's previous adapter unloaded,
        this one loaded (POST /v1/unload_lora_adapter, /v1/load_lora_adapter) under a new name that the requests
        then name as their model; the new name keys the server's prefix cache, so nothing stale is served. Returns
        the seconds it took. The server must run with LoRA on (`vllm-serve --lora-rank R`) and read this machine's
        temporary folder. Raises VLLMError when it refuses the adapter."""
        import safetensors.torch
        from peft import get_peft_model_state_dict

        start = time.perf_counter()
        adapter = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model, state_dict=state).items()}
        scratch = scratch_folder(adapter)
        remove_stale(scratch or tempfile.gettempdir())
        folder = tempfile.mkdtemp(prefix=owned(ADAPTER_PREFIX), dir=scratch)
        name = f"policy-{os.path.basename(folder)}"
        try:
            safetensors.torch.save_file(adapter, os.path.join(folder, "adapter_model.safetensors"),
                                        metadata={"format": "pt"})
            model.peft_config["default"].save_pretrained(folder)
            for path, mode in ((folder, 0o755), *((os.path.join(folder, f), 0o644) for f in os.listdir(folder))):
                os.chmod(path, mode)
            if self.adapter is not None:
                self.post("/v1/unload_lora_adapter", {"lora_name": self.adapter}, answer="text")
                shutil.rmtree(self.adapter_dir, ignore_errors=True)
                self.adapter = None
            self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}, answer="text")
        except OSError as e:  # VLLMError included
            shutil.rmtree(folder, ignore_errors=True)
            raise VLLMError(f"the vLLM server did not load the LoRA adapter ({e}); start it with "
                            "`branchreplay vllm-serve --lora-rank R` (R >= model.lora_r)") from e
        if self.adapter_dir is None:
            atexit.register(self.remove_adapter_folder)
        self.adapter, self.adapter_dir = name, folder
        return time.perf_counter() - start

    def remove_adapter_folder(self) -> None:
        """The last LoRA sync's folder, removed (at exit)."""
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)


def _resolved(path: str) -> str:
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def _request(url: str, body: dict | None, timeout_s: float, answer: str = "json") -> dict:
    """GET (body None) or POST JSON; the decoded JSON answer ({"text": the answer} for answer="text"). Raises
    VLLMError for a refused or timed-out connection and for an HTTP error (with the server's message)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise VLLMError(f"{url} answered HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        raise VLLMError(f"{url} did not answer within {timeout_s:g} s ({reason})" if isinstance(reason, TimeoutError)
                        or "timed out" in str(reason) else f"{url} is not reachable ({reason})") from e
    if answer == "text":
        return {"text": text}
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise VLLMError(f"{url} answered something that is not JSON: {text[:200]!r}") from e
