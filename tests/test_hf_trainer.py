"""Hugging Face ``Trainer`` with ``gradient_checkpointing=True`` on a scopedckpt model (issue 25).

``Trainer`` calls the model's own ``activation_checkpointing_enable`` when training
starts, which stores ``partial(torch.utils.checkpoint.checkpoint, **kwargs)`` in every
layer; after :func:`scopedckpt.integrations.huggingface.gradient_checkpointing_enable`
that must stay a scopedckpt region (NOTE [ Hugging Face re-enables ]). Each run trains a
tiny GPT-2 built from a config, with dropout on and an EMA buffer updated in every
block's forward before anything the recompute needs, so a second update in a recompute
shows (torch's checkpoint stops early after the last saved tensor it needs), and
compares it bit for bit with plain training. Skipped without transformers and
accelerate (``Trainer``) or peft.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from scopedckpt import ScopedCkptError
from scopedckpt.core._engine import COUNTERS

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from scopedckpt.integrations import huggingface  # noqa: E402

STEPS = 4
LAYERS = 2
WIDTH = 32
VOCAB = 64
# The deprecated names of transformers 5 (TrainingArguments' gradient_checkpointing*, the
# model's gradient_checkpointing_enable, and peft reading is_gradient_checkpointing) warn.
DEPRECATED = "ignore:`(gradient|is_gradient)_checkpointing.*deprecated:FutureWarning"


class EMA(nn.Module):
    """Runs ``inner``, first updating an EMA buffer of its input (stands for batch
    statistics, a counter, a quantiser's codebook: any buffer changed in forward)."""

    ema: Tensor

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.ema.mul_(0.5).add_(x.detach().mean((0, 1)))
        out: Tensor = self.inner(x)
        return out


def gpt2() -> Any:
    """A tiny GPT-2 with dropout on and the cache off, the same bits on every call."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=LAYERS,
        n_embd=WIDTH,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    for block in model.transformer.h:
        block.mlp = EMA(block.mlp)
    return model


def scoped(model: nn.Module, every_n_layers: int = 1) -> Any:
    """``model`` after the integration's ``gradient_checkpointing_enable``."""
    return huggingface.gradient_checkpointing_enable(model, every_n_layers=every_n_layers)


def lora(model: nn.Module) -> Any:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        target_modules=["c_attn"], r=2, lora_alpha=4, lora_dropout=0.1, fan_in_fan_out=True
    )
    return peft.get_peft_model(model, config)


def _data() -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(2 * STEPS):
        ids = torch.randint(0, VOCAB, (16,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def train(model: nn.Module, output_dir: Path, **arguments: Any) -> tuple[nn.Module, Tensor]:
    """``STEPS`` steps of ``Trainer``; the model and the global RNG state after them."""
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        seed=0,
        data_seed=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        **arguments,
    )
    with torch.random.fork_rng(devices=[]):
        transformers.Trainer(model=model, args=args, train_dataset=_data()).train()
        return model, torch.get_rng_state()


def assert_bitwise(got: nn.Module, expected: nn.Module) -> None:
    got_state, expected_state = got.state_dict(), expected.state_dict()
    assert list(got_state) == list(expected_state)
    for key, value in got_state.items():
        assert torch.equal(value, expected_state[key]), key


def emas(model: nn.Module) -> list[Tensor]:
    return [m.ema for m in model.modules() if isinstance(m, EMA)]


def regions_of(model: nn.Module) -> list[bool]:
    """Per block: whether Hugging Face checkpoints it, and through a scopedckpt region."""
    layers = [m for m in model.modules() if isinstance(m, transformers.GradientCheckpointingLayer)]
    for layer in layers:
        assert huggingface._is_region(layer._gradient_checkpointing_func), layer
    return [layer.gradient_checkpointing for layer in layers]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Tensor]:
    """Plain training: no checkpointing, no scopedckpt."""
    return train(gpt2(), tmp_path_factory.mktemp("plain"))


# ----------------------------------------------------------------------------- Trainer


@pytest.mark.slow
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize(
    ("arguments", "layers"),
    [
        ({}, [True, True]),  # Trainer's default leaves the layers as the integration set them
        ({"activation_checkpointing": True}, [True, True]),
        ({"gradient_checkpointing": True}, [True, True]),
        (
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_kwargs": {"use_reentrant": False},
            },
            [True, True],
        ),
        (
            {
                "activation_checkpointing": True,
                "activation_checkpointing_kwargs": {"every_n_layers": 2},
            },
            [True, False],
        ),
    ],
    ids=[
        "no-flag",
        "activation_checkpointing",
        "gradient_checkpointing",
        "use_reentrant=False",
        "every_n_layers",
    ],
)
def test_trainer_checkpointing_keeps_scopedckpt_exact(
    plain: tuple[nn.Module, Tensor], tmp_path: Path, arguments: dict[str, Any], layers: list[bool]
) -> None:
    model = scoped(gpt2())
    before = COUNTERS.regions
    got, rng = train(model, tmp_path, **arguments)
    assert COUNTERS.regions - before == STEPS * sum(layers)
    assert regions_of(got) == layers
    assert_bitwise(got, plain[0])
    assert torch.equal(rng, plain[1])  # the replay left the global stream where it was
    assert all(ema.abs().sum() > 0 for ema in emas(got))


@pytest.mark.slow
def test_torch_checkpoint_under_trainer_updates_the_buffer_twice(
    plain: tuple[nn.Module, Tensor], tmp_path: Path
) -> None:
    """What the integration gave before the fix: the test can see the bug."""
    got, _ = train(gpt2(), tmp_path, activation_checkpointing=True)
    functions = [getattr(m, "_gradient_checkpointing_func", None) for m in got.modules()]
    assert not any(map(huggingface._is_region, functions))
    for ema, expected in zip(emas(got), emas(plain[0]), strict=True):
        assert not torch.equal(ema, expected)


