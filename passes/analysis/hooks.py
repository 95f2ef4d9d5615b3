"""What the capture cannot keep of a model's own backward, refused by name instead of dropped.

``torch.export`` records the forward's aten ops, and AOT autograd derives the backward from
their derivatives. Anything that changes a gradient from outside those ops would be lost without
a word, training on other gradients than one device's:

- a module's backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
  the old ``register_backward_hook``, and their global forms);
- a gradient hook that the forward puts on a tensor (``h.register_hook(fn)``);
- the ``backward`` of a ``torch.autograd.Function`` the forward applies: its forward's ops are
  traced and differentiated, its own backward never runs (a custom op's backward registered
  with ``torch.library.register_autograd`` is kept: the op stays in the graph; one declared with
  :func:`differentiate_forward` is differentiated as its forward's ops).

The first are found on the modules before tracing; the others are watched for while the forward
is traced. Gradient hooks on parameters (registered outside the forward) are kept: they fire on
the parameters' DTensor gradients (:func:`autopar.runtime.state.distribute_state` carries them
to the parameters it makes), and are refused under ``no_sync()``, which would call them once for
the micro-batches' sum. Forward hooks are traced into the graph: what they return is computed at
every step, but they are not called then. Torch's own instrumentation (``MemTracker``) is let be.
"""

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch
from torch.nn.modules import module as nn_module

from autopar.core.errors import CaptureError

log = logging.getLogger(__name__)

_FIX = (
    "Fix: write the gradient as an op torch.export keeps, a torch.library.custom_op with its backward registered "
    "by register_autograd, or change the gradients after backward() (parameters' .grad, or p.register_hook on a "
    "parameter, which autopar keeps)"
)

_KEPT = ("torch._library.", "torch.nn.modules._functions.BackwardHookFunction")
"""Functions whose backward the capture keeps or need not: those torch makes for custom ops'
registered backwards (``register_autograd``: the op stays in the graph, and AOT autograd
differentiates it by that backward), and the identity through which a module calls backward
hooks, which are refused before tracing unless they are torch's instrumentation."""

_DIFFERENTIATED: set[type] = set()
"""Functions declared by :func:`differentiate_forward`."""

_REENTRANT = "torch.utils.checkpoint.CheckpointFunction"
"""``torch.utils.checkpoint``'s Function under ``use_reentrant=True``."""


_INSTRUMENTS = (
    "torch.distributed._tools.",
    "torch.utils.module_tracker",
    "torch.utils.flop_counter",
    "torch.distributed.tensor.debug",
)
"""Where torch's instrumentation lives (``MemTracker``, ``FlopCounterMode``, ``CommDebugMode``),
whose hooks measure a step and change no value; torch's other hooks (pruning, weight norm) do."""


def differentiate_forward(function: type) -> type:
    """Declare that ``function``'s backward computes the derivative of its forward, so that the
    capture may differentiate the forward's ops instead of refusing the Function (transformers'
    BLOOM applies such a Function, ``GeLUFunction``, in training). Returns ``function``, so that
    it also serves as a class decorator. The capture cannot check the claim: a Function whose
    backward differs (a clipped or scaled gradient) would train on other gradients than one
    device's."""
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError(f"differentiate_forward takes a torch.autograd.Function subclass, got {function!r}")
    _DIFFERENTIATED.add(function)
    return function


def is_torchs(hook) -> bool:
    """Whether ``hook`` is torch's own instrumentation (:data:`_INSTRUMENTS`), or the wrapper by
    which ``torch.autograd.graph.register_multi_grad_hook`` registers one."""
    function = getattr(hook, "__func__", hook)
    module = getattr(function, "__module__", None) or ""
    if module == "torch.autograd.graph":
        for cell in getattr(function, "__closure__", None) or ():
            try:
                if callable(cell.cell_contents) and is_torchs(cell.cell_contents):
                    return True
            except ValueError:  # a cell never assigned
                continue
        return False
    return module.startswith(_INSTRUMENTS)


def has_gradient_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries gradient hooks (``register_hook``, post-accumulate ones) other
    than torch's instrumentation."""
    tables = (tensor._backward_hooks, tensor._post_accumulate_grad_hooks)
    return any(not is_torchs(h) for table in tables if table for h in table.values())


