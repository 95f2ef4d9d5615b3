"""What a call of a compiled module brings beside its parameters: its inputs, which the ranks
compare by fingerprints with the graphs they run, and the model's settings, which the captured
graph bakes in and the program cached for a call is keyed by."""

import functools
import inspect
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
from autopar.passes.analysis.hooks import module_hooks
from autopar.runtime.program import named_timeouts
from autopar.runtime.release import release
from torch.nn.modules import module as nn_module

from autopar.core.errors import InputError

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the bits of ``x``'s elements, plain and weighted by position (1 to 251,
    repeating): exact whatever the order of the additions (they wrap around), equal on two ranks
    holding equal values (NaNs and infinities too), and all but surely unequal otherwise."""
    flat = x.detach().resolve_conj().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.contiguous().view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device).remainder_(251).add_(1)
    return torch.stack([bits.sum(), (bits * weights).sum()])


SETTINGS_CAPTURES = 8
"""Captures a model's settings alone may cause before a change is refused (a value annealed every
step would capture every step)."""
_PLAIN = (bool, int, float, str, type(None))
_MODULE_ATTRIBUTES = frozenset(vars(torch.nn.Module()))
"""What every module holds (its training flag, hook tables): not settings of the model."""


HOOKS = " hooks"
"""The end of the name under which :func:`modes` lists a module's hooks."""


def modes(
    model: torch.nn.Module, requires_grad: bool = True
) -> tuple[tuple[bool, ...], tuple[tuple[str, object], ...]]:
    """What the captured graph bakes in beside the inputs' sizes: the training flag of every
    module (eval mode of some modules, frozen batch norm, changes the graph as eval mode of the
    whole model does) and, with ``requires_grad``, whether each of its parameters requires a
    gradient (one unfrozen after compiling needs a graph that makes its gradient), and every plain value (number, flag,
    string, a tuple of them) a module holds, or an object a module holds does (a Hugging Face
    config), by name: the forward reads them as constants (a temperature a schedule anneals, a
    drop rate), so a change captures the model again, as ``torch.compile``'s guards recompile
    it. So does a change of the hooks of a module (``"<module> hooks"``) or of every module
    (``"global hooks"``): forward hooks are traced into the graph, backward hooks are refused by
    the capture."""
    flags, values, seen = [], [], set()
    hooks = _hooks(vars(nn_module), "_global_")
    if hooks:
        values.append(("global" + HOOKS, hooks))
    for path, m in model.named_modules():
        flags.append(m.training)
        if requires_grad:
            flags.extend(p.requires_grad for p in m._parameters.values() if p is not None)
        hooks = _hooks(vars(m), "_")
        if hooks:
            values.append(((path or type(model).__name__) + HOOKS, hooks))
        for name, v in vars(m).items():
            if name in _MODULE_ATTRIBUTES:
                continue
            if _plain(v):
                values.append((f"{path}.{name}".lstrip("."), v))
            elif _holds_values(v) and id(v) not in seen:
                seen.add(id(v))
                values.extend((f"{path}.{name}.{k}".lstrip("."), x) for k, x in vars(v).items() if _plain(x))
    return tuple(flags), tuple(values)


def _hooks(table: dict, prefix: str) -> tuple[str, ...]:
    """The forward and backward hooks (pre and post, :func:`module_hooks`) in a module's attribute
    ``table``, each as what it computes (:func:`_hook`)."""
    return tuple(_hook(hook) for kind in ("forward", "backward") for hook in module_hooks(table, prefix, kind))


def _hook(hook) -> str:
    """A hook as what it computes: its function's name and place and the values it closes over,
    reads from its module's globals, takes by default, is bound to or holds (a partial's
    arguments, an object's attributes), plain values as they are and others by type. Equal for a
    hook registered again each step, unequal for one that would compute otherwise."""
    hook = inspect.unwrap(hook)
    bound = getattr(hook, "__self__", None)
    bound = None if isinstance(bound, types.ModuleType) else bound  # a builtin's module (print)
    function = getattr(hook, "__func__", hook)
    if isinstance(function, functools.partial):
        held = [*function.args, *function.keywords.values()]
        function = function.func
    else:
        held = list(vars(bound).values()) if hasattr(bound, "__dict__") else []
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object
        where, held = type(hook).__qualname__, held + (list(vars(hook).values()) if hasattr(hook, "__dict__") else [])
    else:
        where = f"{code.co_filename.rpartition('/')[2]}:{code.co_firstlineno}"
        held += [_cell(c) for c in getattr(function, "__closure__", None) or ()]
        held += [function.__globals__[n] for n in code.co_names if n in function.__globals__]
        held += [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]
    values = tuple(v if _plain(v) else type(v).__qualname__ for v in held if not callable(v) or _plain(v))
    name = getattr(function, "__qualname__", type(hook).__qualname__)
    return f"{name} at {where}" + (f" with {values}" if values else "")


