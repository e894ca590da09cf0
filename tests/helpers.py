"""Helpers that test modules import (`from helpers import grads`); the fixtures stay in conftest.py.

The gradients of a model and the engine against the naive reference on it (`compare`), how close two float32 sums
of one value may be (`float32_close`), a model held in float64 for as long as it lives (`held_float64`), and
`spawn_ranks`, which starts a worker function on local gloo processes as torchrun would.
"""

import datetime
import os
import weakref

import torch
import transformers
from transformers import PreTrainedModel

from branchreplay.reference.float64 import keep_float64
from branchreplay.tiny_models import tiny_config


def compare(model, rollouts, **engine_kw) -> tuple[float, float, float]:
    """The engine against the naive reference (each rollout alone, unpadded) on the same model, GRPO loss with
    entropy 0.01 at temperature 0.7, every shared node kept plus `engine_kw` (EngineConfig fields): (max relative
    gradient error, max |logprob error| in nats, the naive gradient's L1 norm, 0 when the test would pass trivially)."""
    from branchreplay.engine import EngineConfig, replay_backward
    from branchreplay.engine.config import EVERY_SHARED_NODE
    from branchreplay.losses import GRPOLoss
    from branchreplay.reference.naive import max_rel_grad_err, naive_backward
    from branchreplay.tree import RolloutTree

    loss = GRPOLoss(entropy_coef=0.01)
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, loss, temperature=0.7)
    g_naive = grads(model)
    model.zero_grad(set_to_none=True)
    replay = replay_backward(model, RolloutTree(rollouts), loss, temperature=0.7,
                             engine=EngineConfig(**{**EVERY_SHARED_NODE, **engine_kw}))
    g_replay = grads(model)
    model.zero_grad(set_to_none=True)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    return max_rel_grad_err(g_replay, g_naive), lp_err, sum(g.abs().sum().item() for g in g_naive)


def grads(model) -> list[torch.Tensor]:
    """A copy of every parameter's gradient, zeros where it has none."""
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


FLOAT32_REL = 1024 * torch.finfo(torch.float32).eps  # 1.2e-4, about the float32 gradient comparisons' 1e-4
"""How far two float32 computations of one value that sum in different orders may be apart, relative to the value or
to the scale of the terms it sums, whichever is larger (`float32_close`). A loss sums per-token terms that partly
cancel (a group's advantages sum to 0), so its rounding relative to its own value is float32's epsilon times that
cancellation: 160 epsilons on test_trl_grpo's grpo-kl-off-policy batch under AVX2 kernels (issue 50)."""


def float32_close(ours: float, theirs: float, scale: float = 0.0, rel: float = FLOAT32_REL) -> bool:
    """|ours - theirs| <= rel * max(|theirs|, scale): `scale` the magnitude of the terms summed into the value (a
    value that is 0 in exact arithmetic is all rounding of them)."""
    return abs(ours - theirs) <= rel * max(abs(theirs), scale)


def held_float64(model):
    """`keep_float64` on `model` (a test's own model) for as long as it lives: float64 throughout, so that two runs
    whose sums differ only in their order (one process and two ranks, one forest and per-group trees) agree to
    float64 rounding, where HF's float32 RMSNorm would show float32's."""
    _HELD[model] = keep_float64(model)  # referenced while the model lives (not on it: deepcopy cannot copy it)
    _HELD[model].__enter__()
    return model


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()




RANK_TIMEOUT = datetime.timedelta(seconds=120)  # a collective that one rank skips fails the test instead of hanging CI


def spawn_ranks(fn, world: int, *args, group: bool = True) -> None:
    """`fn(rank, world, *args)` on `world` processes started by `torch.multiprocessing.spawn`, over gloo on
    127.0.0.1 at a free port, torch on one thread in each. `group`: the process group is started before `fn`
    (collectives time out after RANK_TIMEOUT); else only torchrun's environment is set (RANK, WORLD_SIZE,
    LOCAL_RANK), for code that starts the group itself (`rl.run.parallel.launch`, the trainer). A rank whose `fn`
    returns ends with `end_spawned_rank`; `fn` must be a module-level function (spawn pickles it). Returns when
    every rank has ended; raises `ProcessRaisedException` or `ProcessExitedException` when one failed."""
    import torch.multiprocessing as mp

    from branchreplay.engine.parallel.distributed import free_port

    mp.spawn(_rank, args=(fn, world, free_port(), args, group), nprocs=world, join=True)


def _rank(rank: int, fn, world: int, port: int, args: tuple, group: bool) -> None:
    import torch.distributed as dist

    from branchreplay.engine.parallel.distributed import end_spawned_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if group:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=RANK_TIMEOUT)
    else:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    fn(rank, world, *args)
    end_spawned_rank()  # on success only, after its results are written (engine.parallel.distributed)


def tiny_qwen2_vl_model(dtype: torch.dtype = torch.float32, seed: int = 0, vocab_size: int = 256,
                        image_token_id: int = 250, vision_start_token_id: int = 251, video_token_id: int = 253,
                        **text_overrides) -> PreTrainedModel:
    """Randomly initialised tiny Qwen2VLForConditionalGeneration (vision-language, rotary positions on the image
    grid), in eval mode, parameters in `dtype`, drawn as `tiny_model`'s. Its text model has `tiny_config("qwen2")`'s
    sizes (head_dim 16: multimodal rotary sections [4, 2, 2] over temporal, height, width) with `text_overrides`;
    its vision tower 2 blocks of width 16 on patches of 2 x 2 pixels x 2 frames, merged 2 x 2: an image of grid
    (1, h, w) patches gives h * w / 4 placeholder tokens (pixel_values [h * w, 24] per image). The placeholder,
    vision-start and video ids are inside the vocabulary. Tests only: the package's own tiny models are in
    `branchreplay.tiny_models`."""
    text = {k: v for k, v in tiny_config("qwen2", vocab_size=vocab_size, **text_overrides).to_dict().items()
            if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", *text_overrides)}
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
                bos_token_id=1, eos_token_id=2)
    vision = dict(depth=2, embed_dim=16, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image_token_id,
                                        vision_start_token_id=vision_start_token_id, video_token_id=video_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2VLForConditionalGeneration._from_config(config, attn_implementation="sdpa",
                                                                          dtype=torch.float32)
    return model.to(dtype).eval()
