"""Plans and the vismemo policy: sizes, disjointness, entropy and guard, attention ranking."""

import math

import pytest
import torch

from vismemo_hf import HitKind, ImageFeatures, ImagePlan, WarmupSignals, get_policy
from vismemo_hf.policies import available_policies
from vismemo_hf.policies.vismemo import normalised_attention


def _features(key, entropy, embeds):
    return ImageFeatures(key, (1, 8, 10), embeds, entropy)


@pytest.fixture
def pair():
    torch.manual_seed(0)
    n = 20
    e_new = torch.randn(n, 16)
    e_old = e_new.clone()
    e_old[5] = torch.randn(16)  # token 5 changed a lot (guard must drop it)
    h_new = torch.linspace(0, 0.95, n)
    h_old = h_new.flip(0) * 0.2
    return _features("new", h_new, e_new), _features("old", h_old, e_old)


@pytest.mark.parametrize("rho,beta", [(0.3, 0.1), (0.0, 0.0), (1.0, 0.0), (0.5, 0.5), (0.25, 0.9)])
def test_vismemo_plan_sizes_and_partition(pair, rho, beta):
    new, old = pair
    n = new.n_tokens
    policy = get_policy("vismemo", recompute_ratio=rho, reuse_ratio=beta, entropy_threshold=0.5)
    reuse = policy.reuse_set(new, old)
    attention = torch.rand(3, 4, 5, n)
    plan = policy.plan(new, old, reuse, WarmupSignals(attention))
    assert plan.kind is HitKind.APPROXIMATE and plan.alias == "old" and plan.warmup_layers == 3
    assert plan.reuse.numel() <= math.ceil(beta * n)
    assert plan.recompute.numel() == min(math.ceil(rho * n), n - plan.reuse.numel())
    sets = [set(plan.recompute.tolist()), set(plan.reuse.tolist()), set(plan.mask.tolist())]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert set.union(*sets) == set(range(n))


def test_reuse_set_is_lowest_entropy_guarded_candidates(pair):
    new, old = pair
    policy = get_policy("vismemo", reuse_ratio=0.5, entropy_threshold=0.5)
    reuse = policy.reuse_set(new, old)
    risk = torch.maximum(new.entropy, old.entropy)
    assert 5 not in reuse.tolist()  # guard: its embedding changed
    assert torch.all(risk[reuse] <= 0.5)
    # the chosen ones are the lowest-risk guarded candidates
    eligible = [i for i in range(new.n_tokens) if risk[i] <= 0.5 and i != 5]
    expected = sorted(eligible, key=lambda i: float(risk[i]))[: math.ceil(0.5 * new.n_tokens)]
    assert sorted(reuse.tolist()) == sorted(expected)
    unguarded = get_policy("vismemo", reuse_ratio=0.5, entropy_threshold=0.5, guard_cosine=None).reuse_set(new, old)
    assert 5 in unguarded.tolist()


def test_recompute_set_follows_normalised_attention(pair):
    new, old = pair
    n = new.n_tokens
    policy = get_policy("vismemo", recompute_ratio=0.2, reuse_ratio=0.0)
    attention = torch.full((2, 2, 3, n), 0.01)
    attention[:, 0, :, 0] = 50.0  # head 0 is a sink on token 0 ...
    attention[:, 0, :, 3] = 0.5  # ... whose raw mass on token 3 would outrank head 1's choices
    attention[:, 1, :, 7] = 0.05  # head 1 spreads, but prefers 7, 8 and 9
    attention[:, 1, :, 8] = 0.04
    attention[:, 1, :, 9] = 0.03
    plan = policy.plan(new, old, torch.tensor([], dtype=torch.long), WarmupSignals(attention))
    assert set(plan.recompute.tolist()) == {0, 7, 8, 9}
    raw = attention.mean(dim=(0, 1, 2))
    assert set(torch.topk(raw, 4).indices.tolist()) == {0, 3, 7, 8}  # what un-normalised attention would pick
    scores = normalised_attention(attention)
    assert torch.allclose(scores.sum(), torch.tensor(1.0))


def test_plan_validation_rejects_overlaps_and_gaps():
    with pytest.raises(ValueError):
        ImagePlan(HitKind.APPROXIMATE, 4, 1, [0, 1], [1], [2, 3], alias="a")
    with pytest.raises(ValueError):
        ImagePlan(HitKind.APPROXIMATE, 4, 1, [0], [1], [2], alias="a")
    plan = ImagePlan.exact(4, "a")
    assert plan.computed_at(0).numel() == 0 and plan.reused_at(5).tolist() == [0, 1, 2, 3]
    miss = ImagePlan.full(HitKind.MISS, 4)
    assert miss.computed_at(9).tolist() == [0, 1, 2, 3] and miss.reused_at(0).numel() == 0


def test_registry_rejects_unknown_names_and_options():
    assert "vismemo" in available_policies()
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("nope")
    with pytest.raises(TypeError, match="no option"):
        get_policy("vismemo", colour="red")
    with pytest.raises(ValueError):
        get_policy("vismemo", recompute_ratio=1.5)


def test_an_images_entropy_and_pixel_hashes_are_each_computed_on_first_use_and_once():
    """A hit whose routing reads the pixel hashes alone (the default's) never pays for the entropy."""
    calls = []

    def entropy():
        calls.append("entropy")
        return torch.zeros(4)

    def hashes():
        calls.append("hashes")
        return None  # unknown hashes are remembered too

    image = ImageFeatures("a", (1, 4, 4), torch.randn(4, 8), pixel_features=(entropy, hashes))
    assert image.patch_hashes is None and image.patch_hashes is None and calls == ["hashes"]
    assert torch.equal(image.entropy, torch.zeros(4)) and image.entropy is image.entropy
    assert calls == ["hashes", "entropy"]
    given = ImageFeatures("b", (1, 4, 4), torch.randn(4, 8), patch_hashes=torch.arange(4),
                          pixel_features=(entropy, hashes))
    assert torch.equal(given.patch_hashes, torch.arange(4)) and calls == ["hashes", "entropy"]