def _cell(cell) -> object:
    """A closure cell's value (``None`` for one never assigned)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _plain(value) -> bool:
    """Whether ``value`` is a number, flag, string or ``None``, or a tuple of them."""
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(x, _PLAIN) for x in value))


def _holds_values(value) -> bool:
    """Whether ``value`` is an object whose attributes a forward may read as settings (not a
    module, tensor, class or function)."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
        and not callable(value)
    )


def setting_changes(before: tuple, after: tuple) -> list[tuple[str, object, object]]:
    """The plain values (:func:`modes`) that differ between two keys' modes, set, changed or
    gone, as ``(name, old, new)`` (``None`` where there is none)."""
    old, new = dict(before[1][1]), dict(after[1][1])
    return [
        (name, old.get(name), new.get(name))
        for name in old.keys() | new.keys()
        if (name in old) != (name in new) or (old[name] is not new[name] and old[name] != new[name])
    ]


def changed_settings(before: tuple, after: tuple) -> str:
    """:func:`setting_changes` as ``name: old -> new``."""
    return ", ".join(
        f"{name}: {was!r} -> {now!r}" for name, was, now in sorted(setting_changes(before, after), key=lambda c: c[0])
    )


def check_ranks_agree(
    whole: list[tuple[torch.Tensor, str]],
    graph_hash: str,
    modes_now: Callable[[], tuple],
    device: torch.device,
    group,
    timeout_s: float | None,
) -> None:
    """Refuse whole inputs (``(tensor, name)``) that differ between the ranks of ``group``, in
    sizes or values, and ranks whose running programs' graphs (``graph_hash``) differ: every rank
    passes the global batch and the program cuts each rank's piece out of it, so ranks loading
    their own data (DDP's ``DistributedSampler``) would train on pieces of different batches, or
    lower programs of other sizes; a setting changed on some ranks only (a module's attribute)
    changes their graph alone, and ``modes_now`` then names it. One all-reduce of the graph's
    fingerprint, the sizes and two integer sums of each input's bits (:func:`fingerprint`), and a
    wait for the device."""
    parts = [
        torch.tensor(
            [int(graph_hash[:15], 16), *(n for x, _ in whole for n in x.shape)], dtype=torch.int64, device=device
        )
    ]
    parts += [fingerprint(x).to(device) for x, _ in whole]
    checked = torch.cat(parts)
    bounds = torch.cat([checked, -checked])
    with named_timeouts(timeout_s, "check that the ranks' inputs agree"):
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    agree = torch.eq(bounds[: len(checked)], -bounds[len(checked) :]).cpu()
    release(bounds)  # here, not on gloo's thread, which may hold it past the wait
    sizes = len(parts[0])
    shapes_differ = not bool(agree[1:sizes].all())
    values_agree = agree[sizes:].view(-1, 2).all(dim=1).tolist()
    differ = [name for (_, name), same in zip(whole, values_agree) if shapes_differ or not same]
    if differ:
        raise InputError(
            f"the ranks passed different {'sizes' if shapes_differ else 'values'} of input "
            f"{', '.join(repr(n) for n in differ)}: every rank passes the whole global batch, of which the plan "
            "gives each rank its piece. Fix: load the same batch on every rank (no DistributedSampler, the same "
            "seed for shuffling), or pin the input to a split (pins={name: 'S(0)'}) and pass each rank's part"
        )
    if not bool(agree[0]):
        everyone: list = [None] * dist.get_world_size(group)
        with named_timeouts(timeout_s, "check that the ranks' settings agree"):
            dist.all_gather_object(everyone, modes_now(), group=group)
        apart = _settings_apart([values for _, values in everyone])
        if not apart and any(flags != everyone[0][0] for flags, _ in everyone):
            apart = "the modules' training modes or the parameters' requires_grad"
        raise InputError(
            "the ranks run programs of different graphs, "
            + (
                f"as the model's settings differ between them ({apart})"
                if apart
                else "though their models' settings agree: the models differ (their code or their structure)"
            )
            + ". Fix: give every rank the same model and set its attributes and hooks alike on every rank"
        )


def _settings_apart(everyone: list[tuple[tuple[str, object], ...]]) -> str:
    """The plain values (:func:`modes`) that differ between ranks, given every rank's, as
    ``name: value on rank 0, value on rank 1, ...``."""
    tables = [dict(values) for values in everyone]
    names = sorted({name for table in tables for name in table})
    return "; ".join(
        f"{name}: {', '.join(repr(t.get(name)) for t in tables)}"
        for name in names
        if any(t.get(name) != tables[0].get(name) for t in tables)
    )
