"""Third-party models: checkpointed training must equal plain training bit for bit.

Tiny, randomly initialised models built from configs (nothing is downloaded) from
Hugging Face transformers (BERT, GPT-2, ViT; eager and SDPA attention), timm (ViT with
fused and unfused attention, ResNet with DropPath and DropBlock, an EfficientNet with
``BatchNormAct2d``), torchvision's ``StochasticDepth`` (a replica, and the real models
when torchvision imports) and ``nn.TransformerEncoder``. Every model trains with
dropout, attention dropout and stochastic depth switched on, so the randomness that
checkpoint recomputes must replay is really drawn.

Each family is checked three ways:

- ``test_checkpointed_training_is_exact``: ``assert_checkpoint_equivalent`` (with
  ``determinism_check="bitwise"``) over the
  per-layer blocks, as shipped and after ``scopedckpt.convert``;
- ``test_plain_training_is_sane``: the model trains (finite loss and gradients, every
  target block on the gradient path), its randomness is live (two seeds give two
  outputs) and it is deterministic from one seed;
- ``test_eval_mode_is_exact``: in eval mode (no randomness, no buffer updates) the
  comparison passes, so a failure of the first test is the model's randomness or
  buffers, never the wrapper, the inputs or the targets.

``test_selective_saving_is_exact`` checks ``save=`` (docs/selective.md) on each family, and
``test_plans_train_exactly`` ``scopedckpt.plan`` (docs/memory-budget.md) at 25 %, 50 % and
100 % of the peak without checkpointing (or the smallest feasible budget, if higher).

Families skip when their package is missing (``pip install -e '.[real]'``); the
builders live in benchmarks/real_families.py, how timm is imported without torchvision in
benchmarks/real_imports.py, and tests/real_models.py turns a missing package into a skip.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import scopedckpt
from scopedckpt.testing import assert_checkpoint_equivalent

from .real_models import FAMILIES, Built, _convert, hf_gpt2
from .test_peak import categories_sum_to_measure_peak

pytestmark = pytest.mark.slow

STEPS = 3


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("converted", [False, True], ids=["as-shipped", "converted"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpointed_training_is_exact(family: str, converted: bool) -> None:
    built = FAMILIES[family]()
    model = _convert(built.model) if converted else built.model
    model.train()
    # Verified too: every recompute proven bit for bit (docs/verification.md).
    assert_checkpoint_equivalent(
        model,
        *built.inputs,
        targets=built.targets,
        steps=STEPS,
        loss_fn=built.loss_fn,
        determinism_check="bitwise",
    )


def _keep_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return scopedckpt.policies.keepable(op)


@pytest.mark.parametrize("policy", ["save_compute", "keep_everything"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_selective_saving_is_exact(family: str, policy: str) -> None:
    """save= on the models as shipped: the compute preset, and every op that can be kept."""
    built = FAMILIES[family]()
    built.model.train()
    save = scopedckpt.policies.save_compute if policy == "save_compute" else [_keep_everything]
    assert_checkpoint_equivalent(
        built.model,
        *built.inputs,
        targets=built.targets,
        steps=2,
        loss_fn=built.loss_fn,
        save=save,
    )


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_plans_train_exactly(family: str, fraction: float) -> None:
    """A plan over the family's blocks, as shipped, keeps every step within its budget and
    trains bit for bit as without."""
    built = FAMILIES[family]()
    built.model.train()
    blocks = built.targets
    whole = scopedckpt.plan(
        built.model, *built.inputs, budget=1.0, blocks=blocks, loss_fn=built.loss_fn
    )
    budget = max(int(fraction * whole.no_checkpoint_peak), whole.smallest_budget)
    plan = scopedckpt.plan(
        built.model, *built.inputs, budget=budget, blocks=blocks, loss_fn=built.loss_fn
    )
    assert plan.peak <= budget

    def step() -> None:
        built.loss_fn(built.model(*built.inputs)).backward()

    # Every step within the budget, from the first after planning (each site's first call,
    # verified bit for bit) on (issue 41).
    for _ in range(3):
        built.model.zero_grad(set_to_none=True)
        with scopedckpt.checkpointing(plan):
            peak = scopedckpt.measure_peak(step)
        assert peak <= plan.budget, (peak, plan.budget, str(plan))
    built.model.zero_grad(set_to_none=True)
    assert_checkpoint_equivalent(
        built.model,
        *built.inputs,
        targets=(plan,),
        steps=2,
        loss_fn=built.loss_fn,
        require_regions=any(b.choice != "none" for b in plan.blocks),
    )


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's and inductor's own
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_compiled_plan_trains_gpt2_bit_for_bit() -> None:
    """A plan entered around a compiled GPT-2, dropout on (its regions torch's checkpoint
    operator in the graph), trains bit for bit as the compiled model without regions, over
    several AdamW steps. Under ``torch.use_deterministic_algorithms(True)``, as bitwise
    compiled training needs: without it inductor's CPU embedding backward accumulates with
    atomic adds, and the compiled model does not reproduce even its own gradients
    (docs/memory-budget.md, "torch.compile")."""
    built = hf_gpt2("eager")
    built.model.train()
    whole = scopedckpt.plan(
        built.model, *built.inputs, budget=1.0, blocks=built.targets, loss_fn=built.loss_fn
    )
    plan = scopedckpt.plan(
        built.model,
        *built.inputs,
        budget=whole.smallest_budget,
        blocks=built.targets,
        loss_fn=built.loss_fn,
    )
    assert any(block.choice != "none" for block in plan.blocks)

    def train(planned: bool) -> list[Tensor]:
        model = copy.deepcopy(built.model)
        compiled = torch.compile(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scope = scopedckpt.checkpointing(plan.bind(model)) if planned else contextlib.nullcontext()
        seen: list[Tensor] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for _ in range(STEPS + 1):
                with scope:
                    loss = built.loss_fn(compiled(*built.inputs))
                loss.backward()
                seen += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return seen + [p.detach().clone() for p in model.parameters()]

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch._dynamo.reset()
        assert _equal(train(planned=True), train(planned=False))
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch._dynamo.reset()


def test_a_resnet_block_with_a_preset_never_peaks_above_its_prediction() -> None:
    """NOTE [ peak model ]: what a ``save=`` preset keeps lives on the region's tape through
    the block's whole backward (a full region's recomputed tensors die as backward reads
    them). On timm's ResNet-18 as the plan benchmark runs it, each block made the one region
    with the convolutions preset peaks at most at the prediction; taking its recompute as the
    full region's less what it keeps put layer2.0's 0.8 % above the plan's budget."""
    from benchmarks.real_imports import UnavailableError, import_timm
    from scopedckpt.planner._profile import profile_step

    try:
        timm = import_timm()
    except UnavailableError as why:
        pytest.skip(str(why))
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10, drop_path_rate=0.1)
    model.train()
    x, labels = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    layers = (model.layer1, model.layer2, model.layer3, model.layer4)
    named = [(f"{i}", block) for i, block in enumerate(b for layer in layers for b in layer)]

    def loss_of(y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(y, labels)

    profile = profile_step(model, named, (x,), {}, loss_of)
    options = [b.choices for b in profile.blocks]

    def step(region: nn.Module) -> None:
        with scopedckpt.checkpointing(region, save=scopedckpt.policies.save_convolutions):
            loss = loss_of(model(x))
        loss.backward()

    for i, (_, block) in enumerate(named):
        preset = [c.name for c in options[i]].index("convolutions")
        predicted = profile.predicted_peak([preset if j == i else 0 for j in range(8)])
        step(block)  # the site's first call, verified
        model.zero_grad(set_to_none=True)
        measured = scopedckpt.measure_peak(step, block)
        model.zero_grad(set_to_none=True)
        assert measured <= predicted, (i, measured - predicted)


@pytest.mark.parametrize("family", ["timm-resnet-droppath-dropblock", "timm-vit-fused"])
def test_peak_report_attributes_the_whole_measured_peak(family: str) -> None:
    """``peak_report`` on a timm model whose blocks are regions (issue 43): over three SGD
    steps with momentum, each report's categories sum to its peak, which is
    ``measure_peak``'s for the same step of a twin, and the twins train bit for bit alike."""
    built = FAMILIES[family]()
    model = built.model.train()

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        with scopedckpt.checkpointing(*_same_blocks(built, model)):
            loss = built.loss_fn(model(*built.inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    reports = categories_sum_to_measure_peak(model, copy.deepcopy(model), step, optimizer_for=sgd)
    # every block's forward and recompute are moments of the timeline, by module path
    paths = {n for n, m in model.named_modules() if any(m is t for t in built.targets)}
    for report in reports:
        assert {region for _, _, region in report.phases} >= paths


def _same_blocks(built: Built, model: nn.Module) -> list[nn.Module]:
    """``built.targets``, as the modules at the same paths in ``model`` (a copy)."""
    paths = {id(m): name for name, m in built.model.named_modules()}
    modules = dict(model.named_modules())
    return [modules[paths[id(block)]] for block in built.targets]


def _train(built: Built, seed: int, steps: int = STEPS) -> tuple[list[Tensor], list[Tensor]]:
    """Plain SGD steps from ``seed``; the outputs and the losses."""
    model, params = built.model, [p for p in built.model.parameters() if p.requires_grad]
    outputs, losses = [], []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = None
            output = model(*built.inputs)
            loss = built.loss_fn(output)
            loss.backward()
            outputs.append(output.detach().clone())
            losses.append(loss.detach().clone())
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.sub_(p.grad, alpha=0.01)
    return outputs, losses


def _equal(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plain_training_is_sane(family: str) -> None:
    built = FAMILIES[family]()
    names = {id(m): n for n, m in built.model.named_modules()}
    assert built.targets and all(id(t) in names for t in built.targets)
    built.model.train()
    state = {k: v.clone() for k, v in built.model.state_dict().items()}

    outputs, losses = _train(built, seed=0)
    assert all(math.isfinite(float(loss)) for loss in losses), losses
    for target in built.targets:  # every target is on the gradient path
        grads = [p.grad for p in target.parameters() if p.grad is not None]
        assert grads, f"{names[id(target)]} got no gradient"
        assert all(bool(torch.isfinite(g).all()) for g in grads)
        assert any(bool(g.ne(0).any()) for g in grads), f"{names[id(target)]}: zero grads"

    built.model.load_state_dict(state)
    again, _ = _train(built, seed=0)
    assert _equal(outputs, again), "plain training is not deterministic from one seed"
    built.model.load_state_dict(state)
    other, _ = _train(built, seed=1, steps=1)
    assert not torch.equal(outputs[0], other[0]), "no randomness: dropout/drop-path inactive?"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eval_mode_is_exact(family: str) -> None:
    """The control: with no randomness and no buffer updates, nothing may differ."""
    built = FAMILIES[family]()
    built.model.eval()
    assert_checkpoint_equivalent(
        built.model, *built.inputs, targets=built.targets, steps=STEPS, loss_fn=built.loss_fn
    )


def _train_step_in_scope(built: Built) -> None:
    output: Any = None
    try:
        with scopedckpt.checkpointing(*built.targets):
            output = built.model(*built.inputs)
        built.loss_fn(output).backward()
    finally:
        output = None  # the graph holds regions: let the traceback not keep them alive


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_use_cache_in_a_region_is_refused(attn: str) -> None:
    """GPT-2 builds a DynamicCache when use_cache=True, even in training, and each block
    appends its keys and values to it: a recompute would append them a second time."""
    built = hf_gpt2(attn, use_cache=True)
    built.model.train()
    _train(built, seed=0, steps=1)  # fine without checkpointing
    with pytest.raises(scopedckpt.ScopedCkptError, match="use_cache"):
        _train_step_in_scope(built)


def _hf_family(name: str, reference: bool = False) -> Built:
    """A family by name, or GPT-2 with the config default use_cache=True.

    Hugging Face's own checkpointing turns the cache off in training, so the
    ``reference`` (plain) run of GPT-2 does too: measured with transformers 5.25,
    plain training with the cache on differs from it off by up to 1.2e-7 in the
    logits (the cached keys take another path), checkpointing or not.
    """
    if name == "gpt2-use-cache":  # the config default: Hugging Face turns it off itself
        return hf_gpt2("sdpa", use_cache=not reference)
    return FAMILIES[name]()


@pytest.mark.parametrize(
    "name", ["hf-bert-eager", "hf-gpt2-eager", "gpt2-use-cache", "hf-vit-sdpa"]
)
def test_huggingface_gradient_checkpointing_through_scopedckpt_is_exact(name: str) -> None:
    """One line routes Hugging Face's own checkpointing through scopedckpt regions."""
    from scopedckpt.core._engine import COUNTERS
    from scopedckpt.integrations import huggingface

    plain, checkpointed = _hf_family(name, reference=True), _hf_family(name)
    hf_model = checkpointed.model.model
    assert huggingface.gradient_checkpointing_enable(hf_model) is hf_model
    for built in (plain, checkpointed):
        built.model.train()
    rng = torch.get_rng_state()
    before = COUNTERS.regions
    with torch.random.fork_rng(devices=[]):
        expected = _train(plain, seed=3)
        expected_rng = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]):
        got = _train(checkpointed, seed=3)
        got_rng = torch.get_rng_state()
    assert COUNTERS.regions - before == STEPS * len(checkpointed.targets)
    assert _equal(got[0] + got[1], expected[0] + expected[1])
    assert torch.equal(got_rng, expected_rng)
    for (key, a), b in zip(
        checkpointed.model.state_dict().items(), plain.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), key
    assert torch.equal(torch.get_rng_state(), rng)


def test_huggingface_integration_refuses_models_without_checkpointing() -> None:
    from scopedckpt.integrations import huggingface

    with pytest.raises(TypeError, match="expected a Hugging Face PreTrainedModel"):
        huggingface.gradient_checkpointing_enable(nn.Linear(2, 2))


def _enable_library_checkpointing(model: nn.Module) -> None:
    """The library's own switch: Hugging Face's or timm's, calling torch's checkpoint."""
    inner = getattr(model, "model", model)
    if hasattr(inner, "activation_checkpointing_enable"):
        inner.activation_checkpointing_enable()
    else:
        inner.set_grad_checkpointing()


@pytest.mark.parametrize(
    "name",
    [
        "hf-bert-eager",
        "hf-gpt2-sdpa",
        "gpt2-use-cache",
        "hf-vit-eager",
        "timm-vit-unfused",
        "timm-resnet-droppath-dropblock",
        "timm-efficientnet-bnact",
    ],
)
def test_library_checkpointing_under_patch_torch_checkpoint_is_exact(name: str) -> None:
    """timm's set_grad_checkpointing and Hugging Face's own switch, unchanged, made exact."""
    from scopedckpt.core._engine import COUNTERS
    from scopedckpt.integrations import patch_torch_checkpoint

    plain, checkpointed = _hf_family(name, reference=True), _hf_family(name)
    _enable_library_checkpointing(checkpointed.model)
    for built in (plain, checkpointed):
        built.model.train()
    with torch.random.fork_rng(devices=[]):
        expected = _train(plain, seed=3)
        expected_rng = torch.get_rng_state()
    before = COUNTERS.regions
    with torch.random.fork_rng(devices=[]), patch_torch_checkpoint():
        got = _train(checkpointed, seed=3)
        got_rng = torch.get_rng_state()
    assert COUNTERS.regions > before
    assert _equal(got[0] + got[1], expected[0] + expected[1])
    assert torch.equal(got_rng, expected_rng)
    for (key, a), b in zip(
        checkpointed.model.state_dict().items(), plain.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), key
