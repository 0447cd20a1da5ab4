"""Fail loudly if torch changes what scopedckpt relies on (see _torch_private.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as tc

from scopedckpt.core import _torch_private
from scopedckpt.mechanisms import _strict


def test_torch_dispatch_mode_still_sees_random_aten_ops_with_their_tag() -> None:
    seen: list[object] = []

    class Spy(_torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.nn.functional.dropout(torch.ones(4), 0.5)
        torch.rand(2)
    random_ops = [f for f in seen if torch.Tag.nondeterministic_seeded in f.tags]  # type: ignore[attr-defined]
    assert random_ops, f"no op tagged nondeterministic_seeded among {seen}"


def test_public_checkpoint_api_still_takes_the_arguments_we_pass() -> None:
    params = inspect.signature(tc.checkpoint).parameters
    for name in ("use_reentrant", "context_fn", "determinism_check", "early_stop"):
        assert name in params, f"torch.utils.checkpoint.checkpoint lost {name}"
    assert "preserve_rng_state" in inspect.getsource(tc.checkpoint)


def test_module_buffers_is_the_registry_register_buffer_fills() -> None:
    module = torch.nn.BatchNorm1d(3)
    buffers = _torch_private.module_buffers(module)
    assert list(buffers) == ["running_mean", "running_var", "num_batches_tracked"]
    swapped = torch.full((3,), 7.0)
    buffers["running_mean"] = swapped  # what the buffer guard does in a recompute
    assert module.running_mean is swapped
    assert dict(module.named_buffers())["running_mean"] is swapped


def test_module_parameters_is_the_registry_attribute_access_reads() -> None:
    module = torch.nn.Linear(2, 2)
    parameters = _torch_private.module_parameters(module)
    assert list(parameters) == ["weight", "bias"]
    swapped = torch.nn.Parameter(torch.zeros(2, 2))
    parameters["weight"] = swapped  # what _written does in a recompute
    assert module.weight is swapped
    assert torch.equal(module(torch.ones(1, 2)), module.bias.detach().reshape(1, 2))


def test_recompute_whole_finds_the_checkpoint_frame_of_a_determinism_check() -> None:
    """NOTE [ late writes ]: torch's pack hook calls the region's metadata_fn, and its
    closure holds the checkpoint's frame, whose early_stop the recompute reads."""
    found: list[bool] = []
    forward = [True]

    def probe(x: torch.Tensor) -> int:
        if forward[0]:  # torch's recompute check calls it from elsewhere
            found.append(_torch_private.recompute_whole(1))
        return 0

    _torch_private.register_determinism_check("scopedckpt-test-probe", probe)
    try:
        x = torch.randn(3, requires_grad=True)
        out = tc.checkpoint(
            lambda t: t.sin().cos(),
            x,
            use_reentrant=False,
            determinism_check="scopedckpt-test-probe",
        )
        forward[0] = False
        out.sum().backward()
    finally:
        del tc._allowed_determinism_checks_to_fns["scopedckpt-test-probe"]
    assert found and all(found)


def test_flash_attention_for_cpu_is_tagged_random_even_without_dropout() -> None:
    """Why strict mode reads dropout_p (kept true: if torch drops the tag, simplify)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert torch.Tag.nondeterministic_seeded in op.tags
    q = torch.randn(1, 1, 2, 4)
    assert not _strict.draws_random_numbers(op, (q, q, q), {})
    assert _strict.draws_random_numbers(op, (q, q, q, 0.1), {})
    dropout = torch.ops.aten.native_dropout.default
    assert not _strict.draws_random_numbers(dropout, (q, 0.5, False), {})
    assert _torch_private.bound_arguments(dropout, (q, 0.5), {"train": True})["p"] == 0.5


def test_global_module_hooks_run_for_every_call_and_on_exceptions() -> None:
    """The buffer guard puts its hooks into torch's global hook dicts at a key of its own:
    they must run, pre-hooks before the module's own, post-hooks even when forward raises."""
    calls: list[str] = []

    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    boom = Boom()
    boom.register_forward_pre_hook(lambda m, a: calls.append("own pre"))
    key = "test key"
    _torch_private.GLOBAL_PRE_HOOKS[key] = lambda m, a: calls.append("pre")
    _torch_private.GLOBAL_POST_HOOKS[key] = lambda m, a, o: calls.append("post")
    _torch_private.GLOBAL_POST_HOOKS_ALWAYS_CALLED[key] = True
    try:
        boom(torch.ones(1))
    except ValueError:
        pass
    finally:
        del _torch_private.GLOBAL_PRE_HOOKS[key]
        del _torch_private.GLOBAL_POST_HOOKS[key]
        del _torch_private.GLOBAL_POST_HOOKS_ALWAYS_CALLED[key]
    assert calls == ["pre", "own pre", "post"]
    torch.nn.Linear(1, 1)(torch.ones(1))
    assert calls == ["pre", "own pre", "post"]  # removed: torch reads the same dicts


def test_global_pre_hooks_keep_their_order_and_can_be_reordered() -> None:
    """The guard moves its global pre-hook to the front of torch's (an OrderedDict)."""
    from collections import OrderedDict

    assert isinstance(_torch_private.GLOBAL_PRE_HOOKS, OrderedDict)


