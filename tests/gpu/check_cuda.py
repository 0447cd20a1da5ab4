"""Checks that need a CUDA device, run by hand: ``python tests/gpu/check_cuda.py``.

CI has no GPU, so pytest does not collect this file. It checks, on the
default CUDA device: the mask's bits (NOTE [ mask bits ]), that both dropout
formulations give the same bits and float32/float64 kept values equal
``F.dropout``'s (NOTE [ two formulations ]), that the CUDA backward runs in
another thread, exactness of eager training with regions (converted and not,
with unscoped ``F.dropout`` and ``torch.rand_like`` in the blocks, plain and
``retain_graph`` backward), explicit generators a region reaches or a forward makes, and that
compiled training with scopedckpt's
regions lands where compiled training with torch's checkpoint does, and that a
``scopedckpt.plan()`` at half the peak trains exactly and keeps its predicted peak
(``torch.cuda.max_memory_allocated`` within 10 %) and every step, the first (verified)
included, within its budget, also across the planner's quick
benchmark (``benchmarks/plan.py``, results in $OUT), and that ``scopedckpt.peak_report``
agrees with the allocator and explains a real out-of-memory error. It prints
what it only reports: float16/bfloat16 kept values against torch's fused CUDA
dropout, and compiled checkpointing against compiled training without it.
Exit status 0 when every check passed.
"""

import json
import os
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import scopedckpt
from scopedckpt.layers import _mask
from scopedckpt.testing import assert_checkpoint_equivalent

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
failures = 0


def check(name, fn):
    global failures
    try:
        fn()
        print("PASS", name)
    except Exception:
        failures += 1
        print("FAIL", name)
        traceback.print_exc()


def mask_bits():
    for p in (1e-3, 0.1, 0.5, 0.9):
        m = _mask.Mask(7, p, (1 << 22,), dev, False, True)
        k1, k2 = m.keep(), m.keep()
        assert k1.device.type == dev.type and k1.dtype == torch.uint8 and torch.equal(k1, k2)
        for half in (k1[0::2], k1[1::2]):
            rate = float(half.double().mean())
            sigma = (p * (1 - p) / half.numel()) ** 0.5
            assert abs(rate - (1 - p)) < 6 * sigma, (p, rate)
    odd = _mask.Mask(3, 0.5, (3, 5), dev, False, True).keep()
    assert odd.shape == (3, 5)


def kept_values_bitwise():
    bad, half = [], []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for p in (0.1, 0.021, 0.3, 0.37):
            for n in (4096, 1 << 16):
                x = (torch.rand(n, device=dev, dtype=torch.float64) + 1).to(dtype)
                ours = scopedckpt.Dropout(p)(x)
                ref = F.dropout(x, p, True)
                both = (ours != 0) & (ref != 0)
                if not torch.equal(ours[both], ref[both]):
                    d = (ours[both].double() - ref[both].double()).abs().max().item()
                    # torch's fused CUDA dropout scales half types in float
                    (half if dtype in (torch.float16, torch.bfloat16) else bad).append(
                        (str(dtype), p, n, "vs torch", d)
                    )
                # the two formulations against each other
                m = _mask.Mask(5, p, (n,), dev, False, True)
                old = _mask.NATIVE_BELOW_ELEMENTS
                try:
                    _mask.NATIVE_BELOW_ELEMENTS = 1 << 30
                    native = _mask.masked_dropout(x, m, False)
                    _mask.NATIVE_BELOW_ELEMENTS = 0
                    function = _mask.masked_dropout(x, m, False)
                finally:
                    _mask.NATIVE_BELOW_ELEMENTS = old
                if not torch.equal(native, function):
                    bad.append((str(dtype), p, n, "native vs function"))
    for b in half:
        print("    reported:", b)
    for b in bad:
        print("   ", b)
    assert not bad


class Block(nn.Module):
    """Linear-BN-GELU-Dropout-Linear with, if ``unscoped``, an unscoped F.dropout and rand_like."""

    def __init__(self, w, unscoped=True):
        super().__init__()
        self.unscoped = unscoped
        self.fc1, self.bn, self.drop, self.fc2 = (
            nn.Linear(w, w),
            nn.BatchNorm1d(w),
            nn.Dropout(0.1),
            nn.Linear(w, w),
        )

    def forward(self, x):
        h = self.drop(F.gelu(self.bn(self.fc1(x))))
        if not self.unscoped:
            return x + self.fc2(h)
        h = F.dropout(h, 0.2, self.training)  # unscoped functional dropout
        return x + self.fc2(h) * torch.rand_like(h).gt(0.1)  # an unscoped random op


