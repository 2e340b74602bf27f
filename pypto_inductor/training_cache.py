"""Training graphs through AOTAutograd's own cache: a warm process skips the joint trace.

A training step's warm first call was ~4 s for T5 against Inductor's ~2.9 s
(docs/benchmarks.md): Inductor's graphs come back from AOTAutograd's cache, which skips
the joint forward/backward trace, the partition and the metadata analysis; ours were
traced again (graph_cache.py holds inference graphs only). AOTAutograd's cache stores any
compiler's result that is an ``OutputCode`` when its bundled mode is on (torch's
aot_compile uses that mode for Inductor): the entry holds the compiled forward and
backward themselves, with everything AOTAutograd needs to rebuild its runtime wrappers.
:class:`GraphOutputCode` is that form of one compiled graph: its FusionPlan and options,
pickled as graph_cache pickles them; loading rebuilds the CompiledGraph (kernels from the
kernel cache).

:func:`cached_aot` runs AOTAutograd with that mode on for a Dynamo graph that
:func:`usable` accepts: grad on and an input requiring grad (a training graph), the
graph_cache conditions (static shapes, no constants or modules on the graph), the cache
not disabled. The key is ours (:func:`cache_key`: graph_cache's key with functorch's
config); inside torch's aot_compile, which keys its own way, AOTAutograd's, with our
settings added through ``torch.compiler.config.cache_key_tag``. In this mode the backward
compiles with the forward (AOTAutograd saves the entry when both exist); a graph whose
compile ran eagerly or whose sizes are symbolic is not stored. ``PYPTO_INDUCTOR_GRAPH_CACHE=0`` turns this off with graph_cache.
"""
from __future__ import annotations

import contextlib
import hashlib
from unittest import mock

import torch
import torch._functorch.config as functorch_config
from torch._functorch._aot_autograd import autograd_cache
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._inductor.output_code import OutputCode

from . import graph_cache
from .codegen import get_target
from .config import Config
from .runtime import CompiledGraph

stats = {"loaded": 0}  # graphs rebuilt from a cache entry


def training_graph(gm, example_inputs, config: Config) -> bool:
    """A Dynamo graph AOTAutograd traces with its backward (grad on, an input requiring
    grad) whose compile depends only on its code and inputs' metadata (graph_cache's
    conditions): one this cache, or torch's aot_compile, can store."""
    return (torch.is_grad_enabled()
            and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
            and graph_cache.storable_graph(gm, example_inputs, config))


def usable(gm, example_inputs, config: Config) -> bool:
    """Whether this Dynamo graph's compile goes through AOTAutograd's cache."""
    return (graph_cache.enabled() and not torch.compiler.config.force_disable_caches
            and functorch_config.enable_autograd_cache
            and training_graph(gm, example_inputs, config))


class GraphOutputCode(OutputCode):
    """One compiled ATen graph as AOTAutograd's cache stores it. ``compiled`` is None for a
    graph that runs eagerly (never stored); ``plan``/``saved_from`` rebuild it on load."""

    def __init__(self, run, config: Config, compiled: CompiledGraph | None = None,
                 saved_from: int | None = None):
        super().__init__()
        self._run, self._compiled = run, compiled
        self.config, self.saved_from = config, saved_from
        self._data: bytes | None = None
        self._boxed_call = True

    @property
    def native(self) -> bool:
        """Compiled by us (not an eager fallback), or rebuilt from an entry."""
        return self._compiled is not None or self._data is not None

    def __call__(self, inputs: list):
        return self._run(inputs)

    def prepare_for_serialization(self) -> None:  # on a copy, before pickling
        if self._compiled is None:
            raise BypassAOTAutogradCache("pypto_inductor: a graph that runs eagerly")
        plan = self._compiled.plan
        if plan.graph.symbol_bindings:
            raise BypassAOTAutogradCache("pypto_inductor: a graph with symbolic sizes")
        self._data = graph_cache.dumps((plan, self.config, self.saved_from))
        self._run = self._compiled = None

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self._run is not None:  # compiled in this process
            return
        plan, config, saved_from = graph_cache.loads(self._data)
        self._compiled = CompiledGraph(plan, get_target(config.target), config,
                                       saved_from=saved_from)
        self._run = self._compiled.call
        stats["loaded"] += 1
        if _loading:  # inside the backend's cached_aot: it reports the graph
            _loading[-1].append(self._compiled)

    def set_triton_bundle(self, triton_bundle) -> None:  # no Triton kernels here
        pass


def output_codes(compilers: dict, config: Config) -> tuple[dict, list[GraphOutputCode]]:
    """``compilers`` (AOTAutograd's keyword -> ``compile(gm, example_inputs, record)``,
    backend.compile_graph bound) as the serializable compilers AOTAutograd's cache asks
    for, and the list each GraphOutputCode they build is appended to."""
    built: list[GraphOutputCode] = []

    def serializable(compile_fn):
        def compile_to_output_code(gm, example_inputs) -> GraphOutputCode:
            record: dict = {}
            run = compile_fn(gm, example_inputs, record)
            built.append(GraphOutputCode(run, config, record.get("compiled"),
                                         record.get("saved_from")))
            return built[-1]
        return SerializableAOTDispatchCompiler(OutputCode, compile_to_output_code)
    return {k: serializable(f) for k, f in compilers.items()}, built


_loading: list[list[CompiledGraph]] = []


def cache_key(graph_key: str) -> str:
    """The entry's key: graph_cache's key of the Dynamo graph (its code and subgraphs',
    inputs' metadata, grad mode, our settings, versions) with functorch's config and the
    deterministic mode, before :func:`cached_aot` patches the config. torch's own key
    (autograd_cache_key) would hash Inductor's state too (its backends' registration,
    torch's sources): ~0.7 s of a cold and of a warm first call, none of it ours."""
    h = hashlib.sha256(graph_key.encode())
    h.update(repr(sorted(functorch_config.save_config_portable().items())).encode())
    h.update(f"deterministic {torch.are_deterministic_algorithms_enabled()}".encode())
    return f"{autograd_cache.AOTAUTOGRAD_CACHE_PREFIX}pypto{h.hexdigest()}"


@contextlib.contextmanager
def cached_aot(config: Config, hw, key: str | None = None):
    """AOTAutograd's bundled cache on for one graph, under ``key`` (:func:`cache_key`);
    with None (inside aot_compile), torch's key with our settings in its tag. Yields the
    list of CompiledGraphs rebuilt from an entry meanwhile (for the report)."""
    tag = torch.compiler.config.cache_key_tag
    keyed = mock.patch.object(autograd_cache, "autograd_cache_key",
                              lambda *args, **kwargs: (key, [])) if key else \
        contextlib.nullcontext()
    with functorch_config.patch(bundled_autograd_cache=True,
                                force_non_lazy_backward_lowering=True,
                                strict_autograd_cache=False), \
            torch.compiler.config.patch(
                cache_key_tag=f"{tag}|pypto {graph_cache.settings_tag(config, hw)}"), keyed:
        _loading.append([])
        try:
            yield _loading[-1]
        finally:
            _loading.pop()