def test_generator_state_round_trips() -> None:
    state = torch.default_generator.get_state()
    first = torch.rand(3)
    torch.default_generator.set_state(state)
    assert torch.equal(torch.rand(3), first)


def test_the_generators_patch_torch_checkpoint_swaps_keep_their_signatures() -> None:
    """_patch.py replaces these module globals with functions of the same call shape
    (NOTE [ torch versions ]); the patch also proves itself live at run time."""
    path = _torch_private.PATH
    assert path.generator is not None, "torch renamed its non-reentrant generator again"
    generator = inspect.signature(getattr(tc, path.generator))
    if path.split:  # torch >= 2.14
        assert list(generator.parameters)[:3] == ["fn", "args", "kwargs"]
        keyword_only = [
            name for name, p in generator.parameters.items() if p.kind is p.KEYWORD_ONLY
        ]
        assert set(path.options) <= set(keyword_only), keyword_only
        front = inspect.getsource(getattr(tc, path.front))
        assert f"{path.generator}(" in front
    else:
        assert list(generator.parameters)[:6] == ["fn", *path.options[:5]]
        front = inspect.getsource(tc.checkpoint)
        assert f"{path.generator}(" in front
    assert "CheckpointFunction.apply(" in front
    assert callable(tc.CheckpointFunction.apply)
    assert "context_fn, unpack_error_cb = _get_debug_context_and_cb()" in inspect.getsource(
        getattr(tc, path.generator)
    )
    assert tc._checkpoint_debug_enabled is None  # the switch's default, read as torch reads it


def test_an_alias_detached_below_autograd_sees_later_in_place_changes() -> None:
    """Selective saving's check for kept outputs changed in place (NOTE [ selective
    saving ]); and why tensor factories are not keepable: their alias does not."""
    kept: dict[str, torch.Tensor] = {}

    class Keep(_torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.rand.default):
                kept[str(func)] = _torch_private.detach_below_autograd(out)
            return out

    with Keep():
        product = torch.mm(torch.ones(2, 2), torch.ones(2, 2))
        product.add_(1)
        noise = torch.rand(2)
        noise.add_(1)
    assert kept["aten.mm.default"]._version == product._version == 1
    assert kept["aten.rand.default"]._version == 0  # a factory: a new tensor object


def test_sac_ignored_ops_and_tracing_context_still_exist() -> None:
    assert torch.ops.aten.detach.default in _torch_private.SAC_IGNORED_OPS
    assert not _torch_private.tracing()
    with torch._guards.tracing(torch._guards.TracingContext(None)):
        assert _torch_private.tracing()


def _private_torch_uses(path: Path, ours: set[str]) -> list[str]:
    """``x._name`` attribute reads and ``from torch._x import`` lines that name something
    scopedckpt did not define itself: torch's private names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if not node.attr.startswith("__") and node.attr not in ours:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            if any(p.startswith("_") for p in parts):
                found.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
    return found


def _names_defined_in(paths: list[Path]) -> set[str]:
    ours: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.arg):
                ours.add(node.arg)
            elif isinstance(node, ast.alias):
                ours.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                ours.add(node.target.id)
            elif isinstance(node, ast.Assign) and "__slots__" in map(ast.unparse, node.targets):
                ours.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return ours


def test_no_module_but_torch_private_uses_a_private_torch_name() -> None:
    package = Path(_torch_private.__file__).parent
    paths = sorted(package.rglob("*.py"))
    ours = _names_defined_in(paths)
    found = [
        use
        for path in paths
        if path.name != "_torch_private.py"
        for use in _private_torch_uses(path, ours)
        if "_aten." not in use  # aten operators named in policies, e.g. _addmm_activation
    ]
    assert found == [], "move these into _torch_private.py (NOTE [ torch versions ])"
    inside = _private_torch_uses(package / "_torch_private.py", ours)
    assert any("_buffers" in use or "_schema" in use for use in inside)  # the scan sees them


def test_what_the_eager_checkpoint_follows_is_there() -> None:
    """The names NOTE [ eager checkpoint ] follows: the early-stop switch, saved inputs,
    graph-task keys, the determinism-check registry, device inference, mode stacks."""
    assert _torch_private.early_stop_override() is None
    with tc.set_checkpoint_early_stop(False):
        assert _torch_private.early_stop_override() is False
    x = torch.ones(2, requires_grad=True)
    assert _torch_private.make_saved_tensor(x).unpack() is x
    assert _torch_private.graph_task_key() != _torch_private.graph_task_key()  # no backward
    keys: list[object] = []
    y = x.sin()
    y.grad_fn.register_prehook(lambda grad: keys.extend([_torch_private.graph_task_key()] * 2))  # type: ignore[union-attr]
    y.sum().backward()
    assert isinstance(keys[0], int) and keys[0] == keys[1]
    assert _torch_private.determinism_check_fn("default")(x) is not None
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        _torch_private.determinism_check_fn("no such check")
    assert _torch_private.infer_device_type([x]) == tc.DefaultDeviceType.get_device_type()
    assert not _torch_private.modes_active()
    with torch.device("cpu"):
        assert _torch_private.modes_active()
    hooks = _torch_private.internal_hooks(lambda t: t, lambda t: t)
    assert isinstance(hooks, torch.autograd.graph.saved_tensors_hooks)
    assert hooks.pack_hook._checkpoint_internal is True
