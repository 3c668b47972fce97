"""The update path on a tiny Qwen2: parameters move, on-policy clipfrac is 0, accumulation is exact,
non-finite steps are skipped and counted, and too many abort."""

import copy

import pytest
import torch

from ragen_tasks.config import AlgoConfig, OptimConfig
from ragen_tasks.data.synthetic import synthetic_trajectories
from ragen_tasks.data.token_batch import collate
from ragen_tasks.training.backend import make_optimizer, make_train_model
from ragen_tasks.training.critic import make_critic, make_reference
from ragen_tasks.training.update import NonFiniteUpdateError, ppo_update
from tests.training._models import tiny_actor


def _setup(algo: AlgoConfig, optim: OptimConfig, *, critic: bool):
    actor_m = tiny_actor(0)
    actor = make_train_model(actor_m, make_optimizer(actor_m, lr=optim.lr, weight_decay=0.0), optim)
    crit = None
    if critic:
        c = make_critic(actor_m)
        crit = make_train_model(c, make_optimizer(c, lr=optim.critic_lr, weight_decay=0.0), optim)
    return actor_m, actor, crit


def test_gae_parameters_move_and_first_clipfrac_zero():
    algo = AlgoConfig(advantage="gae", kl_mode="in_reward", filter_keep_ratio=1.0)
    optim = OptimConfig(lr=1e-3, critic_lr=1e-3, ppo_epochs=2, minibatch_size=8, micro_batch_size=4)
    actor_m, actor, crit = _setup(algo, optim, critic=True)
    before = copy.deepcopy(actor_m.state_dict())
    critic_before = copy.deepcopy(crit.module.state_dict())
    ref = make_reference(actor_m)
    m = ppo_update(
        collate(synthetic_trajectories()),
        actor=actor,
        critic=crit,
        ref_model=ref,
        algo=algo,
        optim=optim,
        generator=torch.Generator().manual_seed(0),
    )
    assert m["actor/first_clipfrac"] == 0.0
    assert m["actor/steps"] == 4 and m["actor/skipped_steps"] == 0
    for k in (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/approx_kl",
        "actor/entropy",
        "critic/vf_loss",
        "actor/clipfrac_low",
        "actor/clipfrac_high",
        "timing/update_s",
        "perf/tokens_per_s",
        "actor/reward_kl",
    ):
        assert isinstance(m[k], float), k
    moved = [k for k, v in actor_m.state_dict().items() if not torch.equal(v, before[k])]
    assert set(moved) == set(before)  # every parameter moved
    assert all(not torch.equal(v, critic_before[k]) for k, v in crit.module.state_dict().items())


def test_gradient_accumulation_matches_full_minibatch():
    """Micro-batches of 3 accumulate the same gradient as one pass over the 16-row minibatch, and
    report the same metrics (the entropy too: every micro-batch computes it).

    Compared through plain SGD (lr 1: the weight change IS the clipped gradient), not AdamW: Adam
    divides by sqrt(v), which turns float round-off on a ~1e-8 gradient into a lr-sized change
    that differs between CPUs and thread counts."""
    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0, kl_mode="none")
    batch = collate(synthetic_trajectories())
    results = []
    for micro in (16, 3):
        optim = OptimConfig(lr=1.0, minibatch_size=16, micro_batch_size=micro)
        actor_m = tiny_actor(0)
        before = copy.deepcopy(actor_m.state_dict())
        actor = make_train_model(actor_m, torch.optim.SGD(actor_m.parameters(), lr=1.0), optim)
        m = ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=torch.Generator().manual_seed(0))
        assert m["actor/steps"] == 1
        change = {k: v - before[k] for k, v in actor_m.state_dict().items()}  # = -clipped gradient
        results.append((change, m))
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy"):
        assert results[0][1][key] == pytest.approx(results[1][1][key], rel=1e-4, abs=1e-6), key
    for k, v in results[0][0].items():
        torch.testing.assert_close(v, results[1][0][k], rtol=1e-4, atol=1e-6, msg=k)


def _one_zero_variance_group() -> list:
    from dataclasses import replace

    trajs = synthetic_trajectories(n_groups=2, group_size=4)
    return [replace(t, turn_rewards=[1.0, 0.0], reward=1.0) if t.group_id == 0 else t for t in trajs]


