"""engine/schedule.py: shared nodes whose sharing saves less than a pack costs run again inside each child. The
merged trees stay exact (against the naive per-rollout reference, float64), and the decision follows the saving."""

import zlib

import pytest
import torch

from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.schedule import schedule
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import SHAPES, make_rollouts, shared_prompt
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads

pytestmark = pytest.mark.usefixtures("one_thread")
LOSS = GRPOLoss(beta=0.04, entropy_coef=0.01)


def _compare(model, rollouts, overhead):
    for r in rollouts:  # a KL term: the reference logprobs are per rollout, so a wrong merge would show
        r.ref_logprobs = r.loss_mask.double() * -0.5
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, LOSS, temperature=0.7)
    g_naive = grads(model)
    model.zero_grad(set_to_none=True)
    engine = EngineConfig(pack_overhead_tokens=overhead, prefix_position_overhead=0.1 if overhead else 0,
                          max_pack_tokens=24, chunk_tokens=16)
    replay = replay_backward(model, RolloutTree(rollouts), LOSS, temperature=0.7, engine=engine)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    return max_rel_grad_err(grads(model), g_naive), lp_err, abs(replay.loss - naive.loss), replay


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral", "lfm2"])  # lfm2: conv state, float64 kernels
@pytest.mark.parametrize("shape", ["branches-of-branches", "edge-cases", "multi-turn", "forest"])
def test_merged_trees_equal_naive(arch, shape, tiny64):
    """Every shared node kept (0), some merged (8 positions) and all merged (the dense packed schedule): the
    gradients, logprobs and loss of the naive reference, in float64; the three schedules are the ones named."""
    model = tiny64(arch)
    names = set()
    for overhead in (0, 8, 10**9):
        g = torch.Generator().manual_seed(zlib.crc32(f"{arch}/{shape}".encode()))
        rollouts = make_rollouts(SHAPES[shape](model.config.vocab_size, g), g)
        grad_err, lp_err, loss_err, replay = _compare(model, rollouts, overhead)
        assert grad_err < 1e-9, f"overhead {overhead}: grad error {grad_err:.2e}"
        assert lp_err < 1e-10 and loss_err < 1e-9
        names.add(replay.schedule)
        if overhead == 0:
            assert replay.schedule == "tree" and replay.shared_nodes_kept > 0
        if overhead == 10**9:
            assert replay.schedule == "packed" and replay.shared_nodes_merged > 0
    assert len(names) >= 2


def test_merging_follows_the_saving():
    """A 100-token prompt shared by 8 completions is kept; a 1-token start two of them share by chance is merged
    into its two children (one extra position); a rollout ending at a merged node gets a copy of it."""
    prompt = list(range(3, 103))
    ends = [[200 + k] * 10 for k in range(6)]
    rollouts = [Rollout(prompt + c, [0] * 100 + [1] * 10) for c in ends]
    rollouts += [Rollout(prompt + [150, 151, 152], [0] * 100 + [1] * 3),
                 Rollout(prompt + [150, 160, 161], [0] * 100 + [1] * 3), Rollout(prompt + [150], [0] * 100 + [1])]
    tree = RolloutTree(rollouts)
    result = schedule(tree.root, overhead_tokens=32, attention_per_key=0.0)
    assert (result.kept, result.merged, result.extra_positions) == (1, 1, 2)
    top = result.root.children[0]
    assert len(top) == 100 and len(top.children) == 9  # 6 + the two merged children + the ending copy
    merged = [c for c in top.children if c.tokens[0].item() == 150]
    assert sorted(c.tokens.tolist() for c in merged) == [[150], [150, 151, 152], [150, 160, 161]]
    assert schedule(tree.root, overhead_tokens=0, attention_per_key=0.0).merged == 0
    assert schedule(tree.root, overhead_tokens=10**6, attention_per_key=0.0).kept == 0


def test_a_root_node_also_pays_for_its_childrens_prefix_attention():
    """A 64-token prompt shared by 2 responses of 1024 tokens saves 64 positions: more than a pack (48), less than
    a pack plus 0.1 x the 2048 positions that would attend to it as a prefix: merged. The same 64-token node below
    a shared root pays no such cost (its children attend to a prefix either way): kept, with that root."""
    def responses(head):
        return [Rollout(head + [200 + k] * 1024, [0] * len(head) + [1] * 1024) for k in range(2)]

    at_root = RolloutTree(responses(list(range(3, 67)))).root
    assert schedule(at_root, 48, 0.0).kept == 1
    assert schedule(at_root, 48, 0.0, prefix_overhead=0.1).kept == 0
    root = list(range(500, 600))  # 100 tokens shared with a third, short rollout: 100 > 48 + 0.1 x (64 + 10)
    below = RolloutTree(responses(root + list(range(3, 67))) + [Rollout(root + [7] * 10, [0] * 100 + [1] * 10)])
    assert schedule(below.root, 48, 0.0, prefix_overhead=0.1).kept == 2


def test_the_engine_charges_the_prefix_overhead(tiny64):
    """replay_backward passes prefix_position_overhead to the schedule: an 8-token prompt shared by 2 responses of
    40 tokens runs as a tree when only the (zero) pack overhead counts, packed when each child position costs 1."""
    model = tiny64("llama")
    g = torch.Generator().manual_seed(0)
    tree = RolloutTree(make_rollouts(shared_prompt(8, 2, 40, model.config.vocab_size, g), g))
    for per_position, expected in ((0.0, "tree"), (1.0, "packed")):
        engine = EngineConfig(pack_overhead_tokens=0, prefix_position_overhead=per_position)
        assert replay_backward(model, tree, GRPOLoss(), engine=engine).schedule == expected