def model(convert):
    torch.manual_seed(0)
    m = nn.Sequential(*[Block(64) for _ in range(4)]).to(dev)
    return scopedckpt.convert(m) if convert else m


def exact(convert, backward):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = model(convert)
    x = torch.randn(32, 64, device=dev)
    assert_checkpoint_equivalent(m, x, steps=3, backward=backward)


def large_dropout_regions():
    # Masks in pieces, the first forward's MaskedDropout against the recompute's
    # ATen ops (NOTE [ two formulations ]), with the dropout last in its region
    # and not, early stop on and off.
    for last in (True, False):
        for early_stop in (True, False):
            torch.manual_seed(0)
            layers = [nn.Linear(512, 512), scopedckpt.Dropout(0.3)]
            block = nn.Sequential(*layers, *([] if last else [nn.Linear(512, 512)])).to(dev)
            x = torch.randn(1024, 512, device=dev)  # 2**19 elements: two pieces
            results = []
            for regions in (False, True):
                torch.manual_seed(1)
                with scopedckpt.checkpointing(enabled=regions):
                    y = scopedckpt.checkpoint(block, x, early_stop=early_stop)
                y.square().sum().backward()
                results.append([y.detach()] + [p.grad.clone() for p in block.parameters()])
                block.zero_grad(set_to_none=True)
            assert all(torch.equal(a, b) for a, b in zip(*results)), (last, early_stop)


def backward_thread():
    # The CUDA backward runs in an autograd device thread, which does not see the
    # forward's context variables: the exactness checks below run in that setting.
    seen = []
    x = torch.randn(4, 4, device=dev, requires_grad=True)
    y = x.sin()
    y.register_hook(lambda g: seen.append(threading.get_ident()) or g)
    y.sum().backward()
    if dev.type == "cuda":
        assert seen[0] != threading.get_ident(), "the backward ran in the calling thread"


def compiled():
    x = torch.randn(32, 64, device=dev)

    def run(convert, mode, drop):
        torch.manual_seed(0)
        # No unscoped randomness: compiled, it draws from inductor's generator.
        mm = nn.Sequential(*[Block(64, unscoped=False) for _ in range(4)]).to(dev)
        for mod in mm.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = drop
        if convert:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ConvertWarning: nothing unscoped here
                mm = scopedckpt.convert(mm)
        torch._dynamo.reset()

        def f(xx):
            h = xx
            for blk in mm:
                if mode == "torch":
                    h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False)
                elif mode == "ours":
                    h = scopedckpt.checkpoint(blk, h)
                else:
                    h = blk(h)
            return h.square().mean()

        cf = torch.compile(f)
        torch.manual_seed(1)
        with scopedckpt.checkpointing():
            loss = cf(x)
        loss.backward()
        return (
            [loss.detach()]
            + [p.grad.clone() for p in mm.parameters()]
            + [b.clone() for b in mm.buffers()]
        )

    def same(a, b):
        diffs = [
            (i, (u.double() - v.double()).abs().max().item())
            for i, (u, v) in enumerate(zip(a, b))
            if not torch.equal(u, v)
        ]
        return diffs[:4]

    for drop in (0.0, 0.1):
        torchs, ours = run(False, "torch", drop), run(True, "ours", drop)
        print(
            "    reported: dropout",
            drop,
            "torch's checkpoint vs none:",
            same(torchs, run(False, "none", drop)),
        )
        print(
            "    reported: dropout",
            drop,
            "scopedckpt vs none:",
            same(ours, run(True, "none", drop)),
        )
        if drop == 0.0:  # the same model and no randomness: the same graphs
            assert not same(ours, torchs), same(ours, torchs)