def test_zero_variance_groups_are_skipped_before_forward():
    trajs = _one_zero_variance_group()
    algo = AlgoConfig(
        advantage="grpo", kl_mode="in_loss", kl_estimator="k3", filter_keep_ratio=1.0, drop_zero_advantage=True
    )
    optim = OptimConfig(lr=1e-3, minibatch_size=8, micro_batch_size=8)
    actor_m, actor, _ = _setup(algo, optim, critic=False)
    m = ppo_update(
        collate(trajs),
        actor=actor,
        ref_model=make_reference(actor_m),
        algo=algo,
        optim=optim,
        generator=torch.Generator().manual_seed(0),
    )
    assert m["batch/skipped_zero_adv"] == 4.0
    assert m["perf/tokens"] == sum(t.num_tokens for t in trajs if t.group_id == 1)
    assert "actor/kl_loss" in m


def test_vanilla_keeps_zero_advantage_rows_in_the_token_mean():
    """Without drop_zero_advantage (vanilla StarPO, as verl / RAGEN) every row reaches the loss: the
    zero-advantage rows add tokens to the token-mean denominator, so the gradient is smaller by
    exactly the token ratio (the pre-clip gradient norm, taken before the optimizer steps)."""
    trajs = _one_zero_variance_group()
    grads = {}
    for drop in (True, False):
        algo = AlgoConfig(advantage="grpo", kl_mode="none", filter_keep_ratio=1.0, drop_zero_advantage=drop)
        optim = OptimConfig(lr=1e-3, minibatch_size=8, micro_batch_size=8, max_grad_norm=1e9)
        _, actor, _ = _setup(algo, optim, critic=False)
        m = ppo_update(collate(trajs), actor=actor, algo=algo, optim=optim, generator=torch.Generator().manual_seed(0))
        assert m["batch/zero_adv_rows"] == 4.0
        grads[drop] = m["actor/grad_norm"]
        if not drop:
            assert "batch/skipped_zero_adv" not in m
            assert m["perf/tokens"] == sum(t.num_tokens for t in trajs)
    kept = sum(sum(t.loss_mask) for t in trajs if t.group_id == 1)
    every = sum(sum(t.loss_mask) for t in trajs)
    assert grads[False] == pytest.approx(grads[True] * kept / every, rel=1e-4)


def test_non_finite_steps_are_skipped_then_abort():
    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
    optim = OptimConfig(lr=1e-3, minibatch_size=4, micro_batch_size=4, max_consecutive_skips=10)
    actor_m, actor, _ = _setup(algo, optim, critic=False)
    with torch.no_grad():
        actor_m.model.norm.weight[0] = float("nan")
    before = copy.deepcopy(actor_m.state_dict())
    m = ppo_update(
        collate(synthetic_trajectories()),
        actor=actor,
        algo=algo,
        optim=optim,
        generator=torch.Generator().manual_seed(0),
    )
    assert m["actor/skipped_steps"] == 4 and m["actor/steps"] == 0
    for k, v in actor_m.state_dict().items():
        assert torch.equal(v, before[k]) or k == "model.norm.weight"
    strict = OptimConfig(lr=1e-3, minibatch_size=4, micro_batch_size=4, max_consecutive_skips=3)
    actor2 = make_train_model(actor_m, make_optimizer(actor_m, lr=1e-3, weight_decay=0.0), strict)
    with pytest.raises(NonFiniteUpdateError, match="max_consecutive_skips=3"):
        ppo_update(
            collate(synthetic_trajectories()),
            actor=actor2,
            algo=algo,
            optim=strict,
            generator=torch.Generator().manual_seed(0),
        )


def test_missing_critic_or_reference_is_a_clear_error():
    optim = OptimConfig()
    _, actor, _ = _setup(AlgoConfig(), optim, critic=False)
    batch = collate(synthetic_trajectories(1, 2))
    with pytest.raises(ValueError, match="needs a critic"):
        ppo_update(batch, actor=actor, algo=AlgoConfig(advantage="gae"), optim=optim, generator=torch.Generator())
    with pytest.raises(ValueError, match="make_reference"):
        ppo_update(
            batch,
            actor=actor,
            algo=AlgoConfig(advantage="grpo", kl_mode="in_loss"),
            optim=optim,
            generator=torch.Generator(),
        )