@pytest.mark.slow
@pytest.mark.filterwarnings(DEPRECATED)
def test_trainer_refuses_reentrant_checkpointing(tmp_path: Path) -> None:
    model = scoped(gpt2())
    with pytest.raises(ScopedCkptError, match=r"use_reentrant=True cannot be exact") as error:
        train(
            model,
            tmp_path,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": True},
        )
    assert "pass {'use_reentrant': False} there" in str(error.value)  # the details say where
    assert regions_of(model) == [True] * LAYERS  # nothing was stored


@pytest.mark.slow
@pytest.mark.filterwarnings(DEPRECATED)
def test_trainer_with_peft_lora_is_exact(tmp_path: Path) -> None:
    expected, expected_rng = train(lora(gpt2()), tmp_path / "plain")
    model = scoped(lora(gpt2()))
    before = COUNTERS.regions
    got, rng = train(model, tmp_path / "scopedckpt", gradient_checkpointing=True)
    assert COUNTERS.regions - before == STEPS * LAYERS
    assert regions_of(got) == [True] * LAYERS
    trainable = [name for name, p in got.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert_bitwise(got, expected)  # trainable, frozen parameters and buffers
    assert torch.equal(rng, expected_rng)


# ----------------------------------------------------------------------------- re-enables


def test_every_enable_and_disable_keeps_scopedckpt() -> None:
    model = scoped(gpt2(), every_n_layers=2)
    assert regions_of(model) == [True, False]
    model.activation_checkpointing_enable()
    assert regions_of(model) == [True, True]
    model.activation_checkpointing_disable()
    assert regions_of(model) == [False, False]
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})
    assert regions_of(model) == [True, True]
    model.activation_checkpointing_enable(every_n_layers=2)
    assert regions_of(model) == [True, False]
    assert scoped(model) is model  # again: no second setter
    assert model._set_gradient_checkpointing.model is model


def test_checkpoint_kwargs_are_honoured() -> None:
    model = scoped(gpt2())
    model.activation_checkpointing_enable(
        {"use_reentrant": False, "determinism_check": "none", "early_stop": False, "debug": 0}
    )
    options = model.transformer.h[0]._gradient_checkpointing_func.args[0]
    assert (options.determinism_check, options.early_stop, options.debug) == ("none", False, False)
    assert options.preserve_rng_state


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            {"activation_checkpointing_kwargs": {"use_reentrant": True}},
            ScopedCkptError,
            "reentrant",
        ),
        ({"activation_checkpointing_kwargs": {"foo": 1}}, ScopedCkptError, "'foo'.*Remove it"),
        ({"offload": True}, ScopedCkptError, "offload=True.*remove offload"),
        ({"activation_checkpointing_kwargs": {"determinism_check": "x"}}, ValueError, "'x'"),
    ],
    ids=["use_reentrant", "unknown", "offload", "determinism_check"],
)
def test_kwargs_scopedckpt_cannot_honour_raise_and_store_nothing(
    call: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = scoped(gpt2(), every_n_layers=2)
    with pytest.raises(error, match=match):
        model.activation_checkpointing_enable(**call)
    assert regions_of(model) == [True, False]


def test_a_layer_call_takes_torch_keywords_and_hands_the_rest_to_the_function() -> None:
    model = scoped(gpt2()).train()
    region = model.transformer.h[0]._gradient_checkpointing_func
    x = torch.randn(2, 3, requires_grad=True)
    before = COUNTERS.regions
    y = region(lambda t, scale: t * scale, x, scale=3.0, use_reentrant=False, early_stop=False)
    assert COUNTERS.regions - before == 1
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((2, 3), 3.0))
    with pytest.raises(ScopedCkptError, match="reentrant"):
        region(torch.sin, x, use_reentrant=True)


@pytest.mark.filterwarnings(DEPRECATED)
def test_peft_after_the_integration_keeps_it() -> None:
    base = scoped(gpt2())
    model = lora(base)
    model.activation_checkpointing_enable()  # what Trainer calls, forwarded to the base model
    assert regions_of(model) == [True, True]
    assert model._set_gradient_checkpointing.model is base


def test_a_deep_copy_keeps_its_own_setter() -> None:
    model = scoped(gpt2())
    twin = copy.deepcopy(model)
    assert twin._set_gradient_checkpointing.model is twin
    twin.activation_checkpointing_disable()
    assert regions_of(twin) == [False, False]
    assert regions_of(model) == [True, True]


@pytest.mark.slow
def test_trainer_under_a_plan_is_exact(plain: tuple[nn.Module, Tensor], tmp_path: Path) -> None:
    """``scopedckpt.plan`` on one batch, then ``with checkpointing(plan):`` around
    ``Trainer.train()``: the regions it chose, bit for bit plain training."""
    import scopedckpt

    model = gpt2()
    ids = torch.stack([row["input_ids"] for row in _data()[:2]])
    batch = {"input_ids": ids, "labels": ids}
    whole = scopedckpt.plan(model, budget=1.0, example_kwargs=batch)
    assert [b.name for b in whole.blocks] == ["transformer.h.0", "transformer.h.1"]
    plan = scopedckpt.plan(model, budget=whole.smallest_budget, example_kwargs=batch)
    regions = sum(b.choice != "none" for b in plan.blocks)
    assert regions
    before = COUNTERS.regions
    with scopedckpt.checkpointing(plan):
        got, rng = train(model, tmp_path)
    assert COUNTERS.regions - before == STEPS * regions
    assert_bitwise(got, plain[0])
    assert torch.equal(rng, plain[1])
