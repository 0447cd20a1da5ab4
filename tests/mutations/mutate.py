"""Mutation check: every realistic bug listed here must turn the test suite red.

Run by hand from anywhere in the repository (it is not a test module; pytest
only imports it for doctests, so nothing runs at import)::

    python tests/mutations/mutate.py                    # every mutant, its own test files
    python tests/mutations/mutate.py --only frame_take_ignores_owner
    python tests/mutations/mutate.py --tests tests/test_layers.py
    python tests/mutations/mutate.py --full             # the whole suite for every mutant
                                                        # (less tests/test_packaging.py)
    python tests/mutations/mutate.py --list
    python tests/mutations/mutate.py --changed HEAD~1 --budget 180 --jobs 2 --no-baseline
                                                        # CI: the mutants of the files the last
                                                        # commit changed, as many as fit

For each mutant the working tree (tracked files plus untracked files git does
not ignore, as they are on disk now: the working tree itself is never
changed) is copied into a temporary directory, one exact snippet of the
package is replaced, and ``python -m pytest -x -q -p no:cacheprovider`` runs
in the copy with the ``ci`` Hypothesis profile and ``PYTHONPATH`` set to the
copy (checked: ``scopedckpt.__file__`` must resolve inside it, not to the
editable install). An unmutated copy runs the same tests first, so a "killed"
cannot come from a test that fails anyway.

A snippet no longer found in the source stops the run with "anchor not
found": update the anchor to the current code, keeping the mutant's meaning
(``tests/test_mutation_anchors.py`` checks every anchor in CI). A mutant that
``needs`` a torch name the running torch lacks (``patch_misses_the_split_front``
on torch 2.13) is skipped with a line saying so: run it with a newer torch.
The exit status is 0 only if every mutant was killed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    """One realistic bug: ``original`` (exactly once in ``path``) becomes ``replacement``."""

    name: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]  # the test files run by default (``--full``: all of them)
    why: str
    # A dotted name the running torch must have for the mutant to change behaviour
    # (an equivalent mutant there otherwise: skipped, not counted as a survivor).
    needs: str = ""


def _has(dotted: str) -> bool:
    """Whether the running Python can reach ``dotted`` (``torch.utils.checkpoint.x``)."""
    module, _, name = dotted.rpartition(".")
    probe = f"import {module}, sys; sys.exit(0 if hasattr({module}, {name!r}) else 1)"
    return subprocess.run([sys.executable, "-W", "ignore", "-c", probe]).returncode == 0


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "frame_take_ignores_owner",
        "scopedckpt/core/_state.py",
        "if record.kind != kind or record.owner_id != owner_id:",
        "if record.kind != kind:",
        ("tests/test_state.py", "tests/test_engine.py"),
        "two dropouts swapping call order in the recompute swap their masks silently",
    ),
    Mutant(
        "compare_with_allclose",
        "scopedckpt/testing/__init__.py",
        "if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):",
        "if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(a, b):",
        ("tests/test_testing.py",),
        "assert_checkpoint_equivalent lets a relative error of 1e-6 pass",
    ),
    Mutant(
        "default_seed_from_fresh_generator",
        "scopedckpt/layers/_dropout.py",
        "return int(torch.randint(0, _SEED_HIGH, (), generator=generator, device=device))",
        "return int(torch.randint(0, _SEED_HIGH, (), "
        "generator=generator if generator is not None else torch.Generator(), device=device))",
        ("tests/test_layers.py",),
        "without generator= every call gets the same mask; torch.manual_seed stops mattering",
    ),
    Mutant(
        "batch_norm_recompute_reads_current_mode",
        "scopedckpt/layers/_layers.py",
        'training, phase = tape_value("batch_norm", self, lambda: self.training)',
        '_, phase = tape_value("batch_norm", self, lambda: self.training)\n'
        "        training = self.training",
        ("tests/test_layers.py",),
        "model.eval() between forward and backward changes the recompute",
    ),
    Mutant(
        "channel_mask_per_sample",
        "scopedckpt/layers/_dropout.py",
        "shape = tuple(input.shape[:2]) + (1,) * (input.dim() - 2) if feature else",
        "shape = (input.shape[0], 1) + (1,) * (input.dim() - 2) if feature else",
        ("tests/test_layers.py",),
        "channel dropout drops all channels of a sample together",
    ),
    Mutant(
        "mask_generator_shared_by_threads",
        "scopedckpt/layers/_mask.py",
        "_GENERATORS = threading.local()",
        '_GENERATORS = type("_SharedByAllThreads", (), {})()',
        ("tests/test_layers.py", "tests/test_concurrency.py"),
        "two threads reseed and draw from one mask generator",
    ),
    Mutant(
        "dropout_scale_off_by_1e-6",
        "scopedckpt/layers/_mask.py",
        "else self.scale(unit.dtype))",
        "else self.scale(unit.dtype) + 1e-6)",
        ("tests/test_layers.py",),
        "kept elements are scaled by 1/(1-p) + 1e-6, not exactly as torch scales them",
    ),
    Mutant(
        "dropout_scale_rounded_from_double",
        "scopedckpt/layers/_mask.py",
        "else self.scale(unit.dtype))",
        "else 1.0 / (1.0 - self.p))",
        ("tests/test_layers.py",),
        "float32 kept values 1 ulp off torch's for about a quarter of all p",
    ),
    Mutant(
        "batch_norm_recompute_updates_running_stats",
        "scopedckpt/layers/_layers.py",
        "running_mean = running_mean.clone()\n"
        "                running_var = None if running_var is None else running_var.clone()",
        "running_mean = running_mean\n                running_var = running_var",
        ("tests/test_layers.py", "tests/test_engine.py"),
        "the recompute updates running_mean/running_var a second time",
    ),
    Mutant(
        "region_call_reads_no_keyword_arguments",
        "scopedckpt/core/_state.py",
        "        if self.kwargs:\n            for name, value in self.kwargs.items():",
        "        if False:\n            for name, value in self.kwargs.items():",
        ("tests/test_state.py", "tests/test_inputs.py"),
        "a region's keyword arguments are not checked for in-place writes, Hugging Face caches "
        "or generators",
    ),
    Mutant(
        "recompute_decides_again",
        "scopedckpt/core/_replay.py",
        "return frame.take(kind, id(owner), owner).value, RECOMPUTE",
        "frame.take(kind, id(owner), owner)\n        return decide(), RECOMPUTE",
        ("tests/test_engine.py", "tests/test_layers.py"),
        "the recompute draws a new dropout seed (and reads the current mode) instead of replaying",
    ),
    Mutant(
        "nested_region_replays_a_fresh_tape",
        "scopedckpt/core/_engine.py",
        "tape = parent.take(_REGION, owner_id, label).value",
        "parent.take(_REGION, owner_id, label)\n        tape = Tape()",
        ("tests/test_engine.py", "tests/test_exactness.py"),
        "a nested region recomputed inside its parent forgets its first forward",
    ),
    # The real-models mechanisms (NOTE [ RNG replay ], NOTE [ buffer guard ], the drop-in).
    Mutant(
        "rng_stash_not_applied",
        "scopedckpt/mechanisms/_rng.py",
        "    stashed.apply()",
        "    pass",
        ("tests/test_rng.py", "tests/test_exactness.py"),
        "recomputes draw unscoped random numbers from wherever the stream is",
    ),
    Mutant(
        "scoped_draw_not_realigned",
        "scopedckpt/layers/_dropout.py",
        "        _redraw(seed, owner, None if from_default else generator)\n",
        "        pass\n",
        ("tests/test_rng.py",),
        "an unscoped draw after a scoped dropout sees a stream shifted by one seed",
    ),
    Mutant(
        "guard_swaps_without_a_copy",
        "scopedckpt/mechanisms/_module_state.py",
        "            swap(module_buffers(holder), name, before.clone(), found)\n",
        "            swap(module_buffers(holder), name, before, found)\n",
        ("tests/test_guard.py",),
        "the first recompute overwrites the recorded state a second recompute needs",
    ),
    Mutant(
        "guard_records_live_buffers",
        "scopedckpt/mechanisms/_module_state.py",
        "    return [(n, b.clone()) for n, b in module_buffers(module).items() if b is not None]",
        "    return [(n, b) for n, b in module_buffers(module).items() if b is not None]",
        ("tests/test_guard.py",),
        "the state recorded before a call is the live buffer, which the call then updates",
    ),
    Mutant(
        "recompute_swaps_nothing_at_its_start",
        "scopedckpt/mechanisms/_guard.py",
        "    put_back = swap_in_first(frame) if frame.tape.states else None\n",
        "    put_back = None\n",
        ("tests/test_guard.py",),
        "a recompute runs its modules on the real buffers, and updates them again",
    ),
    Mutant(
        "guard_caches_guarding_per_class",
        "scopedckpt/core/_subtree.py",
        "    kind = entry[0] if entry is not None else _class_kind(type(module))\n",
        "    kind = entry[0] if entry is not None else _class_kind(type(module))\n"
        "    if kind is False:\n"
        "        kind = bool(module_buffers(module)) or None\n"
        "        _CLASSES[id(type(module))] = (kind, None)\n",
        ("tests/test_guard.py",),
        "the first instance of a class the guard sees decides for all: later instances "
        "with buffers go unguarded",
    ),
    Mutant(
        "guard_copies_lazy_placeholders",
        "scopedckpt/mechanisms/_guard.py",
        "            initialize_lazy(frame, module, args)",
        "            pass",
        ("tests/test_guard.py",),
        "a lazy batch norm first called inside a region fails: its placeholder buffers cannot be copied",
    ),
    Mutant(
        "accelerator_cached_before_it_is_initialised",
        "scopedckpt/mechanisms/_rng.py",
        "    if is_initialized is None or not is_initialized():\n        return []",
        "    if is_initialized is None or not is_initialized():\n        _ACCESSES = []\n"
        "        return []",
        ("tests/test_rng.py",),
        "a CUDA device initialised after the first region is never stashed: its dropout "
        "in attention gets new masks in every recompute",
    ),
    Mutant(
        "guard_keeps_the_recompute_state",
        "scopedckpt/mechanisms/_module_state.py",
        "    put_back(found)\n",
        "    pass\n",
        ("tests/test_guard.py",),
        "after a recompute the module keeps the copies as its buffers",
    ),
    Mutant(
        "strict_ignores_dropout_p",
        "scopedckpt/mechanisms/_strict.py",
        "return not any(name in named and named[name] == value for name, value in _NO_DRAW.items())",
        "return True",
        ("tests/test_rng.py", "tests/test_torch_private.py"),
        "strict mode calls SDPA without dropout random (a false positive)",
    ),
    Mutant(
        "patch_passes_through",
        "scopedckpt/core/_patch.py",
        "    return scope if scope.enabled else None",
        "    return None",
        ("tests/test_dropin.py",),
        "torch's checkpoint inside patch_torch_checkpoint stays torch's (batch norm twice)",
    ),
    # The region mechanisms (NOTE [ region mechanisms ] in _mechanisms.py).
    Mutant(
        "mechanism_entry_not_undone_on_error",
        "scopedckpt/core/_engine.py",
        "                _undo(undos, (type(error), error, error.__traceback__))",
        "                pass",
        ("tests/test_mechanisms.py",),
        "a mechanism raising on entry leaves the ones entered before it active",
    ),
    Mutant(
        "undo_stops_at_the_first_error",
        "scopedckpt/core/_engine.py",
        "        except BaseException as raised:\n            error = error or raised",
        "        except BaseException:\n            raise",
        ("tests/test_mechanisms.py",),
        "an undo raising leaves the mechanisms entered before it active",
    ),
    Mutant(
        "hf_cache_check_unregistered",
        "scopedckpt/integrations/__init__.py",
        "register_mechanism(_hf_cache, first=True)",
        "pass",
        ("tests/test_engine.py",),
        "a Hugging Face cache in a region is appended to again by every recompute",
    ),
    # The torch-version layer (NOTE [ torch versions ] in _torch_private.py).
    Mutant(
        "patch_not_proven_live",
        "scopedckpt/core/_patch.py",
        "                _prove_live(torch_checkpoint_fn)",
        "                pass",
        ("tests/test_torch_versions.py",),
        "a torch that calls its generator by a new name silently gets its own checkpoint back",
    ),
    Mutant(
        "patch_misses_the_split_front",
        "scopedckpt/core/_patch.py",
        "        replacements[PATH.front] = _front",
        "        pass",
        ("tests/test_torch_versions.py", "tests/test_dropin.py"),
        "torch >= 2.14 (run with it): an unset use_reentrant through a bound name is reentrant",
        needs="torch.utils.checkpoint._checkpoint_impl",
    ),
    Mutant(
        "debug_hook_left_swapped",
        "scopedckpt/core/_torch_private.py",
        "                setattr(torch_checkpoint, _DEBUG_NAME, _TORCH_DEBUG_CONTEXT.pop())",
        "                pass",
        ("tests/test_torch_versions.py",),
        "torch's _get_debug_context_and_cb stays replaced after a debug region",
    ),
    Mutant(
        "user_context_fn_dropped",
        "scopedckpt/core/_engine.py",
        "    context_fn = options.caller_context_fn\n    if context_fn is None:",
        "    context_fn = options.caller_context_fn\n    if True:",
        ("tests/test_dropin.py",),
        "checkpoint(context_fn=...) silently ignores the user's contexts",
    ),
    # The compiled path (NOTE [ torch.compile ] in _compiled.py).
    Mutant(
        "compiled_code_makes_no_regions",
        "scopedckpt/core/_paths.py",
        "        return Path.COMPILED if MIRROR.regions and torch.is_grad_enabled() else Path.PLAIN",
        "        return Path.PLAIN",
        ("tests/test_compile.py",),
        "compiled models silently train without checkpointing (no memory saved)",
    ),
    Mutant(
        "oom_noted_by_every_region",
        "scopedckpt/core/_oom.py",
        "    if getattr(error, _NOTED, False):\n        return False\n",
        "",
        ("tests/test_errors.py",),
        "an out-of-memory error in a nested region carries one note per enclosing region",
    ),
    Mutant(
        "oom_forgets_profiled_plans",
        "scopedckpt/planner/_plan.py",
        "    remember(result)  # for out-of-memory notes (``_peak.py``)",
        "    pass",
        ("tests/test_errors.py",),
        "an out-of-memory error in a planned region does not say how low a plan goes",
    ),
    Mutant(
        "oom_outside_regions_unexplained",
        "scopedckpt/mechanisms/_report.py",
        "    except torch.OutOfMemoryError as error:",
        "    except ZeroDivisionError as error:",
        ("tests/test_errors.py",),
        "an out-of-memory error in a memory_report() block outside regions says nothing",
    ),
    Mutant(
        "oom_outside_regions_in_a_scope_unexplained",
        "scopedckpt/core/_scope.py",
        "        if len(exc) > 1 and isinstance(exc[1], torch.OutOfMemoryError):",
        "        if False:",
        ("tests/test_errors.py",),
        "an out-of-memory error between a scope's regions is explained by an outer block only",
    ),
    Mutant(
        "oom_names_a_library_line",
        "scopedckpt/core/_names.py",
        "        if not frame.f_code.co_filename.startswith(LIBRARY_SOURCES):",
        "        if True:",
        ("tests/test_errors.py",),
        "the note outside regions names torch's or scopedckpt's line, not the user's",
    ),
    Mutant(
        "oom_left_unexplained",
        "scopedckpt/core/_engine.py",
        "        if failed and isinstance(exc, torch.OutOfMemoryError):",
        "        if False:",
        ("tests/test_errors.py",),
        "an out-of-memory error in a region says nothing of where it happened",
    ),
    Mutant(
        "compiled_plan_ignores_its_presets",
        "scopedckpt/core/_compiled.py",
        "    elif MIRROR.planned is not None and id(owner) in MIRROR.planned:",
        "    elif False:",
        ("tests/test_selective_compile.py",),
        "a plan around a compiled model recomputes its preset blocks whole: more time, and "
        "not the plan's peak",
    ),
    Mutant(
        "graph_break_fallback_enters_no_frames",
        "scopedckpt/core/_compiled.py",
        "        return self._eager(args, kwargs)",
        "        return self.fn(*args, **kwargs)",
        ("tests/test_compile.py",),
        "a region with a graph break runs as torch's eager checkpoint: batch norm twice",
    ),
    Mutant(
        "compiled_bn_ignores_eager_regions",
        "scopedckpt/layers/_layers.py",
        "        if here is GRAPH:\n            # torch's checkpoint operator",
        "        if True:\n            # torch's checkpoint operator",
        ("tests/test_compile.py",),
        "compiled code rerun by an eager region's recompute updates batch norm twice",
    ),
    Mutant(
        "scope_branch_reads_the_global_compiling_flag",
        "scopedckpt/core/_paths.py",
        "_compiling = torch.compiler.is_dynamo_compiling",
        "_compiling = torch.compiler.is_compiling",
        ("tests/test_compile.py",),
        "an eager scope takes the traced branch while another thread compiles",
    ),
    Mutant(
        "compiled_dropout_leaves_the_graph",
        "scopedckpt/layers/_dropout.py",
        "    if generator is None and (here is GRAPH or (",
        "    if generator is None and (False or (",
        ("tests/test_compile.py",),
        "every scoped dropout is a graph break under torch.compile",
    ),
    # Eager speed and the memory report.
    Mutant(
        "mask_kept_as_floats",
        "scopedckpt/layers/_mask.py",
        "        return keep.to(dtype), (keep if self.save_mask else None)",
        "        return keep.to(dtype), (keep.to(dtype) if self.save_mask else None)",
        ("tests/test_layers.py",),
        "scoped dropout keeps 4 bytes per element for backward instead of 1",
    ),
    Mutant(
        "report_never_forgets_a_freed_storage",
        "scopedckpt/mechanisms/_report.py",
        "    seen[key] = weakref.ref(storage, functools.partial(_forget, seen, key))",
        "    seen[key] = None",
        ("tests/test_report.py",),
        "a tensor reusing a freed tensor's address is not counted as freed by the region",
    ),
    Mutant(
        "report_counts_weights",
        "scopedckpt/mechanisms/_report.py",
        "        if kind is not parameter and (kind is plain or not isinstance(owner, parameter)):",
        "        if True:",
        ("tests/test_report.py",),
        "the report counts the transposed weights linear layers save as freed by checkpointing",
    ),
    Mutant(
        "recompute_hooks_every_module_call",
        "scopedckpt/mechanisms/_guard.py",
        "    every_call = saves(frame.tape)\n",
        "    every_call = True\n",
        ("tests/test_guard.py",),
        "a recompute sends every module call down nn.Module's slow path",
    ),
    Mutant(
        "recompute_keeps_the_stateful_snapshot_of_the_present",
        "scopedckpt/mechanisms/_module_state.py",
        "            _restore(record.module, record.state)",
        "            pass",
        ("tests/test_replay.py",),
        "a Stateful module's recompute counts on from its state after the first forward",
    ),
    Mutant(
        "region_inputs_not_checked",
        "scopedckpt/mechanisms/_inputs.py",
        "        if version_of(tensor) != version:",
        "        if False:",
        ("tests/test_inputs.py",),
        "a region that writes into its own input recomputes from the changed values "
        "(torch's error at backward names no region)",
    ),
    Mutant(
        "holding_recompute_never_released",
        "scopedckpt/core/_engine.py",
        "        recompute: _EnterFrame = _HoldingFrame(RECOMPUTE, tape, scope, owner, True)",
        "        recompute: _EnterFrame = _EnterFrame(RECOMPUTE, tape, scope, owner, True)",
        ("tests/test_targets.py",),
        "module targets stay patched after torch frees the regions that hold them",
    ),
    Mutant(
        "failed_forward_keeps_target_patches",
        "scopedckpt/core/_engine.py",
        "                (self.partner or self).release()",
        "                pass",
        ("tests/test_inputs.py",),
        "a region whose forward failed keeps its module targets patched for good",
    ),
    Mutant(
        "recompute_in_the_current_modes",
        "scopedckpt/mechanisms/_guard.py",
        "    return functools.partial(end, frame, every_call, put_back, _first_forward_modes(frame))",
        "    return functools.partial(end, frame, every_call, put_back, None)",
        ("tests/test_guard.py",),
        "model.eval() between forward and backward: the recompute of an unconverted model "
        "runs in eval mode and torch's checkpoint raises a tensor-count mismatch",
    ),
    Mutant(
        "sampling_verifies_nothing",
        "scopedckpt/core/_sampling.py",
        "    if every and sampled(found.calls - 1, every):",
        "    if False:",
        ("tests/test_sampling.py",),
        "the default check verifies nothing: a model that cannot be recomputed exactly "
        "trains silently wrong",
    ),
    Mutant(
        "sampling_site_per_function_object",
        "scopedckpt/core/_sampling.py",
        "        return id(code), code",
        "        return id(fn), fn",
        ("tests/test_sampling.py",),
        "a lambda region is a new site at every call: every call is verified, at full cost",
    ),
    Mutant(
        "sampling_ignores_reused_ids",
        "scopedckpt/core/_sampling.py",
        "    if entry is None or entry.alive() is not alive:",
        "    if entry is None:",
        ("tests/test_sampling.py",),
        "a new model whose module reuses a freed module's id is not verified on its first step",
    ),
    Mutant(
        "written_ignores_parameters",
        "scopedckpt/mechanisms/_written.py",
        "    if now == versions:  # the common case: nothing changed, nothing to keep",
        "    if True:",
        ("tests/test_written.py",),
        "nn.Embedding(max_norm=...) in a region renormalizes its weight again in every "
        "recompute, silently",
    ),
    Mutant(
        "guard_records_no_subtree",
        "scopedckpt/mechanisms/_guard.py",
        "        record_subtree(tape.states, call.listing)",
        "        pass",
        ("tests/test_written.py",),
        "a memory bank pushed through a method is pushed again by every recompute, silently",
    ),
    Mutant(
        "written_listing_never_refreshed",
        "scopedckpt/core/_subtree.py",
        "    if entry is not None and entry.owner() is owner and entry.generation == _Listing.generation:",
        "    if entry is not None and entry.owner() is owner:",
        ("tests/test_written.py",),
        "a buffer registered after a module's first region is never copied",
    ),
    Mutant(
        "written_recompute_swaps_nothing",
        "scopedckpt/mechanisms/_written.py",
        "    written.listing.learning = False\n",
        "    written.listing.learning = False\n    return None\n",
        ("tests/test_written.py",),
        "nn.Embedding(max_norm=...) in a region renormalizes its weight again in every "
        "recompute, silently",
    ),
    Mutant(
        "guard_records_lazy_placeholders",
        "scopedckpt/mechanisms/_module_state.py",
        "        if any(is_lazy(b) for b in module_buffers(module).values() if b is not None):\n            continue\n",
        "",
        ("tests/test_guard.py",),
        "a lazy batch norm first called in a region over its parent is refused or recomputed "
        "from placeholders",
    ),
    Mutant(
        "written_copy_shared_by_recomputes",
        "scopedckpt/mechanisms/_written.py",
        "        copy = nn.Parameter(before.clone(), written.parameters[index].requires_grad)",
        "        copy = nn.Parameter(before, written.parameters[index].requires_grad)",
        ("tests/test_written.py",),
        "a second recompute (retain_graph) renormalizes the copy the first one renormalized",
    ),
    Mutant(
        "written_real_parameters_never_put_back",
        "scopedckpt/mechanisms/_written.py",
        "        put_back(found)\n",
        "        pass\n",
        ("tests/test_written.py",),
        "after backward the module holds the recompute's copy of its weight, which the "
        "optimizer never updates",
    ),
    Mutant(
        "written_learns_nothing",
        "scopedckpt/mechanisms/_written.py",
        "    listing.written_parameters |= moved\n",
        "",
        ("tests/test_written.py",),
        "nn.Embedding(max_norm=...) in a region is refused from its second step on",
    ),
    Mutant(
        "guard_nested_region_swaps_over_the_outer_copy",
        "scopedckpt/mechanisms/_module_state.py",
        "    token = SWAPPED.set(frozenset(seen)) if len(seen) > len(swapped) else None",
        "    token = None",
        ("tests/test_written.py",),
        "a region nested in one that writes the same bank recomputes the outer one from "
        "stale values, silently",
    ),
    Mutant(
        "verify_sample_positions_shifted",
        "scopedckpt/mechanisms/_bits.py",
        "        first_at = round(first_at * (numel - 1) / (SAMPLE - 1))",
        "        first_at = first_at * (numel - 1) // SAMPLE",
        ("tests/test_verify.py",),
        "a verification failure names the wrong element of a large tensor",
    ),
    Mutant(
        "verify_counts_against_the_recomputes_own_sample",
        "scopedckpt/mechanisms/_verify.py",
        "            recomputed_sample = None if values is None else sample(values)",
        "            recomputed_sample = self.sample",
        ("tests/test_verify.py",),
        "a verification failure says no value differs",
    ),
    Mutant(
        "written_parameters_never_copied",
        "scopedckpt/mechanisms/_written.py",
        "    copied = listing.writable if listing.learning else listing.written_parameters",
        "    copied = ()",
        ("tests/test_written.py",),
        "nn.Embedding(max_norm=...) in a region is refused",
    ),
    Mutant(
        "written_parameters_not_swapped",
        "scopedckpt/mechanisms/_written.py",
        "        for holder, name in slots:\n",
        "        for holder, name in ():\n",
        ("tests/test_written.py",),
        "nn.Embedding(max_norm=...) in a region renormalizes its weight again in every "
        "recompute, silently",
    ),
    Mutant(
        "written_embedding_with_max_norm_taken_for_a_plain_layer",
        "scopedckpt/core/_subtree.py",
        '    return getattr(module, "max_norm", None) is not None or isinstance(module, nn.RNNBase)',
        "    return isinstance(module, nn.RNNBase)",
        ("tests/test_written.py",),
        "nn.Embedding(max_norm=...) in a region is refused",
    ),
    Mutant(
        "written_every_layer_may_write_parameters",
        "scopedckpt/core/_subtree.py",
        "    if not type(module).__module__.startswith(_OWN_LAYERS):",
        "    if True:",
        ("tests/test_written.py",),
        "every region's first step copies every parameter of its subtree",
    ),
    Mutant(
        "written_listing_holds_its_modules",
        "scopedckpt/core/_subtree.py",
        "    weak = {id(module): weakref.ref(module) for _, module in modules}",
        "    weak = {id(module): (lambda m=module: m) for _, module in modules}",
        ("tests/test_written.py",),
        "every model that ever ran a region stays alive, parameters and all",
    ),
    Mutant(
        "written_listing_outlives_its_module",
        "scopedckpt/core/_subtree.py",
        "        weakref.ref(owner, forget),\n",
        "        weakref.ref(owner),\n",
        ("tests/test_written.py",),
        "the parameters of every model that ever ran a region stay alive",
    ),
    Mutant(
        "functional_rrelu_region_stops_early",
        "scopedckpt/core/_torch_private.py",
        "    frame.early_stop = False\n    return True",
        "    return True",
        ("tests/test_verify.py",),
        "F.rrelu in a region fails verification on the first step instead of being exact",
    ),
    Mutant(
        "functional_rrelu_site_forgotten",
        "scopedckpt/core/_early_stop.py",
        "    site(module, fn, count=False).late = True",
        "    pass",
        ("tests/test_verify.py",),
        "F.rrelu in a region reads unwritten noise from the second step on, silently",
    ),
    Mutant(
        "written_buffer_reassignment_rebuilds_listings",
        "scopedckpt/core/_subtree.py",
        "    if tensor is None or module_buffers(module).get(name) is None:",
        "    if True:",
        ("tests/test_written.py",),
        "a counter assigning its buffer (self.steps += 1) makes every region list its subtree "
        "again and copy everything, at every step",
    ),
    Mutant(
        "generators_not_replayed",
        "scopedckpt/mechanisms/_generators.py",
        "    for generator, state in stash:\n        generator.set_state(state)\n",
        "",
        ("tests/test_generators.py",),
        "a region drawing from its own generator recomputes from other random numbers",
    ),
    Mutant(
        "generators_not_put_back",
        "scopedckpt/mechanisms/_generators.py",
        "        for generator, state in found:\n            generator.set_state(state)",
        "        for generator, state in found:\n            pass",
        ("tests/test_generators.py",),
        "after backward an explicit generator is left where the recompute left it",
    ),
    Mutant(
        "generators_site_not_stashed",
        "scopedckpt/mechanisms/_generators.py",
        "        _add(stash, [g for ref in site.generators if (g := ref()) is not None], skip)\n",
        "        pass\n",
        ("tests/test_generators.py",),
        "a generator a verified call of the site found is replayed on verified calls only",
    ),
    Mutant(
        "generators_common_case_ignores_site",
        "scopedckpt/mechanisms/_generators.py",
        "        fn is call.module and (site is None or not site.generators)\n",
        "        fn is call.module\n",
        ("tests/test_generators.py",),
        "a region running a module skips the generators a verified call of its site found",
    ),
    Mutant(
        "generators_not_remembered",
        "scopedckpt/mechanisms/_generators.py",
        "            site.generators.append(weakref.ref(generator))\n",
        "            pass\n",
        ("tests/test_generators.py",),
        "a generator the watch found is forgotten after the verified call",
    ),
    Mutant(
        "generators_ignore_arguments",
        "scopedckpt/mechanisms/_generators.py",
        "    given = [value for _, value in call.others]\n",
        "    given: list[object] = []\n",
        ("tests/test_generators.py",),
        "a generator passed to the region, first used on an unverified call, draws anew",
    ),
    Mutant(
        "generators_ignore_closure",
        "scopedckpt/mechanisms/_generators.py",
        "            carried.append(cell.cell_contents)\n",
        "            pass\n",
        ("tests/test_generators.py",),
        "a generator a region closure holds, first used on an unverified call, draws anew",
    ),
    Mutant(
        "generators_ignore_partial_keywords",
        "scopedckpt/mechanisms/_generators.py",
        "        carried.extend(fn.keywords.values())\n",
        "",
        ("tests/test_generators.py",),
        "a generator bound into a partial, first used on an unverified call, draws anew",
    ),
    Mutant(
        "generators_ignore_registered",
        "scopedckpt/mechanisms/_generators.py",
        "    _add(stash, call.scope.generators, skip)\n",
        "",
        ("tests/test_generators.py",),
        "checkpointing(generators=[g]) is accepted and ignored",
    ),
    Mutant(
        "generators_never_watched",
        "scopedckpt/mechanisms/_generators.py",
        "        if call is None:\n            return None",
        "        if True:\n            return None",
        ("tests/test_generators.py",),
        "no verified call finds a generator: recomputes draw from advanced streams",
    ),
    Mutant(
        "generators_unseen_draws_not_refused",
        "scopedckpt/mechanisms/_generators.py",
        "                raise ScopedCkptError(_message(call))\n",
        "                pass\n",
        ("tests/test_generators.py",),
        "a generator first used on unwatched calls is stashed at the next verified one, silently",
    ),
    Mutant(
        "generators_refuses_a_freshly_seeded_generator",
        "scopedckpt/mechanisms/_generators.py",
        "            if not _seeded_only(generator, state):\n",
        "            if True:\n",
        ("tests/test_generators.py",),
        "a generator made for a sampled verified call is refused although it drew nothing before",
    ),
    Mutant(
        "generators_fresh_unseen_draws_not_warned",
        "scopedckpt/mechanisms/_generators.py",
        "            warnings.warn(_warning(call), stacklevel=3)\n",
        "",
        ("tests/test_generators.py",),
        "a freshly seeded generator first found at a sampled call is stashed without a word",
    ),
    Mutant(
        "generators_watch_stashes_mask_generators",
        "scopedckpt/mechanisms/_generators.py",
        "            and generator not in OWN_GENERATORS\n            and all(",
        "            and all(",
        ("tests/test_generators.py",),
        "every region of a site with scoped dropout stashes and replays the mask generator",
    ),
    Mutant(
        "generators_watch_reads_its_stash_while_compiling",
        "scopedckpt/mechanisms/_generators.py",
        "        if torch.compiler.is_compiling() or self.stash is None:\n",
        "        if self.stash is None or torch.compiler.is_compiling():\n",
        ("tests/test_compile.py",),
        "compiled code in a verified eager region traces another graph in its recompute",
    ),
    Mutant(
        "generators_ignore_module_attributes",
        "scopedckpt/core/_subtree.py",
        "            if generators_in(value):\n",
        "            if False:\n",
        ("tests/test_generators.py",),
        "a generator a module holds, first used on an unverified call, draws anew",
    ),
    Mutant(
        "generators_ignore_lists",
        "scopedckpt/core/_subtree.py",
        "    elif kind is not list and kind is not tuple:\n",
        "    elif True:\n",
        ("tests/test_generators.py",),
        "a generator a module holds in a list, first used on an unverified call, draws anew",
    ),
    Mutant(
        "generators_ignore_dicts",
        "scopedckpt/core/_subtree.py",
        "    if kind is dict:\n",
        "    if False:\n",
        ("tests/test_generators.py",),
        "a generator a module holds in a dict, first used on an unverified call, draws anew",
    ),
    Mutant(
        "dropout_seed_not_redrawn_from_a_replayed_generator",
        "scopedckpt/layers/_dropout.py",
        "        _redraw(seed, owner, None if from_default else generator)\n",
        "        if from_default:\n            _redraw(seed, owner, None)\n",
        ("tests/test_generators.py",),
        "an unscoped op sharing a scoped layer's generator draws from a stream one seed behind",
    ),
    Mutant(
        "written_learning_never_ends",
        "scopedckpt/mechanisms/_written.py",
        "    written.listing.learning = False\n",
        "",
        ("tests/test_written.py",),
        "every region copies every parameter that may be changed, at every step",
    ),
    Mutant(
        "written_only_in_module_target_regions",
        "scopedckpt/mechanisms/_written.py",
        "    module = call.module\n",
        "    module = call.owner if isinstance(call.owner, nn.Module) else None\n",
        ("tests/test_written.py",),
        "checkpoint(block.forward, x) over an embedding with max_norm renormalizes its weight "
        "again in every recompute, silently",
    ),
    Mutant(
        "guard_subtree_only_in_module_target_regions",
        "scopedckpt/mechanisms/_guard.py",
        "    if call.listing is not None and call.listing.guarded:",
        "    if isinstance(owner, nn.Module) and call.listing and call.listing.guarded:",
        ("tests/test_written.py",),
        "checkpoint(block.forward, x) with a bank pushed through a method is wrong, silently",
    ),
    Mutant(
        "rrelu_region_stops_early",
        "scopedckpt/core/_early_stop.py",
        "        if late and any((layer := ref()) is not None and layer.training for ref in late):",
        "        if False:",
        ("tests/test_verify.py",),
        "an RReLU region's recompute ends inside rrelu_with_noise: backward reads unwritten noise",
    ),
    Mutant(
        "verify_compares_unread_rrelu_noise",
        "scopedckpt/mechanisms/_verify.py",
        "        not_verified(x)  # NOTE [ unread saved tensors ]",
        "        pass",
        ("tests/test_verify.py",),
        "an eval-mode RReLU region fails verification on garbage its backward never reads",
    ),
    Mutant(
        "policy_built_in_the_trace",
        "scopedckpt/core/_policy.py",
        "@torch.compiler.assume_constant_result  # NOTE [ policies built in compiled code ]\n",
        "",
        ("tests/test_selective_compile.py",),
        "checkpointing(save=[...]) first entered in compiled code builds its policy in the "
        "trace: dynamo fails there, or not, depending on what ran before",
    ),
    Mutant(
        "verify_compares_shapes_only",
        "scopedckpt/mechanisms/_verify.py",
        "            same = torch.equal(self.sums, other.sums) or (",
        "            same = True or (",
        ("tests/test_verify.py",),
        "determinism_check='bitwise' compares shapes like torch's default: wrong recomputes pass",
    ),
    Mutant(
        "verify_fingerprint_blind_to_order",
        "scopedckpt/mechanisms/_bits.py",
        "    return torch.stack([rows.sum(), rows.flip(0).cumsum(0).sum()])",
        "    return torch.stack([rows.sum(), rows.sum()])",
        ("tests/test_verify.py",),
        "a recompute with the forward's values in another order passes verification",
    ),
    Mutant(
        "verify_ignores_writes_after_saving",
        "scopedckpt/mechanisms/_verify.py",
        "        if version_of(x) != self._version or (node is None and not x.requires_grad):",
        "        if False:",
        ("tests/test_verify.py",),
        "an exact RReLU region (early_stop=False) fails verification: its noise is written "
        "after autograd saved it",
    ),
    Mutant(
        "verify_compares_running_statistics",
        "scopedckpt/mechanisms/_verify.py",
        "        not_verified(module.running_mean, module.running_var)",
        "        pass",
        ("tests/test_verify.py",),
        "a divergence before a batch norm's later call is named at the batch norm, whose "
        "statistics that call updates in place, not at the op that diverged",
    ),
    Mutant(
        "verify_compares_scoped_running_statistics",
        "scopedckpt/layers/_layers.py",
        "            not_verified(running_mean, running_var)",
        "            pass",
        ("tests/test_verify.py",),
        "exact models with scoped batch norm fail verification on the throwaway copies of "
        "running statistics their recompute saves",
    ),
    Mutant(
        "verify_failure_keeps_target_patches",
        "scopedckpt/mechanisms/_verify.py",
        "                patches.release_all()",
        "                pass",
        ("tests/test_verify.py",),
        "a region that failed verification keeps its module targets patched for good",
    ),
    Mutant(
        "guard_hook_traced_by_dynamo",
        "scopedckpt/mechanisms/_guard.py",
        "        if here is BREAK:\n            _pre_outside_dynamo(module, args)\n        return",
        "        if here is GRAPH:\n            return",
        ("tests/test_compile.py",),
        "compiled code inside an eager region traces the guard's bookkeeping: the "
        "compiled helpers go stale and an unconverted batch norm updates twice",
    ),
    Mutant(
        "guard_hooks_never_released",
        "scopedckpt/mechanisms/_guard.py",
        "            del GLOBAL_PRE_HOOKS[_KEY]\n",
        "            pass\n",
        ("tests/test_guard.py",),
        "the buffer guard's global hooks stay installed after the last frame",
    ),
    Mutant(
        "report_counts_the_owners_buffers",
        "scopedckpt/mechanisms/_report.py",
        "if key not in seen and key not in buffers:",
        "if key not in seen:",
        ("tests/test_report.py",),
        "the report counts the region module's running statistics, which stay alive, as freed",
    ),
    # Two dropout formulations (NOTE [ two formulations ] in _mask.py).
    Mutant(
        "mask_band_retuned",
        "scopedckpt/layers/_mask.py",
        "HASHED_FROM_ELEMENTS = 3 << 15  # 98,304",
        "HASHED_FROM_ELEMENTS = 1 << 17",
        ("tests/test_mask_stream.py",),
        "a size band's constant is tuned: users' masks change with no new stream version",
    ),
    Mutant(
        "scale_cache_unbounded",
        "scopedckpt/layers/_mask.py",
        "@functools.lru_cache(maxsize=_CACHE_SIZE)  # computing it costs a kernel and a sync",
        "@functools.lru_cache(maxsize=None)",
        ("tests/test_mask_stream.py",),
        "a dropout schedule grows the per-p scale cache without bound",
    ),
    Mutant(
        "native_dropout_rounds_its_scale",
        "scopedckpt/layers/_mask.py",
        '    return float(torch.ones((), dtype=dtype, device="cpu").div_(1.0 - p))',
        "    return 1.0 / (1.0 - p)",
        ("tests/test_layers.py",),
        "small dropouts scale kept elements by a rounded 1/(1-p): an ulp off torch's and the "
        "Function's for some p",
    ),
    Mutant(
        "scale_computed_on_the_default_device",
        "scopedckpt/layers/_mask.py",
        'torch.ones((), dtype=dtype, device="cpu").div_(1.0 - p)',
        "torch.ones((), dtype=dtype).div_(1.0 - p)",
        ("tests/test_layers.py",),
        "the scale is divided on the default device: on CUDA, a multiply by the reciprocal",
    ),
    Mutant(
        "native_dropout_keeps_float_noise",
        "scopedckpt/layers/_mask.py",
        "    keep = mask.keep()\n    out = input.mul_(keep)",
        "    keep = mask.keep().to(input.dtype)\n    out = input.mul_(keep)",
        ("tests/test_layers.py",),
        "small dropouts keep 4 bytes per element for backward instead of 1",
    ),
    # The mask's bits (NOTE [ mask bits ] in _mask.py).
    Mutant(
        "mask_bits_lose_the_sign_bit",
        "scopedckpt/layers/_mask.py",
        "return words.random_(-(1 << 63), None, generator=generator)",
        "return words.random_(generator=generator)",
        ("tests/test_layers.py",),
        "int64 random_ without a range draws 63 bits: odd elements (the high halves) are kept "
        "more often than 1 - p",
    ),
    Mutant(
        "mask_threshold_off_by_a_factor",
        "scopedckpt/layers/_mask.py",
        "keep = min(round((1.0 - p) * 2.0**32), (1 << 32) - 1)",
        "keep = min(round((1.0 - p) * 2.0**31), (1 << 32) - 1)",
        ("tests/test_layers.py",),
        "the threshold is computed on the wrong scale: keep rates are not 1 - p",
    ),
    Mutant(
        "mask_drawn_in_one_piece",
        "scopedckpt/layers/_mask.py",
        "half = words if numel < PIECES_FROM_ELEMENTS else",
        "half = words if True else",
        ("tests/test_layers.py",),
        "large masks draw all their words at once: 5 bytes per element held by the draw, "
        "above the 4 of torch's noise",
    ),
    Mutant(
        "mask_second_piece_reseeded",
        "scopedckpt/layers/_mask.py",
        "                _random_words(tail, generator)\n",
        "                generator.manual_seed(self.seed)\n                _random_words(tail, generator)\n",
        ("tests/test_layers.py",),
        "the second piece starts the stream again: its bits repeat the first piece's",
    ),
    Mutant(
        "hash_shifts_arithmetic",
        "scopedckpt/layers/_mask.py",
        "zc.bitwise_xor_(tc.bitwise_and_((1 << (64 - shift)) - 1))",
        "zc.bitwise_xor_(tc)",
        ("tests/test_layers.py",),
        "the hash's shifts keep int64's sign extension: not SplitMix64, whose top bits then "
        "mix less",
    ),
    Mutant(
        "hash_chunks_restart_the_sequence",
        "scopedckpt/layers/_mask.py",
        "torch.arange(start, start + n, out=zc)",
        "torch.arange(0, n, out=zc)",
        ("tests/test_layers.py",),
        "every chunk hashes the same indices: a large mask repeats its first chunk's bits",
    ),
    Mutant(
        "hash_in_one_chunk",
        "scopedckpt/layers/_mask.py",
        "chunk = min(_HASH_CHUNK_WORDS, -(-words // 4))",
        "chunk = words",
        ("tests/test_layers.py",),
        "the hash's buffers hold all the words: 8 bytes per element of scratch, above "
        "torch's 4-byte noise",
    ),
    Mutant(
        "recompute_takes_the_function",
        "scopedckpt/layers/_mask.py",
        "if input.numel() >= NATIVE_BELOW_ELEMENTS and not recompute:",
        "if input.numel() >= NATIVE_BELOW_ELEMENTS:",
        ("tests/test_layers.py",),
        "recomputes run MaskedDropout, which allocates its output before the mask is saved: "
        "early stop no longer ends a recompute before a last dropout's output",
    ),
    # Selective saving.
    Mutant(
        "kept_random_op_leaves_the_stream_behind",
        "scopedckpt/mechanisms/_selective.py",
        "        if entry.rng is not None:\n            entry.rng.apply()",
        "        pass",
        ("tests/test_selective.py",),
        "a kept random op is skipped without moving the generators past its draws",
    ),
    Mutant(
        "kept_output_changed_in_place_still_served",
        "scopedckpt/mechanisms/_selective.py",
        "        if any(version_of(t) != version for t, version in entry.versions):",
        "        if False:",
        ("tests/test_selective.py",),
        "an output changed in place after it was kept is served with its new values",
    ),
    Mutant(
        "ops_numbered_per_op_only",
        "scopedckpt/mechanisms/_selective.py",
        "    return func, modules[-1] if modules else None",
        "    return func, None",
        ("tests/test_selective.py",),
        "the recompute numbers calls per op, not per module call, as the forward does not",
    ),
    Mutant(
        "kept_outputs_never_served",
        "scopedckpt/mechanisms/_selective.py",
        "        if entry is None:\n            return func(*args, **kwargs)\n        signature",
        "        if True:\n            return func(*args, **kwargs)\n        signature",
        ("tests/test_selective.py",),
        "save= keeps outputs but the recompute reruns every op (no time saved)",
    ),
    Mutant(
        "guard_copies_numbered",
        "scopedckpt/core/_own_ops.py",
        "        _DEPTH.aside += 1\n        _DEPTH.own += self._own\n        function, dispatch = "
        "innermost_modes()\n        self._function = function if isinstance(function, "
        "WatchingMode) else None\n        self._dispatch = dispatch if isinstance(dispatch, "
        "NumberingMode) else None\n        if self._function is not None:\n            "
        "pop_function_mode()\n        if self._dispatch is not None:\n            "
        "pop_dispatch_mode()\n\n    def __exit__(self, *exc: object) -> None:\n        if "
        "self._dispatch is not None:\n            push_dispatch_mode(self._dispatch)\n        "
        "if self._function is not None:\n            push_function_mode(self._function)\n"
        "        _DEPTH.aside -= 1\n",
        "        _DEPTH.own += self._own\n\n    def __exit__(self, *exc: object) -> None:\n",
        ("tests/test_selective.py",),
        "the buffer guard's and scoped batch norm's copies are numbered and kept like the model's ops",
    ),
    Mutant(
        "numbering_mode_never_set_aside",
        "scopedckpt/core/_own_ops.py",
        "        self._dispatch = dispatch if isinstance(dispatch, NumberingMode) else None",
        "        self._dispatch = None",
        ("tests/test_selective.py",),
        "ops run aside still reach selective saving's mode, a Python call each (a dropout mask's sixty)",
    ),
    Mutant(
        "watching_mode_never_set_aside",
        "scopedckpt/core/_own_ops.py",
        "        self._function = function if isinstance(function, WatchingMode) else None",
        "        self._function = None",
        ("tests/test_generators.py",),
        "a dropout mask's calls reach the explicit-generator watch of verified calls, one each",
    ),
    Mutant(
        "dropout_masks_numbered",
        "scopedckpt/layers/_mask.py",
        "        with aside():\n            return self._keep()",
        "        if True:\n            return self._keep()",
        ("tests/test_selective.py",),
        "a dropout mask's ops are numbered by selective saving, a Python call each",
    ),
    Mutant(
        "unkeepable_ops_kept",
        "scopedckpt/mechanisms/_selective.py",
        "        reason = why_not_keepable(func)\n        if reason is not None:",
        "        reason = why_not_keepable(func)\n        if False:",
        ("tests/test_selective.py",),
        "in-place ops, views and factories selected by a policy are kept like any other",
    ),
    Mutant(
        "factories_keepable",
        "scopedckpt/mechanisms/_selective.py",
        '    elif name.endswith("_like") or not takes_tensors:',
        "    elif False:",
        ("tests/test_selective.py",),
        "tensor factories are kept although a change in place to them goes unseen",
    ),
    Mutant(
        "report_ignores_kept_outputs",
        "scopedckpt/mechanisms/_report.py",
        "    for tensor in kept_tensors(tape):  # outputs kept by save=",
        "    for tensor in []:  # outputs kept by save=",
        ("tests/test_selective.py",),
        "memory_report() counts kept outputs as freed",
    ),
    Mutant(
        "peak_forgets_what_ops_made",
        "scopedckpt/planner/_peak.py",
        "        self.events.append((serial, nbytes))",
        "        pass",
        ("tests/test_peak.py",),
        "peak_report's categories do not sum to the peak: the storages ops made are not in them",
    ),
    Mutant(
        "peak_gradients_unnamed",
        "scopedckpt/planner/_peak.py",
        '    recorder.mark((p.grad for p in params.values()), "gradients")',
        "    pass",
        ("tests/test_peak.py",),
        "gradients made in the step fall under the backward's temporaries",
    ),
    Mutant(
        "peak_recompute_is_a_forward",
        "scopedckpt/planner/_peak.py",
        '                    found = ("recompute" if frame.phase is RECOMPUTE else "forward", region)',
        '                    found = ("forward", region)',
        ("tests/test_peak.py",),
        "a peak in a region's recompute is reported in its forward",
    ),
    Mutant(
        "peak_keeps_its_first_moment",
        "scopedckpt/planner/_peak.py",
        "        if key != self.key:  # the moment changed (or is seen for the first time)",
        "        if self.key is None:",
        ("tests/test_peak.py",),
        "every op after the first is charged to the step's first moment: no recompute, no backward",
    ),
    Mutant(
        "peak_names_a_library_line",
        "scopedckpt/planner/_peak.py",
        "        if not code.co_filename.startswith(LIBRARY_SOURCES):",
        "        if True:",
        ("tests/test_peak.py",),
        "the peak's source line is torch's or scopedckpt's, not the user's",
    ),
    Mutant(
        "live_bytes_count_views",
        "scopedckpt/planner/_live.py",
        "                self._count(out.untyped_storage(), new=not aliasing)",
        "                self._count(out.untyped_storage(), new=True)",
        ("tests/test_plan.py",),
        "a view of a parameter counts the parameter as a new tensor of the step",
    ),
    Mutant(
        "live_bytes_ignore_growth_in_place",
        "scopedckpt/planner/_live.py",
        "            if entry is None and not new:",
        "            if not new:",
        ("tests/test_plan.py",),
        "a counted tensor an out= op enlarges keeps its old size in the count",
    ),
    Mutant(
        "live_bytes_never_freed",
        "scopedckpt/planner/_live.py",
        "                ref = weakref.ref(storage, self._freed_callback(key))",
        "                ref = weakref.ref(storage)",
        ("tests/test_plan.py",),
        "freed storages stay counted: every peak is the step's total allocation",
    ),
    Mutant(
        "untouched_buffers_not_put_back",
        "scopedckpt/planner/_untouched.py",
        "                    if not torch.equal(tensor, clone):",
        "                    if False:",
        ("tests/test_plan.py",),
        "plan() leaves batch norm statistics and counters updated by its steps",
    ),
    Mutant(
        "untouched_trusts_version_counters",
        "scopedckpt/planner/_untouched.py",
        "                    if not torch.equal(tensor, clone):",
        "                    if version_of(tensor) != version:",
        ("tests/test_plan.py",),
        "running statistics, written with no version bump, stay updated by plan()",
    ),
    Mutant(
        "untouched_generators_not_put_back",
        "scopedckpt/planner/_untouched.py",
        "            generator.set_state(state)",
        "            pass",
        ("tests/test_plan.py",),
        "a model's own generator is left advanced by plan()'s steps",
    ),
    Mutant(
        "untouched_written_parameter_not_copied",
        "scopedckpt/planner/_untouched.py",
        "            if parameter is not None and id(parameter) not in self._clones:",
        "            if False:",
        ("tests/test_plan.py",),
        "a parameter written in place in forward (embedding max_norm) is not put back",
    ),
    Mutant(
        "solve_ignores_recompute_peaks",
        "scopedckpt/planner/_solve.py",
        "            if option.recompute is not None:\n                q = torch.maximum(q, p + option.recompute)",
        "            if False:\n                q = torch.maximum(q, p + option.recompute)",
        ("tests/test_plan.py",),
        "plans exceed the budget while a block's recompute rebuilds its activations",
    ),
    Mutant(
        "solve_front_ignores_kept_bytes",
        "scopedckpt/planner/_solve.py",
        "    order = _order(prefix, key)\n",
        "    order = _order(key)\n",
        ("tests/test_plan.py",),
        "the front is pruned by cost alone: costlier partial plans that keep less are lost",
    ),
    Mutant(
        "solve_ranks_by_the_first_column_only",
        "scopedckpt/planner/_solve.py",
        "    for column in columns:\n        ordered = column[order]",
        "    for column in columns[:1]:\n        ordered = column[order]",
        ("tests/test_plan_costs.py", "tests/test_plan.py"),
        "rows equal in their first column share a rank: equal-cost plans tie whatever else",
    ),
    Mutant(
        "solve_ties_ignore_regions",
        "scopedckpt/planner/_solve.py",
        "_lex(cost, regions, rank)",
        "_lex(cost, rank)",
        ("tests/test_plan_costs.py", "tests/test_plan.py"),
        "plans of equal cost are broken by block order alone: more regions than needed",
    ),
    Mutant(
        "solve_ties_by_later_blocks",
        "scopedckpt/planner/_solve.py",
        "        rank = _lex(rank, order)",
        "        rank = _lex(order, rank)",
        ("tests/test_plan_costs.py", "tests/test_plan.py"),
        "ties between equal plans go by another rule than the documented one",
    ),
    Mutant(
        "profile_full_region_keeps_nothing",
        "scopedckpt/planner/_profile.py",
        '            choices.append(Choice("full", kept_full[k] + holds, cost, rebuild))',
        '            choices.append(Choice("full", holds, cost, rebuild))',
        ("tests/test_plan.py",),
        "the peak model forgets what a region keeps (its output) for the next block",
    ),
    Mutant(
        "preset_kept_memory_costs_nothing",
        "scopedckpt/planner/_profile.py",
        "                selective += extra * machine.kept >> 20",
        "                selective += 0",
        ("tests/test_plan_costs.py",),
        "on CPU a preset's kept outputs cost no time: convolutions and matmuls presets look cheap",
    ),
    Mutant(
        "preset_recompute_less_what_it_keeps",
        "scopedckpt/planner/_profile.py",
        "                choices.append(Choice(preset, kept_preset, selective, rebuild))",
        "                choices.append(Choice(preset, kept_preset, selective, rebuild - extra))",
        (
            "tests/test_real_models.py::"
            "test_a_resnet_block_with_a_preset_never_peaks_above_its_prediction",
        ),
        "a preset's recompute is predicted below the full region's by what it keeps, which "
        "lives on its tape through the block's whole backward: plans peak above their budget",
    ),
    Mutant(
        "profile_recompute_rebuilds_nothing",
        "scopedckpt/planner/_profile.py",
        "            rebuild = peak - settled_full[k + 1] + held.handed.get(k + 1, 0)",
        "            rebuild = 0",
        ("tests/test_plan.py",),
        "the peak model forgets the activations a recompute rebuilds during backward",
    ),
    Mutant(
        "profile_region_forward_peak_unseen",
        "scopedckpt/planner/_profile.py",
        "            peak = max(full.backward_peak[k], full.forward_segments.get(k, 0))",
        "            peak = full.backward_peak[k]",
        ("tests/test_plan.py",),
        "a verified region's first forward (its fingerprints) is left out of its peak",
    ),
    Mutant(
        "profile_outputs_handed_to_regions_unseen",
        "scopedckpt/planner/_held.py",
        "            into = held.handed if k > 0 and tag == k - 1 else held.alone",
        "            into = {}",
        ("tests/test_plan.py",),
        "a region after a block without one holds that block's output, which plain training "
        "frees: the plan peaks above its prediction",
    ),
    Mutant(
        "profile_outputs_freed_after_regions_unseen",
        "scopedckpt/planner/_profile.py",
        "held.handed.get(k, 0) - held.handed.get(k + 1, 0)",
        "held.handed.get(k, 0)",
        ("tests/test_plan.py",),
        "a region's output that the next block takes is counted as kept by both: a block "
        "without a region after it looks as if it kept it",
    ),
    Mutant(
        "profile_recompute_counts_the_handed_output",
        "scopedckpt/planner/_profile.py",
        "            rebuild = peak - settled_full[k + 1] + held.handed.get(k + 1, 0)",
        "            rebuild = peak - settled_full[k + 1]",
        ("tests/test_plan.py",),
        "a region's recompute is predicted without its own output, which the next region held "
        "when the step measured it and no longer holds then: plans peak above predictions",
    ),
    Mutant(
        "profile_shared_inputs_unseen",
        "scopedckpt/planner/_profile.py",
        "    late = late_floors(settled, tally.forward_segments, tally.backward_segments, held.shared)",
        "    late = (None,) * len(settled)",
        ("tests/test_plan.py",),
        "a mask made outside the blocks lives to the first region's backward, where plain "
        "training freed it when the forward returned: plans peak above their predictions",
    ),
    Mutant(
        "solve_ignores_late_floors",
        "scopedckpt/planner/_solve.py",
        "        after = late[i + 1] if late else None",
        "        after = None",
        ("tests/test_plan.py",),
        "the solver drops the floors that bind plans with a region: plans peak above budgets",
    ),
    Mutant(
        "solve_prunes_the_plan_without_regions",
        "scopedckpt/planner/_solve.py",
        "        ranged = (regions > 0).nonzero().flatten()\n"
        "        front, thin = _front(prefix[ranged], key[ranged], cap)\n"
        "        kept = torch.cat(((regions == 0).nonzero().flatten(), ranged[front]))\n",
        "        kept, thin = _front(prefix, key, cap)\n",
        ("tests/test_plan.py",),
        "a plan with a region prunes the one without, which late floors do not bind: the best "
        "plan can be lost",
    ),
    Mutant(
        "scope_ignores_plan_presets",
        "scopedckpt/core/_state.py",
        "        if self.saves and id(owner) in self.saves:",
        "        if False:",
        ("tests/test_plan.py",),
        "checkpointing(plan) gives every region the scope's save=, not the plan's preset",
    ),
    Mutant(
        "eager_recompute_holds_its_region",
        "scopedckpt/core/_eager_checkpoint.py",
        "_collector(weakref.ref(self), key)",
        "_collector(lambda: self, key)",
        ("tests/test_eager_checkpoint.py",),
        "a tensor the forward stores on a module keeps the region's function and contexts alive",
    ),
    Mutant(
        "eager_unpack_twice_unnoticed",
        "scopedckpt/core/_eager_checkpoint.py",
        "        slots[placeholder.index] = _UNPACKED\n",
        "",
        ("tests/test_eager_checkpoint.py",),
        "a saved tensor unpacked twice is handed out again and never released",
    ),
    Mutant(
        "eager_ignores_the_early_stop_switch",
        "scopedckpt/core/_eager_checkpoint.py",
        "early_stop if override is None else override",
        "early_stop",
        ("tests/test_eager_checkpoint.py",),
        "set_checkpoint_early_stop(False) no longer makes recomputes run whole",
    ),
    Mutant(
        "eager_recompute_ignores_autocast",
        "scopedckpt/core/_eager_checkpoint.py",
        "with autocast_as(self.autocast), self.recompute_context:",
        "with self.recompute_context:",
        ("tests/test_eager_checkpoint.py",),
        "a region run under autocast recomputes in float32: other saved tensors",
    ),
    Mutant(
        "eager_inputs_held_not_saved",
        "scopedckpt/core/_eager_checkpoint.py",
        "(True, saved(a)) if isinstance(a, torch.Tensor) else (False, a)",
        "(False, a)",
        ("tests/test_eager_checkpoint.py",),
        "a nested region holds its input, an activation the outer region should drop",
    ),
    Mutant(
        "eager_one_recompute_per_region",
        "scopedckpt/core/_eager_checkpoint.py",
        "        key = _torch_private.graph_task_key()\n",
        "        key = 0\n",
        ("tests/test_eager_checkpoint.py",),
        "retain_graph=True then another backward finds the first backward's tensors unpacked",
    ),
    Mutant(
        "eager_compares_no_metadata",
        "scopedckpt/core/_eager_checkpoint.py",
        "            if saved != recomputed:",
        "            if False:",
        ("tests/test_eager_checkpoint.py",),
        "determinism_check='default' lets a recompute with other shapes through",
    ),
    Mutant(
        "eager_stops_one_tensor_early",
        "scopedckpt/core/_eager_checkpoint.py",
        "if frame.early_stop and index + 1 == len(placeholders):",
        "if frame.early_stop and index + 2 == len(placeholders):",
        ("tests/test_eager_checkpoint.py",),
        "early stop ends the recompute before its last saved tensor",
    ),
    Mutant(
        "eager_failed_recompute_kept",
        "scopedckpt/core/_eager_checkpoint.py",
        "            del self.recomputed[key], self.counts[key]\n",
        "",
        ("tests/test_eager_checkpoint.py",),
        "after a failed recompute the next backward of its group gets empty slots",
    ),
    Mutant(
        "eager_never_taken",
        "scopedckpt/core/_eager_checkpoint.py",
        "    return (\n        options.caller_context_fn is None",
        "    return False and (\n        options.caller_context_fn is None",
        ("tests/test_eager_checkpoint.py",),
        "every eager region goes through torch's checkpoint (the per-call cost comes back)",
    ),
    Mutant(
        "sampling_periodic",
        "scopedckpt/core/_sampling.py",
        "    return ((z ^ (z >> 31)) >> 32) % every == 0  # the high half: the low bits follow calls",
        "    return calls % every == 0",
        ("tests/test_sampling.py",),
        "a site whose calls alternate between two kinds has one kind never verified (aliasing)",
    ),
    Mutant(
        "light_check_compares_nothing",
        "scopedckpt/core/_eager_checkpoint.py",
        "                if not torch.equal(recomputed, forward[index]):",
        "                if False:",
        ("tests/test_world.py", "tests/test_written.py"),
        "a recompute with other values goes unseen between sampled calls, silently wrong",
    ),
    Mutant(
        "light_check_watches_only_the_learned_tail",
        "scopedckpt/core/_eager_checkpoint.py",
        "        if index >= tail >= 0 and _light.is_tail(x):  # the site's calls may differ",
        "        if index == tail >= 0 and _light.is_tail(x):  # the site's calls may differ",
        ("tests/test_world.py",),
        "a branch taken after warm-up that saves more tensors than the site learned from "
        "goes unseen",
    ),
    Mutant(
        "path_check_counts_nothing",
        "scopedckpt/core/_eager_checkpoint.py",
        "        if count != len(self.placeholders):\n            self._fail()",
        "        if False:\n            self._fail()",
        ("tests/test_world.py", "tests/test_eager_checkpoint.py"),
        "a recompute that took another path hands backward misplaced tensors",
    ),
    Mutant(
        "measure_peak_returns_the_end",
        "scopedckpt/planner/_measure.py",
        "    return counter.peak",
        "    return counter.live",
        ("tests/test_plan_api.py",),
        "measure_peak returns what is still alive after the step (gradients), far below its "
        "peak: every plan looks within budget",
    ),
    Mutant(
        "plan_profiles_regions_unverified",
        "scopedckpt/planner/_profile.py",
        ', determinism_check="bitwise")\n',
        ")\n",
        ("tests/test_plan_api.py",),
        "a step verified bit for bit (each site's first) peaks above the plan's budget",
    ),
    Mutant(
        "plan_checks_the_budget_after_profiling",
        "scopedckpt/planner/_plan.py",
        "    parse_budget(budget, 0)  # raises for a bad budget before any step runs\n",
        "",
        ("tests/test_plan_api.py",),
        "plan(model, x, budget='lots') runs two whole training steps before saying the budget "
        "is not a size",
    ),
    Mutant(
        "plan_blocks_sequential_is_one_block",
        "scopedckpt/planner/_blocks.py",
        "    if isinstance(blocks, nn.Sequential):\n"
        "        blocks = list(blocks.children())  # what a user means: its layers\n",
        "",
        ("tests/test_plan_api.py",),
        "plan(blocks=model.body) plans one block, the whole Sequential, and no budget below the "
        "peak fits",
    ),
    Mutant(
        "sampling_counts_suspended_calls",
        "scopedckpt/core/_sampling.py",
        "    found = site(owner, fn, count=_Sampling.counting)\n",
        "    found = site(owner, fn)\n",
        ("tests/test_plan_api.py",),
        "the first step after plan() is each site's second call: nothing verifies it",
    ),
    Mutant(
        "guard_records_nothing_at_calls",
        "scopedckpt/mechanisms/_module_state.py",
        "        copied = record_subtree(states, subtree(module))",
        "        copied = 0",
        ("tests/test_guard.py", "tests/test_qat.py"),
        "a batch norm called in a region over a lambda updates its statistics again in every "
        "recompute, silently",
    ),
    Mutant(
        "guard_recompute_starts_on_the_real_buffers",
        "scopedckpt/mechanisms/_module_state.py",
        "            swap(module_buffers(holder), name, before.clone(), found)\n",
        "            pass\n",
        ("tests/test_qat.py",),
        "QAT's fused ConvBn2d folds the running variance its batch norm's first-forward call "
        "already updated: sampled verification fails the step",
    ),
    Mutant(
        "verify_tape_cycle",
        "scopedckpt/mechanisms/_verify.py",
        "    tape.verifying = Verifying(call, stats_of(tape))  # _report started before",
        "    tape.verifying = Verifying(call, stats_of(tape))\n"
        "    tape.verifying.tape = tape  # type: ignore[attr-defined]",
        ("tests/test_plan_api.py",),
        "a verified region with a save= preset keeps its kept op outputs alive until the "
        "garbage collector runs: a verified step peaks about a block's worth above the plan",
    ),
    Mutant(
        "convert_scopes_what_fused_modules_read",
        "scopedckpt/layers/_convert.py",
        "    keep = type(result).__module__.startswith(_READS_CHILDREN)\n",
        "    keep = False\n",
        ("tests/test_qat.py",),
        "convert() on a QAT-fused model swaps in a scoped batch norm whose statistics its "
        "fused parent reads outside its call: sampled verification fails at step 0",
    ),
    Mutant(
        "untouched_leaves_attributes",
        "scopedckpt/planner/_untouched.py",
        "        self._attributes = [(vars(m), dict(vars(m))) for m in self.model.modules()]\n",
        "        self._attributes = []\n",
        ("tests/test_plan.py",),
        "plan() advances a model's call counters and warm-up switches: training after it differs",
    ),
    Mutant(
        "untouched_leaves_python_random",
        "scopedckpt/planner/_untouched.py",
        "        random.setstate(self._python)\n",
        "",
        ("tests/test_plan.py",),
        "plan() draws from Python's random: LayerDrop after it takes other layers",
    ),
    Mutant(
        "world_records_the_live_parametrize_cache",
        "scopedckpt/mechanisms/_world.py",
        "        world.parametrize = (enabled, dict(cache))",
        "        world.parametrize = (enabled, cache)",
        ("tests/test_world.py",),
        "under parametrize.cached() the recompute reads the weight its first forward cached "
        "instead of computing it: a RecomputeDivergenceError in backward",
    ),
    Mutant(
        "world_leaves_the_parametrize_cache_alone",
        "scopedckpt/mechanisms/_world.py",
        "        parametrize = parametrize_cache((enabled, dict(cache)))\n",
        "        parametrize = None\n",
        ("tests/test_world.py",),
        "parametrize.cached() held through backward fails with torch's CheckpointError",
    ),
    Mutant(
        "world_leaves_bindings_alone",
        "scopedckpt/mechanisms/_world.py",
        "                swap(registered, name, tensor, undo)\n",
        "                pass\n",
        ("tests/test_world.py",),
        "functional_call fast weights: the recompute computes with the module's own weights",
    ),
    Mutant(
        "world_learns_no_attributes",
        "scopedckpt/mechanisms/_world.py",
        "        if d.get(name, _MISSING) is not value and (id(d), name) not in known:\n",
        "        if False:\n",
        ("tests/test_world.py",),
        "a counter or a cached mask the forward writes is read changed by the recompute",
    ),
    Mutant(
        "world_learns_only_from_recomputes",
        "scopedckpt/mechanisms/_world.py",
        "        return\n    _learn_attributes(world, learned)\n    if world.python",
        "        return\n    if world.python",
        ("tests/test_world.py",),
        "a counter changed by a call never recomputed in the first step is not learned",
    ),
    Mutant(
        "world_never_replays_python_random",
        "scopedckpt/mechanisms/_world.py",
        "        learned.python = True",
        "        learned.python = False",
        ("tests/test_world.py",),
        "LayerDrop written with random.random() takes another path in the recompute",
    ),
    Mutant(
        "world_keeps_the_recomputes_writes",
        "scopedckpt/mechanisms/_world.py",
        "    put_back(undo)\n",
        "    pass\n",
        ("tests/test_world.py",),
        "after backward a counter reads what the recompute left, not plain training's",
    ),
    Mutant(
        "world_replays_inside_the_parents_recompute",
        "scopedckpt/mechanisms/_world.py",
        "    if not frame.rewind:\n",
        "    if False:\n",
        ("tests/test_written.py",),
        "a region nested in one that swaps buffer copies recomputes from the real buffers",
    ),
    Mutant(
        "verify_holds_saved_tensors",
        "scopedckpt/mechanisms/_verify.py",
        "            self._tensor = (lambda: x) if hold else weakref.ref(x)",
        "            self._tensor = lambda: x",
        ("tests/test_world.py",),
        "a verified step keeps every saved activation to its forward's end: it peaks above "
        "a plan's budget",
    ),
    Mutant(
        "verify_holds_the_regions_arguments",
        "scopedckpt/mechanisms/_verify.py",
        "    verifying.call = verifying.call.without_arguments()\n",
        "",
        ("tests/test_errors.py",),
        "a region refused in its forward keeps its module targets patched: the region's input "
        "holds the graph that holds the tape that holds the input",
    ),
    Mutant(
        "hooks_rerun_in_recomputes",
        "scopedckpt/mechanisms/_hooks.py",
        "        return hook(*args) if run else None",
        "        return hook(*args)",
        ("tests/test_world.py",),
        "a hook that appends a layer's output to a list sees each call twice per step",
    ),
    Mutant(
        "hooks_that_change_tensors_skipped",
        "scopedckpt/mechanisms/_hooks.py",
        "            or _versions(args) != before\n",
        "            or False\n",
        ("tests/test_world.py",),
        "a hook that scales a layer's output in place is skipped in the recompute: other "
        "saved values",
    ),
    Mutant(
        "transform_regions_checkpointed",
        "scopedckpt/core/_transforms.py",
        "    if _torch_private.functorch_level() is None:\n        return False",
        "    if True:\n        return False",
        ("tests/test_world.py",),
        "a region under vmap recomputes outside it: torch's CheckpointError",
    ),
)


@dataclass
class Result:
    name: str
    status: str  # killed / SURVIVED / ERROR / NOT_RUN
    first_failure: str
    seconds: float
    output: str
    imported: str  # where the copy's python found scopedckpt


NOT_RUN = "not run (budget)"


def _files() -> list[str]:
    """Tracked files and untracked ones git does not ignore, that exist on disk now."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({f for f in listing.split("\0") if f and (REPO / f).is_file()})