def test_the_supervised_term_adds_its_coefficient_times_the_demonstrations_gradient() -> None:
    """With ``algo.demo_loss_coef`` the step's gradient is the policy loss's plus coef x the gradient of
    the mean negative log-likelihood per demonstrated token on the step's demonstration rows (5 rows
    from 3, wrapping: rows 0 and 1 count twice), micro-batched (3 rows) or whole alike; its metric is
    that mean. Compared through plain SGD at lr 1 (the weight change IS the gradient) before any clip."""
    from ragen_tasks.training.critic import token_logprobs

    batch = collate(synthetic_trajectories())  # 16 rows: one minibatch, one step
    demos = collate(synthetic_trajectories(1, 3, seed=5, turns=3))
    step_rows = torch.tensor([0, 1, 2, 0, 1])
    reference = tiny_actor(0)
    chosen = demos.select(step_rows)
    targets = chosen.loss_mask > 0  # (5, T) True = a demonstrated token
    logp, _ = token_logprobs(reference, chosen.input_ids, chosen.attention_mask, positions=targets)
    nll = -(logp * targets).sum() / targets.sum()
    nll.backward()
    nll_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}

    changes, metrics = {}, {}
    for coef, micro in ((0.0, 16), (0.7, 16), (0.7, 3)):
        algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0, demo_loss_coef=coef, demo_episodes=5)
        optim = OptimConfig(lr=1.0, minibatch_size=16, micro_batch_size=micro, max_grad_norm=1e9)
        actor_m = tiny_actor(0)
        before = copy.deepcopy(dict(actor_m.named_parameters()))
        actor = make_train_model(actor_m, torch.optim.SGD(actor_m.parameters(), lr=1.0), optim)
        m = ppo_update(
            batch, actor=actor, algo=algo, optim=optim, generator=torch.Generator().manual_seed(0), demos=demos
        )
        assert m["actor/steps"] == 1
        changes[coef, micro] = {k: (before[k] - v).detach() for k, v in actor_m.named_parameters()}  # = gradient
        metrics[coef, micro] = m
    assert "actor/demo_nll" not in metrics[0.0, 16]
    for micro in (16, 3):
        assert metrics[0.7, micro]["actor/demo_nll"] == pytest.approx(float(nll.detach()), rel=1e-5)
        for name, grad in nll_grads.items():
            added = changes[0.7, micro][name] - changes[0.0, 16][name]
            torch.testing.assert_close(added, 0.7 * grad, rtol=1e-3, atol=1e-6, msg=name)


def test_the_supervised_term_without_demonstrations_is_a_clear_error() -> None:
    optim = OptimConfig()
    algo = AlgoConfig(advantage="grpo", demo_loss_coef=0.1)
    _, actor, _ = _setup(algo, optim, critic=False)
    with pytest.raises(ValueError, match=r"algo.demo_loss_coef=0.1 needs demos=.*or set algo.demo_loss_coef=0"):
        ppo_update(
            collate(synthetic_trajectories(1, 2)), actor=actor, algo=algo, optim=optim, generator=torch.Generator()
        )