def explicit_generators():
    """Issue 25, hole 6, on the device: a generator the region reaches (a module attribute)
    first used on the second step, which sampling does not verify, and shared by a scoped
    dropout and an unscoped op; two recomputes a step: bitwise as plain training."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.generator = torch.Generator(device=dev).manual_seed(5)
            self.drop = scopedckpt.Dropout(0.3, generator=self.generator)
            self.linear = nn.Linear(64, 64)
            self.noisy = False

        def forward(self, x):
            y = self.drop(self.linear(x))
            if self.noisy:
                y = y + torch.randn(y.shape, device=y.device, generator=self.generator)
            return y.tanh()

    plain, checkpointed = _noisy_steps(Noisy, False), _noisy_steps(Noisy, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


def _noisy_steps(block, regions, after_forward=lambda b: None, first_noisy=1):
    """Gradients and the block's generator state after each of four steps of ``block()``
    then a linear head, on the device, the block noisy from step ``first_noisy`` and a
    region when ``regions``; two backward passes a step (two recomputes).
    ``after_forward(b)`` runs before each backward."""
    torch.manual_seed(0)
    m = nn.Sequential(block(), nn.Linear(64, 1)).to(dev)
    x = torch.randn(32, 64, device=dev)
    seen = []
    for step in range(4):
        m[0].noisy = step >= first_noisy
        with scopedckpt.checkpointing(m[0], enabled=regions):
            loss = m(x).sum()
        after_forward(m[0])
        loss.backward(retain_graph=True)
        loss.backward()
        seen += [p.grad.clone() for p in m.parameters()]
        generator = getattr(m[0], "generator", None)
        seen += [generator.get_state()] if generator is not None else []
        m.zero_grad(set_to_none=True)
    return seen


def planned():
    """A plan at half the peak: exact, and its predicted peak is what CUDA allocates."""
    m = model(convert=False)
    x = torch.randn(512, 64, device=dev)
    loss = lambda y: y.square().mean()  # noqa: E731
    plan = scopedckpt.plan(m, x, budget=0.5, blocks=list(m), loss_fn=loss)
    print(plan)
    assert_checkpoint_equivalent(m, x, targets=(plan,), steps=2, loss_fn=loss)
    for _ in range(2):  # the second step: first-step transients aside
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with scopedckpt.checkpointing(plan):
            y = loss(m(x))
        y.backward()
        del y
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        m.zero_grad(set_to_none=True)
    print("plan peak predicted", plan.peak, "measured (max_memory_allocated)", measured)
    assert abs(measured - plan.peak) <= 0.10 * plan.peak, (measured, plan.peak)


def planned_steps_within_budget():
    """Every step under a plan, from the first after planning (each site's first call,
    verified bit for bit) on, allocates at most the plan's budget above what was allocated
    before it (``max_memory_allocated``), and ``scopedckpt.measure_peak`` agrees with it to
    within the allocator's rounding (512 bytes a tensor)."""
    m = model(convert=False)
    x = torch.randn(512, 64, device=dev)
    loss = lambda y: y.square().mean()  # noqa: E731
    smallest = scopedckpt.plan(m, x, budget=1.0, blocks=list(m), loss_fn=loss).smallest_budget
    for budget in (0.5, smallest):
        plan = scopedckpt.plan(m, x, budget=budget, blocks=list(m), loss_fn=loss)
        for step in range(4):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with scopedckpt.checkpointing(plan):
                counted = scopedckpt.measure_peak(lambda: loss(m(x)).backward())
            torch.cuda.synchronize()
            allocated = torch.cuda.max_memory_allocated() - before
            m.zero_grad(set_to_none=True)
            print(f"budget {plan.budget} step {step}: allocated {allocated}, counted {counted}")
            assert counted <= plan.budget, (step, counted, plan.budget)
            assert allocated <= plan.budget + 512 * 64, (step, allocated, plan.budget)


def plan_benchmark():
    """``python -m benchmarks.plan --quick --device=cuda``: the planner's benchmark with
    ``max_memory_allocated`` peaks; every plan's peak within 10 % of its prediction.
    Results go to $OUT if set (the device tool brings them back), else benchmarks/results."""
    root = Path(__file__).resolve().parents[2]
    out = Path(os.environ.get("OUT", root / "benchmarks" / "results"))
    code = (
        "from pathlib import Path; from benchmarks import plan; "
        f"plan.main(quick=True, device='cuda', out=Path({str(out)!r}))"
    )
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
    rows = json.loads((out / "plan_cuda.json").read_text())["rows"]
    for row in rows:
        print(row["model"], "worst peak error", row["worst_peak_error"], row["plan_vs_torch"])
        assert row["worst_peak_error"] <= 0.10, row["model"]


def made_in_forward():
    """Issue 25, hole 6: a generator a forward makes on the device at its first step and
    keeps in an attribute that held None; the recomputes run on CUDA's backward thread, in
    the forward's world (NOTE [ forward's world ]: the attribute empty, so the recompute
    makes the generator again), and later steps stash it, as the first step's verified
    call found it (NOTE [ explicit generators ]): bitwise as plain training, and the
    block keeps the generator its first forward made."""

    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.generator = None
            self.linear = nn.Linear(64, 64)
            self.noisy = False

        def forward(self, x):
            y = self.linear(x)
            if self.noisy:
                if self.generator is None:
                    self.generator = torch.Generator(device=dev).manual_seed(9)
                y = y + torch.randn(y.shape, device=y.device, generator=self.generator)
            return y.tanh()

    made = []  # the generator each step's first forward left in the block

    def train(regions):
        made.clear()
        seen = _noisy_steps(Lazy, regions, lambda b: made.append(b.generator), first_noisy=0)
        # every later forward found the one step 0 made: each backward put it back
        assert all(g is made[0] for g in made), made
        return seen

    plain, ours = train(False), train(True)
    assert len(plain) == len(ours)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours))