def _check_anchors(mutants: Sequence[Mutant]) -> list[str]:
    problems = []
    for m in mutants:
        source = REPO / m.path
        count = source.read_text().count(m.original) if source.is_file() else 0
        if count == 0:
            problems.append(
                f"{m.name}: anchor not found in {m.path}: {m.original!r}. Update the anchor "
                "to the current code, keeping the mutant's meaning."
            )
        elif count > 1:
            problems.append(f"{m.name}: anchor found {count} times in {m.path}: {m.original!r}")
    return problems


def _copy_tree(files: Sequence[str], into: Path) -> None:
    for name in files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)
    env["HYPOTHESIS_PROFILE"] = "ci"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _check_imports_the_copy(copy: Path) -> str:
    found = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            "import scopedckpt, scopedckpt.testing; "
            "print(scopedckpt.__file__); print(scopedckpt.testing.__file__)",
        ],
        cwd=copy,
        env=_env(copy),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for path in found:
        if not Path(path).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(
                f"mutate.py: the copy in {copy} imports scopedckpt from {path}, not from the "
                "copy: the mutant would not be tested. Check PYTHONPATH and the editable install."
            )
    return found[0]


_FAILURE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def _run(
    name: str,
    mutant: Mutant | None,
    files: Sequence[str],
    tests: Sequence[str],
    timeout: float,
    keep: bool,
) -> Result:
    start = time.monotonic()
    copy = Path(tempfile.mkdtemp(prefix=f"scopedckpt-mutant-{name}-"))
    try:
        _copy_tree(files, copy)
        if mutant is not None:
            source = copy / mutant.path
            text = source.read_text()
            if text.count(mutant.original) != 1:  # changed since the anchor check
                raise SystemExit(f"{mutant.name}: anchor not found in the copy of {mutant.path}")
            source.write_text(text.replace(mutant.original, mutant.replacement))
        imported = _check_imports_the_copy(copy)
        # -m "": the slow tests of the mutant's files too (the default run leaves them out).
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "",
            *tests,
        ]
        try:
            proc = subprocess.run(
                command,
                cwd=copy,
                env=_env(copy),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            partial = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            rc, output = -1, f"timed out after {timeout:.0f} s\n{partial}"
    finally:
        if keep:
            print(f"kept {name}: {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)
    failure = _FAILURE.search(output)
    first = failure.group(1) if failure else ""
    if rc == 0:
        status = "SURVIVED" if mutant is not None else "passed"
    elif rc == 1 and first:
        status = "killed" if mutant is not None else "FAILED"
    else:  # collection error, usage error, no tests, timeout: not a clean kill
        status = f"ERROR (rc={rc})"
        first = first or (output.strip().splitlines() or [""])[-1]
    return Result(name, status, first, time.monotonic() - start, output, imported)


def _table(results: Sequence[Result]) -> str:
    rows = [("mutant", "result", "first failing test", "s")]
    rows += [(r.name, r.status, r.first_failure or "-", f"{r.seconds:.0f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this mutant (repeatable, or comma separated)",
    )
    parser.add_argument(
        "--tests",
        nargs="+",
        metavar="PATH",
        help="test files or node ids for every mutant instead of its own",
    )
    parser.add_argument("--full", action="store_true", help="run the whole suite per mutant")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the run of the unmutated copy"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--changed",
        metavar="REV",
        help="only the mutants of files changed between REV and the working tree (CI)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="start no mutant after this many seconds; those left are listed as not run",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print pytest's output for survivors and errors",
    )
    args = parser.parse_args(argv)

    names = {n for item in args.only for n in item.split(",") if n}
    unknown = names - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutant(s) {sorted(unknown)}; see --list")
    mutants = [m for m in MUTANTS if not names or m.name in names]
    if args.changed:
        changed = set(
            subprocess.run(
                ["git", "diff", "--name-only", args.changed, "--"],
                cwd=REPO,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
        )
        mutants = [m for m in mutants if m.path in changed]
        print(f"{len(mutants)} mutant(s) target files changed since {args.changed}", flush=True)
        if not mutants:
            return 0
    unreachable = [m for m in mutants if m.needs and not _has(m.needs)]
    for m in unreachable:
        print(f"{m.name}: skipped: this torch has no {m.needs}", flush=True)
    mutants = [m for m in mutants if m not in unreachable]
    if args.list:
        for m in mutants:
            print(f"{m.name:45} {m.path:32} {m.why}")
        return 0

    problems = _check_anchors(mutants)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2

    def tests_for(m: Mutant | None) -> list[str]:
        if args.full:
            # pytest's testpaths (tests/ and the package's doctests), less the wheel build:
            # it tests packaging, not behaviour, and its pip install inherits PYTHONPATH, so
            # pip finds the copy's scopedckpt.egg-info (made by that build) and skips it.
            return ["--ignore=tests/test_packaging.py"]
        if args.tests:
            return list(args.tests)
        if m is None:  # the baseline: every file some selected mutant runs
            return sorted({t for mutant in mutants for t in mutant.tests})
        return list(m.tests)

    files = _files()
    results: list[Result] = []
    if not args.no_baseline:
        baseline = _run("baseline", None, files, tests_for(None), args.timeout, args.keep)
        print(f"the copies import {baseline.imported}", flush=True)
        print(_table([baseline]), flush=True)
        if baseline.status != "passed":
            print(baseline.output[-6000:], file=sys.stderr)
            print(
                "mutate.py: the unmutated copy fails: no mutant result would mean anything.",
                file=sys.stderr,
            )
            return 1

    deadline = None if args.budget is None else time.monotonic() + args.budget

    def run(m: Mutant) -> Result:
        if deadline is not None and time.monotonic() > deadline:
            return Result(m.name, NOT_RUN, "", 0.0, "", "")
        return _run(m.name, m, files, tests_for(m), args.timeout, args.keep)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run, m) for m in mutants]
        for future in futures:
            result = future.result()
            results.append(result)
            print(f"{result.name}: {result.status} {result.first_failure}", flush=True)

    print()
    print(_table(results))
    bad = [r for r in results if r.status not in ("killed", NOT_RUN)]
    skipped = [r.name for r in results if r.status == NOT_RUN]
    if skipped:
        print(f"\n{len(skipped)} mutant(s) not run within the budget: {', '.join(skipped)}")
    if args.verbose:
        for r in bad:
            print(f"\n===== {r.name} =====\n{r.output[-6000:]}")
    if bad:
        print(f"\n{len(bad)} mutant(s) not killed: {', '.join(r.name for r in bad)}")
        return 1
    print(f"\nall {len(results) - len(skipped)} mutants run killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