@pytest.mark.gpu
def test_cuda_update_matches_cpu_update() -> None:
    """The same fp32 update on CUDA and on CPU: same metrics and same new weights (TF32 off).

    Stepped with plain SGD: AdamW would turn round-off on tiny gradients into lr-sized changes."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    algo = AlgoConfig(advantage="grpo", filter_keep_ratio=1.0)
    optim = OptimConfig(lr=1e-3, ppo_epochs=2, minibatch_size=8, micro_batch_size=4)
    results = {}
    for device in ("cpu", "cuda"):
        module = tiny_actor(0).to(device)
        actor = make_train_model(module, torch.optim.SGD(module.parameters(), lr=optim.lr), optim)
        batch = collate(synthetic_trajectories()).to(device)
        m = ppo_update(batch, actor=actor, algo=algo, optim=optim, generator=torch.Generator().manual_seed(0))
        results[device] = (m, {k: v.detach().cpu() for k, v in module.state_dict().items()})
    (m_cpu, w_cpu), (m_gpu, w_gpu) = results["cpu"], results["cuda"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m_gpu[key] == pytest.approx(m_cpu[key], rel=1e-3, abs=1e-5), key
    for name, value in w_cpu.items():
        torch.testing.assert_close(w_gpu[name], value, atol=1e-4, rtol=1e-3, msg=name)


def test_token_logprobs_at_wanted_positions_equal_the_full_pass_with_the_same_gradients() -> None:
    from ragen_tasks.training.critic import token_logprobs

    torch.manual_seed(0)
    actor = tiny_actor(seed=0)
    ids = torch.randint(2, 60, (3, 12))  # (B, T)
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # a left-padded row
    wanted = torch.zeros_like(ids, dtype=torch.bool)  # (B, T) True = the log-prob of token t is needed
    wanted[0, 5:8] = True
    wanted[2, 9:] = True
    full, full_entropy = token_logprobs(actor, ids, attention, with_entropy=True, entropy_grad=True)
    part, part_entropy = token_logprobs(actor, ids, attention, with_entropy=True, entropy_grad=True, positions=wanted)
    assert part_entropy is not None and full_entropy is not None
    torch.testing.assert_close(part[wanted], full[wanted], rtol=0, atol=1e-6)
    torch.testing.assert_close(part_entropy[wanted], full_entropy[wanted], rtol=0, atol=1e-6)
    no_row_wants = ~wanted.any(dim=0)  # (T,) columns never projected onto the vocabulary
    assert no_row_wants.any() and (part[:, no_row_wants] == 0).all()
    grads = []
    for logp in (full, part):
        actor.zero_grad()
        (logp * wanted).sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in actor.parameters()])
    for g_full, g_part in zip(*grads, strict=True):
        torch.testing.assert_close(g_part, g_full, rtol=1e-5, atol=1e-6)
    nothing = token_logprobs(actor, ids, attention, positions=torch.zeros_like(wanted))[0]
    assert (nothing == 0).all()


def test_right_padded_passes_without_the_mask_equal_each_row_alone_with_the_same_gradients() -> None:
    """The training passes hand a right-padded batch to the model without its padding mask: each real
    token's log-prob, value and gradient must equal those of its row run alone, unpadded."""
    from ragen_tasks.training.critic import model_attention_mask, token_logprobs

    torch.manual_seed(0)
    actor = tiny_actor(seed=0)
    critic = make_critic(actor)
    torch.nn.init.normal_(critic.head.weight)  # a zero head would make every value (and its gradient) 0
    lengths = [20, 13, 7]
    ids = torch.zeros((3, 20), dtype=torch.long)  # (B, T), right-padded with pad id 0
    attention = torch.zeros_like(ids)  # (B, T) 1 = real token
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(2, 60, (n,))
        attention[row, :n] = 1
    assert model_attention_mask(attention) is None
    left = attention.flip(1)  # the same rows left-padded: the mask is needed and kept
    assert model_attention_mask(left) is left

    def grads(module: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
        module.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in module.parameters() if p.grad is not None]

    real = attention.bool()
    logp, _ = token_logprobs(actor, ids, attention)  # (B, T)
    values = critic(ids, attention)  # (B, T)
    batch_grads = grads(actor, (logp * real).sum()), grads(critic, (values * real).sum())
    logp_alone_sum = values_alone_sum = torch.zeros(())  # each row's sum, run alone: their gradients add up
    for row, n in enumerate(lengths):
        one = ids[row : row + 1, :n]  # (1, n) the row without padding
        row_logp, _ = token_logprobs(actor, one, torch.ones_like(one))
        row_values = critic(one, torch.ones_like(one))
        torch.testing.assert_close(logp[row : row + 1, :n], row_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(values[row : row + 1, :n], row_values, rtol=0, atol=1e-5)
        logp_alone_sum = logp_alone_sum + row_logp.sum()
        values_alone_sum = values_alone_sum + row_values.sum()
    alone_grads = grads(actor, logp_alone_sum), grads(critic, values_alone_sum)
    for summed, batched in zip(alone_grads, batch_grads, strict=True):
        for g_alone, g_batch in zip(summed, batched, strict=True):
            torch.testing.assert_close(g_batch, g_alone, rtol=1e-4, atol=1e-5)


def test_every_configured_advantage_estimator_is_registered() -> None:
    from typing import get_args

    from ragen_tasks.training.update import ADVANTAGES

    assert set(ADVANTAGES) == set(get_args(AlgoConfig.model_fields["advantage"].annotation))
    assert [name for name, e in ADVANTAGES.items() if not e.model_free] == ["gae"]  # the one that needs a critic