def made_by_a_helper():
    """NOTE [ explicit generators ]: a generator a helper makes on the device at the block's
    second step, which is not verified, and keeps in an attribute it did not have: no
    region held it when it started, so it is refused, the light check naming the block
    on that step (its recompute on CUDA's backward thread drew other numbers)."""

    def make():
        return torch.Generator(device=dev).manual_seed(9)

    class Helped(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)
            self.noisy = False

        def forward(self, x):
            y = self.linear(x)
            if self.noisy:
                if "generator" not in vars(self):
                    self.generator = make()
                y = y + torch.randn(y.shape, device=y.device, generator=self.generator)
            return y.tanh()

    try:
        _noisy_steps(Helped, True)
    except scopedckpt.ScopedCkptError as refused:
        assert "Helped" in str(refused), refused
    else:
        raise AssertionError("a generator first used unverified was not refused")


def refused_only_after_drawing():
    """NOTE [ explicit generators ]: a generator on the device reads as freshly seeded until it
    draws, so only one that drew before a sampled call finds it is refused."""
    from scopedckpt.mechanisms._generators import _seeded_only

    g = torch.Generator(device=dev).manual_seed(5)
    assert _seeded_only(g, g.get_state())
    torch.randn(4, device=dev, generator=g)
    assert not _seeded_only(g, g.get_state())


def peak_report_on_cuda():
    """``scopedckpt.peak_report`` on the device: its peak is ``measure_peak``'s, within the
    allocator's rounding of what ``max_memory_allocated`` shows, and its categories sum to it
    (the backward runs on autograd's device threads)."""
    m = model(convert=True)
    x = torch.randn(512, 64, device=dev)

    def step():
        with scopedckpt.checkpointing(*m):
            y = m(x).square().mean()
        y.backward()

    step()  # first-step transients aside
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    report = scopedckpt.peak_report(step, root=m)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - before
    m.zero_grad(set_to_none=True)
    print(report)
    print("peak_report", report.peak, "max_memory_allocated", allocated)
    assert sum(report.live.values()) == report.peak
    assert report.peak <= allocated <= report.peak + 512 * 64, (report.peak, allocated)


def peak_report_of_a_real_oom():
    """A real CUDA out-of-memory error inside the step, the process allowed a small fraction
    of the device: peak_report raises it again with the attribution at the failing op."""
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.empty_cache()
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.GELU()) for _ in range(4)])
    blocks = blocks.to(dev)
    x = torch.randn(8192, 4096, device=dev)
    allowed = torch.cuda.memory_allocated() + 6 * x.nbytes  # fits the forward, not the rest
    torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), dev)
    try:

        def step():
            with scopedckpt.checkpointing(*blocks):
                y = blocks(x).square().mean()
            y.backward()

        try:
            scopedckpt.peak_report(step, root=blocks)
        except torch.OutOfMemoryError as error:
            message = str(error)
            print(message.splitlines()[0])
            assert "scopedckpt: out of memory in the" in message
            assert isinstance(error.__cause__, torch.OutOfMemoryError)
        else:
            raise AssertionError("no out-of-memory error at the fraction allowed")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()


def main() -> int:
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
    check("mask bits on cuda", mask_bits)
    check(
        "both formulations the same bits; float32/64 kept values equal torch's", kept_values_bitwise
    )
    check("the CUDA backward runs in another thread", backward_thread)
    check(
        "large dropouts in regions exact on cuda (pieces, two formulations)", large_dropout_regions
    )
    for convert in (True, False):
        for backward in ("backward", "retain_graph"):
            check(
                f"exact on cuda, convert={convert}, {backward}",
                lambda c=convert, b=backward: exact(c, b),
            )
    check("explicit generators on cuda: reached, shared with a scoped layer", explicit_generators)
    check("a generator a forward makes on cuda: made again by every recompute", made_in_forward)
    check("a generator a helper makes on cuda, first used unverified: refused", made_by_a_helper)
    check("a cuda generator reads as freshly seeded until it draws", refused_only_after_drawing)
    check("compiled on cuda: scopedckpt lands where torch's checkpoint does", compiled)
    check("a plan at half the peak: exact, its peak as predicted", planned)
    check(
        "every step under a plan within its budget, the first included", planned_steps_within_budget
    )
    check("the planner's benchmark on cuda: peaks as predicted", plan_benchmark)
    check("peak_report on cuda: measure_peak's peak, the allocator's count", peak_report_on_cuda)
    check("a real out-of-memory error: peak_report names the region", peak_report_of_a_real_oom)
    print("failures", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