def test_low_sharing_tree_runs_packed_and_a_shared_prompt_as_a_tree(tiny64):
    """With the default overhead: a 2-token prompt shared by 2 long responses saves too little (each rollout runs
    alone); a 48-token prompt shared by 8 runs once. replay_logprobs takes the same schedule."""
    model = tiny64("llama")
    g = torch.Generator().manual_seed(0)
    low = RolloutTree(make_rollouts(shared_prompt(2, 2, 40, model.config.vocab_size, g), g))
    high = RolloutTree(make_rollouts(shared_prompt(48, 8, 6, model.config.vocab_size, g), g))
    assert replay_backward(model, low, GRPOLoss()).schedule == "packed"
    assert replay_logprobs(model, low).schedule == "packed"
    assert replay_backward(model, high, GRPOLoss()).schedule == "tree"


def test_pack_overhead_tokens_is_checked():
    with pytest.raises(ValueError, match="engine.pack_overhead_tokens"):
        EngineConfig(pack_overhead_tokens=-1)
    with pytest.raises(ValueError, match="engine.prefix_position_overhead"):
        EngineConfig(prefix_position_overhead=-0.1)


def test_the_trainer_logs_the_schedule(tmp_path):
    """Each step's metrics say which schedule the engine took (the toy task's 6-token completions of short prompts
    share little) and how many shared nodes it merged; the reference methods log none."""
    from test_rl_run_trainer import make_config, make_trainer

    record = make_trainer(make_config(tmp_path)).train_step(1)
    assert record["engine/schedule"] in ("tree", "mixed", "packed")
    assert record["engine/shared_nodes_merged"] >= 0
    naive = make_trainer(make_config(tmp_path / "naive", train={"method": "naive"})).train_step(1)
    assert "engine/schedule" not in naive


def _decoder_shapes_and_errors(model, rollouts, engine):
    """The input_ids shape of every decoder call of one replay_backward with `engine` (after a first replay, so
    the head check and the planner's probes are not counted), and its gradient, logprob and loss errors against
    the naive reference (a KL term included, as in `_compare`)."""
    for r in rollouts:
        r.ref_logprobs = r.loss_mask.double() * -0.5
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, LOSS, temperature=0.7)
    g_naive = grads(model)
    replay_logprobs(model, RolloutTree(rollouts), temperature=0.7, engine=engine)  # the head check, once per model
    replay_backward(model, RolloutTree(rollouts), LOSS, temperature=0.7, engine=engine)  # the planner's probes
    model.zero_grad(set_to_none=True)
    shapes = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        replay = replay_backward(model, RolloutTree(rollouts), LOSS, temperature=0.7, engine=engine)
    finally:
        hook.remove()
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    return shapes, max_rel_grad_err(grads(model), g_naive), lp_err, abs(replay.loss - naive.loss)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])  # mistral: a sliding window over the batch's rows
def test_rollouts_of_one_length_at_the_root_run_as_one_batch(arch, tiny64):
    """The dense packed schedule's rollouts of one length run as the rows of one [B, L] forward (at most
    max_batch_tokens tokens per batch), the others as packs; gradients, logprobs and loss equal the naive
    reference's (float64). Lengths 22 x 3, 30 x 2 and 26: batches [2, 22] (60 tokens hold two rows), [1, 22] and
    [2, 30]; the 26 runs as a pack of one."""
    model = tiny64(arch)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    rollouts = []
    for length in (22, 30, 22, 26, 30, 22):
        tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
        rollouts.append(Rollout(tokens, [0] * 2 + [1] * (length - 2), advantages=torch.randn((), generator=g).item()))
    shapes, grad_err, lp_err, loss_err = _decoder_shapes_and_errors(model, rollouts, EngineConfig(max_batch_tokens=60))
    assert sorted(shapes) == [(1, 22), (1, 26), (2, 22), (2, 30)]
    assert grad_err < 1e-9
    assert lp_err < 1e-10
    assert loss_err < 1e-9


@pytest.mark.parametrize("arch,batched", [("llama", True), ("gpt2", True), ("mistral", False)])
def test_leaves_of_one_length_below_a_prefix_run_as_one_batch(arch, batched, tiny64):
    """Below a shared prompt, the childless responses of one length run as the rows of one [B, L] forward against
    the one prefix (split prefix attention; mistral's sliding window takes the masked path, where they stay packs);
    a response with branches of its own runs as a pack of one. Every shared node kept: gradients, logprobs and loss
    equal the naive reference's (float64)."""
    model = tiny64(arch)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (10,), generator=g).tolist()
    stem = torch.randint(0, vocab, (4,), generator=g).tolist()
    completions = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (8, 8, 8, 11, 11)]
    completions += [stem + torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(2)]  # a branch
    rollouts = [Rollout(prompt + c, [0] * len(prompt) + [1] * len(c), advantages=torch.randn((), generator=g).item())
                for c in completions]
    engine = EngineConfig(pack_overhead_tokens=0, prefix_position_overhead=0)
    shapes, grad_err, lp_err, loss_err = _decoder_shapes_and_errors(model, rollouts, engine)
    if batched:  # the stem (a pack: it has children), the prompt, the stem's leaves, the 11s, the 8s
        assert sorted(shapes) == [(1, 4), (1, 10), (2, 5), (2, 11), (3, 8)]
    else:
        assert (3, 8) not in shapes and all(rows == 1 for rows, _ in shapes)
    assert grad_err < 1e-9
    assert lp_err < 1e-10
    assert loss_err < 1e-9