def module_hooks(table: dict, prefix: str, kind: str) -> list:
    """The ``kind`` hooks (``"forward"`` or ``"backward"``, pre and post) in a module's attribute
    ``table`` (``vars(module)``; the global ones with ``prefix="_global_"``), but torch's
    instrumentation."""
    return [h for name in ("_pre_hooks", "_hooks") for h in table[f"{prefix}{kind}{name}"].values() if not is_torchs(h)]


def _hooked(model: torch.nn.Module, kind: str) -> list[str]:
    """The modules of ``model`` with :func:`module_hooks` of ``kind``, by qualified name, and
    ``"(global)"`` for hooks registered on every module."""
    found = [path or type(model).__name__ for path, m in model.named_modules() if module_hooks(vars(m), "_", kind)]
    if module_hooks(vars(nn_module), "_global_", kind):
        found.append("(global)")
    return found


def refuse_backward_hooks(model: torch.nn.Module) -> None:
    """Refuse a model with module backward hooks, naming the modules."""
    hooked = _hooked(model, "backward")
    if hooked:
        raise CaptureError(
            f"backward hooks are registered on {', '.join(hooked)}: the captured graph differentiates the forward's "
            f"ops and would never call them, training on other gradients than one device's. {_FIX}"
        )


def warn_of_forward_hooks(model: torch.nn.Module) -> None:
    """Say which modules' forward hooks the trace runs once, on fake tensors, and the steps
    never call (an activation logger records nothing), though what they return is computed."""
    hooked = _hooked(model, "forward")
    if hooked:
        log.warning(
            "forward hooks of %s run while the model is captured, on fake tensors: what they return is computed at "
            "every step, but they are not called then",
            ", ".join(hooked),
        )


_WATCHING = threading.Lock()
"""One capture watches at a time: the watchers replace process-wide methods."""
_watching = threading.local()
"""``active`` in the thread whose capture watches."""


@contextlib.contextmanager
def refusing_custom_backwards(model: torch.nn.Module) -> Iterator[None]:
    """Trace inside: afterwards, refuse the ``torch.autograd.Function``s the forward applied (each
    application makes a backward context, however ``apply`` was reached) and the gradient hooks
    it registered on tensors, by name (once the trace has ended, so that a forward that catches
    errors cannot hide them). Only this thread's calls count."""
    functions: dict[str, None] = {}
    hooks: dict[str, None] = {}
    contexts = torch.autograd.function.BackwardCFunction
    own_init = contexts.__dict__.get("__init__")
    register_hook = torch.Tensor.register_hook
    owner = threading.get_ident()

    def watched_init(self, *args, **kwargs):
        cls = self._forward_cls
        own = threading.get_ident() == owner and cls not in _DIFFERENTIATED
        if own and not f"{cls.__module__}.{cls.__qualname__}".startswith(_KEPT):
            functions[f"{cls.__module__}.{cls.__qualname__}"] = None
        if own_init is None:
            super(contexts, self).__init__(*args, **kwargs)
        else:
            own_init(self, *args, **kwargs)

    def watched_register_hook(self, hook):
        if threading.get_ident() == owner and not is_torchs(hook):
            hooks[getattr(hook, "__qualname__", type(hook).__name__)] = None
        return register_hook(self, hook)

    if getattr(_watching, "active", False):  # a capture inside a capture (a compiled module in a model being captured)
        yield
        return
    with _WATCHING:
        _watching.active = True
        contexts.__init__ = watched_init
        torch.Tensor.register_hook = watched_register_hook
        try:
            yield
        finally:
            if own_init is None:
                del contexts.__init__
            else:
                contexts.__init__ = own_init
            torch.Tensor.register_hook = register_hook
            _watching.active = False
    if _REENTRANT in functions:
        raise CaptureError(
            f"{type(model).__name__}'s forward checkpoints activations with use_reentrant=True, whose "
            "torch.autograd.Function the capture cannot differentiate. Fix: checkpoint with use_reentrant=False "
            "(Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), "
            "or leave recomputation to autopar's plan (memory_budget=)"
        )
    if functions:
        raise CaptureError(
            f"{type(model).__name__}'s forward applies torch.autograd.Function {', '.join(functions)}: the captured "
            "graph differentiates the ops of its forward, and its own backward would never run. " + _FIX + ". If "
            "its backward is the derivative of its forward (transformers' BLOOM GeLUFunction's is), declare it with "
            "autopar.differentiate_forward(TheFunction)"
        )
    if hooks:
        raise CaptureError(
            f"{type(model).__name__}'s forward registers gradient hooks on tensors ({', '.join(hooks)}): the "
            "captured graph differentiates the forward's ops and would never call them. " + _FIX
        )
